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
// layout, the wave buffer's host side): host memory of about the indexed KV. Not graph-capturable (an update reads back and changes
// the index outside the stream), as the authors' code disables CUDA graphs with index updates.
#ifdef KVS_HAVE_CUDA
#include <algorithm>
#include <cstring>
#include <vector>

#include "backends/cuda/cuda_util.hpp"
#include "backends/cuda/device_method.hpp"
#include "backends/cuda/retro.cuh"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/kv_store.hpp"
#include "methods/retroinfer/retroinfer.hpp"

namespace kvs {
namespace {

using cudautil::check;
using cudautil::DevBuf;
using cudautil::S;

class RetroCuda final : public DeviceMethod {
 public:
  RetroCuda(const MethodContext& ctx, const ParamSet& ps)
      : shape_(ctx.shape), host_(find_method("retroinfer")->create(ctx, ps)), rules_(retro::rules(*host_)),
        layers_(ctx.shape.num_layers) {
    if (rules_.rank_model)
      fail(KVS_STATUS_UNSUPPORTED, "method_params: retroinfer rank_dtype=model is not supported on the cuda backend "
                                   "(cpu only); use rank_dtype=f32");
    const int G = int(shape_.num_q_heads / shape_.num_kv_heads);
    if (G * shape_.head_dim > 2048)
      fail(KVS_STATUS_UNSUPPORTED, "retroinfer on the cuda backend: query heads per KV head x head_dim must be <= 2048, got " +
                                       std::to_string(G * shape_.head_dim));
    check(cudaGetDevice(&device_), "cudaGetDevice");
    install_clusterer();
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
    update(layer, v, tokens, 1, true);
    sync_mirror(layer, v.stream);
  }
  void build_index(uint32_t layer, const DeviceLayerView& v) override {
    KVLayer kv = download(v, v.tokens, std::min<int64_t>(rules_.sinks, v.tokens), v.tokens);
    Clustering scope(this, &v);
    host_->build_index(layer, kv);
    layers_[layer].built = true;
  }
  void reserve(uint32_t layer, int64_t, void* stream) override {
    if (!stats_.p) {  // the last step's rows, then the running sums (zeroed once)
      stats_.reserve(stats_bytes(), device_, "retroinfer stats");
      check(cudaMemset(stats_.p, 0, stats_bytes()), "cudaMemset(retroinfer stats)");
    }
    sync_mirror(layer, stream);
  }
  void truncate(uint32_t layer, int64_t n) override { host_->truncate(layer, n); }
  // A rollback keeps every clustered token and the local window after them: the clusters are not
  // undone here (the cpu backend's max_rollback keeps copies of the index for that).
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
  void select(std::span<DeviceMethod* const>, uint32_t, const DeviceStep& st, const DevicePlan& p, const void* args,
              int32_t* idx, int32_t* cnt, const cuda::Workspace& ws) override {
    cuda::RetroConfig cfg;
    cfg.meta = meta_;
    cfg.mask_before = !rules_.mask_after;
    check(cuda::retro_select(st.shape, st.q, st.kv, st.kv_dtype, static_cast<const cuda::RetroSession*>(args), cfg,
                             max_clusters_, max_rows_, idx, cnt, p.max_selected, st.prior_o, st.prior_lse, ws,
                             st.stream),
          "retro_select");
  }

