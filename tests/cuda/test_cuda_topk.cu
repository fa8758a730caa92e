// SPDX-License-Identifier: Apache-2.0
// Tests of src/backends/cuda/topk.cu (exact_topk's score pass and the radix top-k) against float64
// / std::sort CPU references computed from the same bf16/fp16-rounded inputs.
// Built into kvsieve_cuda_tests (its main lives in test_cuda_attention.cu); exposes
// run_topk_tests(small) -> failures and run_topk_passed(). Prints PASS/FAIL lines.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/topk.cuh"
#include "kernel_test_util.cuh"

using kvs::cuda::Scalar;

namespace {

int g_pass = 0, g_fail = 0;
bool g_small = false;

void report(bool ok, const std::string& name, const std::string& detail) {
  if (ok) ++g_pass;
  else ++g_fail;
  std::printf("%s %s %s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.c_str());
  std::fflush(stdout);
}

// At least 16 bytes, so an empty row set still passes a valid pointer.
template <typename T>
void upload16(DevBuf& d, const std::vector<T>& h) {
  d.alloc(std::max<size_t>(h.size() * sizeof(T), 16));
  if (!h.empty()) KVS_TEST_CK(cudaMemcpy(d.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}


std::mt19937_64 g_rng(20240611);
uint64_t g_x = 0x243f6a8885a308d3ull;
inline uint64_t xrand() {
  g_x ^= g_x >> 12;
  g_x ^= g_x << 25;
  g_x ^= g_x >> 27;
  return g_x * 0x2545f4914f6cdd1dull;
}
inline float urand(float lo, float hi) { return lo + (hi - lo) * float(xrand() >> 40) * (1.f / 16777216.f); }
inline float nrand() {  // approximately normal (sum of uniforms)
  return urand(-1.f, 1.f) + urand(-1.f, 1.f) + urand(-1.f, 1.f);
}

constexpr int32_t kPoison = 0x7f7f7f7f;

// ---- host top-k reference --------------------------------------------------------------------
// The min(k, len) best of v[0..len) by (value desc, NaN last, -0 == +0, index asc), ascending.
std::vector<int> host_topk(const float* v, int len, int k) {
  const int cnt = std::min(k, len);
  std::vector<int> idx(size_t(std::max(len, 0)));
  std::iota(idx.begin(), idx.end(), 0);
  auto better = [&](int a, int b) {
    const float x = v[a], y = v[b];
    const bool nx = std::isnan(x), ny = std::isnan(y);
    if (nx != ny) return ny;
    if (!nx && double(x) != double(y)) return double(x) > double(y);
    return a < b;
  };
  if (cnt < len) std::nth_element(idx.begin(), idx.begin() + cnt, idx.end(), better);
  idx.resize(size_t(cnt));
  std::sort(idx.begin(), idx.end());
  return idx;
}

enum Gen { kRandom, kSoftmax, kTies, kSpecial, kAllEqual, kAllNaN };
const char* gname(Gen g) {
  switch (g) {
    case kRandom: return "random";
    case kSoftmax: return "softmax";
    case kTies: return "ties";
    case kSpecial: return "special";
    case kAllEqual: return "allequal";
    default: return "allnan";
  }
}
float gen_value(Gen g) {
  switch (g) {
    case kRandom: {
      const float m = std::exp(urand(-20.f, 20.f));
      return (xrand() & 1) ? m : -m;
    }
    case kSoftmax: return std::exp(2.f * nrand()) * 1e-5f;
    case kTies: {
      const float v = std::floor(urand(0.f, 8.f)) / 8.f - 0.5f;  // 8 values, 0 among them
      return (v == 0.f && (xrand() & 1)) ? -0.f : v;
    }
    case kSpecial: {
      const uint64_t r = xrand() % 100;
      if (r < 3) return std::numeric_limits<float>::infinity();
      if (r < 6) return std::numeric_limits<float>::quiet_NaN();
      if (r < 8) return -std::numeric_limits<float>::infinity();
      if (r < 10) return (r & 1) ? 0.f : -0.f;
      if (r < 11) return -std::numeric_limits<float>::quiet_NaN();
      return urand(-1.f, 1.f);
    }
    case kAllEqual: return 0.25f;
    default: return std::numeric_limits<float>::quiet_NaN();
  }
}

// One topk_rows call on `rows` rows of lengths lens (max_len, row_stride, offset floats from a
// 256-aligned base), checked exactly against host_topk. row_k (non-empty): each row's own k, read
// on the device (k is then the capacity and the output stride).
void run_rows(const std::string& tag, const std::vector<int>& lens, int max_len, int k,
              int64_t stride, int offset, Gen gen, bool pass_lengths = true, const std::vector<int>& row_k = {}) {
  const int rows = int(lens.size());
  const size_t total = size_t(rows - 1) * size_t(stride) + size_t(max_len) + size_t(offset) + 4;
  std::vector<float> h(total, std::numeric_limits<float>::infinity());  // padding: +inf (must not be read)
  for (int r = 0; r < rows; ++r) {
    const int len = pass_lengths ? lens[r] : max_len;
    float* row = h.data() + offset + size_t(r) * stride;
    for (int t = 0; t < len; ++t) row[t] = gen_value(gen);
  }
  std::vector<int> lclamp(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r) lclamp[r] = pass_lengths ? std::min(std::max(lens[r], 0), max_len) : max_len;
  DevBuf d_sc, d_len, d_rk, d_idx(size_t(rows) * k * 4 + 4), d_cnt(size_t(rows) * 4 + 4);
  upload16(d_sc, h);
  upload16(d_len, lens);
  if (!row_k.empty()) upload16(d_rk, row_k);
  KVS_TEST_CK(cudaMemset(d_idx.p, 0x7f, d_idx.n));
  KVS_TEST_CK(cudaMemset(d_cnt.p, 0x7f, d_cnt.n));
  const kvs::cuda::Status st = kvs::cuda::topk_rows(
      d_sc.as<float>() + offset, stride, pass_lengths ? d_len.as<int32_t>() : nullptr, rows, max_len, k,
      d_idx.as<int32_t>(), d_cnt.as<int32_t>(), {}, nullptr, row_k.empty() ? nullptr : d_rk.as<int32_t>());
  const cudaError_t le = cudaDeviceSynchronize();
  const std::string name = "topk_rows " + tag + " gen=" + gname(gen) + " rows=" + std::to_string(rows) +
                           " max_len=" + std::to_string(max_len) + " k=" + std::to_string(k) +
                           " stride=" + std::to_string(stride) + " off=" + std::to_string(offset) +
                           (row_k.empty() ? "" : " row_k");
  if (!st.ok() || le != cudaSuccess || cudaGetLastError() != cudaSuccess) {
    report(false, name, std::string("status: ") + st.message + " / " + cudaGetErrorString(le));
    return;
  }
  const std::vector<int32_t> idx = download<int32_t>(d_idx.p, size_t(rows) * k);
  const std::vector<int32_t> cnt = download<int32_t>(d_cnt.p, size_t(rows));
  int bad_rows = 0;
  std::string first;
  for (int r = 0; r < rows; ++r) {
    const float* row = h.data() + offset + size_t(r) * stride;
    const int kr = row_k.empty() ? k : std::min(std::max(row_k[r], 0), k);
    const std::vector<int> ref = host_topk(row, lclamp[r], kr);
    bool ok = cnt[r] == int(ref.size());
    size_t i = 0;
    for (; ok && i < ref.size(); ++i) ok = idx[size_t(r) * k + i] == ref[i];
    for (size_t j = ref.size(); ok && j < size_t(k); ++j) ok = idx[size_t(r) * k + j] == -1;
    if (!ok) {
      if (bad_rows++ == 0) {
        char buf[256];
        std::snprintf(buf, sizeof buf, "row %d len %d: cnt %d (want %zu), first mismatch at %zu", r, lclamp[r],
                      cnt[r], ref.size(), i ? i - 1 : 0);
        first = buf;
      }
    }
  }
  report(bad_rows == 0, name, bad_rows ? first : "exact");
}

void run_rows_tests() {
  const int L = g_small ? 3000 : 10000;
  run_rows("mixed lengths", {L, 0, 1, 37, L / 2, L - 1}, L, 100, L, 0, kRandom);
  run_rows("mixed lengths scalar path", {L, 0, 1, 37, L / 2, L - 1}, L, 100, L + 3, 1, kRandom);
  run_rows("lengths=null", {L, L, L}, L, 77, L + 64, 0, kSoftmax, false);
  for (Gen g : {kTies, kSpecial}) {
    run_rows("k=1", {2 * L, L, 5}, 2 * L, 1, 2 * L, 0, g);
    run_rows("k=5%", {2 * L, L, 5}, 2 * L, L / 10, 2 * L + 8, 0, g);
    run_rows("k=len-1", {2 * L, L, 5}, 2 * L, 2 * L - 1, 2 * L, 0, g);
    run_rows("k=len", {2 * L}, 2 * L, 2 * L, 2 * L, 0, g);
  }
  run_rows("all equal", {L, L / 3, 64}, L, 50, L, 0, kAllEqual);
  run_rows("all nan", {L, 100}, L, 10, L, 0, kAllNaN);
  run_rows("k>max_len", {3000, 2999, 0, 1}, 3000, 5000, 3000, 0, kRandom);
  run_rows("k==len", {4096, 4096}, 4096, 4096, 4096, 0, kSoftmax);
  run_rows("many rows", std::vector<int>(64, 4096), 4096, 100, 4100, 0, kSoftmax);
  run_rows("many rows ties", std::vector<int>(40, 5000), 5000, 333, 5000, 0, kTies);
  // Around the one-CTA path's limit (16384 scores; 4 to 16 keys per thread) and a Quest-like row
  // (8191 page scores, +inf pads past the candidates).
  run_rows("short rows at the limit", {16384, 16383, 1000, 0}, 16384, 819, 16384, 0, kTies);
  run_rows("one past the short-row limit", {16385, 5}, 16385, 819, 16385, 0, kSpecial);
  run_rows("short rows, 4 keys per thread", {4096, 4095, 4093}, 4096, 205, 4097, 1, kTies);
  run_rows("short rows, all equal", {8191, 8000}, 8191, 409, 8192, 0, kAllEqual);
  // Per-row k read on the device (capacity 500): 0, negative, above the capacity, above the length.
  run_rows("row_k short rows", {8000, 8000, 8000, 8000, 8000, 300, 5000}, 8000, 500, 8000, 0, kSoftmax, true,
           {409, 0, -3, 9999, 1, 400, 500});
  run_rows("row_k cluster rows", {131072, 100000, 131072}, 131072, 7000, 131072, 0, kTies, true, {6554, 5000, 0});
  run_rows("8x128K", std::vector<int>(8, 131072), 131072, 6554, 131072, 0, kSoftmax);
  run_rows("8x128K ties", {131072, 100000, 131071, 65536, 1, 0, 131072, 7}, 131072, 6554, 131072, 0, kTies);
  run_rows("1x128K random", {131072}, 131072, 6554, 131072, 0, kRandom);
  run_rows("uncached slices", {800000}, 800000, 40000, 800000, 0, kTies);
  if (!g_small) {
    run_rows("1x512K", {524288}, 524288, 26214, 524288, 0, kSoftmax);
    run_rows("2x1M", {1048576, 1000000}, 1048576, 52429, 1048576 + 4, 0, kSoftmax);
    run_rows("1x1M special", {1048576}, 1048576, 52429, 1048576, 0, kSpecial);
    run_rows("1x1M k=1", {1048576}, 1048576, 1, 1048576, 0, kRandom);
    run_rows("1x1M ties scalar", {1048575}, 1048575, 100000, 1048575, 1, kTies);
  }
}

// ---- paged KV problems -----------------------------------------------------------------------
struct Paged {
  int B, Hq, Hkv, D, G, P, max_len;
  Scalar kvt, qt;
  float scale;
  std::vector<int> lens;
  std::vector<float> k;  // host, rounded: [B][Hkv][max_len][D] (t < lens[b])
  std::vector<float> q;  // host, rounded to qt: [B][Hq][D]
  DevBuf d_pool, d_pages, d_q, d_len;
  kvs::cuda::PagedKv kv{};

  float kval(int b, int h, int t, int j) const { return k[((size_t(b) * Hkv + h) * max_len + t) * D + j]; }
};

void build_paged(Paged& p, float qscale) {
  const size_t es = 2;
  const int P = p.P;
  const size_t page_elems = size_t(2) * p.Hkv * P * p.D;
  const int max_pages = (p.max_len + P - 1) / P;
  std::vector<int> npg(static_cast<size_t>(p.B));
  int total = 0;
  for (int b = 0; b < p.B; ++b) total += (npg[b] = (std::min(p.lens[b], p.max_len) + P - 1) / P);
  const int slots = 2 * total + 1;  // pages scattered over twice the room, in shuffled order
  std::vector<int> perm(static_cast<size_t>(slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), g_rng);
  std::vector<uint16_t> pool(size_t(slots) * page_elems, 0xffffu);  // NaN: never to be read
  p.k.assign(size_t(p.B) * p.Hkv * p.max_len * p.D, 0.f);
  p.d_pool.alloc(size_t(slots) * page_elems * es);
  std::vector<const void*> table(size_t(p.B) * max_pages, nullptr);
  int used = 0;
  for (int b = 0; b < p.B; ++b) {
    const int len = std::min(p.lens[b], p.max_len);
    for (int i = 0; i < npg[b]; ++i) {
      const int slot = perm[size_t(used++)];
      table[size_t(b) * max_pages + i] = static_cast<const char*>(p.d_pool.p) + size_t(slot) * page_elems * es;
      uint16_t* pg = pool.data() + size_t(slot) * page_elems;
      for (int h = 0; h < p.Hkv; ++h)
        for (int r = 0; r < P; ++r) {
          const int t = i * P + r;
          if (t >= len) continue;  // rows past the length stay NaN
          for (int j = 0; j < p.D; ++j) {
            const uint16_t u = enc(urand(-1.f, 1.f), p.kvt);
            pg[(size_t(h) * P + r) * p.D + j] = u;
            p.k[((size_t(b) * p.Hkv + h) * p.max_len + t) * p.D + j] = dec(u, p.kvt);
          }
        }
      // V half: random finite values (the score pass must not read them either way)
      for (size_t e = size_t(p.Hkv) * P * p.D; e < page_elems; ++e) pg[e] = enc(urand(-1.f, 1.f), p.kvt);
    }
  }
  KVS_TEST_CK(cudaMemcpy(p.d_pool.p, pool.data(), pool.size() * es, cudaMemcpyHostToDevice));
  upload16(p.d_pages, table);
  p.q.resize(size_t(p.B) * p.Hq * p.D);
  if (p.qt == Scalar::F32) {
    for (auto& x : p.q) x = urand(-1.f, 1.f) * qscale;
    upload16(p.d_q, p.q);
  } else {
    std::vector<uint16_t> qh(p.q.size());
    for (size_t i = 0; i < qh.size(); ++i) {
      qh[i] = enc(urand(-1.f, 1.f) * qscale, p.qt);
      p.q[i] = dec(qh[i], p.qt);
    }
    upload16(p.d_q, qh);
  }
  upload16(p.d_len, p.lens);
  p.kv.pages = p.d_pages.as<const void* const>();
  p.kv.max_pages = max_pages;
  p.kv.page_tokens = P;
  int sh = 0;
  while ((1 << sh) < P) ++sh;
  p.kv.page_shift = sh;
}

// float64 reference scores [B, H, max_len] (NaN past the length) and the per-element tolerance.
void ref_scores(const Paged& p, bool per_head, int sinks, int local, std::vector<double>& ref,
                std::vector<double>& tol) {
  const int H = per_head ? p.Hq : p.Hkv;
  ref.assign(size_t(p.B) * H * p.max_len, std::nan(""));
  tol.assign(ref.size(), 0.0);
  std::vector<double> z(size_t(p.G) * p.max_len), za(size_t(p.G) * p.max_len);
  for (int b = 0; b < p.B; ++b) {
    const int len = std::min(std::max(p.lens[b], 0), p.max_len);
    for (int h = 0; h < p.Hkv; ++h) {
      for (int g = 0; g < p.G; ++g) {
        const float* qv = &p.q[(size_t(b) * p.Hq + h * p.G + g) * p.D];
        for (int t = 0; t < len; ++t) {
          double s = 0, sa = 0;
          for (int j = 0; j < p.D; ++j) {
            const double x = double(qv[j]) * double(p.kval(b, h, t, j));
            s += x;
            sa += std::fabs(x);
          }
          z[size_t(g) * p.max_len + t] = s * p.scale;
          za[size_t(g) * p.max_len + t] = sa * std::fabs(p.scale);
        }
      }
      auto forced = [&](int t) { return t < sinks || t >= len - local; };
      if (per_head) {
        for (int g = 0; g < p.G; ++g)
          for (int t = 0; t < len; ++t) {
            const size_t o = (size_t(b) * p.Hq + h * p.G + g) * p.max_len + t;
            ref[o] = forced(t) ? INFINITY : z[size_t(g) * p.max_len + t];
            tol[o] = 2e-6 * za[size_t(g) * p.max_len + t] + 1e-7;
          }
      } else {
        std::vector<double> lse(size_t(p.G), -INFINITY);
        for (int g = 0; g < p.G; ++g) {
          double m = -INFINITY;
          for (int t = 0; t < len; ++t) m = std::max(m, z[size_t(g) * p.max_len + t]);
          double l = 0;
          for (int t = 0; t < len; ++t) l += std::exp(z[size_t(g) * p.max_len + t] - m);
          lse[g] = m + std::log(l);
        }
        for (int t = 0; t < len; ++t) {
          double s = 0, e = 0;
          for (int g = 0; g < p.G; ++g) {
            const double v = std::exp(z[size_t(g) * p.max_len + t] - lse[g]);
            s += v;
            e += v * (2e-6 * za[size_t(g) * p.max_len + t] + 2e-6);
          }
          const size_t o = (size_t(b) * p.Hkv + h) * p.max_len + t;
          ref[o] = forced(t) ? INFINITY : s;
          tol[o] = 4 * e + 1e-6 * s;
        }
      }
    }
  }
}

// topk_scores on one problem vs the float64 reference, then topk_rows on the device scores vs
// host top-k: exact on the downloaded device scores, and on the float64 scores up to ties within
// 1e-5 relative.
void run_scores(Scalar kvt, Scalar qt, int D, int G, int Hkv, int P, std::vector<int> lens, int max_len,
                bool per_head, int sinks, int local, float qscale = 1.f, bool topk = true) {
  Paged p;
  p.B = int(lens.size());
  p.Hkv = Hkv;
  p.G = G;
  p.Hq = G * Hkv;
  p.D = D;
  p.P = P;
  p.max_len = max_len;
  p.kvt = kvt;
  p.qt = qt;
  p.scale = 1.f / std::sqrt(float(D));
  p.lens = lens;
  build_paged(p, qscale);
  kvs::cuda::AttnShape s{};
  s.batch = p.B;
  s.num_q_heads = p.Hq;
  s.num_kv_heads = Hkv;
  s.head_dim = D;
  s.scale = p.scale;
  const int H = per_head ? p.Hq : Hkv;
  const size_t n = size_t(p.B) * H * max_len;
  DevBuf d_sc(n * 4 + 4);
  KVS_TEST_CK(cudaMemset(d_sc.p, 0x7f, d_sc.n));
  const size_t wsb = kvs::cuda::topk_scores_workspace_bytes(s, max_len);
  DevBuf d_ws(wsb);
  KVS_TEST_CK(cudaMemset(d_ws.p ? d_ws.p : d_sc.p, 0x7f, d_ws.p ? wsb : 0));
  std::string lens_s;
  for (int l : lens) lens_s += (lens_s.empty() ? "" : ",") + std::to_string(l);
  char nm[256];
  std::snprintf(nm, sizeof nm, "topk_scores kv=%s q=%s d=%d G=%d Hkv=%d P=%d lens=%s %s sinks=%d local=%d",
                sname(kvt), sname(qt), D, G, Hkv, P, lens_s.c_str(), per_head ? "per_head" : "group", sinks, local);
  const kvs::cuda::Status st = kvs::cuda::topk_scores(s, {p.d_q.p, qt}, p.kv, kvt, p.d_len.as<int32_t>(), max_len,
                                                      per_head, sinks, local, d_sc.as<float>(),
                                                      {d_ws.p, wsb}, nullptr);
  const cudaError_t le = cudaDeviceSynchronize();
  if (!st.ok() || le != cudaSuccess || cudaGetLastError() != cudaSuccess) {
    report(false, nm, std::string("status: ") + st.message + " / " + cudaGetErrorString(le));
    return;
  }
  const std::vector<float> dev = download<float>(d_sc.p, n);
  std::vector<double> ref, tol;
  ref_scores(p, per_head, sinks, local, ref, tol);
  size_t bad = 0, untouched_bad = 0;
  double worst = 0;
  std::string first;
  for (size_t o = 0; o < n; ++o) {
    if (std::isnan(ref[o])) {  // past the length: must stay poisoned
      uint32_t u;
      std::memcpy(&u, &dev[o], 4);
      if (u != uint32_t(kPoison)) ++untouched_bad;
      continue;
    }
    const double d = dev[o];
    bool ok;
    if (std::isinf(ref[o])) ok = std::isinf(d) && d > 0;
    else {
      const double err = std::fabs(d - ref[o]);
      ok = err <= tol[o];
      worst = std::max(worst, err / (std::fabs(ref[o]) + 1e-30));
    }
    if (!ok && bad++ == 0) {
      char buf[160];
      std::snprintf(buf, sizeof buf, " first bad at %zu: dev %.9g ref %.9g tol %.3g", o, d, ref[o], tol[o]);
      first = buf;
    }
  }
  char det[320];
  std::snprintf(det, sizeof det, "max rel err %.3g, bad %zu, written past length %zu%s", worst, bad, untouched_bad,
                first.c_str());
  report(bad == 0 && untouched_bad == 0, nm, det);
  if (!topk) return;

  // Top-k of every row of the device scores.
  const int rows = p.B * H;
  const int k = std::max(1, max_len / 20);
  std::vector<int> rlen(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r) rlen[r] = std::min(std::max(lens[r / H], 0), max_len);
  DevBuf d_rlen, d_idx(size_t(rows) * k * 4), d_cnt(size_t(rows) * 4);
  upload16(d_rlen, rlen);
  KVS_TEST_CK(cudaMemset(d_idx.p, 0x7f, d_idx.n));
  const kvs::cuda::Status st2 = kvs::cuda::topk_rows(d_sc.as<float>(), max_len, d_rlen.as<int32_t>(), rows, max_len,
                                                     k, d_idx.as<int32_t>(), d_cnt.as<int32_t>(), {}, nullptr);
  const cudaError_t le2 = cudaDeviceSynchronize();
  const std::string nm2 = std::string(nm) + " + topk_rows k=" + std::to_string(k);
  if (!st2.ok() || le2 != cudaSuccess) {
    report(false, nm2, std::string("status: ") + st2.message);
    return;
  }
  const std::vector<int32_t> idx = download<int32_t>(d_idx.p, size_t(rows) * k);
  const std::vector<int32_t> cnt = download<int32_t>(d_cnt.p, size_t(rows));
  int exact_bad = 0, tie_diffs = 0, real_bad = 0;
  std::vector<float> refrow(static_cast<size_t>(max_len));
  for (int r = 0; r < rows; ++r) {
    const float* drow = dev.data() + size_t(r) * max_len;
    const std::vector<int> want = host_topk(drow, rlen[r], k);
    const int c = int(want.size());
    bool ok = cnt[r] == c;
    for (int i = 0; ok && i < c; ++i) ok = idx[size_t(r) * k + i] == want[i];
    for (int i = c; ok && i < k; ++i) ok = idx[size_t(r) * k + i] == -1;
    if (!ok) ++exact_bad;
    // Against the float64 scores: differences only where the reference ties the threshold.
    for (int t = 0; t < rlen[r]; ++t) refrow[t] = float(ref[size_t(r) * max_len + t]);
    std::vector<double> rr(ref.begin() + long(size_t(r) * max_len), ref.begin() + long(size_t(r) * max_len + rlen[r]));
    const std::vector<int> want64 = host_topk(refrow.data(), rlen[r], k);
    if (want64.empty()) continue;
    double thr = INFINITY;
    for (int i : want64) thr = std::min(thr, rr[size_t(i)]);
    std::vector<int> got(idx.begin() + long(size_t(r) * k), idx.begin() + long(size_t(r) * k + c));
    std::vector<int> diff;
    std::set_symmetric_difference(got.begin(), got.end(), want64.begin(), want64.end(), std::back_inserter(diff));
    for (int t : diff) {
      if (t < 0 || t >= rlen[r]) {
        ++real_bad;
        continue;
      }
      if (std::fabs(rr[size_t(t)] - thr) <= 1e-5 * std::fabs(thr)) ++tie_diffs;
      else ++real_bad;
    }
  }
  char det2[200];
  std::snprintf(det2, sizeof det2, "rows %d: exact-on-device-scores bad rows %d, vs float64: %d near-tie diffs, %d real diffs",
                rows, exact_bad, tie_diffs, real_bad);
  report(exact_bad == 0 && real_bad == 0, nm2, det2);
  if (per_head) return;

  // topk_group_select (score pass and top-k in one call; fused past 16384 keys for G <= 8): the
  // same indices and counts as topk_scores + topk_rows above, with every row's k, then with per-row
  // k (row_k); the fused path on every cluster size (forced), where it must leave `scores` unwritten.
  const bool fused = max_len > 16384 && G <= 8;
  for (int C : {0, 1, 2, 4, 8, 16}) {
    if (C > 0 && !fused) break;
    kvs::cuda::detail::set_topk_tuning(C, 0);
    for (int pass = 0; pass < 2; ++pass) {
      std::vector<int> rk(static_cast<size_t>(rows), k);
      if (pass == 1)
        for (int r = 0; r < rows; ++r) rk[r] = (r % 3 == 0) ? k : (r % 3 == 1) ? k / 2 + 1 : 0;
      DevBuf d_rk, d_idx2(size_t(rows) * k * 4), d_cnt2(size_t(rows) * 4), d_sc2(n * 4 + 4);
      upload16(d_rk, rk);
      KVS_TEST_CK(cudaMemset(d_idx2.p, 0x7f, d_idx2.n));
      KVS_TEST_CK(cudaMemset(d_sc2.p, 0x7f, d_sc2.n));
      KVS_TEST_CK(cudaMemset(d_ws.p, 0x7f, wsb));
      const kvs::cuda::Status st3 = kvs::cuda::topk_group_select(
          s, {p.d_q.p, qt}, p.kv, kvt, p.d_len.as<int32_t>(), max_len, sinks, local, d_rlen.as<int32_t>(),
          pass ? d_rk.as<int32_t>() : nullptr, k, d_sc2.as<float>(), d_idx2.as<int32_t>(), d_cnt2.as<int32_t>(),
          {d_ws.p, wsb}, nullptr);
      const cudaError_t le3 = cudaDeviceSynchronize();
      const cudaError_t ge3 = cudaGetLastError();
      const int used = kvs::cuda::detail::topk_rows_last_cluster();
      const std::string nm3 = std::string(nm) + " + topk_group_select" + (pass ? " row_k" : "") +
                              (fused ? " (fused, C=" + std::to_string(used) + ")" : "");
      if (!st3.ok() || le3 != cudaSuccess || ge3 != cudaSuccess) {
        report(false, nm3, std::string("status: ") + st3.message + " / " + cudaGetErrorString(le3 ? le3 : ge3));
        kvs::cuda::detail::set_topk_tuning(0, 0);
        return;
      }
      const std::vector<int32_t> idx2 = download<int32_t>(d_idx2.p, size_t(rows) * k);
      const std::vector<int32_t> cnt2 = download<int32_t>(d_cnt2.p, size_t(rows));
      int bad_rows = 0;
      for (int r = 0; r < rows; ++r) {
        // The expected row from the device scores of topk_scores, at this row's k.
        const std::vector<int> want = host_topk(dev.data() + size_t(r) * max_len, rlen[r], rk[r]);
        bool ok = cnt2[r] == int(want.size());
        for (size_t i = 0; ok && i < want.size(); ++i) ok = idx2[size_t(r) * k + i] == want[i];
        for (int i = int(want.size()); ok && i < k; ++i) ok = idx2[size_t(r) * k + i] == -1;
        if (pass == 0)  // every row's k: exactly topk_rows' output
          for (int i = 0; ok && i < k; ++i) ok = idx2[size_t(r) * k + i] == idx[size_t(r) * k + i];
        if (!ok) ++bad_rows;
      }
      // The fused kernel keeps the scores in shared memory: the buffer stays poisoned. A forced
      // cluster size whose slices do not fit the 176 KB key cache takes the unfused path.
      const bool fits = C == 0 || (int64_t(max_len + C - 1) / C + 3) / 4 * 4 * 4 <= 176 * 1024;
      size_t written = 0;
      if (fused && fits) {
        const std::vector<uint32_t> sc2 = download<uint32_t>(d_sc2.p, n);
        for (uint32_t u : sc2) written += u != uint32_t(kPoison);
      }
      const bool cluster_ok = !fused || (C == 0 ? used > 0 : used == C);  // topk_rows honours C too
      report(bad_rows == 0 && written == 0 && cluster_ok, nm3,
             "rows " + std::to_string(rows) + ", bad rows " + std::to_string(bad_rows) + ", scores written " +
                 std::to_string(written));
    }
  }
  kvs::cuda::detail::set_topk_tuning(0, 0);
}

void run_scores_tests() {
  const int L = g_small ? 700 : 3000;
  const Scalar BF = Scalar::BF16, F16 = Scalar::F16, F32 = Scalar::F32;
  int v = 0;
  for (int D : {64, 128, 256})
    for (int G : {1, 4, 8, 3})
      for (Scalar kvt : {BF, F16})
        for (bool per_head : {false, true}) {
          const Scalar qt = (v & 1) ? kvt : F32;
          const int P = (v & 2) ? 256 : 16;
          const int sinks = (v % 3 == 0) ? 0 : 4, local = (v % 5 == 0) ? 0 : 64;
          ++v;
          run_scores(kvt, qt, D, G, 2, P, {L, L / 3 + 5, 1}, L, per_head, sinks, local, (v & 4) ? 4.f : 1.f);
        }
  run_scores(BF, F32, 128, 16, 2, 16, {L, 250, 0}, L, false, 2, 16);   // G > 8: two query tiles
  run_scores(BF, BF, 128, 16, 1, 64, {L, 17}, L, true, 0, 0);
  run_scores(F16, F32, 128, 2, 4, 32, {L, L - 1, 31}, L + 7, false, 0, 0, 3.f);  // max_len not a page multiple
  run_scores(BF, F32, 64, 6, 3, 1024, {L, 1000}, L, false, 1, 1000);  // local window covers a whole sequence
  run_scores(BF, F32, 128, 4, 8, 256, {g_small ? 5000 : 131072}, g_small ? 5000 : 131072, false, 4, 64, 2.f);
  // Rows past 16384 keys: topk_group_select's fused kernel (G <= 8), and its unfused path (G = 16).
  const int LL = g_small ? 16500 : 40000;
  run_scores(BF, F32, 128, 4, 2, 16, {LL, LL - 3000, 1, 0}, LL, false, 4, 64);
  run_scores(BF, BF, 128, 8, 1, 256, {LL, 17000}, LL + 5, false, 0, 0, 3.f);
  run_scores(F16, F32, 64, 3, 2, 32, {LL, 16385}, LL, false, 1, 100);
  run_scores(BF, F32, 256, 2, 2, 16, {LL}, LL, false, 0, 16);
  run_scores(F16, F16, 128, 1, 3, 64, {LL, 20}, LL, false, 4, 0);
  if (!g_small) run_scores(BF, F32, 128, 16, 1, 16, {20000}, 20000, false, 2, 16);
  // The group mode's logits on the CUDA cores where the tensor-core kernel is the default (d <= 128,
  // groups of 3+): the same checks (float64, and topk_group_select against topk_scores + topk_rows).
  kvs::cuda::detail::set_topk_score_mma(false);
  run_scores(BF, F32, 128, 4, 2, 16, {L, L / 3 + 5, 1}, L, false, 4, 64);
  run_scores(F16, F16, 64, 8, 2, 256, {L, 17}, L, false, 0, 0, 4.f);
  run_scores(BF, F32, 128, 4, 2, 16, {LL, LL - 3000, 1, 0}, LL, false, 4, 64);
  kvs::cuda::detail::set_topk_score_mma(true);
}

// ---- graph capture: topk_scores + topk_rows captured once, replayed, same result -------------------
void run_graph_test() {
  Paged p;
  p.B = 2;
  p.Hkv = 2;
  p.G = 4;
  p.Hq = 8;
  p.D = 128;
  p.P = 64;
  p.max_len = 4000;
  p.kvt = Scalar::BF16;
  p.qt = Scalar::F32;
  p.scale = 1.f / std::sqrt(128.f);
  p.lens = {4000, 2500};
  build_paged(p, 2.f);
  kvs::cuda::AttnShape s{2, 8, 2, 128, p.scale};
  const int rows = 4, k = 200;
  std::vector<int> rlen = {4000, 4000, 2500, 2500};
  DevBuf d_rlen;
  upload16(d_rlen, rlen);
  DevBuf d_sc(size_t(rows) * p.max_len * 4), d_idx(size_t(rows) * k * 4), d_idx2(size_t(rows) * k * 4);
  const size_t wsb = kvs::cuda::topk_scores_workspace_bytes(s, p.max_len);
  DevBuf d_ws(wsb);
  cudaStream_t st;
  KVS_TEST_CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  auto enqueue = [&](void* idx) {
    kvs::cuda::Status a = kvs::cuda::topk_scores(s, {p.d_q.p, Scalar::F32}, p.kv, Scalar::BF16, p.d_len.as<int32_t>(),
                                                 p.max_len, false, 2, 32, d_sc.as<float>(), {d_ws.p, wsb}, st);
    kvs::cuda::Status b = kvs::cuda::topk_rows(d_sc.as<float>(), p.max_len, d_rlen.as<int32_t>(), rows, p.max_len, k,
                                               static_cast<int32_t*>(idx), nullptr, {}, st);
    return a.ok() && b.ok();
  };
  bool ok = enqueue(d_idx.p);
  KVS_TEST_CK(cudaStreamSynchronize(st));
  KVS_TEST_CK(cudaMemsetAsync(d_idx2.p, 0x7f, d_idx2.n, st));  // on st: it does not wait for the legacy stream
  KVS_TEST_CK(cudaStreamSynchronize(st));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  KVS_TEST_CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  ok = enqueue(d_idx2.p) && ok;
  KVS_TEST_CK(cudaStreamEndCapture(st, &g));
  KVS_TEST_CK(cudaGraphInstantiate(&ge, g, 0));
  KVS_TEST_CK(cudaGraphLaunch(ge, st));
  KVS_TEST_CK(cudaGraphLaunch(ge, st));
  KVS_TEST_CK(cudaStreamSynchronize(st));
  const auto a = download<int32_t>(d_idx.p, size_t(rows) * k), b = download<int32_t>(d_idx2.p, size_t(rows) * k);
  report(ok && a == b, "graph capture topk_scores+topk_rows", ok ? (a == b ? "same indices" : "differ") : "call failed");
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaStreamDestroy(st);
}

void run_error_tests() {
  using kvs::cuda::Status;
  DevBuf d(1024);
  Status r = kvs::cuda::topk_rows(d.as<float>(), 16, nullptr, 0, 16, 4, d.as<int32_t>(), nullptr, {}, nullptr);
  report(r.code == 1, "error: topk_rows rows=0 -> INVALID_ARGUMENT", r.message);
  r = kvs::cuda::topk_rows(d.as<float>(), 16, nullptr, 1, 16, -1, d.as<int32_t>(), nullptr, {}, nullptr);
  report(r.code == 1, "error: topk_rows k=-1 -> INVALID_ARGUMENT", r.message);
  {  // k = 0: only the counts are written
    KVS_TEST_CK(cudaMemset(d.p, 0x7f, d.n));
    r = kvs::cuda::topk_rows(d.as<float>(), 16, nullptr, 2, 16, 0, d.as<int32_t>() + 64, d.as<int32_t>() + 128, {}, nullptr);
    KVS_TEST_CK(cudaDeviceSynchronize());
    const auto c = download<int32_t>(d.as<int32_t>() + 128, 2);
    const auto o = download<int32_t>(d.as<int32_t>() + 64, 1);
    report(r.ok() && c[0] == 0 && c[1] == 0 && o[0] == kPoison, "topk_rows k=0 writes counts 0 only", r.message);
  }
  r = kvs::cuda::topk_rows(d.as<float>(), 8, nullptr, 2, 16, 4, d.as<int32_t>(), nullptr, {}, nullptr);
  report(r.code == 1, "error: topk_rows row_stride < max_len -> INVALID_ARGUMENT", r.message);
  r = kvs::cuda::topk_rows(nullptr, 16, nullptr, 1, 16, 4, d.as<int32_t>(), nullptr, {}, nullptr);
  report(r.code == 1, "error: topk_rows null scores -> INVALID_ARGUMENT", r.message);
  kvs::cuda::AttnShape s{1, 8, 2, 96, 0.1f};
  kvs::cuda::PagedKv kv{reinterpret_cast<const void* const*>(d.p), 4, 16, 4};
  r = kvs::cuda::topk_scores(s, {d.p, Scalar::F32}, kv, Scalar::BF16, d.as<int32_t>(), 64, true, 0, 0, d.as<float>(), {}, nullptr);
  report(r.code == 3, "error: topk_scores head_dim 96 -> UNSUPPORTED", r.message);
  s.head_dim = 128;
  kv.page_tokens = 24;
  r = kvs::cuda::topk_scores(s, {d.p, Scalar::F32}, kv, Scalar::BF16, d.as<int32_t>(), 64, true, 0, 0, d.as<float>(), {}, nullptr);
  report(r.code == 1, "error: topk_scores page_tokens 24 -> INVALID_ARGUMENT", r.message);
  kv.page_tokens = 16;
  r = kvs::cuda::topk_scores(s, {d.p, Scalar::F32}, kv, Scalar::BF16, d.as<int32_t>(), 128, true, 0, 0, d.as<float>(), {}, nullptr);
  report(r.code == 1, "error: topk_scores max_length > max_pages*P -> INVALID_ARGUMENT", r.message);
  r = kvs::cuda::topk_scores(s, {d.p, Scalar::F32}, kv, Scalar::BF16, d.as<int32_t>(), 64, false, 0, 0, d.as<float>(), {}, nullptr);
  report(r.code == 1, "error: topk_scores group mode without workspace -> INVALID_ARGUMENT", r.message);
  r = kvs::cuda::topk_scores(s, {d.p, Scalar::F16}, kv, Scalar::BF16, d.as<int32_t>(), 64, true, 0, 0, d.as<float>(), {}, nullptr);
  report(r.code == 1, "error: topk_scores q f16 with bf16 KV -> INVALID_ARGUMENT", r.message);
  report(kvs::cuda::topk_rows_workspace_bytes(8, 131072, 6554) == 0, "topk_rows needs no workspace", "");
}

// Informational (no pass/fail): microseconds per topk_rows call, 200 calls back to back, for Quest's
// page rows (8 or 64 rows of 8602 scores, k 409) and exact_topk's (8 x 128K, k 6554), on the
// automatic path and with each cluster size forced.
void run_rows_timing() {
  struct Shape {
    int rows, len, k;
  };
  // (8 x 8602 with k = 8602: the "every key" path, i.e. launch, load and write without the search.)
  for (Shape sh : {Shape{8, 8602, 409}, Shape{8, 8602, 8602}, Shape{8, 8602, 1}, Shape{-8, 8602, 409},
                   Shape{64, 8602, 409}, Shape{8, 16384, 819},
                   Shape{8, 32768, 1638}, Shape{8, 131072, 6554}}) {
    const bool sorted = sh.rows < 0;  // rows = -R: R rows of ascending scores (long runs of one digit)
    sh.rows = std::abs(sh.rows);
    std::vector<float> h(size_t(sh.rows) * sh.len);
    std::mt19937 gen(5);
    std::normal_distribution<float> nd(3.f, 0.5f);
    for (auto& x : h) x = nd(gen);
    if (sorted)
      for (int r = 0; r < sh.rows; ++r) std::sort(h.begin() + size_t(r) * sh.len, h.begin() + size_t(r + 1) * sh.len);
    DevBuf d_sc, d_idx(size_t(sh.rows) * sh.k * 4);
    upload16(d_sc, h);
    std::string line = "topk_rows timing rows=" + std::to_string(sh.rows) + " len=" + std::to_string(sh.len) +
                       " k=" + std::to_string(sh.k) + (sorted ? " sorted" : "") + ":";
    for (int force : {0, 1, 2, 4, 8, 16}) {
      kvs::cuda::detail::set_topk_tuning(force, 0);
      auto call = [&] {
        return kvs::cuda::topk_rows(d_sc.as<float>(), sh.len, nullptr, sh.rows, sh.len, sh.k, d_idx.as<int32_t>(),
                                    nullptr, {}, nullptr);
      };
      if (!call().ok()) continue;
      cudaEvent_t e0, e1;
      KVS_TEST_CK(cudaEventCreate(&e0));
      KVS_TEST_CK(cudaEventCreate(&e1));
      KVS_TEST_CK(cudaEventRecord(e0, nullptr));
      for (int i = 0; i < 200; ++i) (void)call();
      KVS_TEST_CK(cudaEventRecord(e1, nullptr));
      KVS_TEST_CK(cudaEventSynchronize(e1));
      float ms = 0.f;
      KVS_TEST_CK(cudaEventElapsedTime(&ms, e0, e1));
      KVS_TEST_CK(cudaEventDestroy(e0));
      KVS_TEST_CK(cudaEventDestroy(e1));
      char buf[64];
      std::snprintf(buf, sizeof buf, " %s %.1f us", force == 0 ? "auto" : ("C=" + std::to_string(force)).c_str(),
                    ms * 1e3f / 200.f);
      line += buf;
    }
    kvs::cuda::detail::set_topk_tuning(0, 0);
    std::printf("%s\n", line.c_str());
  }
}

}  // namespace

int run_topk_passed() { return g_pass; }

// Returns the number of failures. small: short rows and contexts (for compute-sanitizer).
int run_topk_tests(bool small) {
  g_small = small;
  run_error_tests();
  run_rows_tests();
  run_scores_tests();
  run_graph_test();
  if (!small) run_rows_timing();
  std::printf("topk tests: %d passed, %d failed\n", g_pass, g_fail);
  return g_fail;
}
