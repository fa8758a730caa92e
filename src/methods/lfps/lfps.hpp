// SPDX-License-Identifier: Apache-2.0
// lfps: Learn From the Past for Sparse Indexing (arXiv 2506.15704; docs/methods/lfps.md). The class is
// declared here (not in an anonymous namespace) so the unit tests can read the tables, their
// incremental moments and the last update, and check them against brute-force recomputations.
#pragma once
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/method.hpp"
#include "core/scratch.hpp"

namespace kvs::lfps {

// One score table (vertical or slash) of one owner (a query head, or a KV head in per_kv_head
// mode). Lazy decay (docs/methods/lfps.md): the true value of entry i is scale * x[i], where scale is
// the owner's global scale g (shared by its two tables). s[p] = sum_i x[i]^(p+1), p = 0..3, over
// the stored floats, kept incrementally (so mean, std and kurtosis cost O(1) per step).
struct Table {
  std::vector<float> x;
  double s[4] = {0, 0, 0, 0};
  void push_zero() { x.push_back(0.f); }
  void pop_to(size_t m);
  void set(size_t i, float v);  // updates the power sums
  // Adds to s[0..3] what replacing the value a by b changes in the power sums.
  static void add_change(double* s, double a, double b);
  void recompute();             // power sums from scratch (O(m))
};

// Summary statistics of a table in true (scaled) units and the eq. (8) threshold.
struct TableStats {
  int64_t count = 0;
  double mean = 0, stddev = 0, kurtosis = 0, tau = 0;
};

struct Params {
  double gamma = 0.95;         // eq. (10) decay
  double alpha = 0.2;          // eq. (8) threshold coefficient
  double alpha_scale = 600.0;   // calibration factor multiplying alpha (docs/methods/lfps.md)
  double theta = 0.85;         // eq. (6) bypass threshold
  bool bypass = true;          // the sink-value bypass of highly sparse heads
  int64_t sinks = 4;           // n_s
  int64_t last_q = 64;         // T, rows of the prompt attention that seed the tables (eq. 4)
  bool init_decayed = true;    // eq. (4) weights gamma^tau (true) or uniform (false)
  double init_mass = 0;        // target sum of each initial table; 0 = 0.5 / (1 - gamma)
  int64_t local_est = 5;       // W_loc of the sparsity estimate (App. B.1)
  bool combine_sum = false;    // eq. (6): max(A_glob, A_loc) (false) or A_glob + A_loc (true)
  std::vector<int> offsets = {-1, 0, 1, 2};  // eq. (9) expansion
  int64_t local_window = 0;    // forced recent keys (not in the paper: a safety option)
  int64_t min_keys = 0;        // floor of the retrieval budget k in keys
  bool per_kv_head = false;    // GQA: tables per KV head, a_t summed over the group
  bool update_priors = false;  // keep K-bar, V-bar as running means over appended tokens
  bool empty_fallback = true;  // thresholds fall back to the means when nothing passes them
  bool diagnostics = false;    // measure the overlap with exact top-k (costs a full scan)
  bool kv_cap = true;          // kv_budget=cap: a KV head attends at most the budget (sinks included)
  bool fill_recent = true;     // fill=recent: too few candidates are completed with recent keys
  // widen=recent (with kv_budget=cap, fill=recent; docs/methods/lfps.md): the most recent keys
  // outside the forced window, as many as the step chooses, join the candidates every step, so the
  // exact top-k chooses between the tables' prediction and streaming's recent keys.
  bool widen = true;
};

class Lfps final : public Method {
 public:
  Lfps(const MethodContext& ctx, const Params& p);

  void on_prefill(uint32_t layer, const float* q, int64_t n, const KVLayer& kv) override;
  void build_index(uint32_t layer, const KVLayer& kv) override;
  void on_append(uint32_t layer, const float* q, int64_t n, const KVLayer& kv, bool decode) override;
  void truncate(uint32_t layer, int64_t n) override;
  void select(uint32_t layer, const float* q, const KVLayer& kv, Selection& out) override;
  bool extra(uint32_t layer, const float* q, const KVLayer& kv, float* o, float* lse) override;
  // The sinks (every list starts with them; the hybrid placement attends them on the GPU, as the
  // paper keeps them there).
  StaticKeys static_keys(uint32_t layer, int64_t n) const override;
  StaticKeys static_capacity() const override { return StaticKeys{p_.sinks, 0}; }

  nlohmann::json save_meta() const override;
  void save(io::TablesWriter& w) const override;
  void load(const io::TablesFile& f, const nlohmann::json& meta) override;
  std::unique_ptr<Method> clone() const override { return std::make_unique<Lfps>(*this); }
  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    const auto& L = layers_[layer];
    if (!L.built || L.tokens == tokens) return true;
    *why = "its lfps tables cover " + std::to_string(L.tokens) + " tokens";
    return false;
  }
  uint64_t index_bytes() const override;
  bool stat(std::string_view name, double* out) const override;

