// SPDX-License-Identifier: Apache-2.0
// The cpu placement: KV in host pages (core/kv_store), the method's CPU implementation (the
// reference), attention on the thread pool. The decode data flow of docs/architecture.md:
// append -> Method::on_append -> Method::select -> attend -> Method::extra -> merge.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "backends/backend.hpp"
#include "backends/cpu/attention.hpp"
#include "backends/cpu/gemm.hpp"
#include "backends/cpu/host_part.hpp"
#include "core/error.hpp"
#include "core/placement.hpp"
#include "core/session.hpp"
#include "core/tensor.hpp"
#include "io/tables.hpp"

namespace kvs {

// ---- the cpu backend -------------------------------------------------------------------------
namespace {

std::atomic<int64_t> g_fail_step_at{-1};  // testing::fail_step_at

class CpuBackend final : public Backend {
 public:
  int32_t id() const override { return KVS_BACKEND_CPU; }
  const char* name() const override { return "cpu"; }
  void* alloc(size_t bytes, Mem where) const override {
    if (where != Mem::Host) fail(KVS_STATUS_UNSUPPORTED, std::string("cpu backend: cannot allocate ") + mem_name(where) + " memory");
    void* p = std::malloc(bytes ? bytes : 1);
    if (!p) fail(KVS_STATUS_OUT_OF_MEMORY, "cpu backend: out of memory (" + std::to_string(bytes) + " bytes)");
    return p;
  }
  void free(void* p, Mem) const noexcept override { std::free(p); }
  void copy(void* dst, Mem dm, const void* src, Mem sm, size_t bytes, void*) const override {
    if (dm == Mem::Device || sm == Mem::Device) fail(KVS_STATUS_UNSUPPORTED, "cpu backend: cannot reach device memory");
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void host_fn(void*, std::function<void()> fn) const override { fn(); }
  void sync(void*) const override {}
  void merge(const AttnState& dst, const AttnState& src, int64_t rows, int32_t d, void*) const override {
    cpu::merge_states(dst.o.as<float>(), dst.lse.as<float>(), src.o.as<float>(), src.lse.as<float>(), int(rows), d);
  }
};

// Token indices are int32 in selections.
constexpr int64_t kMaxLayerTokens = (int64_t(1) << 31) - 1;
std::string L(uint32_t layer) { return std::to_string(layer); }

// Non-finite inputs are rejected on this placement (docs/api.md, "Guarantees"): a NaN or an
// infinity in q would give that head zeros and lse = -inf, and one in k or v would sit in the KV
// cache and poison every later step that attends it. x is the tensor v converted to packed fp32
// (C order of v's shape). The scan is one branch-free pass over the bits (exponent all ones =
// inf or NaN) that the compiler vectorises; the first bad element is looked for only on failure.
void check_finite(const float* x, const View& v, const std::string& fn, const char* name) {
  const size_t n = size_t(v.numel());
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    bad |= uint32_t((u & 0x7f800000u) == 0x7f800000u);
  }
  if (!bad) return;
  size_t i = 0;
  while (std::isfinite(x[i])) ++i;
  std::string idx;
  size_t rest = i;
  for (int a = v.ndim - 1; a >= 0; --a) {
    const size_t e = size_t(v.shape[a]);
    idx = std::to_string(rest % e) + (idx.empty() ? "" : ", ") + idx;
    rest /= e;
  }
  invalid(fn + ": " + name + ": element [" + idx + "] is " +
          (std::isnan(x[i]) ? "NaN" : x[i] > 0 ? "+inf" : "-inf") +
          "; the cpu backend accepts finite values only");
}

}  // namespace

const Backend& cpu_backend() {
  static const CpuBackend b;
  return b;
}

// ---- the placement ---------------------------------------------------------------------------
namespace {

class CpuPlacement final : public Placement, public HostPart {
 public:
  CpuPlacement(const SessionConfig& cfg, const MethodSpec& spec, const ParamSet& ps, std::shared_ptr<ThreadPool> pool)
      : cfg_(cfg), spec_(spec), params_(ps), pool_(std::move(pool)) {
    MethodContext mc{cfg_.shape, cfg_.budget, pool_.get(), int32_t(cpu::resolve_gemm(cfg_.gemm))};
    method_ = spec_.create(mc, ps);
    const auto& s = cfg_.shape;
    layers_.reserve(s.num_layers);
    for (uint32_t l = 0; l < s.num_layers; ++l) layers_.emplace_back(s.kv_dtype, int(s.num_kv_heads), int(s.head_dim));
    last_sel_.resize(s.num_layers);
    last_n_.assign(s.num_layers, 0);
    bound_.resize(s.num_layers);
  }

