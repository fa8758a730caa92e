// SPDX-License-Identifier: Apache-2.0
// retroinfer on the cuda placement: the decode step on the GPU (retro.cuh: the cluster ranking,
// the zones, the exact list and the estimation zone's state, which the gathered attention merges
// in), over a device copy of the meta index (centroids and value means in the decode dtype,
// sizes, starts, positions; the KV itself stays in the placement's pages).
//
// The index is the CPU method's (retroinfer.cpp), kept on the host, with its k-means run on the GPU
// (retro_kmeans, over the stored keys in place); the host lays out the clusters from a copy of the
// indexed tokens read back once, and the incremental update (every update_segment tokens past the
// index) does the same for its tokens. So the tables file is the CPU's, a tables file moves
// between the placements as it is, and a step ranks the very same clusters as the CPU would (up
// to the order of fp32 sums). The host index holds the clustered keys and values too (the CPU
// layout): host memory of about the indexed KV. Not graph-capturable (an update reads back and
// changes the index outside the stream), as the authors' code disables CUDA graphs with index updates.
//
// The wave buffer: with the KV cache in pinned host memory (kv_memory = KVS_DEVICE_CUDA_HOST) the
// placement keeps the steady zone's pages (sinks, local window, unclustered tail) in GPU memory
// (hot_tokens) and the rest on the host, and each layer gets a GPU block cache of cache_ratio of
// its clustered rows per KV head, in blocks of kWaveBlockRows rows of one cluster. The step's page
// table is [the cache's pages | the sequence's pages | staging pages], so a list row's virtual
// position (vpos) names its cache block while cached and its token otherwise: the zones kernel
// lists virtual positions, hits are read from the cache and the steady zone from GPU pages. The
// misses (wave_misses): stage (default) gathers them from host memory into the staging pages and
// points the list there (the authors' execution buffer; the attention reads GPU memory only); copy
// admits them into the cache first and remaps the list (tok2v); inplace leaves them to the
// attention, read from host memory. Off the critical path, on a side stream once the zones kernel
// is done: the ids of the clusters the step read (written by the zones kernel into mapped host
// memory), a host function running the authors' LRU over clusters (retro::WaveCache, after
// BufferManager::batch_update: hits to the front, misses admitted in id order while blocks can be
// freed from clusters this step did not read), then, after the staging, a kernel copying the
// admitted rows into their blocks (from the staging when staged) and rewriting vpos and tok2v. The
// layer's next step waits for that kernel (an event); a failed decision resets every cache
// (recover_wave) rather than letting host and device disagree.
#ifdef KVS_HAVE_CUDA
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/cuda_util.hpp"
#include "backends/cuda/device_method.hpp"
#include "backends/cuda/page_pool.hpp"
#include "backends/cuda/retro.cuh"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/kv_store.hpp"
#include "core/log.hpp"
#include "core/thread_pool.hpp"
#include "methods/retroinfer/retroinfer.hpp"
#include "methods/retroinfer/wave_cache.hpp"

namespace kvs {
namespace {

using cudautil::check;
using cudautil::DevBuf;
using cudautil::S;

size_t al256(size_t x) { return (x + 255) / 256 * 256; }
// x and an eighth more (at least `least`), below 2^31: the room a device layout keeps for the
// index updates to come (the mirror's clusters and rows, the wave buffer's per-token maps).
int32_t with_room(int64_t x, int64_t least) {
  return int32_t(std::min<int64_t>(x + std::max<int64_t>(x / 8, least), INT32_MAX));
}

// One GPU k-means of n tokens (retro_kmeans) and its scratch in one allocation: the workspace,
// then the assignments [Hkv][n] int32 and the centroids [Hkv][C][d] fp32, 256-byte aligned.
struct KMeansRun {
  cuda::RetroKMeans k;
  size_t ws_bytes = 0, a_bytes = 0, c_bytes = 0, bytes = 0;
  KMeansRun(const retro::KMeansConfig& cfg, int64_t n, int hkv, int d) {
    k.n = int32_t(n);
    k.clusters = int32_t(cfg.clusters);
    k.segments = int32_t(cfg.segments);
    k.iterations = cfg.iterations;
    k.centre = cfg.centre;
    k.raw_init = cfg.raw_init;
    ws_bytes = cuda::retro_kmeans_workspace_bytes(hkv, d, k);
    a_bytes = size_t(hkv) * size_t(n) * 4;
    c_bytes = size_t(hkv) * size_t(cfg.clusters) * size_t(d) * 4;
    bytes = al256(ws_bytes) + al256(a_bytes) + c_bytes;
  }
  int32_t* assign(char* base) const { return reinterpret_cast<int32_t*>(base + al256(ws_bytes)); }
  float* centroids(char* base) const { return reinterpret_cast<float*>(base + al256(ws_bytes) + al256(a_bytes)); }
};

class RetroCuda final : public DeviceMethod {
 public:
  RetroCuda(const MethodContext& ctx, const ParamSet& ps)
      : shape_(ctx.shape), host_(find_method("retroinfer")->create(ctx, ps)), rules_(retro::rules(*host_)),
        layers_(ctx.shape.num_layers), pool_(ctx.pool) {
    if (rules_.rank_model)
      fail(KVS_STATUS_UNSUPPORTED, "method_params: retroinfer rank_dtype=model is not supported on the cuda backend "
                                   "(cpu only); use rank_dtype=f32");
    const int G = int(shape_.num_q_heads / shape_.num_kv_heads);
    if (G * shape_.head_dim > 2048)
      fail(KVS_STATUS_UNSUPPORTED, "retroinfer on the cuda backend: query heads per KV head x head_dim must be <= 2048, got " +
                                       std::to_string(G * shape_.head_dim));
    check(cudaGetDevice(&device_), "cudaGetDevice");
    cache_ratio_ = ps.get_float("cache_ratio");
    const std::string wm = ps.get_string("wave_misses");
    misses_ = wm == "copy" ? Misses::Copy : wm == "inplace" ? Misses::Inplace : Misses::Stage;
    hot_.resize(layers_.size());
    if (!(cache_ratio_ >= 0 && cache_ratio_ <= 1))
      invalid("method_params: retroinfer cache_ratio must be in [0, 1], got " + std::to_string(cache_ratio_));
    install_clusterer();
  }
  ~RetroCuda() override {
    if (side_) {
      cudaStreamSynchronize(side_);
      cudaStreamDestroy(side_);
    }
    for (auto& L : layers_) {
      L.wave.release_events();
      if (L.mirror.uploaded) cudaEventDestroy(L.mirror.uploaded);
      if (L.ahead.done) {  // its copies write into pinned memory freed with it
        cudaEventSynchronize(L.ahead.done);
        cudaEventDestroy(L.ahead.done);
      }
    }
    if (stage_read_) cudaEventDestroy(stage_read_);
  }

  // ---- index: the host method's, mirrored ----
  void on_prompt(uint32_t layer, const DeviceLayerView&, const cuda::Query&, int64_t, int64_t) override {
    layers_[layer].prompt_chunk = true;  // on_tokens of a prompt chunk: the build indexes it
  }
  void on_tokens(uint32_t layer, const DeviceLayerView& v, int64_t t0, int64_t t1) override {
    auto& L = layers_[layer];
    if (std::exchange(L.prompt_chunk, false) || !L.built) return;
    update(layer, v, t1, t1 - t0, t1 - t0 == 1);  // a decode token's was done by before_step
  }
  void before_step(uint32_t layer, const DeviceLayerView& v, int64_t tokens) override {
    if (!layers_[layer].built) return;
    // The last step's block-cache moves read KV pages through its table: they run before any page
    // moves between host and device (the placement's, after this call).
    recover_wave();
    if (layers_[layer].wave.pending)
      check(cudaStreamWaitEvent(S(v.stream), layers_[layer].wave.admitted, 0), "cudaStreamWaitEvent(wave buffer)");
    update(layer, v, tokens, 1, true);
    sync_mirror(layer, v.stream);
    sync_wave(layer, v);
    cluster_ahead(layer, v);
  }
  // The steady zone of the step (sinks, local window, the unclustered tail the fill may take).
  HotTokens hot_tokens(uint32_t layer, int64_t tokens, int64_t budget) const override {
    if (!layers_[layer].built) return {};
    return hot_of(retro::step_layout(*host_, layer, tokens, budget), tokens, retro::index_view(*host_, layer).indexed_end);
  }
  static HotTokens hot_of(const retro::StepLayout& lay, int64_t tokens, int64_t indexed_end) {
    using SL = retro::StepLayout;
    if (lay.mode == SL::All) return {};  // every key, every step: nothing is read more than the rest
    if (lay.mode == SL::Streaming) return {lay.sk, tokens - lay.lw};
    return {std::max(lay.sk, lay.sinks_end), std::min(lay.lb, indexed_end)};
  }
  void build_index(uint32_t layer, const DeviceLayerView& v) override {
    const auto t0 = std::chrono::steady_clock::now();
    KVLayer kv = download(v, v.tokens, std::min<int64_t>(rules_.sinks, v.tokens), v.tokens);
    build_readback_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    Clustering scope(this, &v, nullptr, /*build=*/true);
    layers_[layer].ahead.issued = false;  // the index starts again: so does the next update
    host_->build_index(layer, kv);
    layers_[layer].built = true;
    // The updates' KV read-back staging now, not at the first update's step (a cudaHostAlloc of a
    // few MiB took milliseconds there): update_segment tokens span at most this many pages.
    const size_t update_bytes = size_t(rules_.update_segment / kPageTokens + 2) * page_bytes();
    if (update_bytes <= kKeptDownloadBytes) download_stage_.reserve(update_bytes, "cudaHostAlloc(retroinfer KV readback)");
  }
  void reserve(uint32_t layer, int64_t, void* stream) override {
    if (!stats_.p) {  // the last step's rows, then the running sums (zeroed once)
      stats_.reserve(stats_bytes(), device_, "retroinfer stats");
      check(cudaMemset(stats_.p, 0, stats_bytes()), "cudaMemset(retroinfer stats)");
    }
    sync_mirror(layer, stream);
  }
  void truncate(uint32_t layer, int64_t n) override {
    host_->truncate(layer, n);
    // Tokens the next update's clustering ran ahead over may be gone (then written again).
    auto& A = layers_[layer].ahead;
    if (A.issued && n < A.b + rules_.update_segment) A.issued = false;
  }
  // A rollback keeps every clustered token and the local window after them: the clusters are not
  // undone here (the cpu backend's max_rollback keeps copies of the index for that).
  // Its index update reads KV pages back into a host KV layer (download), in the host store's pages.
  // Its wave buffer mixes the caller's pages with its own in one page table: kvsieve's layout only.
  bool caller_kv_ok(int32_t P, bool own_layout, std::string* why) const override {
    if (P != int32_t(kPageTokens)) {
      *why = "kv->page_size: retroinfer on the cuda backend reads a caller's KV cache in pages of " +
             std::to_string(kPageTokens) + " tokens only";
      return false;
    }
    if (!own_layout) {
      *why = "kv->layout, kv->v_pages: retroinfer on the cuda backend reads a caller's KV cache in the HND layout "
             "with K and V in one tensor only";
      return false;
    }
    return true;
  }
  int64_t truncate_floor(uint32_t layer, std::string* why) const override {
    if (!layers_[layer].built) return 0;
    const auto ix = retro::index_view(*host_, layer);
    if (ix.heads->empty()) return 0;
    const int64_t floor = ix.indexed_end + rules_.local;
    *why = "retroinfer on the cuda backend keeps no undo log of its clusters: it rolls back to its clustered tokens "
           "and local window (" + std::to_string(floor) + " tokens) at most (truncate on the cpu backend with "
           "max_rollback, or move the session there with kvs_session_to)";
    return floor;
  }
  void finish(uint32_t, const DeviceLayerView&) override {}

