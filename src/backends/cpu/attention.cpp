// SPDX-License-Identifier: Apache-2.0
#include "backends/cpu/attention.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

namespace kvs::cpu {
namespace {

constexpr int kBlock = 64;  // keys per softmax block
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Software prefetches of one block, issued by the score pass key by key: the block's own V rows
// (into L1: the value pass walks them column chunk by column chunk, a pattern the hardware
// prefetchers miss) and, for gathered rows, which no hardware prefetcher can guess, the next
// block's K and V rows (into L2). Issuing all of them at the start of the block (256 to 768
// prefetches) stalled the core until the miss queue drained, serialising memory and compute:
// spread over the score pass, one dense 128K decode thread went from 7.6 to 10.1 GB/s (EPYC VM).
struct Prefetch {
  const std::byte* const* now = nullptr;     // [cnt] V rows of this block
  const std::byte* const* next_k = nullptr;  // [next_cnt] K rows of the next block (gathered only)
  const std::byte* const* next_v = nullptr;  // [next_cnt] V rows of the next block, or null
  int next_cnt = 0;
  size_t row_bytes = 0;
};

// Online-softmax state of G query heads over one chunk of keys.
struct State {
  int G, d;
  float* m;    // [G] running max
  float* l;    // [G] running sum of exp(s - m)
  float* acc;  // [G][d] running sum of exp(s - m) v
  float* corr; // [G] scratch: rescale factor of acc in the current block
  bool x2 = false;  // q and acc are in the paired-bf16 column order (see bf16x2)
};

// ---------------------------------------------------------------------------------------------
// Row conversion and dot products: a portable path and an AVX2/FMA/F16C path chosen at run time.

void to_f32_row(const std::byte* src, DType t, int d, float* dst) {
  convert_to_f32(src, t, dst, size_t(d));
}

struct Scalar {
  static void convert(const std::byte* src, DType t, int d, float* dst) { to_f32_row(src, t, d, dst); }
  static float dot(const float* a, const float* b, int d) {
    float s = 0.f;
    for (int i = 0; i < d; ++i) s += a[i] * b[i];
    return s;
  }
  static float block_max(const float* x, int n) {
    float m = x[0];
    for (int i = 1; i < n; ++i) m = std::max(m, x[i]);
    return m;
  }
  static void exp_block(float* x, int n, float m, float* sum) {
    float s = 0.f;
    for (int i = 0; i < n; ++i) {
      x[i] = std::exp(x[i] - m);
      s += x[i];
    }
    *sum = s;
  }
};

#define KVS_AVX2 __attribute__((target("avx2,fma,f16c")))

// exp(x) = 2^n * p(f), n = round(x / ln2), f = x - n ln2 in [-ln2/2, ln2/2]; |rel err| < 2e-7.
// Inputs are clamped to [kExpLo, kExpHi]. The constants serve the 8- and 16-lane versions.
namespace expc {
constexpr float kExpLo = -87.3f, kExpHi = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace expc

KVS_AVX2 inline __m256 exp256(__m256 x) {
  using namespace expc;
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kExpHi)), _mm256_set1_ps(kExpLo));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), f);
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kP[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

KVS_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Requires d % 8 == 0.
struct Avx2 {
  KVS_AVX2 static void convert(const std::byte* src, DType t, int d, float* dst) {
    switch (t) {
      case DType::BF16:
        for (int i = 0; i < d; i += 8) {
          __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
          _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        }
        break;
      case DType::F16:
        for (int i = 0; i < d; i += 8)
          _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
        break;
      case DType::F32: std::memcpy(dst, src, size_t(d) * 4); break;
    }
  }
  KVS_AVX2 static float dot(const float* a, const float* b, int d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= d; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i < d; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    return hsum(_mm256_add_ps(s0, s1));
  }
  // The max of x[0..n), n >= 1: 8 lanes at a time, then the tail.
  KVS_AVX2 static float block_max(const float* x, int n) {
    if (n < 8) return Scalar::block_max(x, n);
    __m256 mv = _mm256_loadu_ps(x);
    int i = 8;
    for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float m = _mm_cvtss_f32(m4);
    for (; i < n; ++i) m = std::max(m, x[i]);
    return m;
  }
  KVS_AVX2 static void exp_block(float* x, int n, float m, float* sum) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 s = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
      _mm256_storeu_ps(x + i, e);
      s = _mm256_add_ps(s, e);
    }
    float t = hsum(s);
    for (; i < n; ++i) {
      x[i] = std::exp(x[i] - m);
      t += x[i];
    }
    *sum = t;
  }
};