  int32_t backend() const override { return KVS_BACKEND_CPU; }
  const Backend& ops() const override { return cpu_backend(); }
  int64_t tokens(uint32_t layer) const override { return layers_[layer].size(); }

  void add_tokens(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
                  const char* fn, bool prompt, int64_t max_tokens, void*) override {
    const auto& s = cfg_.shape;
    const int64_t hq = s.num_q_heads, hkv = s.num_kv_heads, d = s.head_dim;
    View qv = check_tensor(q, "q", {-1, hq, d}, Where::Host);
    const int64_t n = qv.shape[0];
    View kv, vv;  // (a caller's cache: none; the session checked its binding holds the tokens)
    if (!caller()) {
      kv = check_tensor(k, "k", {n, hkv, d}, Where::Host);
      vv = check_tensor(v, "v", {n, hkv, d}, Where::Host);
    }
    View ov;
    if (o) ov = check_output_tensor(o, "o", {n, hq, d}, Where::Host);
    auto& lay = layers_[layer];
    const int64_t n0 = lay.size();
    max_tokens = std::min(max_tokens, kMaxLayerTokens);
    if (n > max_tokens - n0)
      invalid(std::string(fn) + ": q: layer " + L(layer) + " may hold at most " + std::to_string(max_tokens) +
              " tokens here (it has " + std::to_string(n0) + "), got " + std::to_string(n) + " more");
    std::vector<float> qf(static_cast<size_t>(qv.numel())), kf(size_t(caller() ? 0 : kv.numel())),
        vf(size_t(caller() ? 0 : vv.numel()));
    read_f32(qv, qf.data());
    check_finite(qf.data(), qv, fn, "q");
    if (!caller()) {
      read_f32(kv, kf.data());
      read_f32(vv, vf.data());
      check_finite(kf.data(), kv, fn, "k");
      check_finite(vf.data(), vv, fn, "v");
    }
    std::vector<float> of(o ? size_t(n) * hq * d : 0);
    if (prompt) history_.clear();  // on_prefill state is not replayed: the history starts again
    else checkpoint();
    try {
      if (caller()) count_bound(layer, n0 + n);
      else lay.append(kf.data(), vf.data(), n);
      if (prompt) method_->on_prefill(layer, qf.data(), n, lay);
      else method_->on_append(layer, qf.data(), n, lay, false);
      if (o) causal_outputs(layer, qf.data(), n, n0, of.data());
    } catch (...) {
      lay.truncate(n0);
      method_->truncate(layer, n0);
      throw;
    }
    if (!prompt) log_call(layer, n0, n, false, std::move(qf));
    if (o) write_f32(ov, of.data());
  }

  // ---- a KV cache the caller owns (kv_source = KVS_KV_CALLER) ----

  // The caller's pages become the layer's (read in place, never written: they are not owned, so
  // nothing copies or zeroes them); the layer keeps its count until add_tokens or decode counts
  // the next bound tokens. Pages already wrapped are reused when the binding names them again.
  void bind_kv(uint32_t layer, const BoundKv& kv, const char* fn, void*) override {
    if (!caller())
      fail(KVS_STATUS_INVALID_STATE, std::string(fn) + ": this session stores its own KV");
    if (kv.page_size != kPageTokens)
      fail(KVS_STATUS_UNSUPPORTED, std::string(fn) + ": kv->page_size: the cpu backend reads pages of " +
                                       std::to_string(kPageTokens) + " tokens, got " + std::to_string(kv.page_size));
    if (kv.nhd)
      fail(KVS_STATUS_UNSUPPORTED, std::string(fn) + ": kv->layout: the cpu backend reads KVS_KV_LAYOUT_HND pages "
                                                     "only (the cuda backend reads NHD too)");
    if (kv.v_pool)
      fail(KVS_STATUS_UNSUPPORTED, std::string(fn) + ": kv->v_pages: the cpu backend reads K and V in one tensor "
                                                     "only, [num_pages][2][Hkv][256][d] (the cuda backend reads two)");
    auto& b = bound_[layer];
    const size_t pb = layers_[layer].page_bytes();
    const auto* pool = static_cast<const std::byte*>(kv.pool);
    // The entries the session found unchanged keep their pages; the rest are wrapped (or reused).
    std::vector<std::shared_ptr<Page>> pages(b.pages.begin(), b.pages.begin() + std::ptrdiff_t(std::min(kv.unchanged, b.pages.size())));
    pages.resize(kv.pages.size());
    for (size_t i = std::min(kv.unchanged, b.pages.size()); i < kv.pages.size(); ++i) {
      const std::byte* at = pool + size_t(kv.pages[i]) * pb;
      if (i < b.pages.size() && b.pages[i]->data() == at) pages[i] = b.pages[i];
      else pages[i] = std::make_shared<Page>(at, pb, caller_owner());
    }
    const int64_t n = layers_[layer].size();
    // Tokens the layer counts must read the same bytes as before (a page renumbered is fine).
    layers_[layer].adopt(std::vector<std::shared_ptr<Page>>(pages.begin(), pages.begin() + (n + kPageTokens - 1) / kPageTokens), n);
    b.pages = std::move(pages);
  }