  // ---- step ----
  DevicePlan plan(std::span<DeviceMethod* const> batch, uint32_t layer, const DeviceStep& st) const override {
    DevicePlan p;
    p.prior = true;
    int64_t cap = 1, maxC = 1, maxRows = 1;
    bool have_meta = false;
    layouts_.clear();
    for (size_t b = 0; b < st.host_lengths.size(); ++b) {
      const auto* m = static_cast<const RetroCuda*>(batch[b]);
      const int64_t n = st.host_lengths[b];
      const auto lay = retro::step_layout(*m->host_, layer, n, st.host_budget[b]);
      layouts_.push_back(lay);  // fill_args, for the same batch
      const Mirror& M = m->layers_[layer].mirror;
      // The list's capacity: the steady zone plus the r largest clusters (paper), or plus the room
      // (session modes); the statistics' counts come from the device (settle_selected).
      using SL = retro::StepLayout;
      int64_t bound = n;
      if (lay.mode == SL::Streaming) bound = lay.sk + lay.lw;
      else if (lay.mode == SL::Paper) bound = lay.sk + (n - lay.lb) + M.top_r_rows;
      else if (lay.mode != SL::All) bound = lay.sk + (n - lay.lb) + lay.room;
      if (M.C > 0) {  // one meta dtype per launch
        if (have_meta && M.meta != meta_)
          fail(KVS_STATUS_UNSUPPORTED, "retroinfer (cuda): the sessions of a batch keep their meta index in different "
                                       "dtypes (meta_dtype); decode them apart");
        meta_ = M.meta;
        have_meta = true;
      }
      cap = std::max(cap, bound);
      if (m->layers_[layer].wave.on && m->misses_ == Misses::Stage) m->ensure_stage(layer, std::min(bound, n));
      maxC = std::max<int64_t>(maxC, M.C);
      maxRows = std::max<int64_t>(maxRows, M.max_size);
      p.selected.push_back(double(std::min(bound, n)));
    }
    p.max_selected = int32_t(std::min<int64_t>(cap, (int64_t(1) << 31) - 1));
    // The counts are exact only where the budget is filled; the device adds up the real ones
    // (settle_selected), for every step alike.
    p.selected_exact = false;
    max_clusters_ = int32_t(maxC);
    max_rows_ = int32_t(maxRows);
    p.workspace = cuda::retro_select_workspace_bytes(st.shape, max_clusters_, max_rows_);
    p.arg_bytes = st.host_lengths.size() * sizeof(cuda::RetroSession);
    return p;
  }
  void fill_args(std::span<DeviceMethod* const> batch, uint32_t layer, const DeviceStep& st, void* host) const override {
    auto* ss = static_cast<cuda::RetroSession*>(host);
    for (size_t b = 0; b < batch.size(); ++b) {
      const auto* m = static_cast<const RetroCuda*>(batch[b]);
      const int64_t n = st.host_lengths[b];
      const retro::StepLayout& lay = layouts_[b];  // plan()'s
      const auto ix = retro::index_view(*m->host_, layer);
      const Mirror& M = m->layers_[layer].mirror;
      if (M.generation != ix.generation)
        fail(KVS_STATUS_INTERNAL, "retroinfer (cuda): the device index is stale (reserve was not called before the step)");
      cuda::RetroSession s{};
      s.cent = M.cent.p;
      s.vmeta = M.vmeta.p;
      s.size = M.size.as<int32_t>();
      s.start = M.start.as<int32_t>();
      s.pos = M.pos.as<int32_t>();
      s.C = M.C;
      s.R = M.R;
      s.cs = M.cs;
      s.rs = M.rs;
      s.mode = int32_t(lay.mode);
      s.n = int32_t(n);
      s.sk = int32_t(lay.sk);
      s.lb = int32_t(lay.lb);
      s.sinks_end = int32_t(lay.sinks_end);
      s.indexed_end = int32_t(ix.indexed_end);
      s.room = int32_t(lay.room);
      s.r_fixed = int32_t(ix.r);
      s.e = int32_t(ix.e);
      s.lw = int32_t(lay.lw);
      const Wave& W = m->layers_[layer].wave;
      if (W.on) {
        s.pos = W.vpos.as<int32_t>();
        s.tok_base = W.tok_base;
        s.wave_cap = W.C;
        s.wave_ids = W.ids.dev<int32_t>();
        s.wave_cnt = W.ids.dev<int32_t>() + size_t(W.C) * shape_.num_kv_heads;
        s.cache_pages = W.page_ptrs.as<const void*>();
        s.cache_page_count = W.cache_pages;
        if (m->misses_ == Misses::Stage) {
          const Stage& SG = m->stage_[layer & 1];
          s.stage_pages = SG.ptrs.as<const void*>();
          s.stage_page_count = SG.cap / int32_t(kPageTokens);
        }
        s.own_cap = int32_t(W.own_cap);
        s.own_table = W.own_table.as<const void*>();
        const HotTokens hot = hot_of(lay, n, ix.indexed_end);  // plan()'s layout: the placement's hot tokens
        m->hot_[layer] = {hot.head_end, hot.tail_begin};
      }
      s.stats = m->stats_.as<int32_t>();
      s.unused_sum = m->unused_sums();
      s.sel_sum = m->unused_sums() ? m->unused_sums() + shape_.num_kv_heads : nullptr;
      ss[b] = s;
      m->last_overrun_ = lay.overrun;
      if (lay.mode != retro::StepLayout::All && lay.mode != retro::StepLayout::Streaming) {  // as the CPU counts
        m->sum_overrun_ += double(lay.overrun);
        ++m->selects_;
      }
      m->stats_fresh_ = false;
    }
  }
  void select(std::span<DeviceMethod* const> batch, uint32_t layer, const DeviceStep& st, const DevicePlan& p, const void* args,
              int32_t* idx, int32_t* cnt, const cuda::Workspace& ws) override {
    cuda::RetroConfig cfg;
    cfg.meta = meta_;
    cfg.mask_before = !rules_.mask_after;
    const auto* ss = static_cast<const cuda::RetroSession*>(args);
    // The wave buffer: the step's page table with the block caches ahead (the admissions of the
    // layer's last step are in: before_step made the stream wait for them).
    const int64_t B = int64_t(batch.size());
    int32_t cp = -1, sp = 0;
    for (int64_t b = 0; b < B; ++b) {
      const auto* m = static_cast<const RetroCuda*>(batch[size_t(b)]);
      const Wave& W = m->layers_[layer].wave;
      if (!W.on) continue;
      cp = std::max(cp, W.cache_pages);
      if (m->misses_ == Misses::Stage) sp = std::max(sp, m->stage_[layer & 1].cap / int32_t(kPageTokens));
    }
    cuda::PagedKv kv = st.kv;
    attn_wave_ = cp >= 0;
    if (attn_wave_) {
      if ((int64_t(cp) + st.kv.max_pages + sp) * kPageTokens >= (int64_t(1) << 31))
        fail(KVS_STATUS_UNSUPPORTED, "retroinfer (cuda) wave buffer: the block cache, the context and the staging "
                                     "exceed 2^31 positions; lower cache_ratio or the budget");
      const int32_t stride = cp + st.kv.max_pages + sp;
      const void** table;
      if (B == 1) {
        table = layers_[layer].wave.own_table.as<const void*>();
      } else {
        batch_table_.reserve(size_t(B) * size_t(stride) * sizeof(void*), device_, "retroinfer wave buffer table");
        table = batch_table_.as<const void*>();
      }
      check(cuda::retro_wave_table(st.kv, int32_t(B), ss, table, stride, st.stream), "retro_wave_table");
      kv = cuda::PagedKv{table, stride, st.kv.page_tokens, st.kv.page_shift};
      attn_kv_ = kv;
    }
    check(cuda::retro_select(st.shape, st.q, kv, st.kv_dtype, ss, cfg, max_clusters_, max_rows_, idx, cnt,
                             p.max_selected, st.prior_o, st.prior_lse, ws, st.stream),
          "retro_select");
    for (int64_t b = 0; b < B; ++b) {
      auto* m = static_cast<RetroCuda*>(batch[size_t(b)]);
      Wave& W = m->layers_[layer].wave;
      if (!W.on) continue;
      m->enqueue_decide(layer, st.stream);
      // From here to the moves' enqueue a failure leaves the host's decision unapplied.
      struct Guard {
        RetroCuda* m;
        bool done = false;
        ~Guard() {
          if (!done) m->wave_broken_ = true;
        }
      } guard{m};
      if (m->misses_ == Misses::Stage) {
        // The execution buffer: the misses' rows copied from host memory into staging pages, the
        // list pointed at them; the admissions (after the host's decision) copy from there.
        Stage& SG = m->stage_[layer & 1];
        if (SG.last_layer >= 0 && SG.last_layer != int32_t(layer) && m->layers_[size_t(SG.last_layer)].wave.pending)
          check(cudaStreamWaitEvent(S(st.stream), m->layers_[size_t(SG.last_layer)].wave.admitted, 0),
                "cudaStreamWaitEvent(wave buffer staging)");
        SG.last_layer = int32_t(layer);
        ++W.epoch;
        W.stage_base = (W.cache_pages + st.kv.max_pages) * int32_t(kPageTokens);
        W.stage_cap = SG.cap;
        check(cudaMemsetAsync(W.stage_cnt.p, 0, size_t(shape_.num_kv_heads) * 4, S(st.stream)),
              "cudaMemsetAsync(retroinfer staging)");
        check(cuda::retro_wave_stage(kv, st.kv_dtype, int32_t(b), int32_t(shape_.num_kv_heads),
                                     int32_t(shape_.head_dim), idx, cnt, p.max_selected, W.T, W.ts, W.tok_base,
                                     W.stage_base, W.stage_cap, W.stage_map.as<int64_t>(), W.stage_tok.as<int32_t>(),
                                     W.stage_cnt.as<int32_t>(), W.epoch, st.stream),
              "retro_wave_stage");
      }
      m->enqueue_moves(layer, st.kv, st.stream);
      guard.done = true;
      if (m->misses_ != Misses::Copy) continue;
      // wave_misses=copy: the attention waits for the admissions and reads the admitted rows from
      // the cache (each missed row crosses the bus once).
      check(cudaStreamWaitEvent(S(st.stream), W.admitted, 0), "cudaStreamWaitEvent(wave buffer)");
      check(cuda::retro_wave_remap(int32_t(b), int32_t(shape_.num_kv_heads), idx, cnt, p.max_selected,
                                   W.tok2v.as<int32_t>(), W.T, W.ts, W.tok_base, st.stream),
            "retro_wave_remap");
    }
  }
  bool attention_kv(cuda::PagedKv* kv) const override {
    if (attn_wave_) *kv = attn_kv_;
    return attn_wave_;
  }
  void token_positions(uint32_t layer, uint32_t kv_head, std::vector<int32_t>& keys) const override {
    const Wave& W = layers_[layer].wave;
    if (!W.on) return;
    quiesce();
    const int32_t* pos = W.pos[kv_head].data();
    std::vector<int32_t> staged;  // the staging slots' tokens (wave_misses=stage)
    if (misses_ == Misses::Stage && W.stage_cap > 0) {
      staged.resize(size_t(W.stage_cap));
      check(cudaMemcpy(staged.data(), W.stage_tok.as<int32_t>() + size_t(kv_head) * W.stage_cap, staged.size() * 4,
                       cudaMemcpyDeviceToHost),
            "cudaMemcpy(retroinfer staging)");
    }
    const auto& HC = W.heads[kv_head];
    for (int32_t& k : keys) {
      if (k < 0) continue;
      if (misses_ == Misses::Stage && k >= W.stage_base && k < W.stage_base + W.stage_cap) {
        k = staged[size_t(k - W.stage_base)];
      } else if (k >= W.tok_base) {
        k -= W.tok_base;
      } else {
        const int32_t row0 = HC.owner(k / cuda::kWaveBlockRows);
        k = row0 < 0 ? -1 : pos[row0 + k % cuda::kWaveBlockRows];
      }
    }
  }