// Head g's running max becomes max(m, block_max): the running sum is rescaled and the rescale
// factor of the accumulators kept in st.corr[g]. Returns the new max.
inline float advance_max(State& st, int g, float block_max) {
  const float m_new = std::max(st.m[g], block_max);
  float c = 1.f;
  if (st.m[g] != m_new) {
    c = st.m[g] == kNegInf ? 0.f : std::exp(st.m[g] - m_new);
    st.l[g] *= c;
    st.m[g] = m_new;
  }
  st.corr[g] = c;
  return m_new;
}

// Online-softmax update of a block's scores s[g][0..cnt): new running max, rescale factor of the
// accumulators (st.corr), running sums; s becomes exp(s - m). Isa::block_max and Isa::exp_block do
// the vector work.
// Always inlined, so that in the AVX2 caller below the Avx2 calls inline too (a function without
// the target attribute cannot inline them).
template <class Isa>
__attribute__((always_inline)) inline void softmax_update_isa(State& st, float* s, int cnt) {
  for (int g = 0; g < st.G; ++g) {
    float* sg = s + g * kBlock;
    const float m_new = advance_max(st, g, Isa::block_max(sg, cnt));
    float sum;
    Isa::exp_block(sg, cnt, m_new, &sum);
    st.l[g] += sum;
  }
}

// The AVX2 instantiation, and the tail of partial blocks for AVX-512.
KVS_AVX2 void softmax_update(State& st, float* s, int cnt) { softmax_update_isa<Avx2>(st, s, cnt); }

// The portable block kernel (CPUs without AVX2, head dims not a multiple of 8). q is [G][d],
// pre-multiplied by the softmax scale; buf: d floats; s: G*kBlock floats.
template <class KRow, class VRow>
void scalar_block(State& st, const float* q, DType t, int cnt, KRow krow, VRow vrow, float* buf, float* s) {
  const int G = st.G, d = st.d;
  for (int j = 0; j < cnt; ++j) {
    Scalar::convert(krow(j), t, d, buf);
    for (int g = 0; g < G; ++g) s[g * kBlock + j] = Scalar::dot(q + size_t(g) * d, buf, d);
  }
  softmax_update_isa<Scalar>(st, s, cnt);
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < d; ++i) st.acc[size_t(g) * d + i] *= st.corr[g];
  for (int j = 0; j < cnt; ++j) {
    Scalar::convert(vrow(j), t, d, buf);
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < d; ++i) st.acc[size_t(g) * d + i] += s[g * kBlock + j] * buf[i];
  }
}

#define KVS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

KVS_AVX512 inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

// exp256 on 16 lanes.
KVS_AVX512 inline __m512 exp512(__m512 x) {
  using namespace expc;
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kExpHi)), _mm512_set1_ps(kExpLo));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), f);
  __m512 p = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kP[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// softmax_update for full blocks on 16 lanes: the block max and the exponentials vectorised.
KVS_AVX512 void softmax_update512(State& st, float* s, int cnt) {
  if (cnt != kBlock) return softmax_update(st, s, cnt);
  for (int g = 0; g < st.G; ++g) {
    float* sg = s + g * kBlock;
    __m512 mv = _mm512_loadu_ps(sg);
    for (int j = 16; j < kBlock; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + j));
    const float m_new = advance_max(st, g, _mm512_reduce_max_ps(mv));
    const __m512 m = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < kBlock; j += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + j), m));
      _mm512_storeu_ps(sg + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    st.l[g] += _mm512_reduce_add_ps(sum);
  }
}

// Sums of 16 vectors at once: lane l of the result is the sum of a[(l % 4) * 4 + l / 4].
KVS_AVX512 inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]), _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x44), _mm512_shuffle_ps(d[0], d[1], 0xEE));
}

// 32 bf16 values (64 bytes) to two fp32 vectors by interleaving with zeros: lo holds columns
// {0-3, 8-11, 16-19, 24-27}, hi {4-7, 12-15, 20-23, 28-31}. Both are port-5 shuffles; the usual
// widen (port 5) and shift (port 0) puts half the conversion on the port the FMAs need.
KVS_AVX512 inline void bf16x2(const std::byte* p, __m512& lo, __m512& hi) {
  const __m512i x = _mm512_loadu_si512(p);
  lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), x));
  hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), x));
}

// Rows of d floats (d % 32 == 0) between natural column order and bf16x2's order, in place.
KVS_AVX512 void x2_order(float* rows, size_t n, int d, bool to_x2) {
  const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i from_a = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i from_b = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (size_t r = 0; r < n; ++r)
    for (int c = 0; c < d; c += 32) {
      float* p = rows + r * size_t(d) + c;
      const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
      _mm512_storeu_ps(p, _mm512_permutex2var_ps(a, to_x2 ? to_lo : from_a, b));
      _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(a, to_x2 ? to_hi : from_b, b));
    }
}