  bool caller() const { return cfg_.kv_source == KVS_KV_CALLER; }
  // The layer counts its first n bound tokens (n <= the binding's: Session::check_caller_kv).
  void count_bound(uint32_t layer, int64_t n) {
    const auto& b = bound_[layer].pages;
    layers_[layer].adopt(std::vector<std::shared_ptr<Page>>(b.begin(), b.begin() + (n + kPageTokens - 1) / kPageTokens), n);
  }
  // Non-null, so the wrapped pages are not owned (never freed, written or zeroed).
  static std::shared_ptr<const void> caller_owner() {
    static const int tag = 0;
    return std::shared_ptr<const void>(&tag, [](const void*) {});
  }

  void build_index(uint32_t layer, void*) override {
    history_.clear();
    method_->build_index(layer, layers_[layer]);
  }

  void decode(std::span<Placement* const> batch, uint32_t layer, const StepTensors& t,
              std::span<StepReport> reports) override {
    const auto& s = cfg_.shape;
    const int64_t B = int64_t(batch.size()), hq = s.num_q_heads, hkv = s.num_kv_heads, d = s.head_dim;
    View qv, kv, vv, ov, lv;
    // kv_source = KVS_KV_CALLER: the new tokens are in the caller's cache (every session of a batch
    // has the same kv_source; the session checked the bindings hold them).
    const bool ext = caller();
    if (t.single) {
      qv = check_tensor(t.q, "q", {hq, d}, Where::Host);
      if (!ext) kv = check_tensor(t.k_new, "k_new", {hkv, d}, Where::Host);
      if (!ext) vv = check_tensor(t.v_new, "v_new", {hkv, d}, Where::Host);
      ov = check_output_tensor(t.o, "o", {hq, d}, Where::Host);
      if (t.lse) lv = check_output_tensor(t.lse, "lse", {hq}, Where::Host);
    } else {
      qv = check_tensor(t.q, "q", {B, hq, d}, Where::Host);
      if (!ext) kv = check_tensor(t.k_new, "k_new", {B, hkv, d}, Where::Host);
      if (!ext) vv = check_tensor(t.v_new, "v_new", {B, hkv, d}, Where::Host);
      ov = check_output_tensor(t.o, "o", {B, hq, d}, Where::Host);
      if (t.lse) lv = check_output_tensor(t.lse, "lse", {B, hq}, Where::Host);
    }
    if (t.lse && lv.dtype != DType::F32) invalid(std::string(t.fn) + ": lse: expected dtype float32");
    std::vector<CpuPlacement*> ps(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      ps[size_t(b)] = static_cast<CpuPlacement*>(batch[size_t(b)]);
      if (ps[size_t(b)]->layers_[layer].size() >= kMaxLayerTokens)
        invalid(std::string(t.fn) + ": layer " + L(layer) + " of sessions[" + std::to_string(b) + "] is full (" +
                std::to_string(kMaxLayerTokens) + " tokens)");
    }
    const size_t kvn = ext ? 0 : size_t(B * hkv * d);
    std::vector<float> qf(static_cast<size_t>(B * hq * d)), kf(kvn), vf(kvn);
    std::vector<float> of(static_cast<size_t>(B * hq * d)), lf(size_t(B * hq));
    read_f32(qv, qf.data());
    check_finite(qf.data(), qv, t.fn, "q");
    if (!ext) {
      read_f32(kv, kf.data());
      read_f32(vv, vf.data());
      check_finite(kf.data(), kv, t.fn, "k_new");
      check_finite(vf.data(), vv, t.fn, "v_new");
    }
    // The sessions' steps as one job on the leader's pool: each session's own parallel rounds nest
    // in it, so the threads one session's step leaves idle serve the others.
    std::vector<uint8_t> took(static_cast<size_t>(B), 0);
    auto one = [&](int64_t b) {
      reports[size_t(b)] = ps[size_t(b)]->decode_f32(layer, qf.data() + b * hq * d, ext ? nullptr : kf.data() + b * hkv * d,
                                                     ext ? nullptr : vf.data() + b * hkv * d, of.data() + b * hq * d,
                                                     lf.data() + b * hq);
      took[size_t(b)] = 1;
    };
    try {
      ps[0]->pool_->parallel_for(B, one);  // (one session: on this thread)
    } catch (...) {
      // All or nothing: the sessions that advanced drop their new token again.
      for (int64_t b = 0; b < B; ++b)
        if (took[size_t(b)]) ps[size_t(b)]->undo_step(layer);
      throw;
    }
    for (int64_t b = 0; b < B; ++b)  // (the query is copied only for a session that keeps a history)
      if (ps[size_t(b)]->logging())
        ps[size_t(b)]->log_call(layer, ps[size_t(b)]->layers_[layer].size() - 1, 1, true,
                                std::vector<float>(qf.begin() + b * hq * d, qf.begin() + (b + 1) * hq * d));
    // lse_base = 2 (kvs_session_params.lse_base): log2 x = ln x / ln 2, per session of the batch.
    for (int64_t b = 0; b < B; ++b)
      if (ps[size_t(b)]->cfg_.lse_base == KVS_LSE_BASE_2)
        for (int64_t h = 0; h < hq; ++h) lf[size_t(b * hq + h)] *= kLog2e;
    write_f32(ov, of.data());
    if (t.lse) write_f32(lv, lf.data());
  }

