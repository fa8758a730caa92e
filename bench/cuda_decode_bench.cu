// SPDX-License-Identifier: Apache-2.0
// C shim over src/backends/cuda/cuda_attention.cuh for bench/cuda_sdpa_compare.py, which loads it
// with ctypes so our kernels and torch's scaled_dot_product_attention run in one process on the
// same data (the script lays K/V out in pages, kv_layout.cuh). Build (see tools/device/cuda_check.sh):
//   nvcc -std=c++17 -O3 -arch=sm_90 -shared -Xcompiler -fPIC -I src -I include \
//        src/backends/cuda/cuda_attention.cu bench/cuda_decode_bench.cu -o libkvs_cuda_bench.so
// Every function returns the Status code (0 ok); kvsb_last_message() names the failed check.
#include <cstddef>
#include <cstdint>

#include "backends/cuda/cuda_attention.cuh"

namespace {
thread_local const char* g_msg = "ok";
thread_local int g_cuda_err = 0;
int ret(const kvs::cuda::Status& s) {
  g_msg = s.message;
  g_cuda_err = s.cuda_error;
  return s.code;
}
kvs::cuda::AttnShape shape(int B, int Hq, int Hkv, int D, float scale) {
  kvs::cuda::AttnShape s;
  s.batch = B;
  s.num_q_heads = Hq;
  s.num_kv_heads = Hkv;
  s.head_dim = D;
  s.scale = scale;
  return s;
}
}  // namespace

kvs::cuda::PagedKv paged(const void* pages, int max_pages, int page_tokens) {
  kvs::cuda::PagedKv kv;
  kv.pages = static_cast<const void* const*>(pages);
  kv.max_pages = max_pages;
  kv.page_tokens = page_tokens;
  kv.page_shift = 0;
  while (kv.page_shift < 30 && (1 << kv.page_shift) < page_tokens) ++kv.page_shift;
  return kv;
}

extern "C" {

const char* kvsb_last_message() { return g_msg; }
int kvsb_last_cuda_error() { return g_cuda_err; }
int kvsb_set_variant(int v) { return kvs::cuda::detail::set_dense_variant(v) ? 0 : 1; }
int kvsb_set_gather_variant(int v) { return kvs::cuda::detail::set_gather_variant(v) ? 0 : 1; }
void kvsb_set_merge_pdl(int on) { kvs::cuda::detail::set_merge_pdl(on != 0); }
void kvsb_set_min_chunk(int tokens) { kvs::cuda::detail::set_min_chunk(tokens); }

int kvsb_num_splits(int B, int Hq, int Hkv, int D, int max_tokens, int kv_dtype) {
  return kvs::cuda::decode_num_splits(shape(B, Hq, Hkv, D, 1.f), max_tokens,
                                      static_cast<kvs::cuda::Scalar>(kv_dtype));
}

size_t kvsb_dense_ws(int B, int Hq, int Hkv, int D, int max_len) {
  return kvs::cuda::dense_decode_workspace_bytes(shape(B, Hq, Hkv, D, 1.f), max_len);
}
size_t kvsb_gathered_ws(int B, int Hq, int Hkv, int D, int max_sel, int per_q) {
  return kvs::cuda::gathered_decode_workspace_bytes(shape(B, Hq, Hkv, D, 1.f), max_sel, per_q != 0);
}

// pages: device [B * max_pages] page pointers (kv_layout.cuh), page_tokens a power of two.
int kvsb_dense(int B, int Hq, int Hkv, int D, float scale, int kv_dtype, int q_dtype, int o_dtype,
               const void* q, const void* pages, int max_pages, int page_tokens,
               const int32_t* lengths, int max_len, void* o, float* lse, void* ws, size_t ws_bytes,
               void* stream) {
  kvs::cuda::Query qq{q, static_cast<kvs::cuda::Scalar>(q_dtype)};
  kvs::cuda::Output out{o, static_cast<kvs::cuda::Scalar>(o_dtype), lse};
  return ret(kvs::cuda::dense_decode(shape(B, Hq, Hkv, D, scale), qq, paged(pages, max_pages, page_tokens),
                                     static_cast<kvs::cuda::Scalar>(kv_dtype), lengths, max_len, out,
                                     kvs::cuda::Workspace{ws, ws_bytes}, stream));
}

int kvsb_gathered(int B, int Hq, int Hkv, int D, float scale, int kv_dtype, int q_dtype,
                  int o_dtype, const void* q, const void* pages, int max_pages, int page_tokens,
                  const int32_t* indices, const int32_t* counts, int max_sel, int per_q, void* o,
                  float* lse, void* ws, size_t ws_bytes, void* stream) {
  kvs::cuda::Query qq{q, static_cast<kvs::cuda::Scalar>(q_dtype)};
  kvs::cuda::Output out{o, static_cast<kvs::cuda::Scalar>(o_dtype), lse};
  return ret(kvs::cuda::gathered_decode(shape(B, Hq, Hkv, D, scale), qq, paged(pages, max_pages, page_tokens),
                                        static_cast<kvs::cuda::Scalar>(kv_dtype), indices, counts,
                                        max_sel, out, kvs::cuda::Workspace{ws, ws_bytes}, stream,
                                        per_q != 0));
}

int kvsb_merge(const float* oa, const float* la, const float* ob, const float* lb, float* o,
               float* l, int64_t rows, int d, void* stream) {
  return ret(kvs::cuda::merge_states(oa, la, ob, lb, o, l, rows, d, stream));
}

}  // extern "C"