// 16 bf16 values (32 bytes) to two fp32 vectors without a shuffle: lo = the even columns
// {0, 2, ..., 14} (each 32-bit pair shifted left by 16), hi = the odd columns {1, 3, ..., 15} (the
// pair with its low half masked off). One load and two single-cycle operations per 16 values,
// where widen-and-shift takes a shuffle and a shift per 8.
KVS_AVX2 inline void bf16x2_8(const std::byte* p, __m256& lo, __m256& hi) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// Rows of d floats (d % 16 == 0) between natural column order and bf16x2_8's order, in place.
void x2_order8(float* rows, size_t n, int d, bool to_x2) {
  float t[16];
  for (size_t r = 0; r < n; ++r)
    for (int c = 0; c < d; c += 16) {
      float* p = rows + r * size_t(d) + c;
      for (int i = 0; i < 8; ++i) {
        if (to_x2) {
          t[i] = p[2 * i];
          t[8 + i] = p[2 * i + 1];
        } else {
          t[2 * i] = p[i];
          t[2 * i + 1] = p[8 + i];
        }
      }
      std::memcpy(p, t, sizeof t);
    }
}

// AVX2 instantiation (8 lanes).
#define KVS_NS simd8
#define KVS_TGT KVS_AVX2
#define VEC __m256
#define W 8
#define V_LOADU _mm256_loadu_ps
#define V_STOREU _mm256_storeu_ps
#define V_FMA _mm256_fmadd_ps
#define V_MUL _mm256_mul_ps
#define V_SET1 _mm256_set1_ps
#define V_ZERO _mm256_setzero_ps
#define V_BCAST _mm256_broadcast_ss
#define V_HSUM hsum
#define V_SOFTMAX softmax_update
#define V_LOAD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16))
#define V_LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
#define V_BF16X2(p, lo, hi) bf16x2_8(p, lo, hi)
#include "backends/cpu/attention_simd.inc"

// AVX-512 instantiation (16 lanes).
#define KVS_NS simd16
#define KVS_TGT KVS_AVX512
#define VEC __m512
#define W 16
#define V_LOADU _mm512_loadu_ps
#define V_STOREU _mm512_storeu_ps
#define V_FMA _mm512_fmadd_ps
#define V_MUL _mm512_mul_ps
#define V_SET1 _mm512_set1_ps
#define V_ZERO _mm512_setzero_ps
#define V_BCAST(p) _mm512_set1_ps(*(p))
#define V_HSUM hsum512
#define V_REDUCE16 reduce16
#define V_SOFTMAX softmax_update512
#define V_LOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))
#define V_LOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
#define V_BF16X2(p, lo, hi) bf16x2(p, lo, hi)
#include "backends/cpu/attention_simd.inc"

enum class Isa { Scalar, Avx2, Avx512 };

// The widest instruction set the CPU has whose vector width divides d (KVS_CPU_ISA=avx2 or scalar
// caps it, for comparisons).
Isa pick_isa(int d) {
  static const Isa best = [] {
    const char* cap = std::getenv("KVS_CPU_ISA");
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
    if (cap && std::strcmp(cap, "scalar") == 0) return Isa::Scalar;
    if (cap && std::strcmp(cap, "avx2") == 0) return avx2 ? Isa::Avx2 : Isa::Scalar;
    return avx512 ? Isa::Avx512 : avx2 ? Isa::Avx2 : Isa::Scalar;
  }();
  if (best == Isa::Avx512 && d % 16 == 0) return Isa::Avx512;
  if (best != Isa::Scalar && d % 8 == 0) return Isa::Avx2;
  return Isa::Scalar;
}

bool use_avx2(int d) { return pick_isa(d) != Isa::Scalar; }

// Converts a finished state into (o, lse) for its G heads.
void finish(const State& st, float* o, float* lse) {
  for (int g = 0; g < st.G; ++g) {
    if (st.l[g] <= 0.f || st.m[g] == kNegInf) {
      lse[g] = kNegInf;
      std::fill(o + size_t(g) * st.d, o + size_t(g + 1) * st.d, 0.f);
      continue;
    }
    lse[g] = st.m[g] + std::log(st.l[g]);
    const float inv = 1.f / st.l[g];
    for (int i = 0; i < st.d; ++i) o[size_t(g) * st.d + i] = st.acc[size_t(g) * st.d + i] * inv;
  }
}

// Scratch for one task: state + buffers.
struct TaskScratch {
  std::vector<float> m, l, acc, corr, buf, s, q, qx;
  State init(int G, int d) {
    m.assign(size_t(G), kNegInf);
    l.assign(size_t(G), 0.f);
    acc.assign(size_t(G) * d, 0.f);
    corr.assign(size_t(G), 1.f);
    buf.resize(size_t(d));
    s.resize(size_t(G) * kBlock);
    return State{G, d, m.data(), l.data(), acc.data(), corr.data()};
  }
};