  bool lse_base2() const override { return true; }

  int64_t truncate_floor(uint32_t layer, std::string* why) const override {
    const int64_t n = layers_[layer].size();
    if (method_->exact_truncate()) {
      *why = "method '" + cfg_.method + "' rolls back to any length";
      return 0;
    }
    if (history_.checkpoints.empty()) {
      *why = cfg_.max_rollback == 0
                 ? "method '" + cfg_.method + "' keeps no rollback history unless kvs_session_params.max_rollback > 0"
                 : "method '" + cfg_.method + "' has no rollback history since the last prefill, index build or load";
      return n;
    }
    const int64_t f = history_.checkpoints.front().tokens[layer];
    *why = "method '" + cfg_.method + "' keeps history back to token " + std::to_string(f) +
           " (max_rollback = " + std::to_string(cfg_.max_rollback) + ")";
    return std::min(f, n);
  }

  void truncate(int64_t n) override {
    const uint32_t nl = cfg_.shape.num_layers;
    std::vector<int64_t> target(nl);
    for (uint32_t l = 0; l < nl; ++l) target[l] = std::min(layers_[l].size(), n);
    if (method_->exact_truncate()) {
      for (uint32_t l = 0; l < nl; ++l)
        if (layers_[l].size() > target[l]) {
          layers_[l].truncate(target[l]);
          method_->truncate(l, target[l]);
          forget_selection(l, target[l]);
        }
      return;
    }
    // Restore the newest copy of the method taken at or before every target, then replay each
    // layer's logged calls up to its target (a call cut in the middle is replayed in part: the
    // same as a session that was given only those tokens).
    auto& H = history_;
    size_t c = H.checkpoints.size();
    while (c > 0) {
      bool fits = true;
      for (uint32_t l = 0; l < nl; ++l) fits &= H.checkpoints[c - 1].tokens[l] <= target[l];
      if (fits) break;
      --c;
    }
    if (c == 0) fail(KVS_STATUS_INTERNAL, "kvs_session_truncate: no rollback checkpoint covers the target");
    const Checkpoint& cp = H.checkpoints[c - 1];
    std::unique_ptr<Method> m = cp.method->clone();
    std::vector<Selection> sel(nl);
    std::vector<int64_t> sel_n(nl, -1);
    const auto& s = cfg_.shape;
    std::vector<float> eo(size_t(s.num_q_heads) * s.head_dim), el(s.num_q_heads);
    for (uint32_t l = 0; l < nl; ++l) {
      for (auto& call : H.calls[l]) {
        if (call.first < cp.tokens[l] || call.first >= target[l]) continue;
        const int64_t cnt = std::min(call.n, target[l] - call.first);
        const KVLayer kv = layers_[l].prefix(call.first + cnt);
        if (call.decode) {
          m->on_append(l, call.q.data(), 1, kv, true);
          m->select(l, call.q.data(), kv, sel[l]);
          m->extra(l, call.q.data(), kv, eo.data(), el.data());
          sel_n[l] = kv.size();
        } else {
          m->on_append(l, call.q.data(), cnt, kv, false);
        }
      }
    }
    // Nothing below can fail: the state changes all at once.
    method_ = std::move(m);
    H.checkpoints.resize(c);
    for (uint32_t l = 0; l < nl; ++l) {
      auto& calls = H.calls[l];
      while (!calls.empty() && calls.back().first >= target[l]) calls.pop_back();
      if (!calls.empty() && calls.back().first + calls.back().n > target[l]) {
        auto& b = calls.back();
        b.n = target[l] - b.first;
        b.q.resize(size_t(b.n) * s.num_q_heads * s.head_dim);
      }
      if (layers_[l].size() > target[l]) layers_[l].truncate(target[l]);
      if (sel_n[l] >= 0) {
        last_sel_[l] = std::move(sel[l]);
        last_n_[l] = sel_n[l];
      } else {
        forget_selection(l, target[l]);
      }
    }
  }

