// SPDX-License-Identifier: Apache-2.0
// HGCA (Hybrid GPU-CPU Attention; arXiv 2507.03153, docs/methods/hgca.md): the two placements of the paper
// as two components behind explicit interfaces, merged by LSE.
//  - NearWindow: the "GPU" part. A circular buffer of blk_num blocks of blk_size entries holding the
//    most recent tokens' K/V and a moving average of attention weights (MAW) per entry and query
//    head; dense attention over it (Alg. 1 lines 2-13, Alg. 2 line 10). CpuNearWindow implements it
//    on the host (on the hybrid backend too: a GPU window would implement the same interface).
//  - FarStore: the "CPU" part. Every evicted entry with its MAW (KV_cpu: the evicted prefix of the
//    layer's host KV store), and per KV head the salient subset KV_ctx (positions, scores,
//    re-normalised weights; with cap=none the K/V rows copied contiguously per head), selected by MAW > beta / W
//    (Alg. 1 lines 23-25), re-evaluated on append (lines 19-22); sparse attention split over
//    threads in tasks of adjacent heads padded to equal length (§3.3).
// The session sees a Selection that only reports the keys attended (window + far salient + padding),
// and the merged state through extra().
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/kv_store.hpp"
#include "core/method.hpp"
#include "core/scratch.hpp"

namespace kvs::hgca {

enum class GqaAgg { Max, Mean };

struct Params {
  double beta = 1.0;         // salience factor: keep an entry iff its weight > beta / size
  int64_t window = 0;        // window tokens W (rounded up to blocks); 0: window_ratio or the budget
  double window_ratio = 0;   // W = ceil(ratio * prompt tokens); 0: the session budget
  int64_t block_size = 64;   // blk_size [the paper does not say; our choice]
  double alpha = 0.1;        // MAW factor [the paper does not say; our choice]
  float maw_init = 0.f;      // MAW of a newly inserted token [the paper does not say; our choice]
  GqaAgg gqa = GqaAgg::Max;  // MAW aggregation over a GQA group [reconstructed: the paper does not say]
  int64_t score_queries = 64;  // r: last queries scoring prompt/append tokens [reconstructed: the paper does not say]; 0 = all
  bool prompt_maw_queries = true;  // prompt/appended tokens' MAW from the r queries [reconstructed: the paper does not say], else maw_init
  bool reeval_on_append = true;    // re-evaluate every far entry on append (Alg. 1 lines 19-22)
  bool free_slot = true;     // Alg. 1 as printed: evict when size+m >= l_max (one slot kept free)
  bool pad = true;           // pad heads of a task to equal length with sub-threshold entries (§3.3)
  int64_t heads_per_task = 0;  // adjacent KV heads per far task; 0 = ceil(Hkv / threads) (fn. 4)
  // cap=budget (not in the paper; docs/methods/hgca.md, "Budget"): the window takes window_share of
  // the budget (unless window / window_ratio size it) and each step's far set is the budget's rest:
  // the far entries ranked by salience (score x the size it is judged against), best first.
  bool cap = true;
  double window_share = 0.25;  // chosen on the validation suite's tuning half (docs/methods/hgca.md)
  // widen=recent (cap=budget only; docs/methods/hgca.md, "When the past does not predict the
  // query"): each step the far set is the best by exact score of a pool of the MAW ranking's far
  // set plus streaming's sinks and recent keys; false: the MAW ranking alone.
  bool widen = true;
};

// Alg. 1 lines 10-11 with the sign typo fixed: entries (of `resident` + `incoming`, oldest first)
// to evict, a multiple of blk_size; 0 when nothing has to go.
int64_t evict_count(int64_t resident, int64_t incoming, int64_t l_max, int64_t blk, bool free_slot);

// The near part. Tokens [begin, end) are resident; token t lives in slot t mod capacity (blocks are
// aligned to token multiples of blk_size, so the slots of a block are contiguous).
class NearWindow {
 public:
  virtual ~NearWindow() = default;
  virtual std::unique_ptr<NearWindow> clone() const = 0;
  virtual int64_t capacity() const = 0;  // l_max = blk_num * blk_size slots
  virtual int64_t begin() const = 0;
  virtual int64_t end() const = 0;
  int64_t size() const { return end() - begin(); }
  // Removes the oldest `count` resident tokens; their MAW goes to maw_out [count][Hq].
  virtual void evict(int64_t count, float* maw_out) = 0;
  // Tokens [end(), end() + count) go straight to the far part (an insertion larger than the
  // window): the empty window moves past them.
  virtual void skip(int64_t count) = 0;
  // Appends tokens [end(), end() + m) from the layer's store, each with MAW maw [m][Hq].
  virtual void insert(const KVLayer& kv, int64_t m, const float* maw) = 0;
  // Dense attention of q [Hq][d] over the resident entries: o [Hq][d], lse [Hq]. With update, MAW
  // <- (1 - alpha) MAW + alpha A for every resident token < no_update_from (A: window softmax).
  // In steps, so that the caller runs the window's KV heads among its other tasks: attend_head for
  // every KV head h (any order, any thread; it writes that head's rows of o and lse), then
  // attend_done.
  virtual void attend_head(const float* q, int h, float* o, float* lse, bool update, int64_t no_update_from) = 0;
  virtual void attend_done(bool update) = 0;
  // MAW of resident token t: out [Hq].
  virtual void maw(int64_t t, float* out) const = 0;
  virtual void set_maw(int64_t t, const float* in) = 0;
  // One-step undo: checkpoint() before a decode step, rollback() restores it.
  virtual void checkpoint() = 0;
  virtual void rollback() = 0;
  virtual uint64_t bytes() const = 0;
};

class CpuNearWindow final : public NearWindow {
 public:
  CpuNearWindow(const ModelShape& shape, int64_t capacity, int64_t first_token, double alpha);
  std::unique_ptr<NearWindow> clone() const override { return std::make_unique<CpuNearWindow>(*this); }
  int64_t capacity() const override { return cap_; }
  int64_t begin() const override { return b_; }
  int64_t end() const override { return e_; }
  void evict(int64_t count, float* maw_out) override;
  void insert(const KVLayer& kv, int64_t m, const float* maw) override;
  void skip(int64_t count) override;
  void attend_head(const float* q, int h, float* o, float* lse, bool update, int64_t no_update_from) override;
  void attend_done(bool update) override;
  void maw(int64_t t, float* out) const override;
  void set_maw(int64_t t, const float* in) override;
  void checkpoint() override;
  void rollback() override;
  uint64_t bytes() const override;