template <DType T>
void simd_block(Isa isa, State& st, const float* q, int cnt, const std::byte* const* kr,
                const std::byte* const* vr, float* s, const Prefetch* pf) {
  if (isa == Isa::Avx512) simd16::block<T>(st, q, cnt, kr, vr, s, pf);
  else simd8::block<T>(st, q, cnt, kr, vr, s, pf);
}

// The paired-bf16 column order (bf16x2) of a run over bf16 rows: with 16 lanes q and the
// accumulators are held in it, with 8 lanes only the accumulators (the value pass pairs).
// KVS_CPU_BF16X2=off keeps the widen-and-shift conversion (for comparisons, like KVS_CPU_ISA).
enum class X2 { None, Lanes16, Lanes8 };
X2 x2_mode(Isa isa, DType t, int d) {
  static const bool off = [] {
    const char* e = std::getenv("KVS_CPU_BF16X2");
    return e != nullptr && std::strcmp(e, "off") == 0;
  }();
  if (off || t != DType::BF16) return X2::None;
  if (isa == Isa::Avx512 && d % 32 == 0) return X2::Lanes16;
  if (isa == Isa::Avx2 && d % 16 == 0) return X2::Lanes8;
  return X2::None;
}
// G rows of d floats into (to) or out of the order of mode m.
void x2_reorder(X2 m, float* rows, int G, int d, bool to) {
  if (m == X2::Lanes16) x2_order(rows, size_t(G), d, to);
  else if (m == X2::Lanes8) x2_order8(rows, size_t(G), d, to);
}

// One score pass (values = false) or value pass of the block kernel over cnt <= kBlock rows, for the
// instruction set and dtype.
void heads_pass_any(Isa isa, DType t, State& st, const float* q, int cnt, const std::byte* const* kr,
                    const std::byte* const* vr, float* s, bool values, const Prefetch* pf) {
  const bool w16 = isa == Isa::Avx512;
  switch (t) {
    case DType::BF16:
      w16 ? simd16::heads_dispatch<DType::BF16>(st, q, cnt, kr, vr, s, values, pf)
          : simd8::heads_dispatch<DType::BF16>(st, q, cnt, kr, vr, s, values, pf);
      break;
    case DType::F16:
      w16 ? simd16::heads_dispatch<DType::F16>(st, q, cnt, kr, vr, s, values, pf)
          : simd8::heads_dispatch<DType::F16>(st, q, cnt, kr, vr, s, values, pf);
      break;
    case DType::F32:
      w16 ? simd16::heads_dispatch<DType::F32>(st, q, cnt, kr, vr, s, values, pf)
          : simd8::heads_dispatch<DType::F32>(st, q, cnt, kr, vr, s, values, pf);
      break;
  }
}

// Runs keys [begin, end) of one KV head (row accessors kat/vat) into the state.
template <class KAt, class VAt>
void run_chunk(Isa isa, State& st, const float* qs, DType t, int64_t begin, int64_t end, KAt kat, VAt vat,
               TaskScratch& sc, bool gathered) {
  if (isa == Isa::Scalar) {
    for (int64_t b = begin; b < end; b += kBlock) {
      const int cnt = int(std::min<int64_t>(kBlock, end - b));
      scalar_block(st, qs, t, cnt, [&](int j) { return kat(b + j); }, [&](int j) { return vat(b + j); },
                   sc.buf.data(), sc.s.data());
    }
    return;
  }
  // bf16: q (16 lanes) and the accumulators in bf16x2's column order for this run.
  const X2 x2 = end > begin ? x2_mode(isa, t, st.d) : X2::None;
  if (x2 != X2::None) {
    if (x2 == X2::Lanes16) {
      sc.qx.assign(qs, qs + size_t(st.G) * st.d);
      x2_reorder(x2, sc.qx.data(), st.G, st.d, true);
      qs = sc.qx.data();
    }
    x2_reorder(x2, st.acc, st.G, st.d, true);
    st.x2 = true;
  }
  // Row pointers of this block and the next (double-buffered: the next block's are needed for
  // its prefetches while this one is computed).
  const std::byte* kr[2][kBlock];
  const std::byte* vr[2][kBlock];
  const size_t row_bytes = size_t(st.d) * dtype_size(t);
  // Gathered rows (index lists) are scattered: the hardware prefetchers cannot guess them, so the
  // K and V rows of the next block are asked for (into L2) during a block's score pass, and the
  // first block's before the loop. KVS_GATHER_PREFETCH=k asks for the K rows only (the V rows of
  // the current block still go to L1 during its score pass), for comparisons on other CPUs.
  static const bool pf_v = [] {
    const char* e = std::getenv("KVS_GATHER_PREFETCH");
    return e == nullptr || std::strcmp(e, "k") != 0;
  }();
  const auto fill = [&](int buf, int64_t b) {
    const int cnt = int(std::min<int64_t>(kBlock, end - b));
    for (int j = 0; j < cnt; ++j) {
      kr[buf][j] = kat(b + j);
      vr[buf][j] = vat(b + j);
    }
    return cnt;
  };
  int cnt = fill(0, begin);
  if (gathered)
    for (int j = 0; j < cnt; ++j)
      for (size_t off = 0; off < row_bytes; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(kr[0][j]) + off, _MM_HINT_T1);
        if (pf_v) _mm_prefetch(reinterpret_cast<const char*>(vr[0][j]) + off, _MM_HINT_T1);
      }
  Prefetch pf;
  pf.row_bytes = row_bytes;
  int cur = 0;
  for (int64_t b = begin; b < end; b += kBlock, cur ^= 1) {
    const int next_cnt = gathered && b + kBlock < end ? fill(cur ^ 1, b + kBlock) : 0;
    pf.now = vr[cur];
    pf.next_k = kr[cur ^ 1];
    pf.next_v = pf_v ? vr[cur ^ 1] : nullptr;
    pf.next_cnt = next_cnt;
    switch (t) {
      case DType::BF16: simd_block<DType::BF16>(isa, st, qs, cnt, kr[cur], vr[cur], sc.s.data(), &pf); break;
      case DType::F16: simd_block<DType::F16>(isa, st, qs, cnt, kr[cur], vr[cur], sc.s.data(), &pf); break;
      case DType::F32: simd_block<DType::F32>(isa, st, qs, cnt, kr[cur], vr[cur], sc.s.data(), &pf); break;
    }
    if (b + kBlock < end) cnt = gathered ? next_cnt : fill(cur ^ 1, b + kBlock);
  }
  if (x2 != X2::None) {
    x2_reorder(x2, st.acc, st.G, st.d, false);
    st.x2 = false;
  }
}

