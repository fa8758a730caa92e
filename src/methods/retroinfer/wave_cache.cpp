// SPDX-License-Identifier: Apache-2.0
#include "methods/retroinfer/wave_cache.hpp"

#include <algorithm>
#include <utility>

namespace kvs::retro {

void WaveCache::reset(int32_t blocks, int32_t block_rows, int32_t clusters) {
  rows_ = block_rows;
  head_.assign(size_t(clusters), -1);
  prev_.assign(size_t(clusters), -1);
  next_.assign(size_t(clusters), -1);
  stamp_.assign(size_t(clusters), -1);
  link_.assign(size_t(blocks), -1);
  owner_.assign(size_t(blocks), -1);
  free_.clear();
  for (int32_t b = blocks; b-- > 0;) free_.push_back(b);  // block 0 taken first
  first_ = last_ = -1;
  step_ = 0;
}

void WaveCache::grow(int32_t clusters) {
  if (clusters <= int32_t(head_.size())) return;
  head_.resize(size_t(clusters), -1);
  prev_.resize(size_t(clusters), -1);
  next_.resize(size_t(clusters), -1);
  stamp_.resize(size_t(clusters), -1);
}

void WaveCache::unlink(int32_t c) {
  (prev_[size_t(c)] >= 0 ? next_[size_t(prev_[size_t(c)])] : first_) = next_[size_t(c)];
  (next_[size_t(c)] >= 0 ? prev_[size_t(next_[size_t(c)])] : last_) = prev_[size_t(c)];
  prev_[size_t(c)] = next_[size_t(c)] = -1;
}

void WaveCache::push_front(int32_t c) {
  prev_[size_t(c)] = -1;
  next_[size_t(c)] = first_;
  (first_ >= 0 ? prev_[size_t(first_)] : last_) = c;
  first_ = c;
}

WaveCache::Step WaveCache::step(const int32_t* ids, int32_t n, const int32_t* start, const int32_t* size,
                                std::vector<WaveMoveRec>& moves, std::vector<int32_t>& missed) {
  Step r;
  ++step_;
  const int32_t C = clusters();
  const size_t miss0 = missed.size();
  for (int32_t k = 0; k < n; ++k) {
    const int32_t c = ids[k];
    if (c < 0 || c >= C || stamp_[size_t(c)] == step_) continue;  // out of range, or listed twice
    stamp_[size_t(c)] = step_;
    if (head_[size_t(c)] >= 0) {
      r.hit_rows += size[c];
      unlink(c);
      push_front(c);
    } else {
      r.miss_rows += size[c];
      missed.push_back(c);
    }
  }
  for (size_t i = miss0; i < missed.size(); ++i) {
    const int32_t c = missed[i], sz = size[c], nb = (sz + rows_ - 1) / rows_;
    if (sz <= 0 || nb > blocks()) continue;
    while (int32_t(free_.size()) < nb) {
      const int32_t t = last_;
      if (t < 0 || stamp_[size_t(t)] == step_) break;  // every cached cluster was read by this step
      unlink(t);
      for (int32_t b = head_[size_t(t)], k = 0; b >= 0; ++k) {
        moves.push_back({start[t] + k * rows_, std::min(rows_, size[t] - k * rows_), -1});
        owner_[size_t(b)] = -1;
        free_.push_back(b);
        b = std::exchange(link_[size_t(b)], -1);
      }
      head_[size_t(t)] = -1;
    }
    if (int32_t(free_.size()) < nb) break;
    for (int32_t k = 0, prev = -1; k < nb; ++k) {
      const int32_t b = free_.back();
      free_.pop_back();
      (prev >= 0 ? link_[size_t(prev)] : head_[size_t(c)]) = b;
      prev = b;
      owner_[size_t(b)] = start[c] + k * rows_;
      moves.push_back({start[c] + k * rows_, std::min(rows_, sz - k * rows_), b});
    }
    push_front(c);
  }
  return r;
}

}  // namespace kvs::retro
