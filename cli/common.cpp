// SPDX-License-Identifier: Apache-2.0
#include "common.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cctype>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

namespace kvcli {

// ------------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------------

const char* status_name(int32_t code) {
  switch (code) {
    case KVS_STATUS_OK: return "OK";
    case KVS_STATUS_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case KVS_STATUS_OUT_OF_MEMORY: return "OUT_OF_MEMORY";
    case KVS_STATUS_UNSUPPORTED: return "UNSUPPORTED";
    case KVS_STATUS_INVALID_STATE: return "INVALID_STATE";
    case KVS_STATUS_IO: return "IO";
    case KVS_STATUS_FORMAT_MAGIC: return "FORMAT_MAGIC";
    case KVS_STATUS_FORMAT_VERSION: return "FORMAT_VERSION";
    case KVS_STATUS_FORMAT_TRUNCATED: return "FORMAT_TRUNCATED";
    case KVS_STATUS_FORMAT_CHECKSUM: return "FORMAT_CHECKSUM";
    case KVS_STATUS_FORMAT_INVALID: return "FORMAT_INVALID";
    case KVS_STATUS_BACKEND: return "BACKEND";
    case KVS_STATUS_ABI_MISMATCH: return "ABI_MISMATCH";
    case KVS_STATUS_INTERNAL: return "INTERNAL";
  }
  return "UNKNOWN_STATUS";
}

Status take_status(kvs_error_t err) {
  Status st;
  if (err == nullptr) return st;
  st.code = kvs_error_code(err);
  const char* msg = kvs_error_message(err);
  st.message = msg != nullptr ? msg : "";
  const int64_t backend = kvs_error_backend_code(err);
  if (backend != 0) st.message += strfmt(" (backend code %lld)", static_cast<long long>(backend));
  kvs_error_destroy(err);
  if (st.code == KVS_STATUS_OK) st.code = KVS_STATUS_INTERNAL;  // an error object must not say OK
  return st;
}

void check(kvs_error_t err, std::string_view context) {
  if (err == nullptr) return;
  const Status st = take_status(err);
  std::string msg(context);
  msg += ": ";
  msg += st.message.empty() ? "(no message)" : st.message;
  msg += " [";
  msg += status_name(st.code);
  msg += "]";
  throw CliError(msg);
}

// ------------------------------------------------------------------------------------------------
// Scalar types
// ------------------------------------------------------------------------------------------------

size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  if (name == "f32" || name == "float32" || name == "fp32") return DType::F32;
  if (name == "f16" || name == "float16" || name == "fp16") return DType::F16;
  if (name == "bf16" || name == "bfloat16") return DType::BF16;
  throw UsageError("unknown dtype '" + std::string(name) + "' (expected f32, f16 or bf16)");
}

DType dtype_from_scalar(int32_t t) {
  switch (t) {
    case KVS_SCALAR_F32: return DType::F32;
    case KVS_SCALAR_F16: return DType::F16;
    case KVS_SCALAR_BF16: return DType::BF16;
  }
  throw CliError(strfmt("unknown kvs_scalar_type %d", t));
}

kvs_dtype to_dl(DType t) {
  switch (t) {
    case DType::F32: return kvs_dtype{KVS_DTYPE_CODE_FLOAT, 32, 1};
    case DType::F16: return kvs_dtype{KVS_DTYPE_CODE_FLOAT, 16, 1};
    case DType::BF16: return kvs_dtype{KVS_DTYPE_CODE_BFLOAT, 16, 1};
  }
  return kvs_dtype{KVS_DTYPE_CODE_FLOAT, 32, 1};
}

DType from_dl(const kvs_dtype& dt) {
  if (dt.lanes == 1) {
    if (dt.code == KVS_DTYPE_CODE_FLOAT && dt.bits == 32) return DType::F32;
    if (dt.code == KVS_DTYPE_CODE_FLOAT && dt.bits == 16) return DType::F16;
    if (dt.code == KVS_DTYPE_CODE_BFLOAT && dt.bits == 16) return DType::BF16;
  }
  throw CliError(strfmt("unsupported tensor dtype (code %u, bits %u, lanes %u)", unsigned(dt.code),
                        unsigned(dt.bits), unsigned(dt.lanes)));
}