// Merge partial states part_o[c][G][d], part_lse[c][G] over chunks c into o/lse of G heads.
void merge_chunks(const float* part_o, const float* part_lse, int chunks, int G, int d, float* o,
                  float* lse) {
  for (int g = 0; g < G; ++g) {
    float mx = kNegInf;
    for (int c = 0; c < chunks; ++c) mx = std::max(mx, part_lse[size_t(c) * G + g]);
    float* og = o + size_t(g) * d;
    std::fill(og, og + d, 0.f);
    if (mx == kNegInf) {
      lse[g] = kNegInf;
      continue;
    }
    double tot = 0.0;
    for (int c = 0; c < chunks; ++c) tot += std::exp(double(part_lse[size_t(c) * G + g]) - mx);
    const float l = mx + float(std::log(tot));
    for (int c = 0; c < chunks; ++c) {
      const float w = std::exp(part_lse[size_t(c) * G + g] - l);
      if (w == 0.f) continue;
      const float* oc = part_o + (size_t(c) * G + g) * d;
      for (int i = 0; i < d; ++i) og[i] += w * oc[i];
    }
    lse[g] = l;
  }
}

// Generic driver: `heads` groups, each with `gq` query heads starting at qhead0(h), over a key
// range split into chunks. keys_of(h) gives the number of keys of group h; kat(h, i) / vat(h, i)
// the i-th key/value row of group h.
// ids: the groups' indices (q, o and lse at id * gq; the id is what nkeys/kat/vat get); null: 0..heads-1.
template <class NKeys, class KAt, class VAt>
void drive(const KVLayer& kv, const float* q, int heads, int gq, int d, float scale, NKeys nkeys,
           KAt kat, VAt vat, float* o, float* lse, ThreadPool& pool, bool gathered, const int* ids = nullptr) {
  if (heads <= 0) return;
  const auto id_of = [&](int h) { return ids ? ids[h] : h; };
  int64_t max_keys = 0;
  for (int h = 0; h < heads; ++h) max_keys = std::max(max_keys, nkeys(id_of(h)));
  // Enough chunks for the pool to balance, each at least one page of keys.
  const int64_t want = std::max<int64_t>(1, (4 * int64_t(pool.size()) + heads - 1) / heads);
  const int64_t chunk = std::max<int64_t>(kPageTokens, (max_keys + want - 1) / std::max<int64_t>(1, want));
  const int chunks = int(std::max<int64_t>(1, (max_keys + chunk - 1) / chunk));
  std::vector<float> part_o(size_t(heads) * chunks * gq * d);
  std::vector<float> part_lse(size_t(heads) * chunks * gq);
  const Isa isa = pick_isa(d);
  const DType t = kv.dtype();
  pool.parallel_for(int64_t(heads) * chunks, [&](int64_t task) {
    const int h = id_of(int(task / chunks));
    const int c = int(task % chunks);
    TaskScratch sc;
    State st = sc.init(gq, d);
    const int64_t n = nkeys(h);
    const int64_t b = int64_t(c) * chunk, e = std::min(n, b + chunk);
    sc.q.resize(size_t(gq) * d);
    for (size_t i = 0; i < sc.q.size(); ++i) sc.q[i] = q[size_t(h) * gq * d + i] * scale;
    auto ka = [&](int64_t i) { return kat(h, i); };
    auto va = [&](int64_t i) { return vat(h, i); };
    if (b < e) run_chunk(isa, st, sc.q.data(), t, b, e, ka, va, sc, gathered);
    const size_t slot = size_t(task / chunks) * chunks + c;
    finish(st, part_o.data() + slot * gq * d, part_lse.data() + slot * gq);
  });
  for (int h = 0; h < heads; ++h)
    merge_chunks(part_o.data() + size_t(h) * chunks * gq * d, part_lse.data() + size_t(h) * chunks * gq,
                 chunks, gq, d, o + size_t(id_of(h)) * gq * d, lse + size_t(id_of(h)) * gq);
}

}  // namespace