  // ---- tables: the host method's ----
  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    return host_->index_fits(layer, tokens, why);
  }
  nlohmann::json save_meta() const override { return host_->save_meta(); }
  void save(io::TablesWriter& w) const override { host_->save(w); }
  void load(const io::TablesFile& f, const nlohmann::json& meta) override {
    host_->load(f, meta);
    for (auto& L : layers_) {
      L.built = true;  // the session builds no layer it loaded
      L.ahead.issued = false;
    }
  }
  std::unique_ptr<DeviceMethod> clone(void*) const override {
    auto c = std::unique_ptr<RetroCuda>(new RetroCuda(*this));
    return c;  // device copies are made by the clone's first reserve
  }
  uint64_t index_bytes() const override {
    uint64_t b = 0;
    for (const auto& L : layers_) b += L.mirror.bytes();
    return b;
  }
  void settle_selected(double* sum, double* last) const override {
    *sum = *last = 0;
    if (!stats_.p) return;
    const DeviceStats d = fetch_stats();
    for (int h = 0; h < int(shape_.num_kv_heads); ++h) {  // the last list's length: retrieval + fill + steady tokens
      const int32_t* x = d.rows.data() + size_t(h) * cuda::kRetroStats;
      *last += double(x[1] + x[4] + x[6]) / shape_.num_kv_heads;
    }
    *sum = d.selected - sel_read_;
    sel_read_ = d.selected;
  }
  bool stat(std::string_view name, double* out) const override {
    static constexpr const char* kStep[] = {"retrieval_clusters",        "retrieval_tokens",
                                            "estimation_clusters",       "estimation_tokens",
                                            "fill_tokens",               "budget_unused_tokens",
                                            "steady_tokens",             "budget_overrun_tokens",
                                            "mean_budget_unused_tokens", "mean_budget_overrun_tokens"};
    for (const char* k : kStep)
      if (name == k) read_stats();  // the device's figures first
    if (name == "host_index_bytes") {
      *out = double(host_->index_bytes());
      return true;
    }
    if (name == "wave_layouts" || name == "wave_extends") {  // host counts (sync_wave, extend_wave)
      *out = double(name == "wave_layouts" ? wave_layouts_ : wave_extends_);
      return true;
    }
    if (name == "build_readback_ms" || name == "build_kmeans_ms") {  // the index builds' parts (build_index)
      *out = name == "build_readback_ms" ? build_readback_ms_ : build_kmeans_ms_;
      return true;
    }
    if (name == "wave_hit_rate" || name == "wave_pcie_bytes" || name == "wave_cache_bytes" ||
        name == "wave_host_seconds") {
      quiesce();
      if (name == "wave_hit_rate") *out = wave_hit_rows_ + wave_miss_rows_ > 0 ? wave_hit_rows_ / (wave_hit_rows_ + wave_miss_rows_) : 0;
      else if (name == "wave_pcie_bytes") *out = wave_steps_ > 0 ? wave_pcie_ / double(wave_steps_) : 0;
      else if (name == "wave_host_seconds") *out = wave_steps_ > 0 ? wave_host_s_ / double(wave_steps_) : 0;
      else {
        double b = 0;
        for (const auto& L : layers_) b += double(L.wave.pages.size()) * double(page_bytes());
        *out = b;
      }
      return true;
    }
    return host_->stat(name, out);
  }

 private:
  // The device copy of one layer's meta index (retro.cuh's layout), and the figures plan() needs.
  struct Mirror {
    DevBuf cent, vmeta, size, start, pos;
    int32_t C = 0, R = 0;
    int32_t cs = 0, rs = 0;                 // per-head strides (capacity) in clusters and rows
    cuda::Scalar meta = cuda::Scalar::F32;  // of cent and vmeta
    int64_t max_size = 0, top_r_rows = 0;  // largest cluster; most rows the top r clusters can hold
    uint64_t generation = 0, lineage = 0;  // the host index's (retro::IndexView) at the last upload
    cudaEvent_t uploaded = nullptr;         // recorded after the last upload's copies (~RetroCuda frees it)
    bool upload_pending = false;            // that upload was not waited for (an append), on:
    void* upload_stream = nullptr;
    uint64_t bytes() const { return cent.bytes + vmeta.bytes + size.bytes + start.bytes + pos.bytes; }
  };
  // One layer's wave buffer (off: the KV is in GPU memory, cache_ratio = 0, or nothing indexed).
  struct Wave {
    bool on = false, pending = false;  // pending: admitted is recorded for the last step
    int32_t blocks = 0;                // cache blocks per KV head
    int32_t cache_pages = 0, tok_base = 0, C = 0, R = 0, rs = 0;  // rs: vpos's stride (the mirror's)
    uint64_t generation = 0, lineage = 0;  // of the mirror it was laid out for (extend: appended to since)
    std::vector<std::shared_ptr<DevicePage>> pages;
    DevBuf page_ptrs, own_table, vpos, tok2v;  // tok2v [Hkv][T]: each clustered token's virtual position
    int32_t T = 0, ts = 0;                     // tokens [0, T) in tok2v (the clustered ones and the sinks), stride ts
    DevBuf stage_map, stage_tok, stage_cnt;    // wave_misses=stage: [Hkv][ts] int64, [Hkv][cap], [Hkv]
    int32_t ids_cap = 0;                       // clusters per head `ids` has room for
    uint32_t epoch = 0;                        // the step's tag in stage_map
    int32_t stage_base = 0, stage_cap = 0;     // the last step's staging positions
    int64_t own_cap = 0;
    int64_t table_cap = 0;             // the sequence's page-table entries (at the last sync)
    cudautil::PinnedBuf ids;    // [Hkv][C] cluster ids, then [Hkv] counts (the zones kernel writes them)
    cudautil::PinnedBuf moves;  // [max_moves] cuda::WaveMove, then the count
    int32_t max_moves = 0;
    std::vector<retro::WaveCache> heads;                 // per KV head
    std::vector<std::vector<int32_t>> start, size, pos;  // the host index's, per KV head
    std::vector<std::vector<retro::WaveMoveRec>> moved;  // decide's, per KV head
    std::vector<std::vector<int32_t>> missed;
    cudaEvent_t zones_done = nullptr, staged = nullptr, admitted = nullptr;
    void release_events() {
      for (cudaEvent_t e : {zones_done, staged, admitted})
        if (e) cudaEventDestroy(e);
      zones_done = staged = admitted = nullptr;
    }
  };
  // The next update's clustering, run ahead (cluster_ahead): the update_segment tokens [b, b + m)
  // the layer's next update will cluster are stored `local` steps before the update is due, so
  // their pages are read back and their k-means runs then, in stream order and without waiting;
  // the update finds both done instead of draining the stream for them (docs/perf.md).
  struct Ahead {
    bool issued = false;  // for tokens [b, b + cfg's update_segment)
    int64_t b = 0, p0 = 0, np = 0;  // np pages from p0 cover the tokens
    DevBuf scratch;                 // retro_kmeans's workspace, then assignments and centroids
    cudautil::PinnedBuf host;       // the pages, then assignments [Hkv][m], then centroids [Hkv][C][d]
    size_t o_assign = 0, o_cent = 0;
    cudaEvent_t done = nullptr;     // recorded after the copies into `host`
  };
  struct Layer {
    Mirror mirror;
    Wave wave;
    Ahead ahead;
    bool built = false, prompt_chunk = false;
  };

