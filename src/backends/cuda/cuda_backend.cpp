// The cuda backend of a Session (see cuda_backend.hpp). Compiled by the host compiler against the
// CUDA runtime; the kernels live in cuda_attention.cu.
#ifdef KVS_HAVE_CUDA
#include "backends/cuda/cuda_backend.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "backends/cuda/cuda_attention.cuh"
#include "core/error.hpp"
#include "core/session.hpp"

namespace kvs {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    fail(KVS_STATUS_BACKEND, std::string("CUDA: ") + what + ": " + cudaGetErrorString(e), int64_t(e));
}
void check(const cuda::Status& st, const char* what) {
  if (!st.ok())
    fail(kvs_status(st.code), std::string("CUDA ") + what + ": " + st.message, int64_t(st.cuda_error));
}

cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

// Switches to the session's device for the scope.
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int dev) {
    check(cudaGetDevice(&prev), "cudaGetDevice");
    if (prev != dev) check(cudaSetDevice(dev), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev && prev >= 0) cudaSetDevice(prev);
  }
};

// A contiguous CUDA tensor of the given shape and one of the allowed dtypes.
View cuda_view(const kvs_tensor* t, const char* name, std::initializer_list<int64_t> shape, int device,
               std::initializer_list<DType> allowed) {
  View v = check_tensor(t, name, shape, Where::Cuda);
  if (v.device_id != device)
    invalid(std::string(name) + ": expected a tensor on CUDA device " + std::to_string(device) + ", got device " +
            std::to_string(v.device_id));
  if (!v.contiguous()) invalid(std::string(name) + ": the cuda backend expects a contiguous tensor");
  bool ok = false;
  std::string names;
  for (DType a : allowed) {
    ok |= a == v.dtype;
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(a));
  }
  if (!ok) invalid(std::string(name) + ": expected dtype " + names + " on the cuda backend, got " + dtype_name(v.dtype));
  return v;
}

int64_t round_capacity(int64_t need) {
  int64_t c = 4096;
  while (c < need) c *= 2;
  return c;
}

}  // namespace

CudaBackend::CudaBackend(Session& owner) : s_(owner), device_(owner.cfg_.device_id) {
  const auto& sh = s_.cfg_.shape;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    fail(KVS_STATUS_UNSUPPORTED, "params->backend: the cuda backend needs a CUDA device, none was found");
  if (device_ < 0 || device_ >= count)
    invalid("params->device_id: expected 0.." + std::to_string(count - 1) + ", got " + std::to_string(device_));
  if (sh.kv_dtype == DType::F32)
    fail(KVS_STATUS_UNSUPPORTED, "params->kv_dtype: the cuda backend stores KV in bf16 or fp16, not f32");
  if (sh.head_dim != 64 && sh.head_dim != 128)
    fail(KVS_STATUS_UNSUPPORTED, "params->head_dim: the cuda backend supports head dims 64 and 128, got " +
                                     std::to_string(sh.head_dim));
  topk_ = s_.cfg_.method == "exact_topk";
  if (topk_) {
    const auto* spec = find_method("exact_topk");
    ParamSet ps = ParamSet::parse("exact_topk", spec->params, s_.cfg_.method_params.c_str());
    if (ps.get_string("mode") != "per_kv_head" || ps.get_int("sinks") != 0 || ps.get_int("local") != 0)
      fail(KVS_STATUS_UNSUPPORTED, "params->method_params: exact_topk on the cuda backend supports mode=per_kv_head without sinks/local");
  }
  layers_.resize(sh.num_layers);
  sel_idx_.assign(sh.num_layers, nullptr);
  sel_cnt_.assign(sh.num_layers, nullptr);
  sel_k_.assign(sh.num_layers, 0);
}

CudaBackend::~CudaBackend() {
  int prev = -1;
  cudaGetDevice(&prev);
  cudaSetDevice(device_);
  for (auto& l : layers_) {
    cudaFree(l.k);
    cudaFree(l.v);
  }
  for (void* p : sel_idx_) cudaFree(p);
  for (void* p : sel_cnt_) cudaFree(p);
  cudaFree(ws_);
  if (prev >= 0) cudaSetDevice(prev);
}

uint64_t CudaBackend::kv_bytes() const {
  const auto& sh = s_.cfg_.shape;
  uint64_t b = 0;
  for (auto& l : layers_) b += uint64_t(l.cap) * sh.num_kv_heads * sh.head_dim * dtype_size(sh.kv_dtype) * 2;
  return b;
}