void attend_dense(const KVLayer& kv, const float* q, int G, int64_t n_keys, float scale, float* o,
                  float* lse, ThreadPool& pool) {
  const int d = kv.head_dim();
  drive(kv, q, kv.num_kv_heads(), G, d, scale, [&](int) { return n_keys; },
        [&](int h, int64_t i) { return kv.k_row(h, i); }, [&](int h, int64_t i) { return kv.v_row(h, i); },
        o, lse, pool, false);
}

void attend_gather_kv(const KVLayer& kv, const float* q, int G,
                      const std::vector<std::vector<int32_t>>& lists, float scale, float* o,
                      float* lse, ThreadPool& pool) {
  const int d = kv.head_dim();
  drive(kv, q, kv.num_kv_heads(), G, d, scale, [&](int h) { return int64_t(lists[size_t(h)].size()); },
        [&](int h, int64_t i) { return kv.k_row(h, lists[size_t(h)][size_t(i)]); },
        [&](int h, int64_t i) { return kv.v_row(h, lists[size_t(h)][size_t(i)]); }, o, lse, pool, true);
}

bool group_shares_list(const std::vector<std::vector<int32_t>>& lists, int h, int G) {
  const size_t h0 = size_t(h) * size_t(G);
  if (h0 + size_t(G) > lists.size()) return false;
  for (int g = 1; g < G; ++g)
    if (lists[h0 + size_t(g)] != lists[h0]) return false;
  return true;
}

void attend_gather_q(const KVLayer& kv, const float* q, int G,
                     const std::vector<std::vector<int32_t>>& lists, float scale, float* o,
                     float* lse, ThreadPool& pool) {
  const int d = kv.head_dim();
  const int hkv = kv.num_kv_heads();
  // A KV head whose G query heads share one list (lfps's kv_budget=cap sets, or every head attending
  // the same keys) is attended as a group: its rows are read once for the G heads, as for
  // attend_gather_kv. The other query heads are attended one by one.
  std::vector<int> grouped, single;
  for (int h = 0; h < hkv; ++h) {
    if (G > 1 && group_shares_list(lists, h, G)) {
      grouped.push_back(h);
    } else {
      for (int g = 0; g < G; ++g) single.push_back(h * G + g);
    }
  }
  drive(kv, q, int(grouped.size()), G, d, scale, [&](int h) { return int64_t(lists[size_t(h) * G].size()); },
        [&](int h, int64_t i) { return kv.k_row(h, lists[size_t(h) * G][size_t(i)]); },
        [&](int h, int64_t i) { return kv.v_row(h, lists[size_t(h) * G][size_t(i)]); }, o, lse, pool, true,
        grouped.data());
  drive(kv, q, int(single.size()), 1, d, scale, [&](int h) { return int64_t(lists[size_t(h)].size()); },
        [&](int h, int64_t i) { return kv.k_row(h / G, lists[size_t(h)][size_t(i)]); },
        [&](int h, int64_t i) { return kv.v_row(h / G, lists[size_t(h)][size_t(i)]); }, o, lse, pool, true,
        single.data());
}

void merge_states(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int H, int d) {
  for (int h = 0; h < H; ++h) {
    const float a = lse_a[h], b = lse_b[h];
    const float m = std::max(a, b);
    if (m == kNegInf) continue;  // both empty: stays empty
    const float l = m + std::log(std::exp(a - m) + std::exp(b - m));
    const float wa = std::exp(a - l), wb = std::exp(b - l);
    for (int i = 0; i < d; ++i) o_a[size_t(h) * d + i] = wa * o_a[size_t(h) * d + i] + wb * o_b[size_t(h) * d + i];
    lse_a[h] = l;
  }
}

