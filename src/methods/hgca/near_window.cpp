// SPDX-License-Identifier: Apache-2.0
// HGCA's near part on the host: the block circular buffer with MAW (Alg. 1 lines 2-13) and its
// dense attention (Alg. 2 line 10), which also yields the window-normalised weights A_gpu that
// the MAW update needs (docs/methods/hgca.md).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "backends/cpu/attention.hpp"
#include "core/error.hpp"
#include "methods/hgca/hgca.hpp"

namespace kvs::hgca {

int64_t evict_count(int64_t resident, int64_t incoming, int64_t l_max, int64_t blk, bool free_slot) {
  const int64_t l_cur = resident + incoming;
  // Printed: ceil((l_max - l_cur + 1) / blk) * blk, sign reversed (docs/methods/hgca.md).
  const int64_t over = free_slot ? l_cur - l_max + 1 : l_cur - l_max;
  if (over <= 0) return 0;
  return (over + blk - 1) / blk * blk;
}

CpuNearWindow::CpuNearWindow(const ModelShape& shape, int64_t capacity, int64_t first_token, double alpha)
    : shape_(shape), cap_(capacity), b_(first_token), e_(first_token), alpha_(alpha) {
  row_ = size_t(shape.head_dim) * dtype_size(shape.kv_dtype);
}

// Re-lays the resident tokens [b_, e_) out over more slots. Called only while no token resident at
// the last checkpoint has been evicted or overwritten (evict grows to the full capacity before its
// first eviction), so the undo of a step never needs a token the move dropped.
void CpuNearWindow::grow(int64_t need) {
  if (need <= alloc_) return;
  const int64_t na = std::min(cap_, std::max({need, 2 * alloc_, int64_t(64)}));
  const size_t hkv = shape_.num_kv_heads, hq = shape_.num_q_heads;
  std::vector<std::byte> k(hkv * size_t(na) * row_), v(k.size());
  std::vector<float> m[2] = {std::vector<float>(hq * size_t(na)), std::vector<float>(hq * size_t(na))};
  for (int64_t t = b_; t < e_; ++t) {
    const size_t from = size_t(t % alloc_), to = size_t(t % na);
    for (size_t h = 0; h < hkv; ++h) {
      std::memcpy(k.data() + (h * size_t(na) + to) * row_, k_.data() + (h * size_t(alloc_) + from) * row_, row_);
      std::memcpy(v.data() + (h * size_t(na) + to) * row_, v_.data() + (h * size_t(alloc_) + from) * row_, row_);
    }
    for (int b = 0; b < 2; ++b)
      for (size_t h = 0; h < hq; ++h) m[b][h * size_t(na) + to] = maw_[b][h * size_t(alloc_) + from];
  }
  k_ = std::move(k);
  v_ = std::move(v);
  maw_[0] = std::move(m[0]);
  maw_[1] = std::move(m[1]);
  alloc_ = na;
}

void CpuNearWindow::evict(int64_t count, float* maw_out) {
  if (count < 0 || count > size()) fail(KVS_STATUS_INTERNAL, "hgca: window eviction beyond its resident entries");
  if (count > 0) grow(cap_);  // a window that evicts is full: its whole storage from here on
  const int hq = int(shape_.num_q_heads);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t slot = (b_ + i) % alloc_;
    for (int h = 0; h < hq; ++h) maw_out[size_t(i) * hq + h] = mawp(cur_, h)[slot];
  }
  b_ += count;
}

void CpuNearWindow::skip(int64_t count) {
  if (count == 0) return;
  if (size() != 0 || count < 0) fail(KVS_STATUS_INTERNAL, "hgca: window skip with resident entries");
  b_ += count;
  e_ += count;
}

void CpuNearWindow::insert(const KVLayer& kv, int64_t m, const float* maw) {
  if (size() + m > cap_) fail(KVS_STATUS_INTERNAL, "hgca: window insertion beyond its capacity");
  if (e_ + m > kv.size()) fail(KVS_STATUS_INTERNAL, "hgca: window insertion of tokens the layer does not hold");
  grow(size() + m);
  const int hkv = int(shape_.num_kv_heads), hq = int(shape_.num_q_heads);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t t = e_ + i, slot = t % alloc_;
    if (armed_ && t - alloc_ >= ck_b_) {  // overwrites an entry resident at the checkpoint
      Saved s{slot, std::vector<std::byte>(row_ * hkv), std::vector<std::byte>(row_ * hkv), std::vector<float>(size_t(hq))};
      for (int h = 0; h < hkv; ++h) {
        std::memcpy(s.k.data() + h * row_, krow(h, slot), row_);
        std::memcpy(s.v.data() + h * row_, vrow(h, slot), row_);
      }
      for (int h = 0; h < hq; ++h) s.maw[size_t(h)] = mawp(cur_, h)[slot];
      saved_.push_back(std::move(s));
    }
    for (int h = 0; h < hkv; ++h) {
      std::memcpy(krow(h, slot), kv.k_row(h, t), row_);
      std::memcpy(vrow(h, slot), kv.v_row(h, t), row_);
    }
    for (int h = 0; h < hq; ++h) mawp(cur_, h)[slot] = maw[size_t(i) * hq + h];
  }
  e_ += m;
}