 private:
  std::byte* krow(int h, int64_t slot) { return k_.data() + (size_t(h) * alloc_ + size_t(slot)) * row_; }
  std::byte* vrow(int h, int64_t slot) { return v_.data() + (size_t(h) * alloc_ + size_t(slot)) * row_; }
  float* mawp(int buf, int hq) { return maw_[buf].data() + size_t(hq) * alloc_; }
  // Storage for at least `need` resident tokens (at most cap_): the slots grow with the tokens the
  // window holds, so a window larger than the context costs only what it holds.
  void grow(int64_t need);

  ModelShape shape_;
  int64_t cap_, b_, e_;
  int64_t alloc_ = 0;                // slots allocated (<= cap_); token t lives in slot t % alloc_
  double alpha_;
  size_t row_;                       // bytes of one K or V row
  std::vector<std::byte> k_, v_;     // [Hkv][alloc][d] storage dtype
  std::vector<float> maw_[2];        // [Hq][alloc], double-buffered (the update writes the other one)
  int cur_ = 0;
  // Undo of one step.
  struct Saved { int64_t slot; std::vector<std::byte> k, v; std::vector<float> maw; };
  bool armed_ = false;
  int64_t ck_b_ = 0, ck_e_ = 0;
  int ck_cur_ = 0;
  std::vector<Saved> saved_;
};

// The far part of one layer.
class FarStore {
 public:
  FarStore() = default;
  FarStore(const ModelShape& shape, const Params& p);

  int64_t tokens() const { return n_; }  // evicted prefix [0, n)
  const std::vector<float>& maw() const { return maw_; }  // [n][Hq]
  struct Head {
    std::vector<int32_t> pos;      // salient positions (ascending after a re-evaluation)
    std::vector<float> score;      // the aggregated weight each was judged by
    std::vector<float> weight;     // score re-normalised to sum to 1 over the head's set
    std::vector<std::byte> k, v;   // [L][d] storage dtype, contiguous (cap=none only: cap=budget reads the store)
    std::vector<int32_t> pad;      // padding positions (sub-threshold, highest score first)
    std::vector<uint8_t> in_ctx;   // [n] membership
  };
  const std::vector<Head>& heads() const { return heads_; }