  std::vector<int32_t> last_selection(uint32_t layer, uint32_t kv_head) const override {
    const Selection& sel = last_sel_[layer];
    std::vector<int32_t> out;
    switch (sel.kind) {
      case Selection::Kind::All:
        out.resize(size_t(last_n_[layer]));
        for (size_t i = 0; i < out.size(); ++i) out[i] = int32_t(i);
        break;
      case Selection::Kind::PerKvHead:
        if (kv_head < sel.lists.size()) out = sel.lists[kv_head];
        std::sort(out.begin(), out.end());
        break;
      case Selection::Kind::PerQueryHead: {
        const int G = cfg_.shape.group();
        if (cpu::group_shares_list(sel.lists, int(kv_head), G)) {  // the group's heads share one list (lfps)
          out = sel.lists[size_t(kv_head) * G];
          if (!std::is_sorted(out.begin(), out.end())) std::sort(out.begin(), out.end());
          break;
        }
        for (int g = 0; g < G; ++g) {
          size_t h = size_t(kv_head) * G + g;
          if (h < sel.lists.size()) out.insert(out.end(), sel.lists[h].begin(), sel.lists[h].end());
        }
        std::sort(out.begin(), out.end());
        out.erase(std::unique(out.begin(), out.end()), out.end());
        break;
      }
    }
    return out;
  }

  void stats(kvs_session_stats& st) const override {
    for (auto& l : layers_) {
      if (caller()) break;  // the caller's cache: kvsieve holds no KV
      st.kv_bytes += l.bytes();
      st.kv_shared_bytes += l.shared_bytes();
    }
    st.index_bytes = method_->index_bytes();
    st.workspace_bytes = 0;
  }

  bool stat(std::string_view name, double* out) const override {
    // Wall time of the decode phases, the same for every method.
    static const char* const kPhases[3] = {"decode_update_seconds", "decode_select_seconds", "decode_attend_seconds"};
    for (int i = 0; i < 3; ++i)
      if (name == kPhases[i]) {
        *out = phase_seconds_[i];
        return true;
      }
    if (name == "rollback_history_bytes") {  // what max_rollback costs now (kvs_session_truncate)
      uint64_t b = 0;
      for (const auto& cp : history_.checkpoints) b += cp.method->index_bytes();
      for (const auto& calls : history_.calls)
        for (const auto& c : calls) b += c.q.size() * sizeof(float);
      *out = double(b);
      return true;
    }
    return method_->stat(name, out);
  }

  nlohmann::json save_meta() const override { return method_->save_meta(); }

  void save(io::TablesWriter& w, bool with_kv) const override {
    if (with_kv && caller())
      fail(KVS_STATUS_UNSUPPORTED, "kvs_session_save: flags: KVS_SAVE_INCLUDE_KV: the KV cache is the caller's "
                                   "(kv_source = KVS_KV_CALLER); save the tables only");
    if (with_kv)
      for (uint32_t l = 0; l < cfg_.shape.num_layers; ++l) {
        std::vector<io::Piece> pieces;
        for (auto& p : layers_[l].pages()) pieces.push_back(io::Piece{p->data(), uint64_t(p->bytes())});
        if (!pieces.empty()) w.add("kv", int32_t(l), -1, std::move(pieces));
      }
    method_->save(w);
  }

  // By default every KV page is copied into memory of its own, so the session does not depend on
  // the file once the load returns (a file truncated under a mapped page kills the process with
  // SIGBUS on the next read; a write into it would change outputs). With map (KVS_LOAD_MMAP) the
  // pages point into the read-only mapping instead, which the pages keep alive, and the caller
  // guarantees the file stays as it is.
  void load(const std::shared_ptr<const io::TablesFile>& file, const nlohmann::json& meta,
            const std::vector<int64_t>& tokens, bool with_kv, const std::string& path, bool map) override {
    const io::TablesFile& f = *file;
    std::shared_ptr<const void> keep;
    if (map) keep = file;  // the file stays mapped while a page points into it
    for (uint32_t l = 0; with_kv && l < cfg_.shape.num_layers; ++l) {
      const int64_t n = tokens[l];
      if (n == 0) continue;
      const auto& sec = f.require("kv", int32_t(l), -1);
      auto& lay = layers_[l];
      const int64_t np = (n + kPageTokens - 1) / kPageTokens;
      if (sec.length != uint64_t(np) * lay.page_bytes())
        fail(KVS_STATUS_FORMAT_INVALID, "tables file '" + path + "': section kv layer " + L(l) + ": expected " +
                                            std::to_string(uint64_t(np) * lay.page_bytes()) + " bytes for " +
                                            std::to_string(n) + " tokens, got " + std::to_string(sec.length));
      std::vector<std::shared_ptr<Page>> pages;
      pages.reserve(size_t(np));
      for (int64_t i = 0; i < np; ++i) {
        const std::byte* src = sec.data + size_t(i) * lay.page_bytes();
        if (map && !lay.pinned()) {
          pages.push_back(std::make_shared<Page>(src, lay.page_bytes(), keep));
        } else {
          auto p = std::make_shared<Page>(lay.page_bytes(), lay.pinned());
          std::memcpy(p->data(), src, lay.page_bytes());
          pages.push_back(std::move(p));
        }
      }
      lay.adopt(std::move(pages), n);
    }
    method_->load(f, meta);
    history_.clear();
  }

  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    return method_->index_fits(layer, tokens, why);
  }

