// SPDX-License-Identifier: Apache-2.0
// exact_topk on the cuda placement: one pass over the keys scores every key (the group's summed
// softmax per KV head, or each query head's logit), forced sinks/local scored +inf, a radix top-k
// per row picks the budget (ties to the lower index, so forced keys are kept sinks first as in the
// CPU method, exact_topk.cpp), and the gathered kernel attends the lists.
#ifdef KVS_HAVE_CUDA
#include <algorithm>

#include "backends/cuda/cuda_util.hpp"
#include "backends/cuda/device_method.hpp"
#include "backends/cuda/topk.cuh"

namespace kvs {
namespace {

size_t a256(size_t x) { return (x + 255) / 256 * 256; }

class ExactTopkCuda final : public DeviceMethod {
 public:
  ExactTopkCuda(const ParamSet& p)
      : per_query_(p.get_string("mode") == "per_query_head"), sinks_(p.get_int("sinks")), local_(p.get_int("local")) {
    if (sinks_ < 0 || local_ < 0) invalid("method_params: exact_topk sinks and local must be >= 0");
  }

  DevicePlan plan(std::span<DeviceMethod* const>, uint32_t, const DeviceStep& st) const override {
    DevicePlan p;
    p.per_query_head = per_query_;
    const int32_t B = st.shape.batch, H = per_query_ ? st.shape.num_q_heads : st.shape.num_kv_heads;
    int64_t kmax = 0;
    for (size_t b = 0; b < st.host_lengths.size(); ++b) {
      const int64_t k = std::min(st.host_budget[b], st.host_lengths[b]);
      kmax = std::max(kmax, k);
      // Keys whose bytes are read per KV head: k per list (per query head: the union is at most G*k).
      p.selected.push_back(double(k));
    }
    p.max_selected = int32_t(kmax);
    const size_t rows = size_t(B) * H;
    p.workspace = a256(rows * size_t(st.max_length) * 4) + a256(cuda::topk_scores_workspace_bytes(st.shape, st.max_length)) +
                  a256(cuda::topk_rows_workspace_bytes(int32_t(rows), st.max_length, int32_t(kmax)));
    p.arg_bytes = 2 * rows * 4;  // per-row lengths, then per-row k
    return p;
  }

  // Every per-token value the step reads is in device memory (lengths, the per-row k, the query
  // through DeviceStep::q.at), and the launches depend only on the capacities: capturable.
  bool capturable() const override { return true; }

  void fill_args(std::span<DeviceMethod* const>, uint32_t, const DeviceStep& st, void* host) const override {
    const int32_t H = per_query_ ? st.shape.num_q_heads : st.shape.num_kv_heads;
    const size_t rows = st.host_lengths.size() * size_t(H);
    auto* rl = static_cast<int32_t*>(host);
    int32_t* rk = rl + rows;
    for (size_t b = 0; b < st.host_lengths.size(); ++b) {
      const auto k = int32_t(std::min(st.host_budget[b], st.host_lengths[b]));
      for (int32_t h = 0; h < H; ++h) {
        rl[b * H + size_t(h)] = int32_t(st.host_lengths[b]);
        rk[b * H + size_t(h)] = k;
      }
    }
  }

  void select(std::span<DeviceMethod* const>, uint32_t, const DeviceStep& st, const DevicePlan& p, const void* args,
              int32_t* idx, int32_t* cnt, const cuda::Workspace& ws) override {
    using cudautil::check;
    const int32_t B = st.shape.batch, H = per_query_ ? st.shape.num_q_heads : st.shape.num_kv_heads;
    const size_t rows = size_t(B) * H;
    char* w = static_cast<char*>(ws.ptr);
    float* scores = reinterpret_cast<float*>(w);
    w += a256(rows * size_t(st.max_length) * 4);
    const size_t sws = cuda::topk_scores_workspace_bytes(st.shape, st.max_length);
    // One top-k for the whole batch: each row's k (the session's budget at its length) is read on
    // the device, p.max_selected (a capacity, rounded up in a captured step) is the row stride.
    const auto* row_len = static_cast<const int32_t*>(args);
    if (!per_query_) {  // the group's summed softmax: score pass and top-k in one call (fused for long rows)
      check(cuda::topk_group_select(st.shape, st.q, st.kv, st.kv_dtype, st.lengths, st.max_length, int32_t(sinks_),
                                    int32_t(local_), row_len, row_len + rows, p.max_selected, scores, idx, cnt,
                                    cuda::Workspace{w, sws}, st.stream),
            "topk_group_select");
      return;
    }
    check(cuda::topk_scores(st.shape, st.q, st.kv, st.kv_dtype, st.lengths, st.max_length, per_query_, int32_t(sinks_),
                            int32_t(local_), scores, cuda::Workspace{w, sws}, st.stream),
          "topk_scores");
    w += a256(sws);
    const size_t tws = cuda::topk_rows_workspace_bytes(int32_t(rows), st.max_length, p.max_selected);
    check(cuda::topk_rows(scores, st.max_length, row_len, int32_t(rows), st.max_length, p.max_selected, idx, cnt,
                          cuda::Workspace{w, tws}, st.stream, row_len + rows),
          "topk_rows");
  }
  std::unique_ptr<DeviceMethod> clone(void*) const override { return std::make_unique<ExactTopkCuda>(*this); }

 private:
  bool per_query_;
  int64_t sinks_, local_;
};
}  // namespace

std::unique_ptr<DeviceMethod> make_exact_topk_cuda(const MethodContext&, const ParamSet& p) {
  return std::make_unique<ExactTopkCuda>(p);
}
}  // namespace kvs
#endif
