// SPDX-License-Identifier: Apache-2.0
// quest_page_scores (the CPU page scoring, AVX-512 / AVX2 where the machine has them) against the
// scalar composition it replaces, bit for bit: the sum over a group's heads of quest_upper_bound
// per page, on random bounds and queries with signed zeros, ties between the two products, large
// and tiny magnitudes, head dims with and without a 16-element tail and groups past one pass (8
// heads); and the bound itself against float64 (it must not fall below any key of its page).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "methods/quest/quest.hpp"
#include "reference.hpp"

using namespace kvt;

TEST_CASE("quest_page_scores equals the scalar bound summed over the group, bit for bit") {
  struct Reset {
    ~Reset() { kvs::quest_simd_limit(0); }
  } reset;
  for (int level = 3; level >= 1; --level) {
  REQUIRE(kvs::quest_simd_limit(level));
  if (kvs::quest_simd_level() != level) continue;  // the machine lacks it
  MESSAGE("quest_page_scores at SIMD level " << level);
  Rng rng(5);
  for (int d : {16, 32, 64, 128, 256, 8, 24, 136})
    for (int ng : {1, 2, 3, 4, 8, 9, 16})
      for (int hkv : {1, 3}) {
        const int64_t pages = 37;
        std::vector<float> b = rng.normals(size_t(pages) * hkv * 2 * d), q = rng.normals(size_t(ng) * d);
        // Rows with special values: signed zeros, equal max and min (a tie of the two products),
        // magnitudes far apart.
        for (size_t i = 0; i < b.size(); i += 7) b[i] = (i % 2) ? 0.f : -0.f;
        for (size_t i = 3; i < b.size(); i += 11) b[i] *= 1e6f;
        for (size_t i = 0; i < q.size(); i += 5) q[i] = (i % 3) ? -0.f : q[i] * 1e-6f;
        for (int64_t p = 0; p < pages; ++p)
          for (int h = 0; h < hkv; ++h) {
            float* mx = b.data() + (size_t(p) * hkv + h) * 2 * d;
            for (int i = 0; i < d; ++i) {
              float& lo = mx[d + i];
              if (lo > mx[i]) std::swap(lo, mx[i]);  // max >= min
              if ((p + i) % 13 == 0) lo = mx[i];
            }
          }
        for (int h = 0; h < hkv; ++h) {
          std::vector<float> got(size_t(pages), NAN);
          kvs::quest_page_scores(q.data(), ng, b.data(), pages, hkv, h, d, got.data());
          for (int64_t p = 0; p < pages; ++p) {
            const float* mx = b.data() + (size_t(p) * hkv + h) * 2 * d;
            float want = 0.f;
            for (int g = 0; g < ng; ++g) want += kvs::quest_upper_bound(q.data() + size_t(g) * d, mx, mx + d, d);
            INFO("d " << d << " heads " << ng << " hkv " << hkv << " h " << h << " page " << p);
            REQUIRE(std::memcmp(&got[size_t(p)], &want, sizeof(float)) == 0);
          }
        }
      }
  }
  CHECK_FALSE(kvs::quest_simd_limit(4));
}

TEST_CASE("quest_page_scores16 (bounds in a 16-bit KV dtype) equals quest_page_scores on the decoded bounds, bit for bit") {
  struct Reset {
    ~Reset() { kvs::quest_simd_limit(0); }
  } reset;
  for (int level = 3; level >= 1; --level) {
    REQUIRE(kvs::quest_simd_limit(level));
    if (kvs::quest_simd_level() != level) continue;
    for (kvs::DType t : {kvs::DType::BF16, kvs::DType::F16}) {
      Rng rng(11);
      for (int d : {16, 64, 128, 8, 24})
        for (int ng : {1, 4, 9})
          for (int hkv : {1, 3}) {
            const int64_t pages = 23;
            std::vector<float> f = rng.normals(size_t(pages) * hkv * 2 * d), q = rng.normals(size_t(ng) * d);
            for (size_t i = 0; i < f.size(); i += 7) f[i] = (i % 2) ? 0.f : -0.f;
            for (size_t i = 3; i < f.size(); i += 11) f[i] *= 300.f;
            std::vector<uint16_t> h(f.size());
            for (size_t i = 0; i < f.size(); ++i) {  // the dtype's values (what a KV of it holds)
              h[i] = t == kvs::DType::BF16 ? kvs::f32_to_bf16(f[i]) : kvs::f32_to_f16(f[i]);
              f[i] = t == kvs::DType::BF16 ? kvs::bf16_to_f32(h[i]) : kvs::f16_to_f32(h[i]);
            }
            for (int64_t p = 0; p < pages; ++p)
              for (int hh = 0; hh < hkv; ++hh)
                for (int i = 0; i < d; ++i) {
                  const size_t a = (size_t(p) * hkv + hh) * 2 * d + i, b = a + d;
                  if (f[b] > f[a]) std::swap(f[a], f[b]), std::swap(h[a], h[b]);  // max >= min
                }
            for (int hh = 0; hh < hkv; ++hh) {
              std::vector<float> want(size_t(pages), NAN), got(size_t(pages), NAN);
              kvs::quest_page_scores(q.data(), ng, f.data(), pages, hkv, hh, d, want.data());
              kvs::quest_page_scores16(q.data(), ng, h.data(), t, pages, hkv, hh, d, got.data());
              INFO("level " << level << " dtype " << kvs::dtype_name(t) << " d " << d << " heads " << ng << " hkv " << hkv);
              REQUIRE(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
            }
          }
    }
  }
}

TEST_CASE("quest_page_scores bounds every key of the page (float64)") {
  Rng rng(9);
  const int d = 128, P = 16, pages = 20, G = 4;
  std::vector<float> k = rng.normals(size_t(pages) * P * d), q = rng.normals(size_t(G) * d);
  std::vector<float> b(size_t(pages) * 2 * d);
  for (int p = 0; p < pages; ++p)
    for (int i = 0; i < d; ++i) {
      float mx = -INFINITY, mn = INFINITY;
      for (int t = 0; t < P; ++t) {
        mx = std::max(mx, k[(size_t(p) * P + t) * d + i]);
        mn = std::min(mn, k[(size_t(p) * P + t) * d + i]);
      }
      b[size_t(p) * 2 * d + i] = mx;
      b[size_t(p) * 2 * d + d + i] = mn;
    }
  std::vector<float> s(static_cast<size_t>(pages));
  kvs::quest_page_scores(q.data(), G, b.data(), pages, 1, 0, d, s.data());
  for (int p = 0; p < pages; ++p) {
    double best = -1e300;  // the largest group-summed logit of a key of the page
    for (int t = 0; t < P; ++t) {
      double sum = 0;
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < d; ++i) sum += double(q[size_t(g) * d + i]) * k[(size_t(p) * P + t) * d + i];
      best = std::max(best, sum);
    }
    CHECK(double(s[size_t(p)]) >= best - 1e-4 * (1 + std::fabs(best)));
  }
}
