// SPDX-License-Identifier: Apache-2.0
// csattention on the cuda placement: the tables (centroids, fixed-length lists) live on the device
// per layer; a decode step is the launches of cuda::csa_select (backends/cuda/csattention.cuh): the
// streaming update of the new token, the search (nearest centroids, the picked lists reduced by key,
// the top of the sums) every `period` steps, and the selection (sinks, searched keys, window) that
// the placement's gathered attention reads. The rules are the CPU method's (csattention.cpp): its
// parameters are parsed by a CPU object this implementation keeps (the same errors), which also
// writes and reads the tables file, so a CPU-built file loads here and a GPU-built one on the CPU.
//
// The prompt's queries are sampled on the device as the CPU method samples them (every stride-th
// token, the stride doubling while the sample exceeds its cap) and the index is built on the GPU
// (cuda::csa_build). Keys appended outside a decode step enter the lists at the next step (as on
// the CPU, whose select catches up on keys it has not seen). Not on this placement yet: rolling back
// below the indexed tokens (the lists keep no undo log here).
#ifdef KVS_HAVE_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "backends/cuda/csa_build.cuh"
#include "backends/cuda/csattention.cuh"
#include "backends/cuda/cuda_util.hpp"
#include "backends/cuda/device_method.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "methods/csattention/csattention.hpp"

namespace kvs {
namespace {

using cudautil::check;
using cudautil::DevBuf;
using cudautil::S;


class CsaCuda final : public DeviceMethod {
 public:
  CsaCuda(const MethodContext& ctx, const ParamSet& ps)
      : shape_(ctx.shape), budget_(ctx.budget), cpu_(find_method("csattention")->create(ctx, ps)),
        P_(csa::params_of(*cpu_)), layers_(ctx.shape.num_layers) {
    if (P_.m > cuda::kCsaMaxSubspaces)
      fail(KVS_STATUS_UNSUPPORTED, "method_params: csattention subspaces above 64 are not supported on the cuda backend");
    check(cudaGetDevice(&device_), "cudaGetDevice");
    cfg_.m = P_.m;
    for (int b = 0; b < P_.m; ++b) {
      cfg_.off[b] = P_.off[size_t(b)];
      cfg_.db[b] = P_.db[size_t(b)];
      cfg_.w[b] = P_.w[size_t(b)];
    }
    cfg_.TH = P_.TH;
    cfg_.per_query_head = P_.per_query;
    cfg_.group_sum = P_.group_sum && !P_.per_query;
    cfg_.qnorm = P_.qnorm;
    cfg_.missing_min = P_.missing_min;
    cfg_.f16_scores = P_.f16;
    cfg_.rerank = P_.rerank;
    cfg_.scale = float(ctx.shape.softmax_scale);
  }

  // ---- prompt: the query sample ----
  void on_prompt(uint32_t layer, const DeviceLayerView& v, const cuda::Query& q, int64_t t0, int64_t n) override {
    auto& L = layers_[layer];
    if (L.built || n <= 0) return;  // a tables-only load gets its prompt again: the index is there
    const int64_t cap = std::max<int64_t>(1, P_.per_query ? P_.sample : P_.sample / P_.G);
    const int64_t row = int64_t(shape_.num_q_heads) * shape_.head_dim;
    if (!L.sample.p) L.sample.reserve(size_t(cap) * size_t(row) * 4, device_, "cudaMalloc(csattention query sample)");
    // The CPU's sample is every stride-th token from 0, the stride the least power of two that
    // keeps it within the cap (csattention.cpp on_prefill/thin).
    const int64_t end = t0 + n;
    int64_t stride = L.stride;
    while ((end + stride - 1) / stride > cap) stride *= 2;
    if (stride != L.stride) {  // thin the rows kept so far: every (stride / old)-th row
      const int64_t ratio = stride / L.stride, kept = (t0 + stride - 1) / stride;
      DevBuf fresh;
      fresh.reserve(L.sample.bytes, device_, "cudaMalloc(csattention query sample)");
      if (kept > 0)
        check(cudaMemcpy2DAsync(fresh.p, size_t(row) * 4, L.sample.p, size_t(row * ratio) * 4, size_t(row) * 4,
                                size_t(kept), cudaMemcpyDeviceToDevice, S(v.stream)),
              "cudaMemcpy2DAsync(csattention sample thinning)");
      check(cudaStreamSynchronize(S(v.stream)), "cudaStreamSynchronize(csattention sample)");
      L.sample = std::move(fresh);
      L.stride = stride;
    }
    const int64_t first = (t0 + stride - 1) / stride;
    check(cuda::csa_sample_rows(q.data, q.dtype, int32_t(n), int32_t(row), t0, stride, L.sample.as<float>(),
                                int32_t(first), v.stream),
          "csa_sample_rows");
    L.sampled = (end + stride - 1) / stride;
  }