void score_keys(const KVLayer& kv, int h, const float* q_group, int G, int64_t n, float scale,
                float* out, ThreadPool& pool) {
  const int d = kv.head_dim();
  const bool avx = use_avx2(d);
  const int64_t chunk = 4 * kPageTokens;
  const int64_t chunks = (n + chunk - 1) / chunk;
  pool.parallel_for(chunks, [&](int64_t c) {
    std::vector<float> buf(static_cast<size_t>(d)), qs(size_t(G) * d);
    for (size_t i = 0; i < qs.size(); ++i) qs[i] = q_group[i] * scale;
    const int64_t b = c * chunk, e = std::min(n, b + chunk);
    for (int64_t t = b; t < e; ++t) {
      if (avx) Avx2::convert(kv.k_row(h, t), kv.dtype(), d, buf.data());
      else Scalar::convert(kv.k_row(h, t), kv.dtype(), d, buf.data());
      for (int g = 0; g < G; ++g)
        out[size_t(g) * n + t] = avx ? Avx2::dot(qs.data() + size_t(g) * d, buf.data(), d)
                                     : Scalar::dot(qs.data() + size_t(g) * d, buf.data(), d);
    }
  });
}

void attend_rows(DType t, int d, int G, const float* q, float scale, const std::byte* const* k_rows,
                 const std::byte* const* v_rows, int64_t n, float* o, float* lse) {
  TaskScratch sc;
  State st = sc.init(G, d);
  sc.q.resize(size_t(G) * d);
  for (size_t i = 0; i < sc.q.size(); ++i) sc.q[i] = q[i] * scale;
  if (n > 0)
    run_chunk(pick_isa(d), st, sc.q.data(), t, 0, n, [&](int64_t i) { return k_rows[i]; },
              [&](int64_t i) { return v_rows[i]; }, sc, true);
  finish(st, o, lse);
}

namespace {
// out[g][i] = scale * q_g . row(i) for i < n, through the score pass of the block kernel (natural
// column order: st.x2 stays false), kBlock rows at a time. gathered: the rows are scattered, so the
// current block's rows go to L1 and the next block's to L2 key by key (Prefetch), as in run_chunk.
template <class RowAt>
void score_rows_at(DType t, int d, int G, const float* q, float scale, int64_t n, float* out, int64_t ld, RowAt row,
                   bool gathered) {
  if (ld <= 0) ld = n;
  const Isa isa = pick_isa(d);
  std::vector<float> qs(size_t(G) * d);
  for (size_t i = 0; i < qs.size(); ++i) qs[i] = q[i] * scale;
  if (isa == Isa::Scalar) {
    std::vector<float> buf(static_cast<size_t>(d));
    for (int64_t j = 0; j < n; ++j) {
      Scalar::convert(row(j), t, d, buf.data());
      for (int g = 0; g < G; ++g) out[size_t(g) * ld + j] = Scalar::dot(qs.data() + size_t(g) * d, buf.data(), d);
    }
    return;
  }
  State st{G, d, nullptr, nullptr, nullptr, nullptr};
  std::vector<float> s(size_t(G) * kBlock);
  const std::byte* kr[2][kBlock];  // this block's rows and the next one's
  const auto fill = [&](int buf, int64_t b) {
    const int cnt = int(std::min<int64_t>(kBlock, n - b));
    for (int j = 0; j < cnt; ++j) kr[buf][j] = row(b + j);
    return cnt;
  };
  Prefetch pf;
  pf.row_bytes = size_t(d) * dtype_size(t);
  int cur = 0, cnt = n > 0 ? fill(0, 0) : 0;
  for (int64_t b = 0; b < n; b += kBlock, cur ^= 1) {
    const int next_cnt = b + kBlock < n ? fill(cur ^ 1, b + kBlock) : 0;
    pf.now = kr[cur];
    pf.next_k = kr[cur ^ 1];
    pf.next_cnt = next_cnt;
    const Prefetch* p = gathered ? &pf : nullptr;
    heads_pass_any(isa, t, st, qs.data(), cnt, kr[cur], kr[cur], s.data(), false, p);
    for (int g = 0; g < G; ++g) std::memcpy(out + size_t(g) * ld + b, s.data() + size_t(g) * kBlock, size_t(cnt) * 4);
    cnt = next_cnt;
  }
}
}  // namespace

void score_rows(DType t, int d, int G, const float* q, float scale, const std::byte* const* k_rows, int64_t n,
                float* out, int64_t ld) {
  score_rows_at(t, d, G, q, scale, n, out, ld, [&](int64_t i) { return k_rows[i]; }, true);
}

void score_contig(DType t, int d, int G, const float* q, float scale, const std::byte* rows, int64_t n, float* out,
                  int64_t ld) {
  const size_t rb = size_t(d) * dtype_size(t);
  score_rows_at(t, d, G, q, scale, n, out, ld, [&](int64_t i) { return rows + size_t(i) * rb; }, false);
}