void CpuNearWindow::attend_head(const float* q, int h, float* o, float* lse, bool update, int64_t no_update_from) {
  const int G = shape_.group(), d = int(shape_.head_dim);
  const int64_t n = size();
  const int nb = 1 - cur_;
  std::vector<const std::byte*> kr(static_cast<size_t>(n)), vr(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t slot = (b_ + j) % alloc_;
    kr[size_t(j)] = krow(h, slot);
    vr[size_t(j)] = vrow(h, slot);
  }
  // The scores once: the window's softmax A (its LSE from their maximum and sum) gives o through
  // the value pass and, with update, the MAW update (A_gpu: window-normalised weights).
  float* oh = o + size_t(h) * G * d;
  float* lh = lse + size_t(h) * G;
  std::fill(oh, oh + size_t(G) * d, 0.f);
  if (n == 0) {
    std::fill(lh, lh + G, -std::numeric_limits<float>::infinity());
    return;
  }
  std::vector<float> s(size_t(G) * n);
  cpu::score_rows(shape_.kv_dtype, d, G, q + size_t(h) * G * d, shape_.softmax_scale, kr.data(), n, s.data());
  cpu::softmax_rows(s.data(), G, n, n, lh);
  cpu::accumulate_rows(shape_.kv_dtype, d, G, s.data(), n, vr.data(), n, oh);
  if (!update) return;
  const float a = float(alpha_), keep = float(1.0 - alpha_);
  for (int g = 0; g < G; ++g) {
    const float* sg = s.data() + size_t(g) * n;
    const float* src = mawp(cur_, h * G + g);
    float* dst = mawp(nb, h * G + g);
    const int64_t upd = std::clamp<int64_t>(no_update_from - b_, 0, n);  // tokens b_ + j < no_update_from
    int64_t slot = b_ % alloc_;
    for (int64_t j = 0; j < n; ++j, slot = slot + 1 == alloc_ ? 0 : slot + 1)
      dst[slot] = j < upd ? keep * src[slot] + a * sg[j] : src[slot];
  }
}

void CpuNearWindow::attend_done(bool update) {
  if (update) cur_ = 1 - cur_;
}

void CpuNearWindow::maw(int64_t t, float* out) const {
  const int64_t slot = t % alloc_;
  for (uint32_t h = 0; h < shape_.num_q_heads; ++h) out[h] = maw_[cur_][size_t(h) * alloc_ + size_t(slot)];
}

void CpuNearWindow::set_maw(int64_t t, const float* in) {
  const int64_t slot = t % alloc_;
  for (uint32_t h = 0; h < shape_.num_q_heads; ++h) maw_[cur_][size_t(h) * alloc_ + size_t(slot)] = in[h];
}

void CpuNearWindow::checkpoint() {
  armed_ = true;
  ck_b_ = b_;
  ck_e_ = e_;
  ck_cur_ = cur_;
  saved_.clear();
}

void CpuNearWindow::rollback() {
  if (!armed_) return;
  b_ = ck_b_;
  e_ = ck_e_;
  cur_ = ck_cur_;
  const int hkv = int(shape_.num_kv_heads), hq = int(shape_.num_q_heads);
  for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
    for (int h = 0; h < hkv; ++h) {
      std::memcpy(krow(h, it->slot), it->k.data() + h * row_, row_);
      std::memcpy(vrow(h, it->slot), it->v.data() + h * row_, row_);
    }
    for (int h = 0; h < hq; ++h) mawp(cur_, h)[it->slot] = it->maw[size_t(h)];
  }
  saved_.clear();
  armed_ = false;
}

uint64_t CpuNearWindow::bytes() const {
  return uint64_t(k_.size() + v_.size()) + uint64_t(maw_[0].size() + maw_[1].size()) * sizeof(float);
}

}  // namespace kvs::hgca