  std::unique_ptr<Placement> fork() const override {
    auto p = std::make_unique<CpuPlacement>(cfg_, spec_, params_, pool_);
    p->layers_ = layers_;  // shares pages; copy-on-write on the next append
    p->method_ = method_->clone();
    p->history_ = history_;  // the checkpoints are shared (read-only), the logs copied
    p->bound_ = bound_;      // the caller's pages: the fork reads the same cache until bound anew
    return p;
  }

 private:
  void causal_outputs(uint32_t layer, const float* q, int64_t n, int64_t first, float* o) {
    const auto& s = cfg_.shape;
    const size_t qs = size_t(s.num_q_heads) * s.head_dim;
    std::vector<float> lse(s.num_q_heads);
    for (int64_t i = 0; i < n; ++i)
      cpu::attend_dense(layers_[layer], q + size_t(i) * qs, s.group(), first + i + 1, s.softmax_scale,
                        o + size_t(i) * qs, lse.data(), *pool_);
  }

  // Every index a method hands to the attention kernels is a token of the layer: an index built
  // from a forged tables file (valid checksums, inconsistent counts) must fail here, not read out
  // of bounds. One pass over the selection, small next to the attention over it.
  static void check_selection(const Selection& sel, int64_t n) {
    for (const auto& l : sel.lists)
      for (int32_t t : l)
        if (t < 0 || t >= n)
          fail(KVS_STATUS_FORMAT_INVALID, "the method's index selected token " + std::to_string(t) + " of a layer of " +
                                              std::to_string(n) + " tokens: its tables do not match the layer");
  }

  // One session's step on fp32 host buffers: q [Hq][d], k, v [Hkv][d] -> o [Hq][d], lse [Hq].
  StepReport decode_f32(uint32_t layer, const float* q, const float* k, const float* v, float* o, float* lse) {
    const auto& s = cfg_.shape;
    std::vector<float> eo(size_t(s.num_q_heads) * s.head_dim), el(s.num_q_heads);
    const Step st = select_step(layer, q, k, v, eo.data(), el.data());
    const auto& lay = layers_[layer];
    try {
      const auto t2 = std::chrono::steady_clock::now();
      const Selection& sel = *st.sel;
      const int G = s.group();
      if (!sel.attend) {  // reported only: the method's extra() is the whole state
        std::fill(o, o + size_t(s.num_q_heads) * s.head_dim, 0.f);
        std::fill(lse, lse + s.num_q_heads, -std::numeric_limits<float>::infinity());
      } else if (sel.kind == Selection::Kind::All) {
        cpu::attend_dense(lay, q, G, lay.size(), s.softmax_scale, o, lse, *pool_);
      } else if (sel.kind == Selection::Kind::PerKvHead) {
        cpu::attend_gather_kv(lay, q, G, sel.lists, s.softmax_scale, o, lse, *pool_);
      } else {
        cpu::attend_gather_q(lay, q, G, sel.lists, s.softmax_scale, o, lse, *pool_);
      }
      if (st.has_extra) cpu::merge_states(o, lse, eo.data(), el.data(), int(s.num_q_heads), int(s.head_dim));
      phase_seconds_[2] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t2).count();
      return st.report;
    } catch (...) {
      undo_step(layer);
      throw;
    }
  }