  // ---- inspection (tests, meta) ----
  int owners() const { return owners_; }
  // True values scale * x of table `which` (0 vertical, indexed j - sinks; 1 slash, indexed by
  // offset t - j with t the newest token) of an owner.
  std::vector<double> table(uint32_t layer, int owner, int which) const;
  // Mean, std, kurtosis and threshold from the incremental power sums.
  TableStats table_stats(uint32_t layer, int owner, int which) const;
  // The same from the given values (brute force, float64).
  TableStats brute_stats(const std::vector<double>& values) const;
  // The (token, a-tilde) pairs added by the last decode step of an owner (empty if none).
  const std::vector<std::pair<int32_t, float>>& last_update(uint32_t layer, int owner) const {
    return layers_[layer].heads[size_t(owner)].last_upd;
  }
  // The candidates (eqs. 7-9) of an owner's last decode step, ascending (empty in a copy of the
  // method made since: they are per-step scratch).
  std::vector<int32_t> last_candidates(uint32_t layer, int owner) const;
  bool last_bypassed(uint32_t layer, int q_head) const { return layers_[layer].bypass[size_t(q_head)] != 0; }
  // K-bar, V-bar of a KV head, rho of a query head.
  std::vector<double> mean_key(uint32_t layer, int kv_head) const;
  std::vector<double> mean_value(uint32_t layer, int kv_head) const;
  double rho(uint32_t layer, int q_head) const { return layers_[layer].rho[size_t(q_head)]; }
  double scale(uint32_t layer, int owner) const { return layers_[layer].heads[size_t(owner)].g; }
  // Below this global scale the tables are renormalised (x *= g, g = 1): every ~270 steps at 0.95.
  static constexpr double kRescaleBelow = 1e-6;

 private:
  int64_t total_keys(int64_t n) const;  // the keys a list may hold at a layer of n tokens (sinks included)
  struct Undo {
    int8_t which;
    int32_t idx;
    float old;
  };
  struct Head {
    Table t[2];  // vertical, slash
    double g = 1.0;
    std::vector<Undo> undo;  // writes of the last decode step
    double undo_g = 1.0;
    bool undo_rescaled = false;
    std::vector<float> undo_x[2];  // whole tables before a rescale in the last step
    std::vector<std::pair<int32_t, float>> last_upd;
    // this step (scratch): the query heads served that are not bypassed (0..G-1 in per_kv_head
    // mode), and the candidates as a bitmask over tokens [0, n)
    Scratch<std::vector<int>> active;
    Scratch<std::vector<uint64_t>> cand;
    // statistics of this owner (summed into the method's on demand)
    double cand_frac_sum = 0, overlap_sum = 0, retrieved_sum = 0;
    int64_t cand_n = 0, overlap_n = 0, fallback_n = 0;
  };
  struct Layer {
    bool built = false;
    bool awaiting_kv = false;  // loaded from tables without KV: prompt chunks come again
    int64_t tokens = 0;        // tokens the tables cover
    std::vector<Head> heads;   // owners_
    // priors
    std::vector<double> ksum, vsum;  // [Hkv][d]
    int64_t prior_count = 0;
    // the last append's contribution to the running priors (update_priors), for a rollback
    std::vector<double> prior_dk, prior_dv;
    int64_t prior_dn = 0, prior_from = -1;
    std::vector<double> rho;          // [Hq]
    // prompt tail: last T query rows [rows][Hq][d] of positions tail_first..
    std::vector<float> tail;
    int64_t tail_first = 0;
    // this step
    std::vector<uint8_t> bypass;     // [Hq]
    std::vector<float> bypass_lse;   // [Hq]
    int64_t undo_tokens = -1;        // token count after the decode step the undo logs belong to
    int64_t bypass_heads = 0, head_steps = 0;  // totals over decode steps
  };

  void check_built(uint32_t layer, const char* fn) const;
  void add_zero_entries(Layer& L, int64_t n_new);
  void add_priors(Layer& L, const KVLayer& kv, int64_t from, int64_t to);
  bool prepare_owner(uint32_t layer, int u, const float* q, const KVLayer& kv, int64_t ns_sel, Selection& out);
  // One set of keys of a step: a KV head's under kv_budget=cap with query-head tables, else an owner's.
  struct KeySet {
    int h = 0;                      // its KV head
    std::vector<int> owners;        // the owners choosing it
    std::vector<int> qheads;        // their active query heads
    std::vector<int32_t> rest;      // the keys step C ranks (ascending)
    std::vector<float> score, w;    // [qheads][rest]: scores; exp(score - its chunk's maximum)
    std::vector<float> cmax;        // [chunk][qheads] the chunk's maximum score
    std::vector<double> csum;       // [chunk][qheads] sum of its w
    std::vector<int32_t> sel;       // the chosen keys (ascending)
    std::vector<float> ssel;        // [qheads][sel] their scores
    int64_t chunks = 0, first_task = 0;
  };
  static constexpr int64_t kScoreChunk = 4096;  // keys per scoring task
  void plan_set(const Layer& L, KeySet& S, int64_t n, int64_t lw, int64_t want) const;
  void gather_queries(const float* q, const std::vector<int>& qheads, std::vector<float>& qa) const;
  void score_chunk(const float* q, const KVLayer& kv, KeySet& S, int64_t c) const;
  void choose_keys(const float* q, const KVLayer& kv, KeySet& S, int64_t want, int64_t lw) const;
  void finish_owner(uint32_t layer, int u, const float* q, const KVLayer& kv, const std::vector<int>& qheads,
                    const std::vector<int32_t>& sel, const float* ssel, size_t ks, int64_t ns_sel, Selection& out);
  TableStats stats_of(const Table& t, double g) const;
  double threshold_from(const TableStats& s) const;
  void apply_undo(Layer& L);

  MethodContext ctx_;
  Params p_;
  int owners_;
  std::vector<Layer> layers_;
  Scratch<std::vector<KeySet>> sets_;  // this step's sets of keys (select runs one layer at a time)
};

Params parse_params(const ParamSet& ps);

}  // namespace kvs::lfps