  void build_index(uint32_t layer, const DeviceLayerView& v) override {
    drop_mirror();
    auto& L = layers_[layer];
    const int64_t N = v.tokens;
    if (L.sampled <= 0)
      fail(KVS_STATUS_INVALID_STATE, "csattention: layer " + std::to_string(layer) + " has no prompt queries to cluster");
    if (P_.km.init_queries)
      fail(KVS_STATUS_UNSUPPORTED, "method_params: csattention init=queries is not supported by the GPU index build; "
                                   "build on the cpu backend and load the tables");
    const int64_t Ln = std::clamp<int64_t>(P_.list_len > 0 ? P_.list_len : int64_t(std::llround(P_.alpha * double(N))), 1, N);
    const int64_t C = std::min<int64_t>(P_.C, L.sampled * (P_.per_query ? 1 : P_.G));
    Tables t;
    t.alloc(*this, C, Ln);
    cuda::CsaBuildShape bs{};
    bs.tokens = int32_t(N);
    bs.num_q_heads = int32_t(shape_.num_q_heads);
    bs.num_kv_heads = int32_t(shape_.num_kv_heads);
    bs.head_dim = int32_t(shape_.head_dim);
    bs.table_heads = P_.TH;
    bs.per_query_head = P_.per_query;
    bs.m = P_.m;
    bs.off = P_.off.data();
    bs.db = P_.db.data();
    bs.C = int32_t(C);
    bs.L = int32_t(Ln);
    bs.f16_scores = P_.f16;
    cuda::CsaKmeans km{P_.km.iters, P_.km.batch, P_.km.full_batch,
                       P_.seed * 0x9E3779B97F4A7C15ull + uint64_t(layer) * 1000003ull};
    DevBuf ws;
    ws.reserve(cuda::csa_build_workspace_bytes(bs, int32_t(L.sampled)), device_, "cudaMalloc(csattention build workspace)");
    check(cuda::csa_build(bs, km, L.sample.as<float>(), int32_t(L.sampled), v.kv, cuda::Scalar(int32_t(shape_.kv_dtype)),
                          t.cent.as<float>(), t.idx.as<int32_t>(), t.val.p, cuda::Workspace{ws.p, ws.bytes}, v.stream),
          "csa_build");
    L.t = std::move(t);
    L.indexed = N;
    sort_lists(L, v.stream);  // waits for the build too
    L.built = true;
    L.dense_fallback = false;
    L.step = 0;
    L.have_cached = false;
    L.sample.release();
    L.sampled = 0;
    const double kvb = double(N) * double(shape_.num_kv_heads) * shape_.head_dim * 2 * dtype_size(shape_.kv_dtype);
    if (double(L.t.bytes()) > kvb)
      logf(LogLevel::Warn, "csattention: layer %u tables (%.1f MiB) exceed its KV cache (%.1f MiB); lower centroids or list_frac",
           layer, double(L.t.bytes()) / 1048576.0, kvb / 1048576.0);
  }

  void reserve(uint32_t layer, int64_t tokens, void* stream) override {
    auto& L = layers_[layer];
    if (!L.built) return;
    reserve_cached(L, csa::step_keys(P_, budget_, tokens).k, stream);
    // The next step inserts tokens [indexed, tokens): each list takes at most one entry per token,
    // so the copy made at sorted_at holds them while tokens - sorted_at <= Lcap - L. (A longer
    // appended turn than that still works: the streaming update compacts a full list, slowly.)
    // Only when the heaps hold tokens the copy lacks (an appended turn's chunks each reserve
    // before any of them enters the lists: sorting again then gains nothing).
    if (!L.dense_fallback && tokens - L.t.sorted_at > L.t.Lcap - L.t.L && L.t.sorted_at < L.indexed)
      sort_lists(L, stream);
  }