void* CudaBackend::workspace(size_t bytes) {
  if (bytes > ws_bytes_) {
    check(cudaFree(ws_), "cudaFree(workspace)");
    ws_ = nullptr;
    ws_bytes_ = 0;
    check(cudaMalloc(&ws_, bytes), "cudaMalloc(workspace)");
    ws_bytes_ = bytes;
  }
  return ws_;
}

void CudaBackend::reserve(uint32_t layer, int64_t tokens, void* stream) {
  auto& l = layers_[layer];
  if (tokens <= l.cap) return;
  const auto& sh = s_.cfg_.shape;
  const int64_t cap = round_capacity(tokens);
  const size_t row = size_t(sh.head_dim) * dtype_size(sh.kv_dtype);
  void *k = nullptr, *v = nullptr;
  check(cudaMalloc(&k, size_t(cap) * sh.num_kv_heads * row), "cudaMalloc(K)");
  if (cudaMalloc(&v, size_t(cap) * sh.num_kv_heads * row) != cudaSuccess) {
    cudaFree(k);
    fail(KVS_STATUS_OUT_OF_MEMORY, "CUDA: cudaMalloc(V) failed for " + std::to_string(cap) + " tokens");
  }
  if (l.n > 0) {
    // Head h moves from h * old_cap to h * cap rows.
    check(cudaMemcpy2DAsync(k, size_t(cap) * row, l.k, size_t(l.cap) * row, size_t(l.n) * row, sh.num_kv_heads,
                            cudaMemcpyDeviceToDevice, S(stream)), "cudaMemcpy2DAsync(K grow)");
    check(cudaMemcpy2DAsync(v, size_t(cap) * row, l.v, size_t(l.cap) * row, size_t(l.n) * row, sh.num_kv_heads,
                            cudaMemcpyDeviceToDevice, S(stream)), "cudaMemcpy2DAsync(V grow)");
    check(cudaStreamSynchronize(S(stream)), "cudaStreamSynchronize(grow)");
  }
  cudaFree(l.k);
  cudaFree(l.v);
  l.k = k;
  l.v = v;
  l.cap = cap;
}

// Appends rows of k, v given as [rows, Hkv, d] (device, KV dtype) to the layer.
void CudaBackend::copy_rows(uint32_t layer, const void* k, const void* v, int64_t rows, void* stream) {
  const auto& sh = s_.cfg_.shape;
  auto& l = layers_[layer];
  const size_t row = size_t(sh.head_dim) * dtype_size(sh.kv_dtype);
  for (uint32_t h = 0; h < sh.num_kv_heads; ++h) {
    char* kd = static_cast<char*>(l.k) + (size_t(h) * l.cap + l.n) * row;
    char* vd = static_cast<char*>(l.v) + (size_t(h) * l.cap + l.n) * row;
    check(cudaMemcpy2DAsync(kd, row, static_cast<const char*>(k) + h * row, sh.num_kv_heads * row, row, rows,
                            cudaMemcpyDeviceToDevice, S(stream)), "cudaMemcpy2DAsync(K)");
    check(cudaMemcpy2DAsync(vd, row, static_cast<const char*>(v) + h * row, sh.num_kv_heads * row, row, rows,
                            cudaMemcpyDeviceToDevice, S(stream)), "cudaMemcpy2DAsync(V)");
  }
  l.n += rows;
}

void CudaBackend::add_tokens(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                             const kvs_tensor* o, void* stream, const char* fn) {
  const auto& sh = s_.cfg_.shape;
  DeviceGuard g(device_);
  View qv = cuda_view(q, "q", {-1, sh.num_q_heads, sh.head_dim}, device_, {DType::F32, sh.kv_dtype});
  const int64_t n = qv.shape[0];
  View kv = cuda_view(k, "k", {n, sh.num_kv_heads, sh.head_dim}, device_, {sh.kv_dtype});
  View vv = cuda_view(v, "v", {n, sh.num_kv_heads, sh.head_dim}, device_, {sh.kv_dtype});
  if (o) fail(KVS_STATUS_UNSUPPORTED, std::string(fn) + ": o: outputs of prompt chunks are not computed by the cuda backend yet; pass NULL");
  if (n >= (int64_t(1) << 31) - layers_[layer].n) invalid(std::string(fn) + ": q: the layer would exceed 2^31 tokens");
  reserve(layer, layers_[layer].n + n, stream);
  copy_rows(layer, kv.base, vv.base, n, stream);
}

void CudaBackend::prefill(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                          const kvs_tensor* o, void* stream) {
  if (s_.built_[layer])
    fail(KVS_STATUS_INVALID_STATE, "kvs_session_prefill: layer " + std::to_string(layer) +
                                       " is already indexed; use kvs_session_append for more");
  add_tokens(layer, q, k, v, o, stream, "kvs_session_prefill");
}