 public:
  // ---- HostPart: the hybrid placement's host half ----
  Step select_step(uint32_t layer, const float* q, const float* k, const float* v, float* extra_o,
                   float* extra_lse) override {
    const auto& s = cfg_.shape;
    auto& lay = layers_[layer];
    const int64_t n0 = lay.size();
    checkpoint();
    if (k) lay.append(k, v, 1);
    else count_bound(layer, n0 + 1);  // kv_source = KVS_KV_CALLER: the token is in the caller's cache
    try {
      using Clock = std::chrono::steady_clock;
      const auto t0 = Clock::now();
      method_->on_append(layer, q, 1, lay, true);
      const auto t1 = Clock::now();
      Selection& sel = last_sel_[layer];
      method_->select(layer, q, lay, sel);
      const auto t2 = Clock::now();  // the checks and the count below are timed with the attention
      const int64_t n = lay.size();
      check_selection(sel, n);
      if (n0 == g_fail_step_at.load(std::memory_order_relaxed))
        fail(KVS_STATUS_INTERNAL, "injected failure (testing::fail_step_at)");
      last_n_[layer] = n;
      const size_t lists = sel.kind == Selection::Kind::PerKvHead ? s.num_kv_heads : s.num_q_heads;
      if (sel.kind != Selection::Kind::All && sel.lists.size() != lists)
        fail(KVS_STATUS_INTERNAL, "method returned a selection of the wrong size");
      double selected = 0;
      switch (sel.kind) {
        case Selection::Kind::All:
          selected = double(n);
          break;
        case Selection::Kind::PerKvHead:
          for (auto& l : sel.lists) selected += double(l.size());
          selected /= double(s.num_kv_heads);
          break;
        case Selection::Kind::PerQueryHead:
          for (uint32_t h = 0; h < s.num_kv_heads; ++h) selected += double(last_selection(layer, h).size());
          selected /= double(s.num_kv_heads);
          break;
      }
      Step st;
      st.sel = &sel;
      st.has_extra = method_->extra(layer, q, lay, extra_o, extra_lse);
      st.report = StepReport{selected, n};
      phase_seconds_[0] += std::chrono::duration<double>(t1 - t0).count();
      phase_seconds_[1] += std::chrono::duration<double>(t2 - t1).count();
      phase_seconds_[2] += std::chrono::duration<double>(Clock::now() - t2).count();
      return st;
    } catch (...) {
      lay.truncate(n0);
      method_->truncate(layer, n0);
      throw;
    }
  }

  StaticKeys static_keys(uint32_t layer, int64_t n) const override { return method_->static_keys(layer, n); }
  StaticKeys static_capacity() const override { return method_->static_capacity(); }

  double attend_rest(uint32_t layer, const float* q, const Step& step, StaticKeys sk, float* o,
                     float* lse) override {
    const auto& s = cfg_.shape;
    const auto& lay = layers_[layer];
    const auto t0 = std::chrono::steady_clock::now();
    const Selection& sel = *step.sel;
    const int64_t n = lay.size(), from = n - sk.recent;
    if (!sel.attend || sel.kind == Selection::Kind::All || sk.sinks < 0 || sk.recent < 0 || sk.sinks > from)
      fail(KVS_STATUS_INTERNAL, "attend_rest: the method's selection has no static set to leave out");
    rest_.resize(sel.lists.size());
    double kept = 0;
    for (size_t i = 0; i < sel.lists.size(); ++i) {
      auto& r = rest_[i];
      r.clear();
      int64_t found = 0;
      for (int32_t t : sel.lists[i]) {
        if (t < sk.sinks || t >= from) ++found;
        else r.push_back(t);
      }
      if (found != sk.total())
        fail(KVS_STATUS_INTERNAL, "the method's selection of layer " + std::to_string(layer) + " lacks " +
                                      std::to_string(sk.total() - found) + " of its " + std::to_string(sk.total()) +
                                      " static keys (list " + std::to_string(i) + ")");
      kept += double(r.size());
    }
    const int G = s.group();
    const size_t hq = s.num_q_heads, d = s.head_dim;
    std::vector<float> eo, el;
    if (step.has_extra) {  // o and lse hold the method's extra state: keep it to merge
      eo.assign(o, o + hq * d);
      el.assign(lse, lse + hq);
    }
    if (sel.kind == Selection::Kind::PerKvHead) cpu::attend_gather_kv(lay, q, G, rest_, s.softmax_scale, o, lse, *pool_);
    else cpu::attend_gather_q(lay, q, G, rest_, s.softmax_scale, o, lse, *pool_);
    if (step.has_extra) cpu::merge_states(o, lse, eo.data(), el.data(), int(hq), int(d));
    phase_seconds_[2] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return sel.lists.empty() ? 0.0 : kept / double(sel.lists.size());
  }

  void undo_step(uint32_t layer) override {
    const int64_t n = layers_[layer].size() - 1;
    layers_[layer].truncate(n);
    method_->truncate(layer, n);
  }

  void log_decode(uint32_t layer, const float* q) override {
    if (!logging()) return;
    const size_t qs = size_t(cfg_.shape.num_q_heads) * cfg_.shape.head_dim;
    log_call(layer, layers_[layer].size() - 1, 1, true, std::vector<float>(q, q + qs));
  }

  KVLayer& kv_layer(uint32_t layer) override { return layers_[layer]; }
  ThreadPool& pool() override { return *pool_; }

