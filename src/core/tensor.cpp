// SPDX-License-Identifier: Apache-2.0
#include "core/tensor.hpp"

#include <algorithm>
#include <sstream>
#include <vector>

#include "core/error.hpp"

namespace kvs {

int64_t View::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool View::contiguous() const {
  int64_t expect = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

int64_t View::offset(const int64_t* idx) const {
  int64_t off = 0;
  for (int i = 0; i < ndim; ++i) off += idx[i] * strides[i];
  return off;
}

DType dtype_from_dl(const kvs_dtype& dt, const char* name) {
  if (dt.lanes == 1) {
    if (dt.code == KVS_DTYPE_CODE_FLOAT && dt.bits == 32) return DType::F32;
    if (dt.code == KVS_DTYPE_CODE_FLOAT && dt.bits == 16) return DType::F16;
    if (dt.code == KVS_DTYPE_CODE_BFLOAT && dt.bits == 16) return DType::BF16;
  }
  std::ostringstream os;
  os << name << ": expected dtype float32, float16 or bfloat16 (1 lane), got code " << int(dt.code)
     << " bits " << int(dt.bits) << " lanes " << dt.lanes;
  invalid(os.str());
}

kvs_dtype dl_from_dtype(DType t) {
  switch (t) {
    case DType::F32: return kvs_dtype{KVS_DTYPE_CODE_FLOAT, 32, 1};
    case DType::F16: return kvs_dtype{KVS_DTYPE_CODE_FLOAT, 16, 1};
    case DType::BF16: return kvs_dtype{KVS_DTYPE_CODE_BFLOAT, 16, 1};
  }
  return kvs_dtype{KVS_DTYPE_CODE_FLOAT, 32, 1};
}

static std::string expected_str(std::initializer_list<int64_t> e) {
  std::ostringstream os;
  os << "[";
  int i = 0;
  for (int64_t x : e) {
    if (i++) os << ", ";
    if (x < 0) os << "*"; else os << x;
  }
  os << "]";
  return os.str();
}

std::string shape_str(const View& v) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < v.ndim; ++i) os << (i ? ", " : "") << v.shape[i];
  os << "]";
  return os.str();
}

View check_tensor(const kvs_tensor* t, const char* name, std::initializer_list<int64_t> expected,
                  Where where) {
  if (!t) invalid(std::string(name) + ": expected a tensor, got NULL");
  const int nd = int(expected.size());
  if (t->ndim != nd)
    invalid(std::string(name) + ": expected " + std::to_string(nd) + " dimensions " +
            expected_str(expected) + ", got ndim " + std::to_string(t->ndim));
  if (!t->shape) invalid(std::string(name) + ": shape is NULL");
  View v;
  v.ndim = nd;
  v.dtype = dtype_from_dl(t->dtype, name);
  int i = 0;
  int64_t total = 1;
  for (int64_t e : expected) {
    const int64_t s = t->shape[i];
    if (s > (int64_t(1) << 31) || __builtin_mul_overflow(total, s < 0 ? 0 : s, &total) || total > (int64_t(1) << 40))
      invalid(std::string(name) + ": shape too large (dimension " + std::to_string(i) + " = " + std::to_string(s) +
              "; at most 2^31 per dimension and 2^40 elements)");
    if (s < 0 || (e >= 0 && s != e) || (e < 0 && s < 1)) {
      View got;
      got.ndim = nd;
      for (int j = 0; j < nd; ++j) got.shape[j] = t->shape[j];
      invalid(std::string(name) + ": expected shape " + expected_str(expected) + ", got " +
              shape_str(got));
    }
    v.shape[i++] = s;
  }
  if (t->strides) {
    for (int j = 0; j < nd; ++j) {
      if (t->strides[j] < 0)
        invalid(std::string(name) + ": negative strides are not supported (dimension " +
                std::to_string(j) + ")");
      v.strides[j] = t->strides[j];
    }
  } else {
    int64_t s = 1;
    for (int j = nd - 1; j >= 0; --j) {
      v.strides[j] = s;
      s *= v.shape[j];
    }
  }
  const int32_t dev = t->device.device_type;
  const bool host = dev == KVS_DEVICE_CPU || dev == KVS_DEVICE_CUDA_HOST;
  if (where == Where::Host && !host)
    invalid(std::string(name) + ": expected a host tensor (device CPU or CUDA_HOST) for this backend, got device type " +
            std::to_string(dev));
  if (where == Where::Cuda && dev != KVS_DEVICE_CUDA)
    invalid(std::string(name) + ": expected a CUDA device tensor for the cuda backend, got device type " +
            std::to_string(dev));
  if (!host && dev != KVS_DEVICE_CUDA)
    invalid(std::string(name) + ": unsupported device type " + std::to_string(dev));
  v.device_type = dev;
  v.device_id = t->device.device_id;
  if (v.numel() > 0 && !t->data) invalid(std::string(name) + ": data is NULL");
  v.base = static_cast<const char*>(t->data) + t->byte_offset;
  return v;
}