void accumulate_rows(DType t, int d, int G, const float* w, int64_t ldw, const std::byte* const* v_rows, int64_t n,
                     float* o) {
  if (n <= 0) return;
  const Isa isa = pick_isa(d);
  if (isa == Isa::Scalar) {
    std::vector<float> buf(static_cast<size_t>(d));
    for (int64_t j = 0; j < n; ++j) {
      Scalar::convert(v_rows[j], t, d, buf.data());
      for (int g = 0; g < G; ++g) {
        const float p = w[size_t(g) * size_t(ldw) + size_t(j)];
        for (int i = 0; i < d; ++i) o[size_t(g) * d + i] += p * buf[size_t(i)];
      }
    }
    return;
  }
  // The block kernel's value pass with a correction of 1 (nothing to rescale), kRun rows at a time,
  // the weights copied into its [G][kBlock] layout; bf16 rows in the paired column order where the
  // dense path uses it (only the accumulators are reordered: no q here).
  std::vector<float> corr(static_cast<size_t>(G), 1.f), s(size_t(G) * kBlock);
  State st{G, d, nullptr, nullptr, o, corr.data()};
  const X2 x2 = x2_mode(isa, t, d);
  x2_reorder(x2, o, G, d, true);
  st.x2 = x2 != X2::None;
  const size_t row_bytes = size_t(d) * dtype_size(t);
  // The rows are gathered (no hardware prefetcher can guess them): the value pass takes 16 rows at a
  // time, and before each run asks for the 16 rows 32 ahead (into L1: a trickle, where asking for a
  // whole next block of 64 at once stalled on the miss queue). Measured on a 16-core Xeon host
  // (docs/perf.md, "hgca's choice over all threads"): hgca's far attention and window 10-15% faster
  // than with the block burst.
  constexpr int64_t kRun = 16, kAhead = 32;
  const auto prefetch = [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < std::min(n, e); ++j)
      for (size_t off = 0; off < row_bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(v_rows[j]) + off, _MM_HINT_T0);
  };
  prefetch(0, kAhead);
  for (int64_t b = 0; b < n; b += kRun) {
    const int cnt = int(std::min<int64_t>(kRun, n - b));
    for (int g = 0; g < G; ++g) std::memcpy(s.data() + size_t(g) * kBlock, w + size_t(g) * size_t(ldw) + size_t(b), size_t(cnt) * 4);
    prefetch(b + kAhead, b + kAhead + kRun);
    heads_pass_any(isa, t, st, nullptr, cnt, v_rows + b, v_rows + b, s.data(), true, nullptr);
  }
  x2_reorder(x2, o, G, d, false);
}

// Eight independent lanes, which the compiler keeps in registers (and vectorises): a single
// running maximum is one long dependency chain.
float max_of(const float* x, int64_t n) {
  float m8[8];
  std::fill(m8, m8 + 8, kNegInf);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) m8[j] = x[i + j] > m8[j] ? x[i + j] : m8[j];
  for (; i < n; ++i) m8[0] = x[i] > m8[0] ? x[i] : m8[0];
  return *std::max_element(m8, m8 + 8);
}

int64_t argmax(const float* x, int64_t n) {
  const float m = max_of(x, n);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    bool any = false;
    for (int j = 0; j < 8; ++j) any |= x[i + j] == m;
    if (any) break;
  }
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;
}

void softmax_rows(float* x, int G, int64_t n, int64_t ld, float* lse) {
  for (int g = 0; g < G; ++g) {
    float* xg = x + size_t(g) * size_t(ld);
    const float mx = max_of(xg, n);
    const double l = exp_shift(xg, n, mx);
    lse[g] = mx + float(std::log(l));
    const float inv = float(1.0 / l);
    for (int64_t i = 0; i < n; ++i) xg[i] *= inv;
  }
}

namespace {
KVS_AVX512 double exp_shift512(float* x, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 s = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
    _mm512_storeu_ps(x + i, e);
    s = _mm512_add_ps(s, e);
  }
  float t[16];
  _mm512_storeu_ps(t, s);
  double sum = 0;
  for (int l = 0; l < 16; ++l) sum += t[l];
  for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - m));
  return sum;
}
}  // namespace

double exp_shift(float* x, int64_t n, float m) {
  // The lane count does not depend on d here: any vector width serves.
  const Isa isa = pick_isa(16);
  if (isa == Isa::Avx512) return exp_shift512(x, n, m);
  // The block kernels' exp (int counts): float sums per chunk, added in double.
  constexpr int64_t kChunk = int64_t(1) << 20;
  double sum = 0;
  for (int64_t b = 0; b < n; b += kChunk) {
    const int c = int(std::min(kChunk, n - b));
    float part = 0.f;
    if (isa == Isa::Avx2) Avx2::exp_block(x + b, c, m, &part);
    else Scalar::exp_block(x + b, c, m, &part);
    sum += part;
  }
  return sum;
}

}  // namespace kvs::cpu