  // Takes the evicted tokens [n, n + count) with their MAW [count][Hq]; with test, tests them
  // against beta / w_size and appends the salient ones per head (without: a re-evaluation follows).
  void add_evicted(const KVLayer& kv, int64_t count, const float* maw, int64_t w_size, ThreadPool& pool,
                   bool test = true);
  // Re-evaluation (Alg. 1 lines 19-22): a [n][Hq] weights of every far entry; replaces the MAW
  // and rebuilds every head's set with the threshold beta / n.
  void reevaluate(const KVLayer& kv, const float* a);
  // Pads the heads of each task of `heads_per_task` adjacent heads to the task's longest set.
  void repad(const KVLayer& kv, int heads_per_task);
  // Sparse attention of q [Hq][d] over each head's far keys (capped: ranked(); else its set +
  // padding) into o [Hq][d], lse [Hq], in steps so that the caller runs its tasks among other work:
  // attend_plan returns the number of tasks, attend_task(i) runs task i (any order, any thread),
  // attend_merge writes o and lse.
  int64_t attend_plan(int heads_per_task);
  void attend_task(const KVLayer& kv, const float* q, int64_t task);
  void attend_merge(float* o, float* lse) const;
  // Copies the K/V rows of every head's set from kv (after a load).
  void materialise(const KVLayer& kv);
  void restore_head(int h, std::vector<int32_t> pos, std::vector<float> score, std::vector<int32_t> pad);
  void set_far(int64_t n, std::vector<float> maw);

  // cap=budget: each head attends the `far_keys` far entries of highest salience ratio
  // (agg MAW x the size it is judged against: the far count of the last re-evaluation for the
  // entries it covered, w_size for the ones evicted since; salient entries have a ratio > beta),
  // instead of its salient set + padding. limit(-1) returns to the uncapped sets.
  void limit(int64_t far_keys, int64_t w_size, ThreadPool& pool);
  int64_t limited() const { return limit_; }
  // widen=recent, after limit(): this step's far set of each head becomes the limit() entries of
  // highest exact attention weight among a pool = the first 2 x limit() entries of the MAW ranking
  // (at most its cached prefix, about 1.5 limit() + 64), the
  // far entries [0, sinks) and the most recent `recent` far entries [n - recent, n) (streaming's
  // far keys). The weight of key i is sum_g exp(scale q_g.k_i - Z_g), Z_g the log-sum-exp of head
  // g over the pool and the window (win_lse [Hq]). A query the MAW does not predict gets the
  // recent keys, the sinks or lower-ranked far entries instead of the wrong ones. Cost: the pool's
  // keys are scored (at most 2 limit() + sinks + recent K rows per head), the chosen limit() attended
  // from those scores. In steps, so that the caller scores the pool beside other work (the window):
  // widen_plan returns the number of scoring tasks, widen_score(i) runs task i (any order, any
  // thread), and widen_choose chooses once every task has run and win_lse is known.
  int64_t widen_plan(int64_t sinks, int64_t recent);
  void widen_score(const KVLayer& kv, const float* q, int64_t task);
  void widen_choose(const float* win_lse, ThreadPool& pool);
  // The far keys head h attends under a limit (the first limit() entries of its ranking, or the
  // widened set).
  const int32_t* ranked(int h) const { return widened_ ? chosen_[size_t(h)].data() : ranked_[size_t(h)].data(); }
  int64_t ranked_keys(int h) const {
    return widened_ ? int64_t(chosen_[size_t(h)].size()) : std::min(limit_, rank_len_);
  }
  // Far keys of head h that this step's widening chose in place of the MAW ranking's first limit().
  int64_t widened_keys(int h) const { return widened_ ? swapped_[size_t(h)] : 0; }
  int64_t reeval_tokens() const { return reeval_n_; }
  int64_t ranked_prefix() const { return rank_len_; }  // the ranking's prefix a step sees (widen's pool takes up to 2 limit() of it)
  void set_reeval_tokens(int64_t n) { reeval_n_ = n; rank_dirty_ = true; }

