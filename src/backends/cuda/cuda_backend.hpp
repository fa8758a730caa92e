// The cuda backend of a Session: KV of every layer in GPU memory as [Hkv, capacity, d] per layer
// (the layout of cuda_attention.cuh), decode through the CUDA kernels on the caller's stream.
// Supports the methods `full` and `exact_topk` (per_kv_head, no forced sinks/local), KV in bf16 or
// fp16, head dims 64 and 128. Inputs must be contiguous CUDA tensors; nothing synchronises the
// stream except kvs_session_last_selection (which must read the selection back).
#pragma once
#ifdef KVS_HAVE_CUDA
#include <cstdint>
#include <vector>

#include "kvsieve/kvsieve.h"

namespace kvs {

class Session;

class CudaBackend {
 public:
  explicit CudaBackend(Session& owner);
  ~CudaBackend();
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  void prefill(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
               const kvs_tensor* o, void* stream);
  void build_index(uint32_t layer, void* stream) {}
  void append(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
              const kvs_tensor* o, void* stream);
  static void decode_batch(Session* const* sessions, size_t count, uint32_t layer, const kvs_tensor* q,
                           const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
                           const kvs_tensor* lse, void* stream, bool single);
  int64_t layer_tokens(uint32_t layer) const { return layers_[layer].n; }
  uint64_t kv_bytes() const;
  std::vector<int32_t> last_selection(uint32_t layer, uint32_t kv_head) const;

 private:
  struct Layer {
    void* k = nullptr;
    void* v = nullptr;
    int64_t cap = 0;
    int64_t n = 0;
  };
  // Appends n rows of a contiguous CUDA q/k/v chunk (prefill chunks and append share it).
  void add_tokens(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                  const kvs_tensor* o, void* stream, const char* fn);
  void reserve(uint32_t layer, int64_t tokens, void* stream);
  void copy_rows(uint32_t layer, const void* k, const void* v, int64_t rows, void* stream);
  void* workspace(size_t bytes);

  Session& s_;
  int device_;
  bool topk_;
  std::vector<Layer> layers_;
  void* ws_ = nullptr;
  size_t ws_bytes_ = 0;
  // exact_topk: the last step's indices/counts per layer (device), and the stream that wrote them.
  std::vector<void*> sel_idx_, sel_cnt_;
  std::vector<int32_t> sel_k_;
  void* last_stream_ = nullptr;
};

}  // namespace kvs
#endif
