// SPDX-License-Identifier: Apache-2.0
// A fixed, portable pseudo-random generator: xoshiro256** seeded through splitmix64, normals by
// Box-Muller. Unlike std::normal_distribution (whose algorithm is implementation-defined), these
// produce the same stream on every platform, so a synthetic trace is a pure function of its seed.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace kvcli {

// splitmix64 (Steele, Lea, Flood 2014): one step of the mixing function.
inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A 64-bit key derived from a seed and a path of integers (layer, head, purpose, ...): independent
// streams for independent parts, so the result does not depend on the order or thread of work.
inline uint64_t derive_seed(uint64_t seed, std::initializer_list<uint64_t> path) {
  uint64_t state = seed;
  uint64_t key = splitmix64(state);
  for (uint64_t p : path) {
    state = key ^ (p + 0x632be59bd9b4e019ull);
    key = splitmix64(state);
  }
  return key;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) {
    uint64_t st = seed;
    for (auto& w : s_) w = splitmix64(st);
  }

  // xoshiro256** 1.0 (Blackman, Vigna 2018).
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Uniform integer in [0, n) (n >= 1): the high 64 bits of next() * n (Lemire's multiply, without
  // the rejection step; the bias is below n / 2^64).
  uint64_t below(uint64_t n) { return mulhi(next(), n); }
  // Standard normal by Box-Muller; the second value of each pair is kept for the next call.
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    const double u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double a = 6.283185307179586476925 * u2;
    spare_ = r * std::sin(a);
    has_spare_ = true;
    return r * std::cos(a);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  // High half of the 128-bit product, in portable 32-bit pieces.
  static uint64_t mulhi(uint64_t a, uint64_t b) {
    const uint64_t a_lo = a & 0xffffffffu, a_hi = a >> 32, b_lo = b & 0xffffffffu, b_hi = b >> 32;
    const uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo, lo_hi = a_lo * b_hi, hi_hi = a_hi * b_hi;
    const uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xffffffffu) + lo_hi;
    return hi_hi + (hi_lo >> 32) + (cross >> 32);
  }
  uint64_t s_[4];
  double spare_ = 0.0;
  bool has_spare_ = false;
};

}  // namespace kvcli