  // One-step undo (decode): checkpoint() then rollback().
  void checkpoint();
  void rollback();
  uint64_t bytes() const;
  int64_t padded_keys(int h) const { return int64_t(heads_[size_t(h)].pad.size()); }

 private:
  float agg(const float* w) const;  // over the G query heads of one KV head
  void renormalise(Head& hd);
  void push(const KVLayer& kv, Head& hd, int h, int32_t t, float score);

  ModelShape shape_{};
  Params p_{};
  size_t row_ = 0;
  int64_t n_ = 0;
  std::vector<float> maw_;
  std::vector<Head> heads_;
  // Undo of one step.
  int64_t ck_n_ = 0;
  std::vector<size_t> ck_len_;
  std::vector<std::vector<int32_t>> ck_pad_;
  bool armed_pad_ = false, pad_saved_ = false;
  // cap=budget.
  int64_t reeval_n_ = 0;    // far entries the last re-evaluation judged (their MAW is far-normalised)
  int64_t limit_ = -1;      // far keys per head this step; -1: no cap
  bool rank_dirty_ = true;  // entries ranked_ was built from changed (beyond new evictions)
  int64_t rank_w_ = 0;
  int64_t rank_n_ = 0;      // far entries when ranked_ was built (newer ones are merged in by limit)
  int64_t rank_len_ = 0;    // the prefix of ranked_ a step sees
  std::vector<std::vector<int32_t>> ranked_;  // per head: best far entries first (an exact prefix of the ranking, >= rank_len_)
  std::vector<std::vector<uint64_t>> rank_keys_;  // per head: the ranking keys of ranked_
  bool widened_ = false;                      // this step's far sets are chosen_ (widen)
  std::vector<std::vector<int32_t>> chosen_;  // per head: this step's widened far set (in pool order)
  std::vector<std::vector<int64_t>> chosen_at_;  // per head: each chosen key's index into its scores (score_)
  std::vector<int64_t> swapped_;              // per head: keys of chosen_ outside the MAW prefix
  int32_t pool_pos(int h, int64_t i) const;    // the i-th entry of head h's widen pool, repeats included
  bool pool_repeat(int h, int64_t i) const;     // a MAW candidate that is also a sink or a recent key
  int widen_head(int64_t task, int64_t& b, int64_t& e) const;  // a scoring task's head and pool entries [b, e)
  static constexpr int64_t kWidenChunk = 2048;  // widen's rows per scoring task
  static constexpr int64_t kFarChunk = 1024;    // far keys per attention task
  struct WidenPlan {
    int64_t tasks = 0, sinks = 0, rb = 0;
    std::vector<int64_t> P, M, first;  // per head: MAW candidates, pool size; first task of each head
    std::vector<float> tmax;           // [task][G] maximum score of the task's entries
    std::vector<double> tsum;          // [task][G] sum of exp(score - tmax) over them
    std::vector<float> zmax, zinv;     // [Hkv][G] the normaliser: max and 1 / sum (pool and window)
    std::vector<std::vector<float>> w;  // per head: each pool entry's weight (-1: a repeat)
  };
  struct FarPlan {
    int hpt = 1, chunks = 1;
    bool scored = false;
    std::vector<int64_t> len;
    std::vector<std::pair<int, int>> items;  // (task of adjacent heads, chunk)
    std::vector<float> part_o, part_lse;
  };
  Scratch<WidenPlan> wp_;
  Scratch<FarPlan> fa_;
  Scratch<std::vector<std::vector<float>>> score_;  // per head: widen's pool scores [G][pool]
};

// Mean over queries of the causal softmax over keys [a, b) of KV head h: out [b - a][G]. queries:
// r rows [r][Hq][d] at positions qpos; a query sees keys <= its position; queries that see none are
// left out of the mean. Used by the reconstructed prompt scoring and the append re-evaluation.
void mean_attention(const KVLayer& kv, int h, int64_t a, int64_t b, const float* queries, const int64_t* qpos,
                    int64_t r, const ModelShape& shape, int32_t gemm, float* out);

// White-box access for tests: the components of an hgca method's layer (nullptr when the method
// is not hgca or the layer has no built, materialised state).
const NearWindow* window_of(const Method& m, uint32_t layer);
const FarStore* far_of(const Method& m, uint32_t layer);

}  // namespace kvs::hgca