  RetroCuda(const RetroCuda& o)
      : shape_(o.shape_), host_(o.host_->clone()), rules_(o.rules_), layers_(o.layers_.size()), pool_(o.pool_),
        device_(o.device_), cache_ratio_(o.cache_ratio_), misses_(o.misses_) {
    for (size_t l = 0; l < layers_.size(); ++l) layers_[l].built = o.layers_[l].built;
    hot_.resize(layers_.size());
    install_clusterer();  // the copied host method's points at `o`
    // The step statistics so far (the device's running sums copied once the buffer exists).
    o.read_stats();
    sum_overrun_ = o.sum_overrun_;
    selects_ = o.selects_;
    last_overrun_ = o.last_overrun_;
    if (o.stats_.p) {
      stats_.reserve(stats_bytes(), device_, "retroinfer stats");
      check(cudaMemcpy(stats_.p, o.stats_.p, stats_bytes(), cudaMemcpyDeviceToDevice), "cudaMemcpy(retroinfer stats)");
      stats_fresh_ = false;  // the first stat() reads the copy
      // The list lengths added up so far belong to `o`'s steps: this session counts from here.
      sel_read_ = fetch_stats().selected;
    }
  }

  // A host KV layer holding tokens [t0, t1) of the device layer (n tokens stored): the pages
  // covering them read back; the other pages are one shared zero page (never read). One kernel
  // (retro_copy_pages) at a time copies a chunk of pages into mapped pinned staging, in stream
  // order, and the host copies each chunk into its pages while the next one comes: an update's few
  // pages through the staging the session keeps, a build's prompt through two chunks of
  // kBuildChunkBytes freed afterwards (page by page into pageable memory, a build of 128K tokens
  // spent 240 ms here on an H200, 820 ms at 512K; docs/perf.md).
  KVLayer download(const DeviceLayerView& v, int64_t n, int64_t t0, int64_t t1) const {
    const size_t pb = page_bytes();
    std::vector<std::shared_ptr<Page>> hp = blank_pages(n);
    if (t1 > t0) {
      const int64_t p0 = t0 / kPageTokens, p1 = (t1 + kPageTokens - 1) / kPageTokens, np = p1 - p0;
      cudautil::PinnedBuf local;
      cudautil::PinnedBuf* buf = &download_stage_;
      int64_t chunk = np, slots = 1;
      if (size_t(np) * pb <= kKeptDownloadBytes) {
        download_stage_.reserve(size_t(np) * pb, "cudaHostAlloc(retroinfer KV readback)");
      } else {
        chunk = std::clamp<int64_t>(int64_t(kBuildChunkBytes / pb), 1, 65535);
        slots = 2;
        local.reserve(size_t(2 * chunk) * pb, "cudaHostAlloc(retroinfer KV readback)");
        buf = &local;
      }
      struct Events {
        cudaEvent_t e[2] = {nullptr, nullptr};
        ~Events() {
          for (cudaEvent_t x : e) {
            if (!x) continue;
            cudaEventSynchronize(x);  // no copy may still write `local` when it is freed
            cudaEventDestroy(x);
          }
        }
      } ev;
      for (int64_t k = 0; k < slots; ++k)
        check(cudaEventCreateWithFlags(&ev.e[k], cudaEventDisableTiming), "cudaEventCreate(retroinfer KV readback)");
      const int64_t chunks = (np + chunk - 1) / chunk;
      auto issue = [&](int64_t i) {
        const int64_t q0 = p0 + i * chunk, q = std::min(chunk, p1 - q0), slot = i % slots;
        check(cuda::retro_copy_pages(v.kv, int32_t(q0), int32_t(q), pb, buf->dev<char>(size_t(slot * chunk) * pb),
                                     v.stream),
              "retro_copy_pages (KV readback)");
        check(cudaEventRecord(ev.e[slot], S(v.stream)), "cudaEventRecord(retroinfer KV readback)");
      };
      for (int64_t i = 0; i < std::min(chunks, slots); ++i) issue(i);
      for (int64_t i = 0; i < chunks; ++i) {
        const int64_t q0 = p0 + i * chunk, q = std::min(chunk, p1 - q0), slot = i % slots;
        check(cudaEventSynchronize(ev.e[slot]), "cudaEventSynchronize(retroinfer KV readback)");
        fill_pages(hp, q0, q, buf->at<char>(size_t(slot * chunk) * pb));
        if (i + slots < chunks) issue(i + slots);
      }
    }
    return host_layer(std::move(hp), n);
  }
  // Page slots for n tokens, every one the same zero page (never read).
  std::vector<std::shared_ptr<Page>> blank_pages(int64_t n) const {
    const size_t pb = page_bytes();
    auto blank = std::make_shared<Page>(pb);
    std::memset(blank->data(), 0, pb);
    return std::vector<std::shared_ptr<Page>>(static_cast<size_t>((n + kPageTokens - 1) / kPageTokens), blank);
  }
  // Pages [p0, p0 + np) as new host pages copied from src (np pages back to back; on the pool).
  void fill_pages(std::vector<std::shared_ptr<Page>>& hp, int64_t p0, int64_t np, const char* src) const {
    const size_t pb = page_bytes();
    for (int64_t p = p0; p < p0 + np; ++p) hp[size_t(p)] = std::make_shared<Page>(pb);
    auto copy = [&](int64_t k) { std::memcpy(hp[size_t(p0 + k)]->data(), src + size_t(k) * pb, pb); };
    if (pool_ && np > 1) pool_->parallel_for(np, copy);
    else for (int64_t k = 0; k < np; ++k) copy(k);
  }
  KVLayer host_layer(std::vector<std::shared_ptr<Page>> hp, int64_t n) const {
    KVLayer kv(shape_.kv_dtype, int(shape_.num_kv_heads), int(shape_.head_dim));
    kv.adopt(std::move(hp), n);
    return kv;
  }

  // Brings the layer's device copy up to the host index (after a build, an update, a truncation,
  // a load or a clone).
  void sync_mirror(uint32_t layer, void* stream) {
    auto& M = layers_[layer].mirror;
    const auto ix = retro::index_view(*host_, layer);
    if (M.generation == ix.generation && M.generation != 0) {
      if (M.upload_pending && stream != M.upload_stream)  // a step on another stream waits for the copies
        check(cudaStreamWaitEvent(S(stream), M.uploaded, 0), "cudaStreamWaitEvent(retroinfer index upload)");
      return;
    }
    const auto& heads = *ix.heads;
    if (heads.empty() || heads[0].clusters() == 0) {
      M.C = M.R = 0;
      M.max_size = M.top_r_rows = 0;
      M.generation = ix.generation;
      return;
    }
    const int64_t hkv = int64_t(heads.size()), C = heads[0].clusters(), R = heads[0].rows(), d = shape_.head_dim;
    const DType mdt = heads[0].mdt;
    for (const auto& h : heads)
      if (h.mdt != mdt)  // fp16 meta falls back to bf16 per head (wave_index.hpp): one dtype per layer here
        fail(KVS_STATUS_UNSUPPORTED, "retroinfer (cuda): layer " + std::to_string(layer) +
                                         " mixes fp16 and bf16 meta rows (values beyond fp16's range); use meta_dtype=bf16");
    const cuda::Scalar meta = mdt == DType::F32 ? cuda::Scalar::F32 : mdt == DType::F16 ? cuda::Scalar::F16 : cuda::Scalar::BF16;
    // The device layout leaves every head room for more clusters and rows (strides cs and rs): an
    // update that only appended clusters, and fits, sends its own clusters and rows and nothing
    // else, without waiting for the steps in flight (they read the first C clusters only). Any
    // other change sends the whole index, with an eighth to spare.
    const bool append = M.C > 0 && M.lineage == ix.lineage && M.meta == meta && C >= M.C && R >= M.R &&
                        C <= M.cs && R <= M.rs;
    const int64_t c0 = append ? M.C : 0, r0 = append ? M.R : 0, nc = C - c0, nr = R - r0;
    if (append) {
      // The staging is the session's, shared by its layers: the last upload's copies (any layer's)
      // may still read it.
      if (stage_read_) check(cudaEventSynchronize(stage_read_), "cudaEventSynchronize(retroinfer index staging)");
    } else {
      // A step still running (on any stream) may read the old copy, and the last upload may still
      // read the staging: wait for the device (a rebuild, a rollback or a load is rare).
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(retroinfer index upload)");
      M.C = M.R = 0;
      // (At 128K tokens, 8192 clusters a head: room for 128 updates of 64 tokens; the session tests'
      // small indexes outgrow it in a few updates, so both paths run there.)
      M.cs = with_room(C, 16);
      M.rs = with_room(R, 256);
    }
    M.meta = meta;
    M.lineage = ix.lineage;
    // Staged in pinned memory kept between changes and packed by the pool's threads, head by head
    // (fresh pageable vectors cost their page faults on every update: 27 ms of a 33 ms upload at
    // 128K on an H200 host; docs/perf.md), then one strided copy per array.
    const size_t es = dtype_size(mdt), row = size_t(d) * es;
    const size_t meta_bytes = size_t(hkv * nc) * row, o_vm = al256(meta_bytes), o_size = o_vm + al256(meta_bytes),
                 o_start = o_size + al256(size_t(hkv * nc) * 4), o_pos = o_start + al256(size_t(hkv * nc) * 4),
                 total = o_pos + size_t(hkv * nr) * 4;
    if (total > index_stage_.bytes) index_stage_.reserve(total + total / 8, "cudaHostAlloc(retroinfer index staging)");
    char* sb = index_stage_.at<char>(0);
    std::vector<int64_t> top(static_cast<size_t>(hkv)), largest(static_cast<size_t>(hkv));
    auto pack = [&](int64_t h) {
      const auto& H = heads[size_t(h)];
      const bool f32 = mdt == DType::F32;
      const char* cent = static_cast<const char*>(f32 ? static_cast<const void*>(H.centroids.data()) : H.dcent.data());
      const char* vm = static_cast<const char*>(f32 ? static_cast<const void*>(H.value_sum.data()) : H.dvmean.data());
      std::memcpy(sb + size_t(h * nc) * row, cent + size_t(c0) * row, size_t(nc) * row);
      std::memcpy(sb + o_vm + size_t(h * nc) * row, vm + size_t(c0) * row, size_t(nc) * row);
      std::memcpy(sb + o_size + size_t(h * nc) * 4, H.size.data() + c0, size_t(nc) * 4);
      int32_t* start = reinterpret_cast<int32_t*>(sb + o_start) + h * nc;
      for (int64_t c = 0; c < nc; ++c) start[c] = int32_t(H.start[size_t(c0 + c)]);
      std::memcpy(sb + o_pos + size_t(h * nr) * 4, H.pos.data() + r0, size_t(nr) * 4);
      // plan()'s bounds: the largest cluster (of the new ones, after an append) and, for
      // budget=paper only, the rows of the r largest clusters (a selection over every cluster).
      largest[size_t(h)] = nc > 0 ? *std::max_element(H.size.begin() + c0, H.size.end()) : 0;
      const int64_t r = std::min<int64_t>(ix.r, C);
      if (rules_.paper && r > 0) {
        std::vector<int32_t> sz(H.size);
        std::nth_element(sz.begin(), sz.begin() + (r - 1), sz.end(), std::greater<>());
        for (int64_t i = 0; i < r; ++i) top[size_t(h)] += sz[size_t(i)];
      }
    };
    if (pool_) pool_->parallel_for(hkv, pack);
    else for (int64_t h = 0; h < hkv; ++h) pack(h);
    M.top_r_rows = *std::max_element(top.begin(), top.end());
    M.max_size = std::max<int64_t>(append ? M.max_size : 0, *std::max_element(largest.begin(), largest.end()));
    // Head h's new entries [c0, C) of an array of w bytes each go to h * stride + c0.
    auto up = [&](DevBuf& buf, size_t off, size_t w, int64_t first, int64_t n, int64_t stride, const char* what) {
      if (!append) buf.reserve(size_t(hkv * stride) * w, device_, what);
      if (n > 0)
        check(cudaMemcpy2DAsync(static_cast<char*>(buf.p) + size_t(first) * w, size_t(stride) * w, sb + off,
                                size_t(n) * w, size_t(n) * w, size_t(hkv), cudaMemcpyHostToDevice, S(stream)),
              what);
    };
    if (!stage_read_) check(cudaEventCreateWithFlags(&stage_read_, cudaEventDisableTiming), "cudaEventCreate(retroinfer index)");
    {
      // After the copies, however this block ends (a copy that fails leaves the ones before it
      // queued): the next upload waits for this event before it packs the staging again.
      struct StageRead {
        cudaEvent_t e;
        void* st;
        ~StageRead() { cudaEventRecord(e, S(st)); }
      } stage_read{stage_read_, stream};
      up(M.cent, 0, row, c0, nc, M.cs, "retroinfer centroids");
      up(M.vmeta, o_vm, row, c0, nc, M.cs, "retroinfer value means");
      up(M.size, o_size, 4, c0, nc, M.cs, "retroinfer sizes");
      up(M.start, o_start, 4, c0, nc, M.cs, "retroinfer starts");
      up(M.pos, o_pos, 4, r0, nr, M.rs, "retroinfer positions");
    }
    if (!M.uploaded) check(cudaEventCreateWithFlags(&M.uploaded, cudaEventDisableTiming), "cudaEventCreate(retroinfer index)");
    check(cudaEventRecord(M.uploaded, S(stream)), "cudaEventRecord(retroinfer index upload)");
    if (append) {
      M.upload_pending = true;  // a step on another stream waits for the copies (above)
      M.upload_stream = stream;
    } else {
      // The copies done before any step reads the new index, whatever its stream.
      check(cudaStreamSynchronize(S(stream)), "cudaStreamSynchronize(retroinfer index upload)");
      M.upload_pending = false;
    }
    M.C = int32_t(C);
    M.R = int32_t(R);
    M.generation = ix.generation;  // last: a failure above leaves the mirror to be sent again
  }