float bf16_to_f32(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      u = sign | (uint32_t(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                                  // below 2^-14: subnormal or zero
    if (abs < 0x33000000u) return sign;                     // below half the smallest subnormal
    // value = mant * 2^(exp-150); in f16 subnormal units of 2^-24 that is mant * 2^(exp-126),
    // i.e. a right shift by 14..24 bits, rounded to nearest even.
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t s = 126 - exp;
    uint32_t q = mant >> s;
    const uint32_t rem = mant & ((1u << s) - 1u);
    const uint32_t halfway = 1u << (s - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return uint16_t(sign | q);
  }
  // normal: rebias exponent, round mantissa from 23 to 10 bits (carry may bump the exponent)
  uint32_t v = abs - (uint32_t(127 - 15) << 23);
  v += 0xfffu + ((v >> 13) & 1u);
  return uint16_t(sign | (v >> 13));
}

void store_elem(void* base, DType t, size_t i, float value) {
  char* p = static_cast<char*>(base);
  switch (t) {
    case DType::F32: std::memcpy(p + 4 * i, &value, 4); return;
    case DType::BF16: {
      const uint16_t h = f32_to_bf16(value);
      std::memcpy(p + 2 * i, &h, 2);
      return;
    }
    case DType::F16: {
      const uint16_t h = f32_to_f16(value);
      std::memcpy(p + 2 * i, &h, 2);
      return;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Tensors
// ------------------------------------------------------------------------------------------------

Tensor::Tensor(const void* data, DType dtype, std::initializer_list<int64_t> shape) {
  if (shape.size() > shape_.size()) throw CliError("internal: tensor rank above 4");
  t_.data = const_cast<void*>(data);
  t_.device = kvs_device{KVS_DEVICE_CPU, 0};
  t_.ndim = int32_t(shape.size());
  t_.dtype = to_dl(dtype);
  t_.byte_offset = 0;
  dtype_ = dtype;
  std::copy(shape.begin(), shape.end(), shape_.begin());
  fix();
}

Tensor& Tensor::operator=(const Tensor& o) {
  t_ = o.t_;
  dtype_ = o.dtype_;
  shape_ = o.shape_;
  strides_ = o.strides_;
  has_strides_ = o.has_strides_;
  fix();
  return *this;
}

Tensor Tensor::on(void* data, kvs_device device) const {
  Tensor r(*this);
  r.t_.data = data;
  r.t_.device = device;
  r.t_.byte_offset = 0;
  r.has_strides_ = false;
  r.fix();
  return r;
}

size_t Tensor::bytes() const {
  size_t n = dtype_size(dtype_);
  for (int i = 0; i < t_.ndim; ++i) n *= size_t(shape_[size_t(i)]);
  return n;
}

void Tensor::copy_to_contiguous(void* dst) const {
  const size_t es = dtype_size(dtype_);
  const char* base = static_cast<const char*>(t_.data) + t_.byte_offset;
  const int nd = t_.ndim;
  if (!has_strides_ || nd == 0) {
    std::memcpy(dst, base, bytes());
    return;
  }
  // Rows of the innermost dimension (one memcpy each when it is contiguous) over an odometer of the
  // outer indices (ndim <= 4).
  const int64_t inner = shape_[size_t(nd - 1)], step = strides_[size_t(nd - 1)];
  std::array<int64_t, 4> idx{};
  char* out = static_cast<char*>(dst);
  const size_t rows = inner > 0 ? bytes() / (es * size_t(inner)) : 0;
  for (size_t r = 0; r < rows; ++r) {
    int64_t off = 0;
    for (int i = 0; i < nd - 1; ++i) off += idx[size_t(i)] * strides_[size_t(i)];
    const char* src = base + off * int64_t(es);
    if (step == 1) {
      std::memcpy(out, src, size_t(inner) * es);
    } else {
      for (int64_t j = 0; j < inner; ++j) std::memcpy(out + size_t(j) * es, src + j * step * int64_t(es), es);
    }
    out += size_t(inner) * es;
    for (int i = nd - 2; i >= 0; --i) {
      if (++idx[size_t(i)] < shape_[size_t(i)]) break;
      idx[size_t(i)] = 0;
    }
  }
}

StridedArray::StridedArray(const kvs_tensor& view, std::string_view what) {
  if (view.ndim != 3)
    throw CliError(strfmt("%.*s: expected a 3-d tensor, the library returned %d dims",
                          int(what.size()), what.data(), view.ndim));
  if (view.device.device_type != KVS_DEVICE_CPU && view.device.device_type != KVS_DEVICE_CUDA_HOST)
    throw CliError(std::string(what) + ": the library returned a view that is not in host memory");
  dtype_ = from_dl(view.dtype);
  for (int i = 0; i < 3; ++i) shape_[size_t(i)] = view.shape[i];
  if (view.strides != nullptr) {
    for (int i = 0; i < 3; ++i) strides_[size_t(i)] = view.strides[i];
  } else {
    strides_ = {shape_[1] * shape_[2], shape_[2], 1};
  }
  if (strides_[2] != 1 && shape_[2] > 1)
    throw CliError(std::string(what) + ": the head dimension is not contiguous");
  base_ = static_cast<const char*>(view.data) + view.byte_offset;
}

StridedArray::StridedArray(const void* data, DType dtype, int64_t rows, int64_t heads, int64_t dim)
    : base_(static_cast<const char*>(data)),
      dtype_(dtype),
      shape_{rows, heads, dim},
      strides_{heads * dim, dim, 1} {}

Tensor StridedArray::rows_view(int64_t row0, int64_t n) const {
  Tensor t;
  t.t_.data = const_cast<char*>(base_);
  t.t_.byte_offset = uint64_t(row0 * strides_[0]) * dtype_size(dtype_);
  t.t_.device = kvs_device{KVS_DEVICE_CPU, 0};
  t.t_.ndim = 3;
  t.t_.dtype = to_dl(dtype_);
  t.dtype_ = dtype_;
  t.shape_ = {n, shape_[1], shape_[2], 0};
  t.strides_ = {strides_[0], strides_[1], strides_[2], 0};
  t.has_strides_ = true;
  t.fix();
  return t;
}

Tensor StridedArray::row_view(int64_t row) const {
  Tensor t;
  t.t_.data = const_cast<char*>(base_);
  t.t_.byte_offset = uint64_t(row * strides_[0]) * dtype_size(dtype_);
  t.t_.device = kvs_device{KVS_DEVICE_CPU, 0};
  t.t_.ndim = 2;
  t.t_.dtype = to_dl(dtype_);
  t.dtype_ = dtype_;
  t.shape_ = {shape_[1], shape_[2], 0, 0};
  t.strides_ = {strides_[1], strides_[2], 0, 0};
  t.has_strides_ = true;
  t.fix();
  return t;
}

// ------------------------------------------------------------------------------------------------
// Handles
// ------------------------------------------------------------------------------------------------

Trace::Trace(const std::string& path) : path_(path) {
  kvs_trace_t t = nullptr;
  check(kvs_trace_open(path.c_str(), &t), "cannot open trace '" + path + "'");
  handle_.reset(t);
  kvs_trace_info_init(&info_);
  check(kvs_trace_get_info(t, &info_), "trace '" + path + "': reading its header");
  layers_.reserve(info_.num_present_layers);
  for (uint32_t i = 0; i < info_.num_present_layers; ++i) {
    uint32_t layer = 0;
    check(kvs_trace_layer_index(t, i, &layer), strfmt("trace '%s': present layer %u", path.c_str(), i));
    layers_.push_back(layer);
  }
  if (layers_.empty()) throw CliError("trace '" + path + "' holds no layer");
}

StridedArray Trace::tensor(uint32_t layer, const char* name) const {
  kvs_tensor view{};
  const std::string what = strfmt("trace '%s': layers.%u.%s", path_.c_str(), layer, name);
  check(kvs_trace_tensor(handle_.get(), layer, name, &view), what);
  StridedArray a(view, what);
  return a;
}

double Trace::softmax_scale() const {
  return info_.softmax_scale > 0.0f ? double(info_.softmax_scale)
                                    : 1.0 / std::sqrt(double(info_.head_dim));
}

#ifdef KVS_HAVE_CUDA
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw CliError(strfmt("CUDA: %s: %s", what, cudaGetErrorString(e)));
}
#endif

// Host tensors staged on a GPU for a session of the cuda or hybrid backend: a grow-only device
// buffer per argument slot (q, k, v, o, lse), copied in before a call and out after it.
struct DeviceStage {
#ifdef KVS_HAVE_CUDA
  explicit DeviceStage(int32_t device) : device_(device) {}
  // Slot i's device buffer, at least `bytes` long.
  void* buffer(size_t i, size_t bytes) {
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    auto& b = buf_[i];
    if (!b || b->bytes() < bytes) {
      b.reset();
      b = std::make_unique<DeviceBuffer>(bytes, "cudaMalloc");
    }
    return b->get();
  }
  // A device copy of host tensor `h` in slot i.
  Tensor put(size_t i, const Tensor& h) {
    host_.resize(h.bytes());
    h.copy_to_contiguous(host_.data());
    void* d = buffer(i, h.bytes());
    cuda_check(cudaMemcpy(d, host_.data(), h.bytes(), cudaMemcpyHostToDevice), "cudaMemcpy (host to device)");
    return h.on(d, kvs_device{KVS_DEVICE_CUDA, device_});
  }
  // A device tensor shaped like host output `h` in slot i (not copied in).
  Tensor out(size_t i, const Tensor& h) { return h.on(buffer(i, h.bytes()), kvs_device{KVS_DEVICE_CUDA, device_}); }
  // Device tensor `d` back into host output `h` (the commands' outputs are C-contiguous buffers).
  void get(const Tensor& d, const Tensor& h) {
    if (h.get()->strides != nullptr || h.get()->byte_offset != 0)
      throw CliError("internal: a staged output must be a contiguous host buffer");
    cuda_check(cudaMemcpy(h.get()->data, d.get()->data, h.bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy (device to host)");
  }

 private:
  int32_t device_;
  std::array<std::unique_ptr<DeviceBuffer>, 5> buf_;
  std::vector<char> host_;
#endif
};

Session::Session(const kvs_session_params& params, std::string label) : label_(std::move(label)) {
  kvs_session_t s = nullptr;
  check(kvs_session_create(&params, &s), label_ + ": creating the session");
  handle_.reset(s);
#ifdef KVS_HAVE_CUDA
  if (params.backend == KVS_BACKEND_CUDA || params.backend == KVS_BACKEND_HYBRID)
    stage_ = std::make_shared<DeviceStage>(params.device_id);
#endif
}

void Session::prefill(uint32_t layer, const Tensor& q, const Tensor& k, const Tensor& v) {
  const std::string what = strfmt("%s: prefill of layer %u", label_.c_str(), layer);
#ifdef KVS_HAVE_CUDA
  if (stage_) {
    const Tensor dq = stage_->put(0, q), dk = stage_->put(1, k), dv = stage_->put(2, v);
    check(kvs_session_prefill(get(), layer, dq.get(), dk.get(), dv.get(), nullptr, nullptr), what);
    return;
  }
#endif
  check(kvs_session_prefill(get(), layer, q.get(), k.get(), v.get(), nullptr, nullptr), what);
}

void Session::build_index() {
  check(kvs_session_build_index(get(), nullptr), label_ + ": building the index");
}

void Session::decode(uint32_t layer, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& o, const Tensor* lse) {
#ifdef KVS_HAVE_CUDA
  if (stage_) {  // synchronous copies: the outputs are on the host when this returns
    const Tensor dq = stage_->put(0, q), dk = stage_->put(1, k), dv = stage_->put(2, v);
    const Tensor d_o = stage_->out(3, o);
    const Tensor dl = lse ? stage_->out(4, *lse) : Tensor();
    const kvs_error_t err = kvs_session_decode(get(), layer, dq.get(), dk.get(), dv.get(), d_o.get(),
                                               lse ? dl.get() : nullptr, nullptr);
    if (err != nullptr) check(err, strfmt("%s: decode of layer %u", label_.c_str(), layer));
    stage_->get(d_o, o);
    if (lse) stage_->get(dl, *lse);
    return;
  }
#endif
  const kvs_error_t err = kvs_session_decode(get(), layer, q.get(), k.get(), v.get(), o.get(),
                                             lse != nullptr ? lse->get() : nullptr, nullptr);
  if (err != nullptr) check(err, strfmt("%s: decode of layer %u", label_.c_str(), layer));
}

void Session::last_selection(uint32_t layer, uint32_t kv_head, std::vector<int32_t>& out) const {
  auto query = [&](size_t& count) {
    const kvs_error_t err = kvs_session_last_selection(get(), layer, kv_head, out.data(), out.size(), &count);
    if (err != nullptr)
      check(err, strfmt("%s: selection of layer %u, KV head %u", label_.c_str(), layer, kv_head));
  };
  size_t count = 0;
  out.resize(out.capacity());
  query(count);
  if (count > out.size()) {  // grow once to the reported size and ask again
    out.resize(count);
    query(count);
  }
  out.resize(std::min(count, out.size()));
}

kvs_session_stats Session::stats() const {
  kvs_session_stats st{};
  st.struct_size = sizeof(st);
  check(kvs_session_get_stats(get(), &st), label_ + ": reading statistics");
  return st;
}

void Session::save(const std::string& path, uint32_t flags) const {
  check(kvs_session_save(get(), path.c_str(), flags), label_ + ": saving to '" + path + "'");
}

kvs_session_params session_params_for(const kvs_trace_info& info) {
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = info.num_layers;
  p.num_q_heads = info.num_q_heads;
  p.num_kv_heads = info.num_kv_heads;
  p.head_dim = info.head_dim;
  p.softmax_scale = info.softmax_scale;
  p.kv_dtype = info.dtype;
  return p;
}

// ------------------------------------------------------------------------------------------------
// Registry and parsing
// ------------------------------------------------------------------------------------------------

std::vector<std::string> registered_methods() {
  std::vector<std::string> names;
  const size_t n = kvs_method_count();
  for (size_t i = 0; i < n; ++i) {
    const char* name = kvs_method_name(i);
    if (name != nullptr) names.emplace_back(name);
  }
  return names;
}

bool method_exists(std::string_view name) {
  for (const auto& m : registered_methods())
    if (m == name) return true;
  return false;
}

std::vector<std::string> backends_list(uint32_t mask) {
  std::vector<std::string> out;
  for (int32_t b : {KVS_BACKEND_CPU, KVS_BACKEND_CUDA, KVS_BACKEND_HYBRID})
    if (mask & (1u << b)) out.emplace_back(backend_name(b));
  return out;
}

std::string backends_string(uint32_t mask) {
  const auto l = backends_list(mask);
  return l.empty() ? "-" : join(l, ",");
}

int32_t parse_backend(std::string_view name) {
  if (name == "cpu") return KVS_BACKEND_CPU;
  if (name == "cuda") return KVS_BACKEND_CUDA;
  if (name == "hybrid") return KVS_BACKEND_HYBRID;
  throw UsageError("unknown backend '" + std::string(name) + "' (expected cpu, cuda or hybrid)");
}

const char* backend_name(int32_t backend) {
  switch (backend) {
    case KVS_BACKEND_CPU: return "cpu";
    case KVS_BACKEND_CUDA: return "cuda";
    case KVS_BACKEND_HYBRID: return "hybrid";
  }
  return "?";
}

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(sep, start);
    if (end == std::string_view::npos) end = s.size();
    std::string_view item = s.substr(start, end - start);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.remove_prefix(1);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.remove_suffix(1);
    if (!item.empty()) out.emplace_back(item);
    start = end + 1;
  }
  return out;
}

std::string join(const std::vector<std::string>& items, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    out += items[i];
  }
  return out;
}

std::vector<uint32_t> parse_index_list(std::string_view s, std::string_view what) {
  std::vector<uint32_t> out;
  for (const auto& item : split(s, ',')) {
    char* end = nullptr;
    errno = 0;
    const unsigned long v = std::strtoul(item.c_str(), &end, 10);
    if (end == item.c_str() || *end != '\0' || errno != 0 || v > UINT32_MAX || item[0] == '-')
      throw UsageError(std::string(what) + ": '" + item + "' is not a non-negative integer");
    out.push_back(uint32_t(v));
  }
  return out;
}

unsigned resolve_threads(unsigned requested) {
  if (requested != 0) return requested;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : hw;
}

void parallel_for(size_t n, unsigned threads, const std::function<void(size_t)>& fn) {
  const size_t workers = std::min<size_t>(n, std::max(1u, threads));
  if (workers <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::exception_ptr first;
  std::mutex mu;
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (size_t w = 1; w < workers; ++w) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (first) std::rethrow_exception(first);
}

// ------------------------------------------------------------------------------------------------
// Output
// ------------------------------------------------------------------------------------------------

std::string strfmt(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  va_list ap2;
  va_copy(ap2, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string s;
  if (n > 0) {
    s.resize(size_t(n) + 1);
    std::vsnprintf(s.data(), s.size(), fmt, ap2);
    s.resize(size_t(n));
  }
  va_end(ap2);
  return s;
}

std::string human_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? strfmt("%.0f B", bytes) : strfmt("%.1f %s", bytes, units[u]);
}

TextTable::TextTable(std::vector<std::string> headers, std::vector<bool> numeric)
    : headers_(std::move(headers)), numeric_(std::move(numeric)) {
  numeric_.resize(headers_.size(), false);
}

void TextTable::add_row(std::vector<std::string> cells) {
  cells.resize(headers_.size());
  rows_.push_back(std::move(cells));
}

std::string TextTable::render(int indent) const {
  std::vector<size_t> width(headers_.size());
  for (size_t c = 0; c < headers_.size(); ++c) {
    width[c] = headers_[c].size();
    for (const auto& r : rows_) width[c] = std::max(width[c], r[c].size());
  }
  const std::string lead(size_t(std::max(indent, 0)), ' ');
  auto line = [&](const std::vector<std::string>& cells) {
    std::string out = lead;
    for (size_t c = 0; c < cells.size(); ++c) {
      const size_t pad = width[c] - cells[c].size();
      if (c) out += "  ";
      if (numeric_[c]) out.append(pad, ' ');
      out += cells[c];
      if (!numeric_[c] && c + 1 < cells.size()) out.append(pad, ' ');
    }
    out += '\n';
    return out;
  };
  std::string out = line(headers_);
  size_t total = 0;
  for (size_t c = 0; c < width.size(); ++c) total += width[c] + (c ? 2 : 0);
  out += lead;
  out.append(total, '-');
  out += '\n';
  for (const auto& r : rows_) out += line(r);
  return out;
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw CliError("cannot open '" + path + "' for writing: " + std::strerror(errno));
  f << text;
  f.close();
  if (!f) throw CliError("writing '" + path + "' failed");
}

double median(std::vector<double> v) { return percentile(std::move(v), 50.0); }

double mean(const std::vector<double>& v) {
  if (v.empty()) return 0.0;
  double s = 0.0;
  for (double x : v) s += x;
  return s / double(v.size());
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double pos = std::clamp(p, 0.0, 100.0) / 100.0 * double(v.size() - 1);
  const size_t lo = size_t(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  const double frac = pos - double(lo);
  return v[lo] + (v[hi] - v[lo]) * frac;
}

}  // namespace kvcli