  void truncate(uint32_t layer, int64_t n) override {
    auto& L = layers_[layer];
    L.pending_n = -1;
    if (!L.built) {  // prompt chunks: the sample keeps the tokens < n
      L.sampled = std::min(L.sampled, (n + L.stride - 1) / L.stride);
      return;
    }
    if (n >= L.indexed) return;
    // The lists may name tokens that are gone: attend densely (as the CPU method past its undo log).
    L.dense_fallback = true;
    L.indexed = n;
    logf(LogLevel::Warn, "csattention: layer %u truncated below its indexed tokens; decoding densely", layer);
  }
  int64_t truncate_floor(uint32_t layer, std::string* why) const override {
    const auto& L = layers_[layer];
    if (!L.built || L.dense_fallback) return 0;
    *why = "csattention on the cuda backend keeps no undo log of its lists: it rolls back to its indexed tokens (" +
           std::to_string(L.indexed) + ") at most (truncate on the cpu backend, or move the session there with kvs_session_to)";
    return L.indexed;
  }

  // ---- a step ----
  void on_tokens(uint32_t layer, const DeviceLayerView&, int64_t t0, int64_t t1) override {
    drop_mirror();
    auto& L = layers_[layer];
    // The decode token of a planned step: its select inserted every key up to it.
    if (t1 - t0 == 1 && L.pending_n == t1) {
      L.indexed = std::max(L.indexed, t1);
      ++L.step;
      if (L.pending_search) {
        L.have_cached = true;
        ++searches_;
      }
    }
    L.pending_n = -1;
  }

  DevicePlan plan(std::span<DeviceMethod* const> batch, uint32_t layer, const DeviceStep& st) const override {
    DevicePlan p;
    p.per_query_head = P_.per_query;
    bool any_index = false;
    int64_t max_sel = 1;
    for (size_t b = 0; b < batch.size(); ++b) {
      const auto* m = static_cast<const CsaCuda*>(batch[b]);
      if (b > 0 && !same_config(*m))
        invalid("kvs_decode_batch: sessions[" + std::to_string(b) +
                "]: on the cuda backend the sessions of one batch must share csattention's subspaces, splits, "
                "weights, weight_list, score_dtype, gqa, group_pick, missing and rerank parameters");
      const auto& L = m->layers_[layer];
      const int64_t n = st.host_lengths[b];
      int64_t cnt = n;
      if (L.built && !L.dense_fallback) {
        any_index = true;
        const auto sk = csa::step_keys(m->P_, m->budget_, n);
        cnt = sk.s_emit + sk.rest + (n - sk.w_emit);
      }
      p.selected.push_back(double(cnt));
      max_sel = std::max(max_sel, cnt);
    }
    if (!any_index) {
      p.dense = true;
      return p;
    }
    // Capacity in steps of 256 keys: a captured step serves every token until the selection
    // leaves it (it is also the top-k's k capacity, see select()).
    p.max_selected = int32_t((max_sel + 255) / 256 * 256);
    p.workspace = cuda::csa_select_workspace_bytes(cfg_, st.shape.batch, st.shape.num_q_heads, st.shape.num_kv_heads,
                                                   st.max_length, p.max_selected);
    p.arg_bytes = batch.size() * sizeof(cuda::CsaSession);
    return p;
  }

  void fill_args(std::span<DeviceMethod* const> batch, uint32_t layer, const DeviceStep& st, void* host) const override {
    auto* out = static_cast<cuda::CsaSession*>(host);
    for (size_t b = 0; b < batch.size(); ++b) {
      const auto* m = static_cast<const CsaCuda*>(batch[b]);
      auto& L = m->layers_[layer];
      const int64_t n = st.host_lengths[b];
      cuda::CsaSession s{};
      s.n = int32_t(n);
      if (!L.built || L.dense_fallback) {
        s.search = 2;
        s.ins_from = s.n;
      } else {
        const auto sk = csa::step_keys(m->P_, m->budget_, n);
        s.cent = L.t.cent.as<float>();
        s.idx = L.t.idx.as<int32_t>();
        s.val = L.t.val.p;
        s.cached = L.cached.as<int32_t>();
        s.cached_cnt = L.cached_cnt.as<int32_t>();
        s.C = int32_t(L.t.C);
        s.L = int32_t(L.t.L);
        s.cached_cap = int32_t(L.cached_cap);
        s.sidx = L.t.sidx.as<int32_t>();
        s.sval = L.t.sval.p;
        s.scnt = L.t.scnt.as<int32_t>();
        s.Lcap = int32_t(L.t.Lcap);
        s.ins_from = int32_t(std::min(L.indexed, n));
        s.s_end = int32_t(sk.s_end);
        s.w_begin = int32_t(sk.w_begin);
        s.s_emit = int32_t(sk.s_emit);
        s.w_emit = int32_t(sk.w_emit);
        s.rest = int32_t(sk.rest);
        s.search = !L.have_cached || L.step % m->P_.period == 0 ? 1 : 0;
        L.pending_n = n;
        L.pending_search = s.search == 1;
      }
      out[b] = s;
    }
  }

