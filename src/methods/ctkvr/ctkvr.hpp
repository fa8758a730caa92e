// SPDX-License-Identifier: Apache-2.0
// ctkvr: CTkvr's query-centroid inverted file (qcIVF), declared here so the tests can inspect the
// FIFO of centroids. The algorithm is described in ctkvr.cpp and docs/methods/ctkvr.md.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvs::ctkvr {

// One posting-list entry: the key's aggregated score for the centroid (see Agg) and its token.
struct Entry {
  float s;
  int32_t i;
};

// How a group's G per-head scores of one key combine into one score (reconstructed: the paper does not say; docs/methods/ctkvr.md).
enum class Agg { SumSoftmax, MaxSoftmax, SumLogits };

// s: G scaled logits q_g.k; lse: G log-normalisers of the centroid (ignored for SumLogits).
float aggregate(Agg a, const float* s, const float* lse, int G);

// The qcIVF of one (layer, KV head): a FIFO of at most `cap` centroids. Centroid c is the raw
// concatenation of the G query rows of its group at token position pos (G*d floats), its per-head
// log-normalisers lse (G), and a posting list of at most rho entries kept as a min-heap on s (so
// the weakest member is at the front and a better key replaces it in O(log rho)).
class Fifo {
 public:
  Fifo() = default;
  Fifo(int cap, int rho, int G, int d);

  int size() const { return count_; }
  int capacity() const { return cap_; }
  int rho() const { return rho_; }
  // Logical index i: 0 = oldest.
  int phys(int i) const { return (head_ + i) % cap_; }
  const float* cent(int i) const { return cent_.data() + size_t(phys(i)) * gd_; }
  const float* lse(int i) const { return lse_.data() + size_t(phys(i)) * G_; }
  const float* hnorm(int i) const { return hnorm_.data() + size_t(phys(i)) * G_; }
  float cnorm(int i) const { return cnorm_[size_t(phys(i))]; }
  int64_t pos(int i) const { return pos_[size_t(phys(i))]; }
  int list_len(int i) const { return len_[size_t(phys(i))]; }
  const Entry* list(int i) const { return lists_.data() + size_t(phys(i)) * rho_; }
  Entry* list_mut(int i) { return lists_.data() + size_t(phys(i)) * rho_; }
  int& list_len_mut(int i) { return len_[size_t(phys(i))]; }

  // A saved centroid (what push_back evicts; used to undo a step).
  struct Item {
    int64_t pos;
    std::vector<float> cent, lse;
    std::vector<Entry> list;
  };
  // Appends a centroid (list: any order, at most rho entries; heapified here). When full, the
  // oldest is removed first and returned through *popped (if given).
  void push_back(int64_t pos, const float* cent, const float* lse, const Entry* list, int len, Item* popped);
  // Undo helpers: remove the newest; re-insert an item as the oldest.
  void pop_back();
  void push_front(const Item& it);
  Item item(int i) const;

  // Try-insert key t with score s into centroid i's list (docs/methods/ctkvr.md, insertion (a)).
  void offer(int i, float s, int32_t t);
  // Drops every list entry with token >= n (rebuilds the heaps).
  void forget_tokens_from(int64_t n);

  uint64_t bytes() const;

 private:
  void refresh_min(int p);
  void set(int p, int64_t pos, const float* cent, const float* lse, const Entry* list, int len);

  void grow(int slots);

  int cap_ = 0, rho_ = 0, G_ = 0, d_ = 0, gd_ = 0;
  int alloc_ = 0;  // slots allocated (<= cap_), grown as centroids arrive
  int head_ = 0, count_ = 0;
  std::vector<float> cent_, lse_, hnorm_, cnorm_, min_;  // min_: a full list's weakest score, else -inf
  std::vector<int64_t> pos_;
  std::vector<int32_t> len_;
  std::vector<Entry> lists_;
};

}  // namespace kvs::ctkvr

namespace kvs {
class Method;
// The FIFO of (layer, kv head) of a ctkvr method instance (nullptr if m is not ctkvr).
const ctkvr::Fifo* ctkvr_fifo(const Method& m, uint32_t layer, int kv_head);
}  // namespace kvs