  // ---- tables: the host method's ----
  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    return host_->index_fits(layer, tokens, why);
  }
  nlohmann::json save_meta() const override { return host_->save_meta(); }
  void save(io::TablesWriter& w) const override { host_->save(w); }
  void load(const io::TablesFile& f, const nlohmann::json& meta) override {
    host_->load(f, meta);
    for (auto& L : layers_) L.built = true;  // the session builds no layer it loaded
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
    for (int h = 0; h < shape_.num_kv_heads; ++h) {  // the last list's length: retrieval + fill + steady tokens
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
    return host_->stat(name, out);
  }

 private:
  // The device copy of one layer's meta index (retro.cuh's layout), and the figures plan() needs.
  struct Mirror {
    DevBuf cent, vmeta, size, start, pos;
    int32_t C = 0, R = 0;
    cuda::Scalar meta = cuda::Scalar::F32;  // of cent and vmeta
    int64_t max_size = 0, top_r_rows = 0;  // largest cluster; most rows the top r clusters can hold
    uint64_t generation = 0;
    uint64_t bytes() const { return cent.bytes + vmeta.bytes + size.bytes + start.bytes + pos.bytes; }
  };
  struct Layer {
    Mirror mirror;
    bool built = false, prompt_chunk = false;
  };

  RetroCuda(const RetroCuda& o)
      : shape_(o.shape_), host_(o.host_->clone()), rules_(o.rules_), layers_(o.layers_.size()), device_(o.device_) {
    for (size_t l = 0; l < layers_.size(); ++l) layers_[l].built = o.layers_[l].built;
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
  // covering them read back; the other pages are one shared zero page (never read).
  KVLayer download(const DeviceLayerView& v, int64_t n, int64_t t0, int64_t t1) const {
    const size_t pb = cuda::paged_kv_page_bytes(int32_t(shape_.num_kv_heads), int32_t(kPageTokens),
                                                int32_t(shape_.head_dim), int32_t(dtype_size(shape_.kv_dtype)));
    const int64_t pages = (n + kPageTokens - 1) / kPageTokens;
    std::vector<const void*> table(static_cast<size_t>(pages));
    check(cudaStreamSynchronize(S(v.stream)), "cudaStreamSynchronize(retroinfer index)");
    if (pages > 0)
      check(cudaMemcpy(table.data(), v.kv.pages, size_t(pages) * sizeof(void*), cudaMemcpyDeviceToHost),
            "cudaMemcpy(retroinfer page table)");
    auto blank = std::make_shared<Page>(pb);
    std::memset(blank->data(), 0, pb);
    std::vector<std::shared_ptr<Page>> hp(static_cast<size_t>(pages), blank);
    if (t1 > t0)
      for (int64_t p = t0 / kPageTokens; p < (t1 + kPageTokens - 1) / kPageTokens; ++p) {
        auto page = std::make_shared<Page>(pb);
        check(cudaMemcpy(page->data(), table[size_t(p)], pb, cudaMemcpyDeviceToHost), "cudaMemcpy(retroinfer KV page)");
        hp[size_t(p)] = std::move(page);
      }
    KVLayer kv(shape_.kv_dtype, int(shape_.num_kv_heads), int(shape_.head_dim));
    kv.adopt(std::move(hp), n);
    return kv;
  }

  // Brings the layer's device copy up to the host index (after a build, an update, a truncation,
  // a load or a clone).
  void sync_mirror(uint32_t layer, void* stream) {
    auto& M = layers_[layer].mirror;
    const auto ix = retro::index_view(*host_, layer);
    if (M.generation == ix.generation && M.generation != 0) return;
    const auto& heads = *ix.heads;
    M.generation = ix.generation;
    M.C = 0;
    M.R = 0;
    M.max_size = M.top_r_rows = 0;
    if (heads.empty() || heads[0].clusters() == 0) return;
    const int64_t hkv = int64_t(heads.size()), C = heads[0].clusters(), R = heads[0].rows(), d = shape_.head_dim;
    const DType mdt = heads[0].mdt;
    for (const auto& h : heads)
      if (h.mdt != mdt)  // fp16 meta falls back to bf16 per head (wave_index.hpp): one dtype per layer here
        fail(KVS_STATUS_UNSUPPORTED, "retroinfer (cuda): layer " + std::to_string(layer) +
                                         " mixes fp16 and bf16 meta rows (values beyond fp16's range); use meta_dtype=bf16");
    M.meta = mdt == DType::F32 ? cuda::Scalar::F32 : mdt == DType::F16 ? cuda::Scalar::F16 : cuda::Scalar::BF16;
    const size_t es = dtype_size(mdt), row = size_t(d) * es;
    std::vector<std::byte> cent(size_t(hkv * C) * row), vm(size_t(hkv * C) * row);
    std::vector<int32_t> size(size_t(hkv * C)), start(size_t(hkv * C)), pos(size_t(hkv * R));
    for (int64_t h = 0; h < hkv; ++h) {
      const auto& H = heads[size_t(h)];
      const bool f32 = mdt == DType::F32;
      std::memcpy(cent.data() + size_t(h * C) * row, f32 ? static_cast<const void*>(H.centroids.data()) : H.dcent.data(),
                  size_t(C) * row);
      std::memcpy(vm.data() + size_t(h * C) * row, f32 ? static_cast<const void*>(H.value_sum.data()) : H.dvmean.data(),
                  size_t(C) * row);
      std::memcpy(size.data() + size_t(h * C), H.size.data(), size_t(C) * 4);
      for (int64_t c = 0; c < C; ++c) start[size_t(h * C + c)] = int32_t(H.start[size_t(c)]);
      std::memcpy(pos.data() + size_t(h * R), H.pos.data(), size_t(R) * 4);
      // plan()'s bound for budget=paper: the r largest clusters of any head.
      std::vector<int32_t> s(H.size);
      const int64_t r = std::min<int64_t>(ix.r, C);
      std::partial_sort(s.begin(), s.begin() + r, s.end(), std::greater<>());
      int64_t top = 0;
      for (int64_t i = 0; i < r; ++i) top += s[size_t(i)];
      M.top_r_rows = std::max(M.top_r_rows, top);
      M.max_size = std::max<int64_t>(M.max_size, *std::max_element(H.size.begin(), H.size.end()));
    }
    // A step still running (on any stream) may read the old copy: wait for the device first (an
    // index change is rare: a build, an update every update_segment tokens, a rollback, a load).
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(retroinfer index upload)");
    auto up = [&](DevBuf& buf, const void* src, size_t bytes, const char* what) {
      buf.reserve(bytes, device_, what);
      check(cudaMemcpyAsync(buf.p, src, bytes, cudaMemcpyHostToDevice, S(stream)), what);
    };
    up(M.cent, cent.data(), cent.size(), "retroinfer centroids");
    up(M.vmeta, vm.data(), vm.size(), "retroinfer value means");
    up(M.size, size.data(), size.size() * 4, "retroinfer sizes");
    up(M.start, start.data(), start.size() * 4, "retroinfer starts");
    up(M.pos, pos.data(), pos.size() * 4, "retroinfer positions");
    // The host staging is freed on return: wait for the copies.
    check(cudaStreamSynchronize(S(stream)), "cudaStreamSynchronize(retroinfer index upload)");
    M.C = int32_t(C);
    M.R = int32_t(R);
  }

  // The CPU method's update rule (on_append): once more than update_segment tokens lie between the
  // index and the local window of a layer of n tokens, the oldest update_segment of them are
  // clustered alone and appended (stored tokens only: [indexed_end, n - local)).
  void update(uint32_t layer, const DeviceLayerView& v, int64_t n, int64_t added, bool decode) {
    const int64_t lo = retro::index_view(*host_, layer).indexed_end;
    if (n - rules_.local - lo <= rules_.update_segment) return;
    KVLayer kv = download(v, n, lo, n - rules_.local);
    Clustering scope(this, &v);
    host_->on_append(layer, nullptr, added, kv, decode);
  }
  // The layer the host method's k-means reads (cluster()), set for one build or update, cleared
  // however it ends.
  struct Clustering {
    RetroCuda* m;
    Clustering(RetroCuda* mm, const DeviceLayerView* v) : m(mm) { m->cur_ = v; }
    ~Clustering() { m->cur_ = nullptr; }
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
    cuda::RetroKMeans k;
    k.n = int32_t(n);
    k.clusters = int32_t(cfg.clusters);
    k.segments = int32_t(cfg.segments);
    k.iterations = cfg.iterations;
    k.centre = cfg.centre;
    k.raw_init = cfg.raw_init;
    // Scratch for this run only (the build's, not the steps'): freed on return.
    DevBuf ws, da, dc;
    ws.reserve(cuda::retro_kmeans_workspace_bytes(hkv, d, k), device_, "cudaMalloc(retroinfer k-means)");
    da.reserve(size_t(hkv) * size_t(n) * 4, device_, "cudaMalloc(retroinfer k-means)");
    dc.reserve(size_t(hkv) * size_t(k.clusters) * d * 4, device_, "cudaMalloc(retroinfer k-means)");
    check(cuda::retro_kmeans(cur_->kv, cuda::Scalar(int32_t(shape_.kv_dtype)), hkv, d, int32_t(b), k, da.as<int32_t>(),
                             dc.as<float>(), cuda::Workspace{ws.p, ws.bytes}, cur_->stream),
          "retro_kmeans");
    assign.assign(size_t(hkv), std::vector<int32_t>(size_t(n)));
    cent.assign(size_t(hkv), std::vector<float>(size_t(k.clusters) * d));
    check(cudaStreamSynchronize(S(cur_->stream)), "cudaStreamSynchronize(retroinfer k-means)");
    for (int h = 0; h < hkv; ++h) {
      check(cudaMemcpy(assign[size_t(h)].data(), da.as<int32_t>() + size_t(h) * n, size_t(n) * 4, cudaMemcpyDeviceToHost),
            "cudaMemcpy(retroinfer assignments)");
      check(cudaMemcpy(cent[size_t(h)].data(), dc.as<float>() + size_t(h) * k.clusters * d, size_t(k.clusters) * d * 4,
                       cudaMemcpyDeviceToHost),
            "cudaMemcpy(retroinfer centroids)");
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
};

}  // namespace

std::unique_ptr<DeviceMethod> make_retroinfer_cuda(const MethodContext& c, const ParamSet& p) {
  return std::make_unique<RetroCuda>(c, p);
}
}  // namespace kvs
#endif