  // ---- the wave buffer ----
  size_t page_bytes() const {
    return cuda::paged_kv_page_bytes(int32_t(shape_.num_kv_heads), int32_t(kPageTokens), int32_t(shape_.head_dim),
                                     int32_t(dtype_size(shape_.kv_dtype)));
  }
  // Waits for the host functions and moves in flight (before the host reads or changes a wave
  // buffer), and reports a failure of one of them.
  void quiesce() const {
    if (side_) check(cudaStreamSynchronize(side_), "cudaStreamSynchronize(retroinfer wave buffer)");
  }
  // After a decision or an enqueue that failed (wave_broken_): the host's cache maps no longer match
  // the device's, and every later decision has been a no-op since (the device's cache stays as the
  // last moves left it, consistent). Every layer's wave buffer is laid out again, empty (a warning;
  // the outputs are unaffected).
  void recover_wave() {
    if (!wave_broken_.load()) return;
    quiesce();
    for (auto& L : layers_) {
      L.wave.on = false;
      L.wave.pending = false;
    }
    logf(LogLevel::Warn, "retroinfer (cuda) wave buffer: %s; the block caches start again empty",
         wave_error_.empty() ? "a step failed between its cache decision and its moves" : wave_error_.c_str());
    wave_error_.clear();
    wave_broken_ = false;
  }

