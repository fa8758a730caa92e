// Standalone tests of src/backends/cuda/cuda_attention.cu against float64 CPU references computed
// from the same bf16/fp16-rounded inputs. Prints "N passed, M failed"; exit 0 iff all pass.
// Exits 0 with "SKIPPED: no CUDA device" where no device is usable.
// Usage: test_cuda_attention [--small]   (--small: short contexts only, for compute-sanitizer)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/cuda_attention.cuh"

using kvs::cuda::Scalar;

namespace {

int g_pass = 0, g_fail = 0;
bool g_small = false;
int g_variant = 0;  // dense kernel variant under test (kvs::cuda::detail::set_dense_variant)

void report(bool ok, const std::string& name, const std::string& detail) {
  if (ok) ++g_pass;
  else ++g_fail;
  std::printf("%s %s %s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.c_str());
  std::fflush(stdout);
}

#define CK(call)                                                                         \
  do {                                                                                   \
    cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                             \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #call); \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

struct DevBuf {
  void* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t bytes = 0) { alloc(bytes); }
  void alloc(size_t bytes) {
    free();
    n = bytes;
    if (bytes) CK(cudaMalloc(&p, bytes));
  }
  void free() {
    if (p) cudaFree(p);
    p = nullptr;
  }
  ~DevBuf() { free(); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

template <typename T>
void upload(DevBuf& d, const std::vector<T>& h) {
  d.alloc(h.size() * sizeof(T));
  if (!h.empty()) CK(cudaMemcpy(d.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}
template <typename T>
std::vector<T> download(const DevBuf& d, size_t count) {
  std::vector<T> h(count);
  if (count) CK(cudaMemcpy(h.data(), d.p, count * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// 16-bit encode/decode on the host.
uint16_t enc(float x, Scalar t) {
  if (t == Scalar::BF16) {
    __nv_bfloat16 b = __float2bfloat16_rn(x);
    uint16_t u;
    std::memcpy(&u, &b, 2);
    return u;
  }
  __half h = __float2half_rn(x);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
float dec(uint16_t u, Scalar t) {
  if (t == Scalar::BF16) {
    uint32_t w = uint32_t(u) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  }
  __half h;
  std::memcpy(&h, &u, 2);
  return __half2float(h);
}
const char* sname(Scalar t) { return t == Scalar::F32 ? "f32" : t == Scalar::F16 ? "f16" : "bf16"; }

std::mt19937_64 g_rng(12345);
uint64_t g_x = 0x9e3779b97f4a7c15ull;  // xorshift64* for the bulk values (fast)
float urand(float lo, float hi) {
  g_x ^= g_x >> 12;
  g_x ^= g_x << 25;
  g_x ^= g_x >> 27;
  const uint64_t r = g_x * 0x2545f4914f6cdd1dull;
  return lo + (hi - lo) * float(r >> 40) * (1.f / 16777216.f);
}
int irand(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g_rng); }

// One batch of sequences with device-resident caches (the library's layout).
struct Problem {
  int B, Hq, Hkv, D, G;
  int64_t cap;
  Scalar kvt, qt, ot;
  float scale;
  std::vector<int> lens;          // per sequence
  std::vector<float> q;           // [B,Hq,D], values as the device sees them (rounded if 16-bit)
  std::vector<std::vector<float>> k, v;  // per sequence [Hkv, cap, D] as floats (rounded)
  DevBuf dq, dk_ptrs, dv_ptrs, dlens;
  std::vector<DevBuf*> dk, dv;
  ~Problem() {
    for (auto* p : dk) delete p;
    for (auto* p : dv) delete p;
  }
};

// Fills q, K, V with random (never zero-biased) values. Tokens at or past `valid_len(b,h)` are set
// to NaN on the device (poison: reading them would show up as NaN output).
void build(Problem& P, float qamp, const std::vector<std::vector<uint8_t>>* poison_mask = nullptr) {
  P.G = P.Hq / P.Hkv;
  const size_t qn = size_t(P.B) * P.Hq * P.D;
  P.q.resize(qn);
  std::vector<uint16_t> q16(qn);
  for (size_t i = 0; i < qn; ++i) {
    float x = urand(-qamp, qamp);
    if (P.qt != Scalar::F32) {
      q16[i] = enc(x, P.qt);
      x = dec(q16[i], P.qt);
    }
    P.q[i] = x;
  }
  if (P.qt == Scalar::F32) upload(P.dq, P.q);
  else upload(P.dq, q16);
  std::vector<uint64_t> kp(P.B), vp(P.B);
  P.k.assign(P.B, {});
  P.v.assign(P.B, {});
  const uint16_t nan16 = P.kvt == Scalar::BF16 ? 0x7fc0 : 0x7e00;
  for (int b = 0; b < P.B; ++b) {
    const size_t n = size_t(P.Hkv) * P.cap * P.D;
    std::vector<uint16_t> k16(n), v16(n);
    P.k[b].resize(n);
    P.v[b].resize(n);
    for (int h = 0; h < P.Hkv; ++h)
      for (int64_t t = 0; t < P.cap; ++t) {
        bool poison;
        if (poison_mask) poison = !(*poison_mask)[size_t(b) * P.Hkv + h][size_t(t)];
        else poison = t >= P.lens[b];
        for (int j = 0; j < P.D; ++j) {
          const size_t i = (size_t(h) * P.cap + t) * P.D + j;
          if (poison) {
            k16[i] = v16[i] = nan16;
            P.k[b][i] = P.v[b][i] = NAN;
            continue;
          }
          k16[i] = enc(urand(-1.f, 1.f), P.kvt);
          v16[i] = enc(urand(-1.f, 1.f) + 0.25f, P.kvt);
          P.k[b][i] = dec(k16[i], P.kvt);
          P.v[b][i] = dec(v16[i], P.kvt);
        }
      }
    P.dk.push_back(new DevBuf());
    P.dv.push_back(new DevBuf());
    upload(*P.dk.back(), k16);
    upload(*P.dv.back(), v16);
    kp[b] = reinterpret_cast<uint64_t>(P.dk.back()->p);
    vp[b] = reinterpret_cast<uint64_t>(P.dv.back()->p);
  }
  upload(P.dk_ptrs, kp);
  upload(P.dv_ptrs, vp);
  upload(P.dlens, P.lens);
}

// float64 attention over an explicit token list for query row (b, h).
void ref_attend(const Problem& P, int b, int h, const std::vector<int>& toks, std::vector<double>& o,
                double& lse) {
  const int kvh = h / P.G;
  const float* q = &P.q[(size_t(b) * P.Hq + h) * P.D];
  o.assign(P.D, 0.0);
  if (toks.empty()) {
    lse = -INFINITY;
    return;
  }
  std::vector<double> s(toks.size());
  double mx = -INFINITY;
  for (size_t i = 0; i < toks.size(); ++i) {
    const float* k = &P.k[b][(size_t(kvh) * P.cap + toks[i]) * P.D];
    double d = 0;
    for (int j = 0; j < P.D; ++j) d += double(q[j]) * double(k[j]);
    s[i] = d * double(P.scale);
    mx = std::max(mx, s[i]);
  }
  double sum = 0;
  for (size_t i = 0; i < toks.size(); ++i) {
    const double p = std::exp(s[i] - mx);
    sum += p;
    const float* v = &P.v[b][(size_t(kvh) * P.cap + toks[i]) * P.D];
    for (int j = 0; j < P.D; ++j) o[j] += p * double(v[j]);
  }
  for (int j = 0; j < P.D; ++j) o[j] /= sum;
  lse = mx + std::log(sum);
}

// Downloads o/lse (poisoned beforehand) and compares with the per-row references.
// rows_toks(b, h) returns the token list of that row.
template <typename F>
void check_output(const std::string& name, const Problem& P, const DevBuf& dout, const DevBuf& dlse,
                  F rows_toks) {
  const size_t rows = size_t(P.B) * P.Hq;
  std::vector<float> o(rows * P.D);
  if (P.ot == Scalar::F32) {
    o = download<float>(dout, rows * P.D);
  } else {
    auto o16 = download<uint16_t>(dout, rows * P.D);
    for (size_t i = 0; i < o.size(); ++i) o[i] = dec(o16[i], P.ot);
  }
  auto lse = download<float>(dlse, rows);
  double num = 0, den = 0, lse_err = 0;
  bool finite_ok = true, empty_ok = true;
  std::vector<double> ro;
  double rl;
  for (int b = 0; b < P.B; ++b)
    for (int h = 0; h < P.Hq; ++h) {
      const size_t row = size_t(b) * P.Hq + h;
      ref_attend(P, b, h, rows_toks(b, h), ro, rl);
      for (int j = 0; j < P.D; ++j) {
        const double x = o[row * P.D + j];
        if (!std::isfinite(x)) finite_ok = false;
        num += (x - ro[j]) * (x - ro[j]);
        den += ro[j] * ro[j];
      }
      if (std::isinf(rl)) {
        if (!(std::isinf(lse[row]) && lse[row] < 0)) empty_ok = false;
        for (int j = 0; j < P.D; ++j)
          if (o[row * P.D + j] != 0.f) empty_ok = false;
      } else {
        if (!std::isfinite(lse[row])) finite_ok = false;
        lse_err = std::max(lse_err, std::fabs(double(lse[row]) - rl));
      }
    }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  // fp32 outputs see only fp32 arithmetic (~1e-6); 16-bit outputs add their own rounding.
  const double tol = P.ot == Scalar::F32 ? 1e-4 : 1e-2;
  const bool ok = finite_ok && empty_ok && rel < tol && lse_err < 1e-3;
  char buf[256];
  std::snprintf(buf, sizeof buf, "rel_err=%.2e lse_abs_err=%.2e%s%s", rel, lse_err,
                finite_ok ? "" : " NON-FINITE/UNWRITTEN", empty_ok ? "" : " BAD-EMPTY");
  report(ok, name, buf);
}

kvs::cuda::AttnShape shape_of(const Problem& P) {
  kvs::cuda::AttnShape s;
  s.batch = P.B;
  s.num_q_heads = P.Hq;
  s.num_kv_heads = P.Hkv;
  s.head_dim = P.D;
  s.scale = P.scale;
  return s;
}

void run_dense(Scalar kvt, Scalar qt, Scalar ot, int D, int G, int Hkv, std::vector<int> lens,
               float qamp = 2.f, float scale = -1.f) {
  Problem P;
  P.B = int(lens.size());
  P.Hkv = Hkv;
  P.Hq = G * Hkv;
  P.D = D;
  P.kvt = kvt;
  P.qt = qt;
  P.ot = ot;
  P.scale = scale > 0 ? scale : 1.f / std::sqrt(float(D));
  P.lens = lens;
  const int maxlen = *std::max_element(lens.begin(), lens.end());
  P.cap = maxlen + 37;  // stride != length; tokens past each length are NaN-poisoned
  build(P, qamp);
  const auto s = shape_of(P);
  const size_t rows = size_t(P.B) * P.Hq;
  DevBuf dout(rows * D * (ot == Scalar::F32 ? 4 : 2)), dlse(rows * 4);
  CK(cudaMemset(dout.p, 0xff, dout.n));  // NaN poison
  CK(cudaMemset(dlse.p, 0xff, dlse.n));
  DevBuf ws(kvs::cuda::dense_decode_workspace_bytes(s, maxlen));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  kvs::cuda::Query q{P.dq.p, qt};
  kvs::cuda::KvCache kv{reinterpret_cast<const void* const*>(P.dk_ptrs.p),
                        reinterpret_cast<const void* const*>(P.dv_ptrs.p), P.cap, kvt};
  kvs::cuda::Output out{dout.p, ot, dlse.as<float>()};
  auto r = kvs::cuda::dense_decode(s, q, kv, P.dlens.as<int32_t>(), maxlen, out,
                                   kvs::cuda::Workspace{ws.p, ws.n}, st);
  CK(cudaStreamSynchronize(st));
  CK(cudaGetLastError());
  CK(cudaStreamDestroy(st));
  std::string lens_s;
  for (int l : lens) lens_s += (lens_s.empty() ? "" : ",") + std::to_string(l);
  char name[256];
  std::snprintf(name, sizeof name, "dense v%d kv=%s q=%s o=%s d=%d G=%d Hkv=%d B=%d lens=[%s] splits=%d",
                g_variant, sname(kvt), sname(qt), sname(ot), D, G, Hkv, P.B, lens_s.c_str(),
                kvs::cuda::decode_num_splits(s, maxlen, kvt));
  if (!r.ok()) {
    report(false, name, std::string("status ") + r.message);
    return;
  }
  check_output(name, P, dout, dlse, [&](int b, int) {
    std::vector<int> t(P.lens[b]);
    std::iota(t.begin(), t.end(), 0);
    return t;
  });
}

void run_gathered(Scalar kvt, Scalar qt, Scalar ot, int D, int G, int Hkv, int B, int cap,
                  int max_sel) {
  Problem P;
  P.B = B;
  P.Hkv = Hkv;
  P.Hq = G * Hkv;
  P.D = D;
  P.kvt = kvt;
  P.qt = qt;
  P.ot = ot;
  P.scale = 1.f / std::sqrt(float(D));
  P.lens.assign(B, cap);
  P.cap = cap;
  // Random subsets in random order; some heads empty, one head full-size.
  std::vector<int32_t> idx(size_t(B) * Hkv * max_sel, -7), cnt(size_t(B) * Hkv);
  std::vector<std::vector<int>> lists(size_t(B) * Hkv);
  std::vector<std::vector<uint8_t>> mask(size_t(B) * Hkv, std::vector<uint8_t>(cap, 0));
  std::vector<int> perm(cap);
  for (size_t sg = 0; sg < lists.size(); ++sg) {
    int n = irand(0, std::min(max_sel, cap));
    if (sg % 3 == 1) n = 0;
    if (sg == 2) n = std::min(max_sel, cap);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), g_rng);
    lists[sg].assign(perm.begin(), perm.begin() + n);
    cnt[sg] = n;
    for (int i = 0; i < n; ++i) {
      idx[sg * max_sel + i] = lists[sg][i];
      mask[sg][lists[sg][i]] = 1;
    }
  }
  build(P, 2.f, &mask);  // every unselected token is NaN: reading one would show
  DevBuf didx, dcnt;
  upload(didx, idx);
  upload(dcnt, cnt);
  const auto s = shape_of(P);
  const size_t rows = size_t(P.B) * P.Hq;
  DevBuf dout(rows * D * (ot == Scalar::F32 ? 4 : 2)), dlse(rows * 4);
  CK(cudaMemset(dout.p, 0xff, dout.n));
  CK(cudaMemset(dlse.p, 0xff, dlse.n));
  DevBuf ws(kvs::cuda::gathered_decode_workspace_bytes(s, max_sel));
  kvs::cuda::Query q{P.dq.p, qt};
  kvs::cuda::KvCache kv{reinterpret_cast<const void* const*>(P.dk_ptrs.p),
                        reinterpret_cast<const void* const*>(P.dv_ptrs.p), P.cap, kvt};
  kvs::cuda::Output out{dout.p, ot, dlse.as<float>()};
  auto r = kvs::cuda::gathered_decode(s, q, kv, didx.as<int32_t>(), dcnt.as<int32_t>(), max_sel,
                                      out, kvs::cuda::Workspace{ws.p, ws.n}, nullptr);
  CK(cudaDeviceSynchronize());
  CK(cudaGetLastError());
  char name[256];
  std::snprintf(name, sizeof name, "gathered kv=%s q=%s o=%s d=%d G=%d Hkv=%d B=%d cap=%d max_sel=%d",
                sname(kvt), sname(qt), sname(ot), D, G, Hkv, B, cap, max_sel);
  if (!r.ok()) {
    report(false, name, std::string("status ") + r.message);
    return;
  }
  check_output(name, P, dout, dlse, [&](int b, int h) { return lists[size_t(b) * Hkv + h / G]; });
}

void run_merge(int rows, int D, bool in_place) {
  std::vector<float> oa(size_t(rows) * D), ob(oa.size()), la(rows), lb(rows);
  for (int r = 0; r < rows; ++r) {
    la[r] = urand(-20.f, 20.f);
    lb[r] = urand(-20.f, 20.f);
    const int kind = r % 5;  // 0,1: both live; 2: a empty; 3: b empty; 4: both empty
    if (kind == 2 || kind == 4) la[r] = -INFINITY;
    if (kind == 3 || kind == 4) lb[r] = -INFINITY;
    if (r == 1) lb[r] = la[r];  // equal LSEs
    for (int j = 0; j < D; ++j) {
      oa[size_t(r) * D + j] = std::isinf(la[r]) ? 0.f : urand(-3.f, 3.f);
      ob[size_t(r) * D + j] = std::isinf(lb[r]) ? 0.f : urand(-3.f, 3.f);
    }
  }
  DevBuf doa, dob, dla, dlb, doo(oa.size() * 4), dlo(size_t(rows) * 4);
  upload(doa, oa);
  upload(dob, ob);
  upload(dla, la);
  upload(dlb, lb);
  CK(cudaMemset(doo.p, 0xff, doo.n));
  CK(cudaMemset(dlo.p, 0xff, dlo.n));
  float* o_out = in_place ? doa.as<float>() : doo.as<float>();
  float* l_out = in_place ? dla.as<float>() : dlo.as<float>();
  auto r = kvs::cuda::merge_states(doa.as<float>(), dla.as<float>(), dob.as<float>(), dlb.as<float>(),
                                   o_out, l_out, rows, D, nullptr);
  CK(cudaDeviceSynchronize());
  CK(cudaGetLastError());
  char name[128];
  std::snprintf(name, sizeof name, "merge rows=%d d=%d%s", rows, D, in_place ? " in-place" : "");
  if (!r.ok()) {
    report(false, name, std::string("status ") + r.message);
    return;
  }
  auto o = download<float>(in_place ? doa : doo, oa.size());
  auto l = download<float>(in_place ? dla : dlo, rows);
  double num = 0, den = 0, lerr = 0;
  bool ok = true;
  for (int r2 = 0; r2 < rows; ++r2) {
    const double a = la[r2], b = lb[r2];
    const double m = std::max(a, b);
    double lse = -INFINITY, wa = 0, wb = 0;
    if (!std::isinf(m)) {
      lse = m + std::log(std::exp(a - m) + std::exp(b - m));
      wa = std::exp(a - lse);
      wb = std::exp(b - lse);
    }
    if (std::isinf(lse)) {
      if (!(std::isinf(l[r2]) && l[r2] < 0)) ok = false;
    } else {
      if (!std::isfinite(l[r2])) ok = false;
      lerr = std::max(lerr, std::fabs(l[r2] - lse));
    }
    for (int j = 0; j < D; ++j) {
      const double ref = wa * oa[size_t(r2) * D + j] + wb * ob[size_t(r2) * D + j];
      const double x = o[size_t(r2) * D + j];
      if (!std::isfinite(x)) ok = false;
      num += (x - ref) * (x - ref);
      den += ref * ref;
    }
  }
  const double rel = std::sqrt(num / den);
  ok = ok && rel < 1e-5 && lerr < 1e-5;
  char buf[128];
  std::snprintf(buf, sizeof buf, "rel_err=%.2e lse_abs_err=%.2e", rel, lerr);
  report(ok, name, buf);
}

void run_topk(Scalar kvt, Scalar qt, int D, int G, int Hkv, std::vector<int> lens, int k) {
  Problem P;
  P.B = int(lens.size());
  P.Hkv = Hkv;
  P.Hq = G * Hkv;
  P.D = D;
  P.kvt = kvt;
  P.qt = qt;
  P.ot = Scalar::F32;
  P.scale = 1.f / std::sqrt(float(D));
  P.lens = lens;
  const int maxlen = *std::max_element(lens.begin(), lens.end());
  P.cap = maxlen + 5;
  build(P, 3.f);
  const auto s = shape_of(P);
  const size_t segs = size_t(P.B) * Hkv;
  DevBuf didx(segs * k * 4), dcnt(segs * 4);
  CK(cudaMemset(didx.p, 0x7f, didx.n));
  CK(cudaMemset(dcnt.p, 0x7f, dcnt.n));
  DevBuf ws(kvs::cuda::group_topk_workspace_bytes(s, maxlen, k));
  kvs::cuda::Query q{P.dq.p, qt};
  kvs::cuda::KvCache kv{reinterpret_cast<const void* const*>(P.dk_ptrs.p),
                        reinterpret_cast<const void* const*>(P.dv_ptrs.p), P.cap, kvt};
  auto r = kvs::cuda::group_topk(s, q, kv, P.dlens.as<int32_t>(), maxlen, k, didx.as<int32_t>(),
                                 dcnt.as<int32_t>(), kvs::cuda::Workspace{ws.p, ws.n}, nullptr);
  CK(cudaDeviceSynchronize());
  CK(cudaGetLastError());
  std::string lens_s;
  for (int l : lens) lens_s += (lens_s.empty() ? "" : ",") + std::to_string(l);
  char name[256];
  std::snprintf(name, sizeof name, "topk kv=%s q=%s d=%d G=%d Hkv=%d lens=[%s] k=%d", sname(kvt),
                sname(qt), D, G, Hkv, lens_s.c_str(), k);
  if (!r.ok()) {
    report(false, name, std::string("status ") + r.message);
    return;
  }
  auto idx = download<int32_t>(didx, segs * k);
  auto cnt = download<int32_t>(dcnt, segs);
  bool ok = true;
  std::string why;
  double worst_gap = 0;
  for (int b = 0; b < P.B; ++b)
    for (int h = 0; h < Hkv; ++h) {
      const int len = lens[b];
      // float64 group-summed softmax
      std::vector<double> score(len, 0.0);
      for (int g = 0; g < G; ++g) {
        const int qh = h * G + g;
        const float* qv = &P.q[(size_t(b) * P.Hq + qh) * D];
        std::vector<double> z(len);
        double mx = -INFINITY;
        for (int t = 0; t < len; ++t) {
          const float* kk = &P.k[b][(size_t(h) * P.cap + t) * D];
          double d = 0;
          for (int j = 0; j < D; ++j) d += double(qv[j]) * kk[j];
          z[t] = d * P.scale;
          mx = std::max(mx, z[t]);
        }
        double sum = 0;
        for (int t = 0; t < len; ++t) sum += std::exp(z[t] - mx);
        for (int t = 0; t < len; ++t) score[t] += std::exp(z[t] - mx) / sum;
      }
      const size_t seg = size_t(b) * Hkv + h;
      const int want = std::min(k, len);
      if (cnt[seg] != want) {
        ok = false;
        why = "count";
      }
      std::vector<double> sorted = score;
      std::sort(sorted.begin(), sorted.end(), std::greater<double>());
      const double kth = want > 0 ? sorted[want - 1] : 0;
      const double tol = 1e-5 * (sorted.empty() ? 1 : sorted[0]) + 1e-12;
      std::vector<uint8_t> seen(len, 0);
      double prev = INFINITY;
      for (int i = 0; i < k; ++i) {
        const int t = idx[seg * k + i];
        if (i >= want) {
          if (t != -1) { ok = false; why = "pad"; }
          continue;
        }
        if (t < 0 || t >= len || seen[t]) { ok = false; why = "range/dup"; continue; }
        seen[t] = 1;
        worst_gap = std::max(worst_gap, kth - score[t]);
        if (score[t] < kth - tol) { ok = false; why = "not top-k"; }
        if (score[t] > prev + tol) { ok = false; why = "order"; }
        prev = score[t];
      }
    }
  char buf[128];
  std::snprintf(buf, sizeof buf, "worst_below_kth=%.2e %s", worst_gap, why.c_str());
  report(ok, name, buf);
}

void run_errors() {
  kvs::cuda::AttnShape s;
  s.batch = 1;
  s.num_q_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 96;
  s.scale = 0.1f;
  auto r = kvs::cuda::dense_decode(s, {}, {}, nullptr, 0, {}, {}, nullptr);
  report(r.code == 3, "error: head_dim 96 -> UNSUPPORTED", r.message);
  s.head_dim = 64;
  s.num_q_heads = 3;
  r = kvs::cuda::dense_decode(s, {}, {}, nullptr, 0, {}, {}, nullptr);
  report(r.code == 1, "error: Hq % Hkv != 0 -> INVALID_ARGUMENT", r.message);
  s.num_q_heads = 4;
  r = kvs::cuda::dense_decode(s, {}, {}, nullptr, 0, {}, {}, nullptr);
  report(r.code == 1, "error: null pointers -> INVALID_ARGUMENT", r.message);
  r = kvs::cuda::merge_states(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 4, 64, nullptr);
  report(r.code == 1, "error: merge null -> INVALID_ARGUMENT", r.message);
}

}  // namespace

int run_session_tests();
int run_session_passed();

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--small") g_small = true;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;  // ctest's SKIP_RETURN_CODE (tests/CMakeLists.txt)
  }
  const Scalar BF = Scalar::BF16, F16 = Scalar::F16, F32 = Scalar::F32;
  const int L = g_small ? 1000 : 70000;

  run_errors();
  // Dense: d x G x lengths, B = 1 and B = 3 with different lengths. q/o dtypes alternate.
  int variant = 0;
  for (int D : {64, 128})
    for (int G : {1, 4, 8}) {
      for (int len : {1, 17, 1000, L}) {
        const Scalar qt = (variant & 1) ? BF : F32, ot = (variant & 2) ? BF : F32;
        ++variant;
        run_dense(BF, qt, ot, D, G, 2, {len});
      }
      run_dense(BF, F32, BF, D, G, 2, {17, L, 1000});
    }
  run_dense(F16, F32, F32, 64, 4, 2, {1, 1000, L});
  run_dense(F16, F16, F16, 128, 4, 2, {L, 17, 1000});
  run_dense(BF, F32, F32, 128, 3, 2, {1000, 5000});   // G not a power of two
  run_dense(BF, F32, F32, 128, 16, 1, {1000, 5000});  // G > 8: two query groups
  run_dense(BF, F32, F32, 64, 6, 3, {2500});
  run_dense(F16, F32, F32, 128, 8, 2, {L, 17, 1000});  // f16 through the tensor-core kernel
  run_dense(F16, F16, F16, 64, 8, 1, {3000});
  run_dense(BF, BF, F32, 128, 8, 8, {g_small ? 3000 : 131072});
  run_dense(BF, F32, F32, 128, 8, 2, {4000}, 4.f, 1.f);  // peaked softmax, tensor-core kernel
  run_dense(BF, F32, F32, 128, 4, 8, {g_small ? 3000 : 131072});  // the benchmark shape
  run_dense(BF, F32, F32, 128, 4, 2, {2000, 0, 333});  // an empty sequence
  run_dense(BF, F32, F32, 128, 4, 2, {4000}, 4.f, 1.f);  // peaked softmax
  // The other dense kernel variants (bf16 only): 1 = CUDA-core 4x4 for every group size,
  // 2, 3 = tensor-core kernel for every group size (padding small groups).
  for (int v = 1; v < 4; ++v) {
    if (!kvs::cuda::detail::set_dense_variant(v)) {
      report(false, "set_dense_variant", std::to_string(v));
      continue;
    }
    g_variant = v;
    for (int D : {64, 128})
      for (int G : {1, 4, 8}) {
        run_dense(BF, F32, BF, D, G, 2, {17, L / 7, 1000, 1});
        run_dense(BF, BF, F32, D, G, 2, {L / 3});
      }
    run_dense(BF, F32, F32, 128, 4, 8, {g_small ? 3000 : 131072});
  }
  kvs::cuda::detail::set_dense_variant(0);
  g_variant = 0;
  // Gathered: random subsets, empty lists, NaN on every unselected token.
  for (int D : {64, 128})
    for (int G : {1, 4, 8}) run_gathered(BF, (G & 4) ? BF : F32, (G & 1) ? BF : F32, D, G, 2, 2, g_small ? 1500 : 20000, g_small ? 700 : 3000);
  run_gathered(F16, F32, F32, 128, 4, 2, 3, 5000, 1024);
  run_gathered(F16, F16, F32, 128, 8, 2, 3, 5000, 1024);
  run_gathered(BF, F32, F32, 64, 6, 2, 2, 3000, 777);
  run_gathered(BF, F32, F32, 64, 2, 2, 1, 100, 17);
  // Merge
  for (int D : {64, 128, 5}) run_merge(37, D, false);
  run_merge(1000, 128, true);
  // Top-k
  for (int D : {64, 128})
    for (int G : {1, 4, 8}) run_topk(BF, F32, D, G, 2, {3000, 777}, 64);
  run_topk(BF, BF, 128, 4, 2, {3000, 777}, 1000);  // k > one length: padding with -1
  run_topk(F16, F32, 128, 2, 2, {500}, 1);
  if (!g_small) run_topk(BF, F32, 128, 4, 8, {65536}, 2048);
  std::printf("kernel tests: %d passed, %d failed\n", g_pass, g_fail);

#ifndef KVS_NO_SESSION_TESTS
  // Sessions through the C API, cuda backend against the CPU backend (test_cuda_session.cu).
  const int session_failures = run_session_tests();
  const int session_passed = run_session_passed();
#else  // the kernels-only build of tools/device/cuda_check.sh
  const int session_failures = 0, session_passed = 0;
#endif
  std::printf("%d passed, %d failed\n", g_pass + session_passed, g_fail + session_failures);
  return g_fail == 0 && session_failures == 0 ? 0 : 1;
}