  void select(std::span<DeviceMethod* const>, uint32_t, const DeviceStep& st, const DevicePlan& p, const void* args,
              int32_t* idx, int32_t* cnt, const cuda::Workspace& ws) override {
    drop_mirror();
    check(cuda::csa_select(cfg_, static_cast<const cuda::CsaSession*>(args), st.shape.batch, st.shape.num_q_heads,
                           st.shape.num_kv_heads, st.shape.head_dim, st.q, st.kv, st.kv_dtype, st.max_length,
                           p.max_selected, idx, cnt, p.max_selected, ws, st.stream),
          "csa_select");
  }
  bool capturable() const override { return true; }

  // ---- tables: through the CPU object (the same file sections and checks) ----
  void finish(uint32_t layer, const DeviceLayerView& v) override {
    auto& L = layers_[layer];
    auto t = csa::tables_of(*cpu_, layer);
    mirrored_ = true;
    *t.built = L.built;
    if (!L.built) return;
    check(cudaStreamSynchronize(S(v.stream)), "cudaStreamSynchronize(csattention save)");
    *t.dense_fallback = L.dense_fallback;
    *t.L = L.t.L;
    *t.C = L.t.C;
    *t.indexed = L.indexed;
    *t.step = L.step;
    const size_t lists = size_t(P_.TH) * P_.m * size_t(L.t.C) * size_t(L.t.L);
    t.cent->resize(size_t(P_.TH) * size_t(L.t.C) * P_.d);
    t.idx->resize(lists);
    check(cudaMemcpy(t.cent->data(), L.t.cent.p, t.cent->size() * 4, cudaMemcpyDeviceToHost), "cudaMemcpy(csattention centroids)");
    check(cudaMemcpy(t.idx->data(), L.t.idx.p, lists * 4, cudaMemcpyDeviceToHost), "cudaMemcpy(csattention lists)");
    if (P_.f16) {
      t.v16->resize(lists);
      check(cudaMemcpy(t.v16->data(), L.t.val.p, lists * 2, cudaMemcpyDeviceToHost), "cudaMemcpy(csattention scores)");
    } else {
      t.v32->resize(lists);
      check(cudaMemcpy(t.v32->data(), L.t.val.p, lists * 4, cudaMemcpyDeviceToHost), "cudaMemcpy(csattention scores)");
    }
    t.cached->clear();
    if (L.have_cached && L.cached.p) {
      std::vector<int32_t> c(size_t(P_.TH) * size_t(L.cached_cap)), n(size_t(P_.TH));
      check(cudaMemcpy(c.data(), L.cached.p, c.size() * 4, cudaMemcpyDeviceToHost), "cudaMemcpy(csattention cached search)");
      check(cudaMemcpy(n.data(), L.cached_cnt.p, n.size() * 4, cudaMemcpyDeviceToHost), "cudaMemcpy(csattention cached counts)");
      t.cached->resize(size_t(P_.TH));
      for (int h = 0; h < P_.TH; ++h) {
        const int32_t* r = c.data() + size_t(h) * size_t(L.cached_cap);
        (*t.cached)[size_t(h)].assign(r, r + std::clamp<int64_t>(n[size_t(h)], 0, L.cached_cap));
      }
    }
  }
  nlohmann::json save_meta() const override { return cpu_->save_meta(); }
  void save(io::TablesWriter& w) const override { cpu_->save(w); }
  void load(const io::TablesFile& f, const nlohmann::json& meta) override {
    cpu_->load(f, meta);
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      auto t = csa::tables_of(*cpu_, l);
      if (!*t.built) continue;
      auto& L = layers_[l];
      Tables tb;
      tb.alloc(*this, *t.C, *t.L);
      check(cudaMemcpy(tb.cent.p, t.cent->data(), t.cent->size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy(csattention centroids)");
      check(cudaMemcpy(tb.idx.p, t.idx->data(), t.idx->size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy(csattention lists)");
      if (P_.f16) check(cudaMemcpy(tb.val.p, t.v16->data(), t.v16->size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy(csattention scores)");
      else check(cudaMemcpy(tb.val.p, t.v32->data(), t.v32->size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy(csattention scores)");
      L.t = std::move(tb);
      L.indexed = *t.indexed;
      sort_lists(L, nullptr);  // before the layer counts as built: its copy is then complete
      L.built = true;
      L.dense_fallback = *t.dense_fallback;
      L.step = *t.step;
      L.have_cached = false;
      if (t.cached->size() == size_t(P_.TH)) {
        int64_t k = 0;
        for (auto& c : *t.cached) k = std::max<int64_t>(k, int64_t(c.size()));
        reserve_cached(L, std::max<int64_t>(k, 1), nullptr);
        check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(csattention load)");
        std::vector<int32_t> c(size_t(P_.TH) * size_t(L.cached_cap), -1), n(size_t(P_.TH));
        for (int h = 0; h < P_.TH; ++h) {
          const auto& src = (*t.cached)[size_t(h)];
          std::copy(src.begin(), src.end(), c.begin() + int64_t(h) * L.cached_cap);
          n[size_t(h)] = int32_t(src.size());
        }
        check(cudaMemcpy(L.cached.p, c.data(), c.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy(csattention cached search)");
        check(cudaMemcpy(L.cached_cnt.p, n.data(), n.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy(csattention cached counts)");
        L.have_cached = true;
      }
    }
    mirrored_ = true;
    drop_mirror();
  }

  std::unique_ptr<DeviceMethod> clone(void* stream) const override {
    auto c = std::unique_ptr<CsaCuda>(new CsaCuda(*this, 0));
    for (size_t l = 0; l < layers_.size(); ++l) {
      const auto& A = layers_[l];
      auto& B = c->layers_[l];
      B.stride = A.stride;
      B.sampled = A.sampled;
      B.built = A.built;
      B.dense_fallback = A.dense_fallback;
      B.indexed = A.indexed;
      B.step = A.step;
      B.have_cached = A.have_cached;
      auto copy = [&](const DevBuf& from, DevBuf& to, const char* what) {
        if (!from.p) return;
        to.reserve(from.bytes, device_, what);
        check(cudaMemcpyAsync(to.p, from.p, from.bytes, cudaMemcpyDeviceToDevice, S(stream)), what);
      };
      copy(A.sample, B.sample, "csattention fork: query sample");
      if (A.built) {
        B.t.C = A.t.C;
        B.t.L = A.t.L;
        copy(A.t.cent, B.t.cent, "csattention fork: centroids");
        copy(A.t.idx, B.t.idx, "csattention fork: lists");
        copy(A.t.val, B.t.val, "csattention fork: scores");
        B.t.Lcap = A.t.Lcap;
        B.t.sorted_at = A.t.sorted_at;
        copy(A.t.sidx, B.t.sidx, "csattention fork: token-ordered lists");
        copy(A.t.sval, B.t.sval, "csattention fork: token-ordered scores");
        copy(A.t.scnt, B.t.scnt, "csattention fork: list counts");
      }
      copy(A.cached, B.cached, "csattention fork: cached search");
      copy(A.cached_cnt, B.cached_cnt, "csattention fork: cached counts");
      B.cached_cap = A.cached_cap;
    }
    return c;
  }

  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    const auto& L = layers_[layer];
    if (!L.built || L.indexed <= tokens) return true;
    *why = "its csattention tables index " + std::to_string(L.indexed) + " tokens";
    return false;
  }
  uint64_t index_bytes() const override {
    uint64_t b = 0;
    for (auto& L : layers_)
      if (L.built) b += L.t.device_bytes();
    return b;
  }
  bool stat(std::string_view name, double* out) const override {
    if (name == "searches") {
      *out = double(searches_);
    } else if (name == "list_sorts") {
      *out = double(list_sorts_);
    } else if (name == "list_len") {
      *out = 0;
      for (auto& L : layers_)
        if (L.built) {
          *out = double(L.t.L);
          break;
        }
    } else if (name == "table_kv_ratio") {
      double kvb = 0;
      for (auto& L : layers_)
        if (L.built) kvb += double(L.indexed) * shape_.num_kv_heads * shape_.head_dim * 2 * dtype_size(shape_.kv_dtype);
      double tb = 0;
      for (auto& L : layers_)
        if (L.built) tb += double(L.t.bytes());
      *out = kvb > 0 ? tb / kvb : 0.0;
    } else {
      return false;
    }
    return true;
  }

 private:
  struct Tables {
    DevBuf cent, idx, val;
    // The lists in token order for the search (csattention.cuh): Lcap = L + room entries each, so
    // that `room` more tokens can enter every list before the copy is rebuilt from the heaps.
    DevBuf sidx, sval, scnt;
    int64_t C = 0, L = 0, Lcap = 0;
    int64_t sorted_at = 0;  // the indexed tokens when the token-ordered copy was last made
    uint64_t bytes() const { return cent.bytes + idx.bytes + val.bytes; }  // the tables (as saved)
    uint64_t device_bytes() const { return bytes() + sidx.bytes + sval.bytes + scnt.bytes; }
    int64_t lists(const CsaCuda& m) const { return int64_t(m.P_.TH) * m.P_.m * C; }
    void alloc(const CsaCuda& m, int64_t c, int64_t l) {
      C = c;
      L = l;
      Lcap = l + token_list_room(l);
      const size_t lists = size_t(m.P_.TH) * size_t(m.P_.m) * size_t(c) * size_t(l);
      const size_t slots = size_t(m.P_.TH) * size_t(m.P_.m) * size_t(c) * size_t(Lcap);
      cent.reserve(size_t(m.P_.TH) * size_t(c) * size_t(m.P_.d) * 4, m.device_, "cudaMalloc(csattention centroids)");
      idx.reserve(lists * 4, m.device_, "cudaMalloc(csattention lists)");
      val.reserve(lists * (m.P_.f16 ? 2 : 4), m.device_, "cudaMalloc(csattention scores)");
      sidx.reserve(slots * 4, m.device_, "cudaMalloc(csattention token-ordered lists)");
      sval.reserve(slots * (m.P_.f16 ? 2 : 4), m.device_, "cudaMalloc(csattention token-ordered scores)");
      scnt.reserve(size_t(m.P_.TH) * size_t(m.P_.m) * size_t(c) * 4, m.device_, "cudaMalloc(csattention list counts)");
    }
  };
  // Tokens every list can take in token order before a rebuild: a quarter of the list, at least 256
  // (so short lists' copies are larger than 1.25x: 5x at L = 64, still small in bytes).
  // KVS_CSA_LIST_ROOM (environment, read once; tests) sets it, so that the rebuilds and the
  // streaming update's compaction of a full list run often.
  static int64_t token_list_room(int64_t L) {
    static const int64_t forced = [] {
      const char* e = std::getenv("KVS_CSA_LIST_ROOM");
      return e && *e ? std::max<int64_t>(1, std::atoll(e)) : int64_t(0);
    }();
    return forced > 0 ? forced : std::max<int64_t>(256, L / 4);
  }

  struct Layer {
    // Before the build: the prompt-query sample, fp32 [cap][Hq][d], tokens 0, stride, 2 stride, ...
    DevBuf sample;
    int64_t stride = 1, sampled = 0;
    // The index.
    bool built = false, dense_fallback = false;
    Tables t;
    int64_t indexed = 0, step = 0;
    DevBuf cached, cached_cnt;  // the period's search [TH][cached_cap], counts [TH]
    int64_t cached_cap = 0;
    bool have_cached = false;
    // The step planned by fill_args, committed by on_tokens of its token.
    int64_t pending_n = -1;
    bool pending_search = false;
  };

  // The token-ordered copy of layer L's lists made from its heaps, in stream order (index build,
  // load, and reserve() when the next step could overflow it). Its workspace (up to 4M entries of
  // sort buffers) lives for the call only: the host waits for the sort (a rare event: at build,
  // load, and once every `room` tokens).
  void sort_lists(Layer& L, void* stream) {
    const int64_t lists = L.t.lists(*this);
    DevBuf ws;
    ws.reserve(cuda::csa_token_lists_workspace_bytes(lists, int32_t(L.t.L), P_.f16), device_,
               "cudaMalloc(csattention list sort workspace)");
    check(cuda::csa_token_lists(lists, int32_t(L.t.L), int32_t(L.t.Lcap), P_.f16, L.t.idx.as<int32_t>(), L.t.val.p,
                                L.t.sidx.as<int32_t>(), L.t.sval.p, L.t.scnt.as<int32_t>(),
                                cuda::Workspace{ws.p, ws.bytes}, stream),
          "csa_token_lists");
    check(cudaStreamSynchronize(S(stream)), "cudaStreamSynchronize(csattention list sort)");
    L.t.sorted_at = L.indexed;
    ++list_sorts_;
  }

  // For clone(): the same parameters and a copy of the CPU object, no device state.
  CsaCuda(const CsaCuda& o, int)
      : shape_(o.shape_), budget_(o.budget_), cpu_(o.cpu_->clone()), P_(csa::params_of(*cpu_)), cfg_(o.cfg_),
        device_(o.device_), layers_(o.layers_.size()) {}

  // Field by field (the struct has padding).
  bool same_config(const CsaCuda& o) const {
    const auto &a = cfg_, &b = o.cfg_;
    if (a.m != b.m || a.TH != b.TH || a.per_query_head != b.per_query_head || a.group_sum != b.group_sum ||
        a.qnorm != b.qnorm || a.missing_min != b.missing_min || a.f16_scores != b.f16_scores ||
        a.rerank != b.rerank || a.scale != b.scale)
      return false;
    for (int i = 0; i < a.m; ++i)
      if (a.off[i] != b.off[i] || a.db[i] != b.db[i] || a.w[i] != b.w[i]) return false;
    return true;
  }
  // Room for a cached search of k keys per table head (contents kept).
  void reserve_cached(Layer& L, int64_t k, void* stream) {
    if (k <= L.cached_cap) return;
    const int64_t cap = std::max<int64_t>({256, k + k / 4, L.cached_cap * 2});
    DevBuf c, n;
    c.reserve(size_t(P_.TH) * size_t(cap) * 4, device_, "cudaMalloc(csattention cached search)");
    n.reserve(size_t(P_.TH) * 4, device_, "cudaMalloc(csattention cached counts)");
    if (L.cached.p) {
      check(cudaMemcpy2DAsync(c.p, size_t(cap) * 4, L.cached.p, size_t(L.cached_cap) * 4, size_t(L.cached_cap) * 4,
                              size_t(P_.TH), cudaMemcpyDeviceToDevice, S(stream)),
            "cudaMemcpy2DAsync(csattention cached search)");
      check(cudaMemcpyAsync(n.p, L.cached_cnt.p, size_t(P_.TH) * 4, cudaMemcpyDeviceToDevice, S(stream)),
            "cudaMemcpyAsync(csattention cached counts)");
      // The old buffers may still be read by queued work: free them after it.
      check(cudaStreamSynchronize(S(stream)), "cudaStreamSynchronize(csattention cached search)");
    } else {
      check(cudaMemsetAsync(n.p, 0, size_t(P_.TH) * 4, S(stream)), "cudaMemsetAsync(csattention cached counts)");
    }
    L.cached = std::move(c);
    L.cached_cnt = std::move(n);
    L.cached_cap = cap;
  }
  // The host copies of the tables made for a save (or a load) are dropped once the session moves on.
  void drop_mirror() {
    if (!mirrored_) return;
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      auto t = csa::tables_of(*cpu_, l);
      *t.built = false;
      std::vector<float>().swap(*t.cent);
      std::vector<int32_t>().swap(*t.idx);
      std::vector<uint16_t>().swap(*t.v16);
      std::vector<float>().swap(*t.v32);
      std::vector<std::vector<int32_t>>().swap(*t.cached);
    }
    mirrored_ = false;
  }

  ModelShape shape_;
  Budget budget_;
  std::unique_ptr<Method> cpu_;  // parses the parameters; writes and reads the tables file
  csa::Params P_;
  cuda::CsaConfig cfg_;
  int device_ = 0;
  mutable std::vector<Layer> layers_;  // fill_args (const) records the step it plans
  bool mirrored_ = false;
  int64_t searches_ = 0;
  int64_t list_sorts_ = 0;  // token-ordered copies made (stat "list_sorts")
};

}  // namespace

std::unique_ptr<DeviceMethod> make_csattention_cuda(const MethodContext& c, const ParamSet& p) {
  return std::make_unique<CsaCuda>(c, p);
}
}  // namespace kvs
#endif