  // Lays out the layer's wave buffer for its index (after a build, an update, a rollback, a load),
  // keeping what is cached where the index only grew; the own page table's room for v's pages.
  void sync_wave(uint32_t layer, const DeviceLayerView& v) {
    Wave& W = layers_[layer].wave;
    const Mirror& M = layers_[layer].mirror;
    const bool want = v.host_kv && cache_ratio_ > 0 && M.C > 0;
    W.table_cap = v.kv.max_pages;
    const int64_t need = W.cache_pages + int64_t(v.kv.max_pages);
    if (want == W.on && (!want || (W.generation == M.generation && W.own_cap >= need))) return;
    if (want && W.on && extend_wave(layer, v, need)) return;
    quiesce();
    // A step still running on another stream may read vpos and tok2v, rewritten below (an update
    // that only appended clusters no longer waits for the device in sync_mirror).
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(retroinfer wave buffer)");
    W.pending = false;
    if (!want) {
      W.on = false;
      return;
    }
    const auto& heads = *retro::index_view(*host_, layer).heads;
    const int hkv = int(shape_.num_kv_heads);
    const int32_t C = M.C, R = M.R, RS = M.rs;  // vpos has pos's layout (stride RS)
    constexpr int32_t kRows = cuda::kWaveBlockRows, kPerPage = int32_t(kPageTokens) / kRows;
    // The cache stays where the index only grew (an update appends clusters; a rollback or a
    // rebuild does not).
    bool keep = W.on && W.C <= C && W.R <= R;
    for (int h = 0; keep && h < hkv; ++h)
      for (int32_t c = 0; keep && c < W.C; ++c)
        keep = W.start[size_t(h)][size_t(c)] == heads[size_t(h)].start[size_t(c)] &&
               W.size[size_t(h)][size_t(c)] == heads[size_t(h)].size[size_t(c)];
    for (int h = 0; keep && h < hkv; ++h)  // the rows themselves (a rebuild could keep every size)
      keep = std::equal(W.pos[size_t(h)].begin(), W.pos[size_t(h)].end(), heads[size_t(h)].pos.begin());
    if (!keep) {
      const int64_t want_blocks = std::max<int64_t>(1, int64_t(std::ceil(cache_ratio_ * double(R) / kRows)));
      W.blocks = int32_t((want_blocks + kPerPage - 1) / kPerPage * kPerPage);
      W.cache_pages = W.blocks / kPerPage;
      W.tok_base = int32_t(int64_t(W.cache_pages) * kPageTokens);
      if (int64_t(W.tok_base) + int64_t(v.kv.max_pages) * kPageTokens >= (int64_t(1) << 31))
        fail(KVS_STATUS_UNSUPPORTED, "retroinfer (cuda) wave buffer: the block cache and the context exceed 2^31 positions; "
                                     "lower cache_ratio");
      W.pages.clear();
      std::vector<const void*> ptrs;
      for (int32_t i = 0; i < W.cache_pages; ++i) {
        W.pages.push_back(device_page(device_, page_bytes(), PageMemory::Device));
        ptrs.push_back(W.pages.back()->data());
      }
      W.page_ptrs.reserve(ptrs.size() * sizeof(void*), device_, "retroinfer wave buffer pages");
      check(cudaMemcpy(W.page_ptrs.p, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice),
            "cudaMemcpy(retroinfer wave buffer pages)");
      W.heads.assign(size_t(hkv), retro::WaveCache{});
      for (auto& HC : W.heads) HC.reset(W.blocks, kRows, C);
      W.moved.resize(size_t(hkv));
      W.missed.resize(size_t(hkv));
    }
    for (int h = 0; h < hkv; ++h) {  // decide allocates nothing
      W.moved[size_t(h)].reserve(2 * size_t(W.blocks));
      W.missed[size_t(h)].reserve(size_t(C));
    }
    W.start.resize(size_t(hkv));
    W.size.resize(size_t(hkv));
    W.pos.resize(size_t(hkv));
    std::vector<int32_t> vp(size_t(hkv) * size_t(RS));
    for (int h = 0; h < hkv; ++h) {
      const auto& H = heads[size_t(h)];
      auto& HC = W.heads[size_t(h)];
      HC.grow(C);
      W.start[size_t(h)].assign(H.start.begin(), H.start.end());
      W.size[size_t(h)] = H.size;
      W.pos[size_t(h)] = H.pos;
      int32_t* row = vp.data() + size_t(h) * RS;
      for (int32_t r = 0; r < R; ++r) row[r] = W.tok_base + H.pos[size_t(r)];
      for (int32_t c = 0; c < C; ++c)
        for (int32_t blk = HC.first_block(c), k = 0; blk >= 0; blk = HC.next_block(blk), ++k)
          for (int32_t i = 0; i < kRows && k * kRows + i < H.size[size_t(c)]; ++i)
            row[H.start[size_t(c)] + int64_t(k) * kRows + i] = blk * kRows + i;
    }
    W.vpos.reserve(vp.size() * 4, device_, "retroinfer wave buffer positions");
    check(cudaMemcpyAsync(W.vpos.p, vp.data(), vp.size() * 4, cudaMemcpyHostToDevice, S(v.stream)),
          "cudaMemcpyAsync(retroinfer wave buffer positions)");
    const int32_t T = int32_t(retro::index_view(*host_, layer).indexed_end);
    const int32_t ts = with_room(T, 256);
    W.T = T;
    W.ts = ts;
    if (misses_ == Misses::Copy) {  // the same by token (the list's remap after the admissions)
      std::vector<int32_t> tv(size_t(hkv) * size_t(ts));
      for (int h = 0; h < hkv; ++h) {
        int32_t* row = tv.data() + size_t(h) * ts;
        for (int32_t t = 0; t < T; ++t) row[t] = W.tok_base + t;
        const int32_t* vr = vp.data() + size_t(h) * RS;
        const auto& pos = heads[size_t(h)].pos;
        for (int32_t r = 0; r < R; ++r)
          if (pos[size_t(r)] < T) row[pos[size_t(r)]] = vr[r];
      }
      W.tok2v.reserve(std::max<size_t>(tv.size() * 4, 4), device_, "retroinfer wave buffer positions");
      check(cudaMemcpyAsync(W.tok2v.p, tv.data(), tv.size() * 4, cudaMemcpyHostToDevice, S(v.stream)),
            "cudaMemcpyAsync(retroinfer wave buffer positions)");
    }
    if (misses_ == Misses::Stage) {  // tags 0: nothing staged (epochs start at 1)
      W.stage_map.reserve(std::max<size_t>(size_t(hkv) * size_t(ts) * 8, 8), device_, "retroinfer wave buffer staging");
      check(cudaMemsetAsync(W.stage_map.p, 0, W.stage_map.bytes, S(v.stream)), "cudaMemsetAsync(retroinfer staging)");
      W.epoch = 0;
    }
    // Room for the updates to come (extend_wave): the mirror's clusters, an eighth more tokens.
    W.ids_cap = std::max(C, M.cs);
    W.ids.reserve((size_t(hkv) * size_t(W.ids_cap) + size_t(hkv)) * 4, "cudaHostAlloc(retroinfer wave buffer ids)");
    W.max_moves = 2 * W.blocks * hkv;
    W.moves.reserve(size_t(W.max_moves) * sizeof(cuda::WaveMove) + 16, "cudaHostAlloc(retroinfer wave buffer moves)");
    const int64_t own_need = W.cache_pages + int64_t(v.kv.max_pages);
    if (W.own_cap < own_need) {
      const int64_t cap = std::max(own_need, 2 * W.own_cap);
      W.own_table.reserve(size_t(cap) * sizeof(void*), device_, "retroinfer wave buffer table");
      W.own_cap = cap;
    }
    if (!W.zones_done) {
      check(cudaEventCreateWithFlags(&W.zones_done, cudaEventDisableTiming), "cudaEventCreate(retroinfer wave buffer)");
      check(cudaEventCreateWithFlags(&W.admitted, cudaEventDisableTiming), "cudaEventCreate(retroinfer wave buffer)");
      check(cudaEventCreateWithFlags(&W.staged, cudaEventDisableTiming), "cudaEventCreate(retroinfer wave buffer)");
    }
    W.C = C;
    W.R = R;
    W.rs = RS;
    W.generation = M.generation;
    W.lineage = M.lineage;
    W.on = true;
    ++wave_layouts_;
    check(cudaStreamSynchronize(S(v.stream)), "cudaStreamSynchronize(retroinfer wave buffer)");  // vp is freed next
  }
  // An index update that only appended clusters (the mirror's lineage and row stride kept, within
  // the room the layout left): their rows and tokens enter the wave buffer uncached, set on the
  // device in stream order (retro_wave_extend, from the mirror's positions) and appended to the
  // host's copies. The steps in flight read only the rows and tokens before, left as they are; the
  // host waits only for the layer's last decision and moves (they read the copies and the cache
  // maps). The whole layout again instead was O(clustered tokens) of host work, a copy and two
  // device synchronisations a layer, at every update (docs/perf.md). False: lay out anew.
  bool extend_wave(uint32_t layer, const DeviceLayerView& v, int64_t need) {
    Wave& W = layers_[layer].wave;
    const Mirror& M = layers_[layer].mirror;
    const auto ix = retro::index_view(*host_, layer);
    const int32_t C = M.C, R = M.R, T = int32_t(ix.indexed_end);
    if (M.lineage != W.lineage || M.generation != ix.generation || M.rs != W.rs || C < W.C || R < W.R || T < W.T ||
        C > W.ids_cap || T > W.ts || W.own_cap < need)
      return false;
    if (W.pending) check(cudaEventSynchronize(W.admitted), "cudaEventSynchronize(retroinfer wave buffer)");
    const auto& heads = *ix.heads;
    // The launch first: a failure leaves the host's copies as they were (the next sync lays out).
    check(cuda::retro_wave_extend(int32_t(heads.size()), M.pos.as<int32_t>(), W.rs, W.vpos.as<int32_t>(), W.R, R,
                                  W.tok_base, misses_ == Misses::Copy ? W.tok2v.as<int32_t>() : nullptr,
                                  misses_ == Misses::Stage ? W.stage_map.as<int64_t>() : nullptr, W.ts, W.T, T, v.stream),
          "retro_wave_extend");
    for (size_t h = 0; h < heads.size(); ++h) {
      const auto& H = heads[h];
      W.start[h].insert(W.start[h].end(), H.start.begin() + W.C, H.start.end());
      W.size[h].insert(W.size[h].end(), H.size.begin() + W.C, H.size.end());
      W.pos[h].insert(W.pos[h].end(), H.pos.begin() + W.R, H.pos.end());
      W.heads[h].grow(C);
      W.missed[h].reserve(size_t(C));
    }
    W.C = C;
    W.R = R;
    W.T = T;
    W.generation = M.generation;
    ++wave_extends_;
    return true;
  }

  // Staging for `rows` rows per KV head in the layer's parity buffer, and the layer's slot records
  // (plan time: the step allocates nothing). A buffer that grows first lets the admissions reading
  // it finish.
  void ensure_stage(uint32_t layer, int64_t rows) const {
    Stage& SG = stage_[layer & 1];
    Wave& W = const_cast<Wave&>(layers_[layer].wave);
    const int hkv = int(shape_.num_kv_heads);
    const int32_t cap = int32_t(std::max<int64_t>(1, (rows + kPageTokens - 1) / kPageTokens) * kPageTokens);
    if (SG.cap < cap) {
      quiesce();
      std::vector<const void*> ptrs;
      SG.pages.clear();
      for (int32_t i = 0; i < cap / int32_t(kPageTokens); ++i) {
        SG.pages.push_back(device_page(device_, page_bytes(), PageMemory::Device));
        ptrs.push_back(SG.pages.back()->data());
      }
      SG.ptrs.reserve(ptrs.size() * sizeof(void*), device_, "retroinfer wave buffer staging");
      check(cudaMemcpy(SG.ptrs.p, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice),
            "cudaMemcpy(retroinfer wave buffer staging)");
      SG.cap = cap;
    }
    // B = 1: the step's table is the layer's own, staging pages included.
    const int64_t need = W.cache_pages + W.table_cap + SG.cap / int32_t(kPageTokens);
    if (W.own_cap < need) {
      quiesce();
      W.own_table.reserve(size_t(need) * sizeof(void*), device_, "retroinfer wave buffer table");
      W.own_cap = need;
    }
    if (W.stage_tok.bytes < size_t(hkv) * size_t(SG.cap) * 4 || !W.stage_cnt.p) {
      quiesce();
      W.stage_tok.reserve(size_t(hkv) * size_t(SG.cap) * 4, device_, "retroinfer wave buffer staging");
      W.stage_cnt.reserve(size_t(hkv) * 4, device_, "retroinfer wave buffer staging");
    }
  }