 private:
  // ---- rollback history (kvs_session_truncate) ----
  // For a method whose truncate only undoes its latest call (exact_truncate() false): copies of
  // the method taken at most every max_rollback tokens (the two newest kept) and, per layer, the
  // append and decode calls since the older one with their queries. Rolling back restores the
  // newest copy at or before the target and replays the calls after it, so the method ends in the
  // state a session that never saw the dropped tokens has (its code, its order, its rounding).
  // Cost: up to two copies of the index, Hq*d*4 bytes of queries per token and layer kept for up
  // to 2 * max_rollback tokens, and a truncate replays up to 2 * max_rollback steps per layer.
  struct Checkpoint {
    std::shared_ptr<const Method> method;
    std::vector<int64_t> tokens;  // per layer, when the copy was taken
  };
  struct Call {
    int64_t first, n;  // the layer's tokens before the call, tokens added
    bool decode;
    std::vector<float> q;  // [n][Hq][d]
  };
  struct History {
    std::vector<Checkpoint> checkpoints;  // oldest first, at most two
    std::vector<std::vector<Call>> calls;  // [layer]
    void clear() {
      checkpoints.clear();
      for (auto& c : calls) c.clear();
    }
  };

  bool keeps_history() const { return cfg_.max_rollback > 0 && !method_->exact_truncate(); }

  // Before an append or decode call: the first copy after a prefill, build or load, and a new one
  // once every layer has moved max_rollback tokens past the newest (the older one then still
  // reaches at least max_rollback tokens back).
  void checkpoint() {
    if (!keeps_history()) return;
    auto& H = history_;
    const uint32_t nl = cfg_.shape.num_layers;
    if (H.calls.size() != nl) H.calls.resize(nl);
    if (!H.checkpoints.empty()) {
      const auto& newest = H.checkpoints.back().tokens;
      for (uint32_t l = 0; l < nl; ++l)
        if (layers_[l].size() > 0 && layers_[l].size() - newest[l] < cfg_.max_rollback) return;
    }
    Checkpoint cp;
    cp.method = method_->clone();
    cp.tokens.resize(nl);
    for (uint32_t l = 0; l < nl; ++l) cp.tokens[l] = layers_[l].size();
    H.checkpoints.push_back(std::move(cp));
    if (H.checkpoints.size() > 2) {
      H.checkpoints.erase(H.checkpoints.begin());
      const auto& oldest = H.checkpoints.front().tokens;
      for (uint32_t l = 0; l < nl; ++l) {
        auto& calls = H.calls[l];
        size_t drop = 0;
        while (drop < calls.size() && calls[drop].first < oldest[l]) ++drop;
        calls.erase(calls.begin(), calls.begin() + std::ptrdiff_t(drop));
      }
    }
  }

  // After a successful append or decode call.
  bool logging() const { return keeps_history() && !history_.checkpoints.empty(); }
  void log_call(uint32_t layer, int64_t first, int64_t n, bool decode, std::vector<float> q) {
    if (!logging()) return;
    history_.calls[layer].push_back(Call{first, n, decode, std::move(q)});
  }

  // After a truncate: the last selection names no dropped token.
  void forget_selection(uint32_t layer, int64_t n) {
    for (auto& l : last_sel_[layer].lists) l.erase(std::remove_if(l.begin(), l.end(), [n](int32_t t) { return t >= n; }), l.end());
    last_n_[layer] = std::min(last_n_[layer], n);
  }

  static constexpr float kLog2e = 1.4426950408889634f;

  SessionConfig cfg_;
  const MethodSpec& spec_;
  ParamSet params_;
  std::shared_ptr<ThreadPool> pool_;
  std::unique_ptr<Method> method_;
  std::vector<KVLayer> layers_;
  std::vector<Selection> last_sel_;
  std::vector<std::vector<int32_t>> rest_;  // attend_rest: the lists without the static set
  std::vector<int64_t> last_n_;
  // Wall time of the decode phases, summed over every step and layer: the method's streaming
  // update (on_append), its selection (select) and the exact attention with the merge.
  double phase_seconds_[3] = {0, 0, 0};
  History history_;
  struct Bound {  // kv_source = KVS_KV_CALLER: the pages of the layer's last binding
    std::vector<std::shared_ptr<Page>> pages;
  };
  std::vector<Bound> bound_;
};

}  // namespace

HostPart* host_part(Placement* p) { return dynamic_cast<CpuPlacement*>(p); }

void testing::fail_step_at(int64_t tokens) { g_fail_step_at.store(tokens, std::memory_order_relaxed); }

std::unique_ptr<Placement> make_cpu_placement(const SessionConfig& cfg, const MethodSpec& spec, const ParamSet& ps,
                                              std::shared_ptr<ThreadPool> pool) {
  return std::make_unique<CpuPlacement>(cfg, spec, ps, std::move(pool));
}

}  // namespace kvs