void check_no_overlap(const View& v, const char* name) {
  if (v.numel() <= 1) return;
  // Dimensions of extent > 1, ordered by stride (extent 1 never moves the address).
  int dims[4], n = 0;
  for (int i = 0; i < v.ndim; ++i)
    if (v.shape[i] > 1) dims[n++] = i;
  for (int j = 1; j < n; ++j)  // insertion sort of at most 4 (std::sort trips -Warray-bounds here)
    for (int i = j; i > 0 && v.strides[dims[i]] < v.strides[dims[i - 1]]; --i) std::swap(dims[i], dims[i - 1]);
  // Nested strides (the common case, O(ndim)): each stride exceeds the largest offset the smaller
  // ones reach, so every multi-index has its own offset.
  bool nested = true;
  __int128 reach = 0;
  for (int j = 0; j < n && nested; ++j) {
    const int i = dims[j];
    if (__int128(v.strides[i]) <= reach) nested = false;
    reach += __int128(v.strides[i]) * (v.shape[i] - 1);
  }
  if (nested) return;
  auto overlap = [&](const std::string& why) {
    std::ostringstream os;
    os << name << ": an output tensor's elements must not overlap, got shape " << shape_str(v) << " with strides [";
    for (int i = 0; i < v.ndim; ++i) os << (i ? ", " : "") << v.strides[i];
    os << "] (" << why << ")";
    invalid(os.str());
  };
  for (int j = 0; j < n; ++j)
    if (v.strides[dims[j]] == 0)
      overlap("dimension " + std::to_string(dims[j]) + " has stride 0: all its elements are one address");
  // Interleaved strides may still be injective (shape [3, 2], strides [2, 3]): decided exactly by
  // listing the offsets while that is cheap, refused as unverifiable beyond.
  constexpr int64_t kExactLimit = int64_t(1) << 22;
  if (v.numel() > kExactLimit)
    overlap("strides that do not nest cannot be checked for overlap above " + std::to_string(kExactLimit) +
            " elements; use a layout whose dimensions, ordered by stride, each step past the smaller ones, as a "
            "dense layout does");
  __int128 last = 0;
  for (int j = 0; j < n; ++j) last += __int128(v.strides[dims[j]]) * (v.shape[dims[j]] - 1);
  if (last > __int128(INT64_MAX)) overlap("the last element's offset overflows 64 bits");
  std::vector<int64_t> offs;
  offs.reserve(size_t(v.numel()));
  int64_t idx[4] = {0, 0, 0, 0};
  for (int64_t lin = 0, total = v.numel(); lin < total; ++lin) {
    offs.push_back(v.offset(idx));
    for (int d = v.ndim - 1; d >= 0; --d) {
      if (++idx[d] < v.shape[d]) break;
      idx[d] = 0;
    }
  }
  std::sort(offs.begin(), offs.end());
  if (std::adjacent_find(offs.begin(), offs.end()) != offs.end())
    overlap("two elements have the same offset");
}

View check_output_tensor(const kvs_tensor* t, const char* name, std::initializer_list<int64_t> expected,
                         Where where) {
  View v = check_tensor(t, name, expected, where);
  check_no_overlap(v, name);
  return v;
}

// Iterates the multi-index in C order; fn(element offset in source, linear index).
template <class F>
static void for_each_index(const View& v, F&& fn) {
  if (v.contiguous()) {
    const int64_t n = v.numel();
    for (int64_t i = 0; i < n; ++i) fn(i, i);
    return;
  }
  int64_t idx[4] = {0, 0, 0, 0};
  const int64_t n = v.numel();
  for (int64_t lin = 0; lin < n; ++lin) {
    fn(v.offset(idx), lin);
    for (int d = v.ndim - 1; d >= 0; --d) {
      if (++idx[d] < v.shape[d]) break;
      idx[d] = 0;
    }
  }
}

void read_f32(const View& v, float* dst) {
  if (v.contiguous()) {
    convert_to_f32(v.base, v.dtype, dst, size_t(v.numel()));
    return;
  }
  for_each_index(v, [&](int64_t off, int64_t lin) { dst[lin] = load_as_f32(v.base, v.dtype, size_t(off)); });
}

void write_f32(const View& v, const float* src) {
  if (v.contiguous()) {
    convert_from_f32(src, v.mutable_base(), v.dtype, size_t(v.numel()));
    return;
  }
  for_each_index(v, [&](int64_t off, int64_t lin) { store_from_f32(v.mutable_base(), v.dtype, size_t(off), src[lin]); });
}

void convert_to_f32(const void* src, DType t, float* dst, size_t n) {
  switch (t) {
    case DType::F32: std::memcpy(dst, src, n * 4); break;
    case DType::F16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      break;
    }
    case DType::BF16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      break;
    }
  }
}

void convert_from_f32(const float* src, void* dst, DType t, size_t n) {
  switch (t) {
    case DType::F32: std::memcpy(dst, src, n * 4); break;
    case DType::F16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      break;
    }
    case DType::BF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      break;
    }
  }
}

}  // namespace kvs