  // After the zones kernel of a step (stream order): the LRU decision on the host, then the moves,
  // on the side stream.
  struct MoveCtx {
    RetroCuda* m;
    uint32_t layer;
    int64_t hot_head, hot_tail;
  };
  // The host's decision once the zones kernel has listed the step's clusters (it reads nothing the
  // later launches write, so it runs beside them).
  void enqueue_decide(uint32_t layer, void* stream) {
    Wave& W = layers_[layer].wave;
    if (!side_) check(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreate(retroinfer wave buffer)");
    check(cudaEventRecord(W.zones_done, S(stream)), "cudaEventRecord(retroinfer wave buffer)");
    check(cudaStreamWaitEvent(side_, W.zones_done, 0), "cudaStreamWaitEvent(retroinfer wave buffer)");
    auto* ctx = new MoveCtx{this, layer, hot_[layer].first, hot_[layer].second};
    if (cudaError_t e = cudaLaunchHostFunc(side_, &RetroCuda::decide_cb, ctx); e != cudaSuccess) {
      delete ctx;
      check(e, "cudaLaunchHostFunc(retroinfer wave buffer)");
    }
  }
  // The moves, after the decision and after the main stream's launches so far (the staging).
  void enqueue_moves(uint32_t layer, const cuda::PagedKv& like, void* stream) {
    Wave& W = layers_[layer].wave;
    check(cudaEventRecord(W.staged, S(stream)), "cudaEventRecord(retroinfer wave buffer)");
    check(cudaStreamWaitEvent(side_, W.staged, 0), "cudaStreamWaitEvent(retroinfer wave buffer)");
    const cuda::PagedKv own{W.own_table.as<const void*>(), int32_t(W.own_cap), like.page_tokens, like.page_shift};
    auto* mv = W.moves.dev<cuda::WaveMove>();
    const bool staged = misses_ == Misses::Stage;
    const Stage& SG = stage_[layer & 1];
    const cuda::PagedKv stage{SG.ptrs.as<const void*>(), SG.cap / int32_t(kPageTokens), like.page_tokens,
                              like.page_shift};
    check(cuda::retro_wave_moves(own, cuda::Scalar(int32_t(shape_.kv_dtype)), int32_t(shape_.num_kv_heads),
                                 int32_t(shape_.head_dim), layers_[layer].mirror.pos.as<int32_t>(), W.rs,
                                 W.vpos.as<int32_t>(), misses_ == Misses::Copy ? W.tok2v.as<int32_t>() : nullptr, W.T,
                                 W.ts, W.tok_base, stage,
                                 staged ? W.stage_map.as<int64_t>() : nullptr, W.epoch, mv,
                                 reinterpret_cast<const int32_t*>(mv + W.max_moves), W.max_moves, side_),
          "retro_wave_moves");
    check(cudaEventRecord(W.admitted, side_), "cudaEventRecord(retroinfer wave buffer)");
    W.pending = true;
  }
  static void CUDART_CB decide_cb(void* p) {
    std::unique_ptr<MoveCtx> c(static_cast<MoveCtx*>(p));
    RetroCuda* m = c->m;
    Wave& W = m->layers_[c->layer].wave;
    *reinterpret_cast<int32_t*>(W.moves.at<cuda::WaveMove>(0) + W.max_moves) = 0;  // no moves unless decided
    if (m->wave_broken_.load()) return;  // the maps are out of step: decide nothing until recover_wave
    try {
      m->decide(c->layer, c->hot_head, c->hot_tail);
    } catch (const std::exception& e) {
      m->wave_error_ = e.what();
      m->wave_broken_ = true;
    } catch (...) {
      m->wave_error_ = "the cache decision failed";
      m->wave_broken_ = true;
    }
  }
  // The authors' BufferManager::batch_update for one step of a layer (retro::WaveCache), the KV
  // heads in parallel; the moves for the kernel; hits, misses and bus bytes counted (rows outside
  // the GPU's hot pages that the moves read, and with wave_misses=inplace the attention too).
  void decide(uint32_t layer, int64_t hot_head, int64_t hot_tail) {
    const auto t0 = std::chrono::steady_clock::now();
    Wave& W = layers_[layer].wave;
    const int hkv = int(shape_.num_kv_heads);
    const int32_t* ids = W.ids.at<int32_t>(0);
    const int32_t* cnt = ids + size_t(W.C) * hkv;
    const int64_t hh = (hot_head + kPageTokens - 1) / kPageTokens * kPageTokens;
    const int64_t ht = hot_tail == INT64_MAX ? INT64_MAX : hot_tail / kPageTokens * kPageTokens;
    std::vector<retro::WaveCache::Step> st(static_cast<size_t>(hkv));
    std::vector<double> cold(static_cast<size_t>(hkv));
    wave_pool().parallel_for(hkv, [&](int64_t h) {
      auto& moved = W.moved[size_t(h)];
      auto& missed = W.missed[size_t(h)];
      moved.clear();
      missed.clear();
      const auto& start = W.start[size_t(h)];
      const auto& size = W.size[size_t(h)];
      const auto& pos = W.pos[size_t(h)];
      st[size_t(h)] = W.heads[size_t(h)].step(ids + size_t(h) * W.C, std::clamp(cnt[h], 0, W.C), start.data(),
                                              size.data(), moved, missed);
      double k = 0;
      for (const int32_t c : missed) {
        const int32_t times = misses_ == Misses::Inplace && W.heads[size_t(h)].cached(c) ? 2 : 1;
        for (int32_t i = 0; i < size[size_t(c)]; ++i) {
          const int64_t t = pos[size_t(start[size_t(c)] + i)];
          k += (t >= hh && t < ht) ? times : 0;
        }
      }
      cold[size_t(h)] = k;
    });
    auto* mv = W.moves.at<cuda::WaveMove>(0);
    int32_t nm = 0;
    double cold_rows = 0;
    for (int h = 0; h < hkv; ++h) {
      for (const auto& m : W.moved[size_t(h)])
        if (nm < W.max_moves) mv[nm++] = cuda::WaveMove{h, m.row0, m.rows, m.block};
      wave_hit_rows_ += double(st[size_t(h)].hit_rows);
      wave_miss_rows_ += double(st[size_t(h)].miss_rows);
      cold_rows += cold[size_t(h)];
    }
    *reinterpret_cast<int32_t*>(mv + W.max_moves) = nm;
    wave_pcie_ += cold_rows * 2.0 * double(shape_.head_dim) * double(dtype_size(shape_.kv_dtype));
    ++wave_steps_;
    wave_host_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  // The threads of every session's LRU decisions (host work only: no CUDA call waits on them).
  static ThreadPool& wave_pool() {
    static ThreadPool* p = new ThreadPool(8);  // never destroyed: a decision may run during exit
    return *p;
  }

  // The CPU method's update rule (on_append): once more than update_segment tokens lie between the
  // index and the local window of a layer of n tokens, the oldest update_segment of them are
  // clustered alone and appended (stored tokens only: [indexed_end, n - local)).
  void update(uint32_t layer, const DeviceLayerView& v, int64_t n, int64_t added, bool decode) {
    if (!retro::update_due(*host_, layer, n)) return;
    const int64_t lo = retro::index_view(*host_, layer).indexed_end, seg = rules_.update_segment;
    // One update (not an appended turn's several) of the tokens clustered ahead: their pages and
    // clusters are read from the run ahead's copies (waiting for them, normally long done).
    Ahead& A = layers_[layer].ahead;
    const bool ahead = A.issued && A.b == lo && n - rules_.local - lo <= 2 * seg;
    A.issued = false;  // used now, or behind the index once this update is done
    KVLayer kv = ahead ? ahead_layer(A, n) : download(v, n, lo, n - rules_.local);
    Clustering scope(this, &v, ahead ? &A : nullptr);
    host_->on_append(layer, nullptr, added, kv, decode);
  }
  // Runs the layer's next update's clustering ahead once its tokens are stored (see Ahead), when
  // its copies fit the session's bound (layers past it update as before, draining the stream).
  void cluster_ahead(uint32_t layer, const DeviceLayerView& v) {
    Ahead& A = layers_[layer].ahead;
    const retro::KMeansConfig& cfg = rules_.update_kmeans;
    const auto ix = retro::index_view(*host_, layer);
    const int64_t m = rules_.update_segment, b = ix.indexed_end;
    if (A.issued || !layers_[layer].built || m < 1 || b + m > v.tokens) return;
    if (ix.heads->empty() && rules_.index_min > m) return;  // the layer's first update is several at once
    const int hkv = int(shape_.num_kv_heads), d = int(shape_.head_dim);
    const size_t pb = page_bytes();
    const int64_t p0 = b / kPageTokens, np = (b + m + kPageTokens - 1) / kPageTokens - p0;
    const KMeansRun k(cfg, m, hkv, d);
    const size_t dev_need = k.bytes, host_need = al256(size_t(np) * pb) + al256(k.a_bytes) + k.c_bytes;
    if (A.scratch.bytes + A.host.bytes == 0 && ahead_bytes_ + dev_need + host_need > kAheadBytes) return;
    // A run dropped unread (a rollback) may still be writing the buffers.
    if (A.done) check(cudaEventSynchronize(A.done), "cudaEventSynchronize(retroinfer clustering ahead)");
    else check(cudaEventCreateWithFlags(&A.done, cudaEventDisableTiming), "cudaEventCreate(retroinfer clustering ahead)");
    ahead_bytes_ -= A.scratch.bytes + A.host.bytes;
    A.scratch.reserve(dev_need, device_, "cudaMalloc(retroinfer clustering ahead)");
    A.host.reserve(host_need, "cudaHostAlloc(retroinfer clustering ahead)");
    ahead_bytes_ += A.scratch.bytes + A.host.bytes;
    A.o_assign = al256(size_t(np) * pb);
    A.o_cent = A.o_assign + al256(k.a_bytes);
    char* base = static_cast<char*>(A.scratch.p);
    check(cuda::retro_copy_pages(v.kv, int32_t(p0), int32_t(np), pb, A.host.d, v.stream), "retro_copy_pages");
    check(cuda::retro_kmeans(v.kv, cuda::Scalar(int32_t(shape_.kv_dtype)), hkv, d, int32_t(b), k.k, k.assign(base),
                             k.centroids(base), cuda::Workspace{base, k.ws_bytes}, v.stream),
          "retro_kmeans (ahead)");
    check(cudaMemcpyAsync(A.host.at<char>(A.o_assign), k.assign(base), k.a_bytes, cudaMemcpyDeviceToHost, S(v.stream)),
          "cudaMemcpy(retroinfer assignments ahead)");
    check(cudaMemcpyAsync(A.host.at<char>(A.o_cent), k.centroids(base), k.c_bytes, cudaMemcpyDeviceToHost, S(v.stream)),
          "cudaMemcpy(retroinfer centroids ahead)");
    check(cudaEventRecord(A.done, S(v.stream)), "cudaEventRecord(retroinfer clustering ahead)");
    A.b = b;
    A.p0 = p0;
    A.np = np;
    A.issued = true;
  }
  // A host KV layer of n tokens holding the run ahead's pages (the others one shared zero page,
  // never read), once its copies are done.
  KVLayer ahead_layer(const Ahead& A, int64_t n) const {
    check(cudaEventSynchronize(A.done), "cudaEventSynchronize(retroinfer clustering ahead)");
    std::vector<std::shared_ptr<Page>> hp = blank_pages(n);
    fill_pages(hp, A.p0, A.np, A.host.at<char>(0));
    return host_layer(std::move(hp), n);
  }
  // The layer the host method's k-means reads (cluster()), set for one build or update, cleared
  // however it ends.
  struct Clustering {
    RetroCuda* m;
    Clustering(RetroCuda* mm, const DeviceLayerView* v, const Ahead* a = nullptr, bool build = false) : m(mm) {
      m->cur_ = v;
      m->cur_ahead_ = a;
      m->cur_build_ = build;
    }
    ~Clustering() {
      m->cur_ = nullptr;
      m->cur_ahead_ = nullptr;
      m->cur_build_ = false;
    }
    Clustering(const Clustering&) = delete;
    Clustering& operator=(const Clustering&) = delete;
  };

  // The host method's k-means runs here, on the GPU, over the layer's stored keys (retro_kmeans);
  // the host then lays out the clusters (lists, value sums) from its copy of the tokens.
  void install_clusterer() {
    retro::set_clusterer(*host_, [this](uint32_t, int64_t b, int64_t n, const retro::KMeansConfig& cfg,
                                        std::vector<std::vector<int32_t>>& assign,
                                        std::vector<std::vector<float>>& cent) { cluster(b, n, cfg, assign, cent); });
  }
  void cluster(int64_t b, int64_t n, const retro::KMeansConfig& cfg, std::vector<std::vector<int32_t>>& assign,
               std::vector<std::vector<float>>& cent) const {
    if (!cur_) fail(KVS_STATUS_INTERNAL, "retroinfer (cuda): a clustering outside a build or an update");
    const int hkv = int(shape_.num_kv_heads), d = int(shape_.head_dim);
    if (cur_ahead_ && b == cur_ahead_->b && n == rules_.update_segment &&
        cfg == rules_.update_kmeans) {  // run ahead (ahead_layer waited for its copies)
      split_heads(cur_ahead_->host.at<int32_t>(cur_ahead_->o_assign), cur_ahead_->host.at<float>(cur_ahead_->o_cent),
                  n, cfg.clusters, assign, cent);
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    // Scratch in one allocation: an update's (small) kept for the next update, a build's freed on
    // return (a cudaMalloc and a cudaFree, which waits for the device, on every update otherwise).
    const KMeansRun k(cfg, n, hkv, d);
    DevBuf local;
    DevBuf& scratch = k.bytes <= kKeptKMeansBytes ? kmeans_scratch_ : local;
    scratch.reserve(k.bytes, device_, "cudaMalloc(retroinfer k-means)");
    char* base = static_cast<char*>(scratch.p);
    check(cuda::retro_kmeans(cur_->kv, cuda::Scalar(int32_t(shape_.kv_dtype)), hkv, d, int32_t(b), k.k, k.assign(base),
                             k.centroids(base), cuda::Workspace{base, k.ws_bytes}, cur_->stream),
          "retro_kmeans");
    // Both results in one copy each, then split by head.
    std::vector<int32_t> ha(k.a_bytes / 4);
    std::vector<float> hc(k.c_bytes / 4);
    check(cudaMemcpyAsync(ha.data(), k.assign(base), k.a_bytes, cudaMemcpyDeviceToHost, S(cur_->stream)),
          "cudaMemcpy(retroinfer assignments)");
    check(cudaMemcpyAsync(hc.data(), k.centroids(base), k.c_bytes, cudaMemcpyDeviceToHost, S(cur_->stream)),
          "cudaMemcpy(retroinfer centroids)");
    check(cudaStreamSynchronize(S(cur_->stream)), "cudaStreamSynchronize(retroinfer k-means)");
    split_heads(ha.data(), hc.data(), n, cfg.clusters, assign, cent);
    if (cur_build_) build_kmeans_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  // assign [Hkv][n] and centroids [Hkv][C][d] back to back, split by KV head.
  void split_heads(const int32_t* ha, const float* hc, int64_t n, int64_t C, std::vector<std::vector<int32_t>>& assign,
                   std::vector<std::vector<float>>& cent) const {
    const int hkv = int(shape_.num_kv_heads);
    const int64_t cd = C * int64_t(shape_.head_dim);
    assign.resize(size_t(hkv));
    cent.resize(size_t(hkv));
    for (int h = 0; h < hkv; ++h) {
      assign[size_t(h)].assign(ha + int64_t(h) * n, ha + int64_t(h + 1) * n);
      cent[size_t(h)].assign(hc + int64_t(h) * cd, hc + int64_t(h + 1) * cd);
    }
  }

  // The stats buffer: [Hkv][kRetroStats] int32 (the last step), then [Hkv] double (the budget
  // unused, added up by every step) and one double (the list lengths, mean over heads, added up).
  size_t stats_rows_bytes() const { return (size_t(shape_.num_kv_heads) * cuda::kRetroStats * 4 + 7) / 8 * 8; }
  size_t stats_bytes() const { return stats_rows_bytes() + size_t(shape_.num_kv_heads + 1) * 8; }
  double* unused_sums() const {
    return stats_.p ? reinterpret_cast<double*>(static_cast<char*>(stats_.p) + stats_rows_bytes()) : nullptr;
  }

  // The stats buffer read back in one copy (after the device's queued work).
  struct DeviceStats {
    std::vector<int32_t> rows;   // [Hkv][kRetroStats]: the last step's
    std::vector<double> unused;  // [Hkv]: the budget unused, added up
    double selected = 0;         // the list lengths, added up
  };
  DeviceStats fetch_stats() const {
    const int hkv = int(shape_.num_kv_heads);
    std::vector<char> raw(stats_bytes());
    cudautil::DeviceGuard g(device_);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(retroinfer stats)");
    check(cudaMemcpy(raw.data(), stats_.p, raw.size(), cudaMemcpyDeviceToHost), "cudaMemcpy(retroinfer stats)");
    DeviceStats d;
    d.rows.resize(size_t(hkv) * cuda::kRetroStats);
    d.unused.resize(size_t(hkv));
    std::memcpy(d.rows.data(), raw.data(), d.rows.size() * 4);
    std::memcpy(d.unused.data(), raw.data() + stats_rows_bytes(), d.unused.size() * 8);
    std::memcpy(&d.selected, raw.data() + stats_rows_bytes() + d.unused.size() * 8, 8);
    return d;
  }

  // The last step's figures (device, per KV head) and the running sums into the host method's
  // statistics.
  void read_stats() const {
    if (stats_fresh_ || !stats_.p) return;
    stats_fresh_ = true;
    const int hkv = int(shape_.num_kv_heads);
    const DeviceStats d = fetch_stats();
    const std::vector<int32_t>& s = d.rows;
    retro::StepFigures f;
    for (int h = 0; h < hkv; ++h) {
      const int32_t* x = s.data() + size_t(h) * cuda::kRetroStats;
      f.retrieval_clusters += double(x[0]) / hkv;
      f.retrieval_tokens += double(x[1]) / hkv;
      f.estimation_clusters += double(x[2]) / hkv;
      f.estimation_tokens += double(x[3]) / hkv;
      f.fill_tokens += double(x[4]) / hkv;
      f.budget_unused += double(x[5]) / hkv;
      f.steady_tokens += double(x[6]) / hkv;
    }
    f.budget_overrun = double(last_overrun_);
    double unused = 0;
    for (double x : d.unused) unused += x / hkv;
    retro::record_steps(*host_, f, unused, sum_overrun_, selects_);
  }

  ModelShape shape_;
  std::unique_ptr<Method> host_;
  retro::Rules rules_;
  std::vector<Layer> layers_;
  ThreadPool* pool_ = nullptr;        // the session's (packs the meta index for an upload)
  // An update's k-means scratch (retro_kmeans's workspace, assignments, centroids), kept when at
  // most kKeptKMeansBytes (an update's is a few hundred KiB; a build's, larger, is freed).
  static constexpr size_t kKeptKMeansBytes = size_t(4) << 20;
  mutable DevBuf kmeans_scratch_;
  // An update's KV readback staging, kept when at most kKeptDownloadBytes (an update of 1024
  // tokens reads 65 pages, 4 MiB at 8 KV heads, d 128, bf16).
  static constexpr size_t kKeptDownloadBytes = size_t(8) << 20;
  static constexpr size_t kBuildChunkBytes = size_t(16) << 20;  // a build's read-back: two chunks in flight
  mutable cudautil::PinnedBuf download_stage_;
  cudautil::PinnedBuf index_stage_;   // sync_mirror's staging, kept between index changes
  cudaEvent_t stage_read_ = nullptr;  // recorded after each upload's copies from index_stage_
  int device_ = 0;
  mutable cuda::Scalar meta_ = cuda::Scalar::F32;  // plan(): the batch's meta dtype
  mutable DevBuf stats_;  // [Hkv][kRetroStats] int32: this session's rows of the last step
  mutable bool stats_fresh_ = true;
  mutable int64_t last_overrun_ = 0;
  mutable double sum_overrun_ = 0;  // budget overrun added up over every select (host-known)
  mutable int64_t selects_ = 0;     // selects (layers x steps), as the CPU counts steps
  mutable double sel_read_ = 0;     // the device's list-length sum at the last settle_selected
  mutable int32_t max_clusters_ = 1, max_rows_ = 1;
  mutable std::vector<retro::StepLayout> layouts_;  // plan()'s, per session of the batch, for fill_args
  const DeviceLayerView* cur_ = nullptr;  // the layer a build or an update is clustering
  const Ahead* cur_ahead_ = nullptr;       // that update's clustering, run ahead
  bool cur_build_ = false;                 // the clustering is an index build's
  // The index builds' read-backs and GPU k-means (results copied back included), summed over
  // layers and builds, ms (stats build_readback_ms, build_kmeans_ms; the host's layout is the
  // host method's build_ms less the k-means).
  double build_readback_ms_ = 0;
  mutable double build_kmeans_ms_ = 0;
  // Clustering ahead: the bytes its layers hold (device and pinned), at most kAheadBytes (at
  // update_segment=64, 8 KV heads, d 128, bf16, about 0.5 MiB a layer: 32 layers; at 1024, about 5
  // MiB: three layers, where running ahead saves less).
  static constexpr size_t kAheadBytes = size_t(16) << 20;
  size_t ahead_bytes_ = 0;
  // The wave buffer.
  double cache_ratio_ = 0.05;
  enum class Misses { Stage, Copy, Inplace } misses_ = Misses::Stage;  // wave_misses
  // wave_misses=stage: the execution buffer's staging pages, by layer parity (a layer's admissions
  // read them until they ran; the layer two later waits for that before it stages).
  struct Stage {
    std::vector<std::shared_ptr<DevicePage>> pages;
    DevBuf ptrs;
    int32_t cap = 0;          // rows per KV head
    int32_t last_layer = -1;  // the last layer that staged here
  };
  mutable Stage stage_[2];
  cudaStream_t side_ = nullptr;  // the LRU decisions and the cache moves
  mutable std::vector<std::pair<int64_t, int64_t>> hot_;  // per layer: fill_args's hot tokens, for the step's decide
  mutable bool attn_wave_ = false;  // the last select's page table for the attention
  mutable cuda::PagedKv attn_kv_{};
  mutable DevBuf batch_table_;     // the step's page table of a batch (B > 1)
  double wave_hit_rows_ = 0, wave_miss_rows_ = 0, wave_pcie_ = 0, wave_host_s_ = 0;
  int64_t wave_steps_ = 0;
  int64_t wave_layouts_ = 0, wave_extends_ = 0;  // layers' wave buffers laid out anew, and extended by an update
  std::string wave_error_;         // why a decision failed (recover_wave reports it)
  std::atomic<bool> wave_broken_{false};  // a decision, or a step between its decision and its moves, failed
};

}  // namespace

std::unique_ptr<DeviceMethod> make_retroinfer_cuda(const MethodContext& c, const ParamSet& p) {
  return std::make_unique<RetroCuda>(c, p);
}
}  // namespace kvs
#endif