void CudaBackend::append(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                         const kvs_tensor* o, void* stream) {
  add_tokens(layer, q, k, v, o, stream, "kvs_session_append");
}

void CudaBackend::decode_batch(Session* const* sessions, size_t count, uint32_t layer, const kvs_tensor* q,
                               const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
                               const kvs_tensor* lse, void* stream, bool single) {
  Session& s0 = *sessions[0];
  CudaBackend& b0 = *s0.cuda_;
  const auto& sh = s0.cfg_.shape;
  const int64_t B = int64_t(count), hq = sh.num_q_heads, hkv = sh.num_kv_heads, d = sh.head_dim;
  DeviceGuard g(b0.device_);
  for (size_t i = 0; i < count; ++i) {
    if (sessions[i]->cfg_.method != s0.cfg_.method || sessions[i]->cuda_->device_ != b0.device_)
      invalid("kvs_decode_batch: sessions[" + std::to_string(i) + "]: expected the method and device of sessions[0]");
  }
  View qv, kv, vv, ov, lv;
  const std::initializer_list<DType> qdt = {DType::F32, sh.kv_dtype};
  if (single) {
    qv = cuda_view(q, "q", {hq, d}, b0.device_, qdt);
    kv = cuda_view(k, "k_new", {hkv, d}, b0.device_, {sh.kv_dtype});
    vv = cuda_view(v, "v_new", {hkv, d}, b0.device_, {sh.kv_dtype});
    ov = cuda_view(o, "o", {hq, d}, b0.device_, qdt);
    if (lse) lv = cuda_view(lse, "lse", {hq}, b0.device_, {DType::F32});
  } else {
    qv = cuda_view(q, "q", {B, hq, d}, b0.device_, qdt);
    kv = cuda_view(k, "k_new", {B, hkv, d}, b0.device_, {sh.kv_dtype});
    vv = cuda_view(v, "v_new", {B, hkv, d}, b0.device_, {sh.kv_dtype});
    ov = cuda_view(o, "o", {B, hq, d}, b0.device_, qdt);
    if (lse) lv = cuda_view(lse, "lse", {B, hq}, b0.device_, {DType::F32});
  }
  int32_t k_top = 0;
  if (b0.topk_) {
    for (int64_t b = 0; b < B; ++b) {
      const int32_t kb = int32_t(sessions[b]->cfg_.budget.keys(sessions[b]->cuda_->layers_[layer].n + 1, 0.05));
      if (b && kb != k_top)
        fail(KVS_STATUS_UNSUPPORTED, "kvs_decode_batch: exact_topk on cuda needs the same budget in keys for every session of a batch (use budget_tokens)");
      k_top = kb;
    }
  }
  // Append every session's new token, growing all to one capacity (the kernels take one stride).
  int64_t cap = 0, max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const auto& l = sessions[b]->cuda_->layers_[layer];
    if (l.n + 1 >= (int64_t(1) << 31)) invalid("kvs_decode_batch: layer " + std::to_string(layer) + " is full (2^31 tokens)");
    cap = std::max({cap, l.cap, round_capacity(l.n + 1)});  // buffers never shrink
  }
  const size_t row = size_t(d) * dtype_size(sh.kv_dtype);
  for (int64_t b = 0; b < B; ++b) {
    CudaBackend& cb = *sessions[b]->cuda_;
    cb.reserve(layer, cap, stream);
    cb.copy_rows(layer, kv.base + size_t(b) * hkv * row, vv.base + size_t(b) * hkv * row, 1, stream);
    max_len = std::max(max_len, cb.layers_[layer].n);
  }
  // Argument block on the device: K pointers [B], V pointers [B], lengths [B].
  std::vector<char> args(size_t(B) * (2 * sizeof(void*) + sizeof(int32_t)));
  auto* kp = reinterpret_cast<const void**>(args.data());
  auto* vp = kp + B;
  auto* lens = reinterpret_cast<int32_t*>(vp + B);
  for (int64_t b = 0; b < B; ++b) {
    const auto& l = sessions[b]->cuda_->layers_[layer];
    kp[b] = l.k;
    vp[b] = l.v;
    lens[b] = int32_t(l.n);
  }
  cuda::AttnShape as{int32_t(B), int32_t(hq), int32_t(hkv), int32_t(d), sh.softmax_scale};
  const auto kvdt = cuda::Scalar(int32_t(sh.kv_dtype));
  cuda::Query cq{qv.base, cuda::Scalar(int32_t(qv.dtype))};
  // Device-side lse when the caller passed none.
  const size_t args_bytes = (args.size() + 255) / 256 * 256;
  const size_t lse_bytes = (size_t(B) * hq * sizeof(float) + 255) / 256 * 256;
  const size_t sel_bytes = b0.topk_ ? (size_t(B) * hkv * k_top * 4 + size_t(B) * hkv * 4 + 511) / 256 * 256 : 0;
  const size_t kern_ws = b0.topk_
      ? std::max(cuda::group_topk_workspace_bytes(as, int32_t(max_len), k_top), cuda::gathered_decode_workspace_bytes(as, k_top))
      : cuda::dense_decode_workspace_bytes(as, int32_t(max_len));
  char* ws = static_cast<char*>(b0.workspace(args_bytes + lse_bytes + sel_bytes + kern_ws));
  check(cudaMemcpyAsync(ws, args.data(), args.size(), cudaMemcpyHostToDevice, S(stream)), "cudaMemcpyAsync(args)");
  cuda::KvCache ckv{reinterpret_cast<const void* const*>(ws), reinterpret_cast<const void* const*>(ws) + B, cap, kvdt};
  const int32_t* dlens = reinterpret_cast<const int32_t*>(ws + 2 * B * sizeof(void*));
  float* dlse = lse ? reinterpret_cast<float*>(lv.mutable_base()) : reinterpret_cast<float*>(ws + args_bytes);
  cuda::Output out{ov.mutable_base(), cuda::Scalar(int32_t(ov.dtype)), dlse};
  cuda::Workspace kw{ws + args_bytes + lse_bytes + sel_bytes, kern_ws};
  if (!b0.topk_) {
    check(cuda::dense_decode(as, cq, ckv, dlens, int32_t(max_len), out, kw, stream), "dense_decode");
  } else {
    int32_t* idx = reinterpret_cast<int32_t*>(ws + args_bytes + lse_bytes);
    int32_t* cnt = idx + size_t(B) * hkv * k_top;
    check(cuda::group_topk(as, cq, ckv, dlens, int32_t(max_len), k_top, idx, cnt, kw, stream), "group_topk");
    check(cuda::gathered_decode(as, cq, ckv, idx, cnt, k_top, out, kw, stream), "gathered_decode");
    // Keep each session's selection for inspection (device copy, stream-ordered).
    for (int64_t b = 0; b < B; ++b) {
      CudaBackend& cb = *sessions[b]->cuda_;
      const size_t bytes = size_t(hkv) * k_top * 4;
      if (cb.sel_k_[layer] != k_top) {
        cudaFree(cb.sel_idx_[layer]);
        cb.sel_idx_[layer] = nullptr;
        cb.sel_k_[layer] = 0;
        check(cudaMalloc(&cb.sel_idx_[layer], bytes), "cudaMalloc(selection)");
        cb.sel_k_[layer] = k_top;
      }
      check(cudaMemcpyAsync(cb.sel_idx_[layer], idx + size_t(b) * hkv * k_top, bytes, cudaMemcpyDeviceToDevice, S(stream)),
            "cudaMemcpyAsync(selection)");
      cb.last_stream_ = stream;
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    Session& sb = *sessions[b];
    const int64_t n = sb.cuda_->layers_[layer].n;
    const double selected = b0.topk_ ? double(std::min<int64_t>(k_top, n)) : double(n);
    sb.last_n_[layer] = n;
    ++sb.decode_steps_;
    sb.last_selected_ = selected;
    sb.last_fraction_ = selected / double(n);
    sb.sum_selected_ += selected;
  }
}

std::vector<int32_t> CudaBackend::last_selection(uint32_t layer, uint32_t kv_head) const {
  const int64_t n = s_.last_n_[layer];
  std::vector<int32_t> out;
  if (!topk_) {
    out.resize(size_t(n));
    for (int64_t i = 0; i < n; ++i) out[size_t(i)] = int32_t(i);
    return out;
  }
  if (!sel_idx_[layer]) return out;
  DeviceGuard g(device_);
  check(cudaStreamSynchronize(S(last_stream_)), "cudaStreamSynchronize(selection)");
  out.resize(size_t(sel_k_[layer]));
  check(cudaMemcpy(out.data(), static_cast<const int32_t*>(sel_idx_[layer]) + size_t(kv_head) * sel_k_[layer],
                   out.size() * 4, cudaMemcpyDeviceToHost), "cudaMemcpy(selection)");
  out.erase(std::remove(out.begin(), out.end(), -1), out.end());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace kvs
#endif
