// SPDX-License-Identifier: Apache-2.0
// The backend consistency harness (in the spirit of ggml's test-backend-ops): every (method,
// placement) pair that exists in this build against the cpu placement, the reference, through the
// public C API only. For each case the same prompt and decode tokens go to cpu sessions (host
// tensors) and to the other placement's sessions (device tensors), and every step compares:
//   outputs: relative L2 error per query head <= 1e-2 (bf16/fp16 KV read by both; fp32 arithmetic)
//   lse:     |difference| <= 1e-3 (natural log)
//   keys:    the last selection of every KV head equal up to near-ties (>= 95% in common, the same
//            count; exactly equal for index-free methods)
// Cases: random data (several shapes, dtypes, GQA ratios, batches with different lengths and
// budgets; single decode, kvs_decode_batch and kvs_batch_plan/decode; append; kvs_session_to and save on one
// placement and load on the other; fork; csattention with the index built on the cpu and moved by
// kvs_session_to, its k-means being randomised) and a real trace (stories260K's q/k/v, padded with zero
// dimensions to head dim 64 so the GPU kernels take it: the attention pattern is the model's).
//
//   kvsieve_backend_tests [--small] [--trace FILE] [--backend cuda|hybrid] [--only-split]
// Prints PASS/FAIL lines and "N passed, M failed"; exits 77 (skipped) without a CUDA device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "kvsieve/kvsieve.h"
#include "../cuda/crash_report.hpp"
#include "../cuda/cuda_check.hpp"

namespace {

int g_pass = 0, g_fail = 0;
bool g_small = false;
// The placement checked against the cpu: cuda, or hybrid (--backend hybrid).
int32_t g_other = KVS_BACKEND_CUDA;

void report(bool ok, const std::string& name, const std::string& detail) {
  (ok ? g_pass : g_fail)++;
  std::printf("%s %s %s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.c_str());
  std::fflush(stdout);
}

bool ok(kvs_error_t e, const std::string& what) {
  if (!e) return true;
  report(false, what, kvs_error_message(e));
  kvs_error_destroy(e);
  return false;
}


const kvs_dtype F32{KVS_DTYPE_CODE_FLOAT, 32, 1};
kvs_dtype dt16(kvs_scalar_type s) {
  return s == KVS_SCALAR_BF16 ? kvs_dtype{KVS_DTYPE_CODE_BFLOAT, 16, 1} : kvs_dtype{KVS_DTYPE_CODE_FLOAT, 16, 1};
}

uint16_t f2h(float x, kvs_scalar_type s) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (s == KVS_SCALAR_BF16) return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  // fp16, round to nearest even (inputs are finite and in range here).
  const uint32_t sign = (u >> 16) & 0x8000;
  int32_t e = int32_t((u >> 23) & 0xff) - 127 + 15;
  uint32_t m = u & 0x7fffff;
  if (e <= 0) {
    if (e < -10) return uint16_t(sign);
    m |= 0x800000;
    const int shift = 14 - e;
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t r = (uint32_t(e) << 10) | (m >> 13);
  const uint32_t rem = m & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;
  return uint16_t(sign | r);
}

struct Tensor {
  kvs_tensor t{};
  int64_t shape[3]{};
  Tensor(const void* data, bool dev, kvs_dtype dt, std::initializer_list<int64_t> dims) {
    t.data = const_cast<void*>(data);
    t.device = kvs_device{dev ? KVS_DEVICE_CUDA : KVS_DEVICE_CPU, 0};
    t.ndim = int32_t(dims.size());
    t.dtype = dt;
    int i = 0;
    for (auto x : dims) shape[i++] = x;
    t.shape = shape;
  }
};

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t bytes) { KVS_TEST_CK(cudaMalloc(&p, bytes ? bytes : 16)); }
  // A copy from pageable memory may return before its DMA lands, and the tests read these buffers
  // on non-blocking streams, which do not wait for the default stream: synchronise first.
  template <class T>
  Dev(const std::vector<T>& h) : Dev(h.size() * sizeof(T)) {
    KVS_TEST_CK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    KVS_TEST_CK(cudaDeviceSynchronize());
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
};

// One sequence's tokens for every layer: q [T, Hq, d] f32, k/v [T, Hkv, d] f32 (already rounded to
// the KV dtype, so both placements store the same values).
struct Seq {
  std::vector<std::vector<float>> q, k, v;  // [layer]
};

struct Shape {
  int layers, hq, hkv, d;
  kvs_scalar_type kv;
  float scale;  // 0 = 1/sqrt(d)
};

float rnd16(float x, kvs_scalar_type s) {
  const uint16_t h = f2h(x, s);
  if (s == KVS_SCALAR_BF16) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  // fp16 -> f32
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  uint32_t u;
  if (e == 0) {
    if (m == 0) u = sign;
    else {
      int ee = -1;
      uint32_t mm = m;
      do {
        ++ee;
        mm <<= 1;
      } while (!(mm & 0x400));
      u = sign | uint32_t(127 - 15 - ee) << 23 | (mm & 0x3ff) << 13;
    }
  } else u = sign | (e - 15 + 127) << 23 | m << 13;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

Seq random_seq(const Shape& s, int64_t T, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  Seq q;
  q.q.resize(size_t(s.layers));
  q.k.resize(size_t(s.layers));
  q.v.resize(size_t(s.layers));
  for (int l = 0; l < s.layers; ++l) {
    q.q[size_t(l)].resize(size_t(T) * s.hq * s.d);
    q.k[size_t(l)].resize(size_t(T) * s.hkv * s.d);
    q.v[size_t(l)].resize(size_t(T) * s.hkv * s.d);
    for (auto& x : q.q[size_t(l)]) x = nd(rng);
    for (auto& x : q.k[size_t(l)]) x = rnd16(nd(rng), s.kv);
    for (auto& x : q.v[size_t(l)]) x = rnd16(nd(rng), s.kv);
    // Some keys stand out, as attention sinks and heavy hitters do in real models.
    for (int64_t t = 0; t < T; t += 29)
      for (int i = 0; i < s.hkv * s.d; ++i) q.k[size_t(l)][size_t(t) * s.hkv * s.d + i] = rnd16(3.f * q.k[size_t(l)][size_t(t) * s.hkv * s.d + i], s.kv);
  }
  return q;
}

std::vector<uint16_t> to16(const float* x, size_t n, kvs_scalar_type s) {
  std::vector<uint16_t> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = f2h(x[i], s);
  return r;
}

kvs_session_params params(const Shape& s, const char* method, const char* mp, double budget, int64_t budget_tokens,
                          int32_t backend) {
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = uint32_t(s.layers);
  p.num_q_heads = uint32_t(s.hq);
  p.num_kv_heads = uint32_t(s.hkv);
  p.head_dim = uint32_t(s.d);
  p.kv_dtype = s.kv;
  p.softmax_scale = s.scale;
  p.method = method;
  p.method_params = mp;
  p.budget = budget;
  p.budget_tokens = budget_tokens;
  p.backend = backend;
  return p;
}

// Tokens [t0, t1) of every layer into a session (prefill or append), from host (cpu) or device.
bool add(kvs_session_t s, bool dev, const Shape& sh, const Seq& q, int64_t t0, int64_t t1, bool append, const std::string& what) {
  const int64_t n = t1 - t0;
  for (int l = 0; l < sh.layers; ++l) {
    const float* qp = q.q[size_t(l)].data() + t0 * sh.hq * sh.d;
    const float* kp = q.k[size_t(l)].data() + t0 * sh.hkv * sh.d;
    const float* vp = q.v[size_t(l)].data() + t0 * sh.hkv * sh.d;
    kvs_error_t e;
    if (!dev) {
      Tensor tq(qp, false, F32, {n, sh.hq, sh.d}), tk(kp, false, F32, {n, sh.hkv, sh.d}), tv(vp, false, F32, {n, sh.hkv, sh.d});
      e = append ? kvs_session_append(s, uint32_t(l), &tq.t, &tk.t, &tv.t, nullptr, nullptr)
                 : kvs_session_prefill(s, uint32_t(l), &tq.t, &tk.t, &tv.t, nullptr, nullptr);
    } else {
      Dev dq(std::vector<float>(qp, qp + n * sh.hq * sh.d));
      Dev dk(to16(kp, size_t(n) * sh.hkv * sh.d, sh.kv)), dv(to16(vp, size_t(n) * sh.hkv * sh.d, sh.kv));
      Tensor tq(dq.p, true, F32, {n, sh.hq, sh.d}), tk(dk.p, true, dt16(sh.kv), {n, sh.hkv, sh.d}),
          tv(dv.p, true, dt16(sh.kv), {n, sh.hkv, sh.d});
      e = append ? kvs_session_append(s, uint32_t(l), &tq.t, &tk.t, &tv.t, nullptr, nullptr)
                 : kvs_session_prefill(s, uint32_t(l), &tq.t, &tk.t, &tv.t, nullptr, nullptr);
      KVS_TEST_CK(cudaDeviceSynchronize());
    }
    if (!ok(e, what)) return false;
  }
  return true;
}

struct Cmp {
  double err = 0, lse = 0;
  bool sel = true;
  std::string sel_detail;
};

void compare_out(const std::vector<float>& o, const std::vector<float>& lse, const std::vector<float>& ro,
                 const std::vector<float>& rl, int d, Cmp& c) {
  for (size_t r = 0; r < rl.size(); ++r) {
    double num = 0, den = 0;
    for (int i = 0; i < d; ++i) {
      const double a = o[r * d + size_t(i)], b = ro[r * d + size_t(i)];
      num += (a - b) * (a - b);
      den += b * b;
    }
    const double e = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    c.err = std::isfinite(e) ? std::max(c.err, e) : 1e9;
    const double le = std::isinf(rl[r]) && std::isinf(lse[r]) ? 0.0 : std::fabs(double(lse[r]) - double(rl[r]));
    c.lse = std::isfinite(le) ? std::max(c.lse, le) : 1e9;
  }
}

std::vector<int32_t> selection(kvs_session_t s, uint32_t layer, uint32_t h) {
  size_t n = 0;
  kvs_session_last_selection(s, layer, h, nullptr, 0, &n);
  std::vector<int32_t> v(n);
  kvs_session_last_selection(s, layer, h, v.data(), n, &n);
  return v;
}

void compare_sel(kvs_session_t a, kvs_session_t b, const Shape& sh, bool exact, Cmp& c) {
  for (int l = 0; l < sh.layers; ++l)
    for (int h = 0; h < sh.hkv; ++h) {
      auto x = selection(a, uint32_t(l), uint32_t(h)), y = selection(b, uint32_t(l), uint32_t(h));
      size_t common = 0;
      for (int32_t t : y) common += std::binary_search(x.begin(), x.end(), t);
      // The hybrid placement runs the cpu's own selection code: always exactly the same keys.
      if (g_other == KVS_BACKEND_HYBRID) exact = true;
      const bool good = exact ? x == y : (x.size() == y.size() && double(common) >= 0.95 * double(x.size()));
      if (!good && c.sel) {
        c.sel = false;
        c.sel_detail = "layer " + std::to_string(l) + " head " + std::to_string(h) + ": " + std::to_string(x.size()) +
                       " vs " + std::to_string(y.size()) + " keys, " + std::to_string(common) + " in common";
      }
    }
}

// One decode step of every layer: cpu sessions one by one on host tensors; the device sessions
// through `mode` (0 single decode, 1 kvs_decode_batch, 2 kvs_batch_plan + kvs_batch_decode).
void step(std::vector<kvs_session_t>& cpu, std::vector<kvs_session_t>& gpu, kvs_batch_t batch, int mode, const Shape& sh,
          const std::vector<Seq>& seqs, const std::vector<int64_t>& pos, cudaStream_t stream, Cmp& c, const std::string& name) {
  const int B = int(cpu.size());
  const size_t qs = size_t(sh.hq) * sh.d, ks = size_t(sh.hkv) * sh.d;
  if (mode == 2 && !ok(kvs_batch_plan(batch, stream), name + " kvs_batch_plan")) return;
  for (int l = 0; l < sh.layers; ++l) {
    std::vector<float> hq(B * qs), ro(B * qs), rl(size_t(B) * sh.hq);
    std::vector<uint16_t> hk(B * ks), hv(B * ks);
    for (int b = 0; b < B; ++b) {
      const auto& s = seqs[size_t(b)];
      const int64_t t = pos[size_t(b)];
      if (t < 0 || size_t(t + 1) * qs > s.q[size_t(l)].size()) {  // a test bug, not a crash
        report(false, name + " test data", "position " + std::to_string(t) + " past the generated tokens");
        return;
      }
      const float* qp = s.q[size_t(l)].data() + t * qs;
      const float* kp = s.k[size_t(l)].data() + t * ks;
      const float* vp = s.v[size_t(l)].data() + t * ks;
      std::copy(qp, qp + qs, hq.begin() + b * qs);
      auto k16 = to16(kp, ks, sh.kv), v16 = to16(vp, ks, sh.kv);
      std::copy(k16.begin(), k16.end(), hk.begin() + b * ks);
      std::copy(v16.begin(), v16.end(), hv.begin() + b * ks);
      Tensor tq(qp, false, F32, {sh.hq, sh.d}), tk(kp, false, F32, {sh.hkv, sh.d}), tv(vp, false, F32, {sh.hkv, sh.d});
      Tensor to(ro.data() + b * qs, false, F32, {sh.hq, sh.d}), tl(rl.data() + size_t(b) * sh.hq, false, F32, {sh.hq});
      if (!ok(kvs_session_decode(cpu[size_t(b)], uint32_t(l), &tq.t, &tk.t, &tv.t, &to.t, &tl.t, nullptr), name + " cpu decode")) return;
    }
    Dev dq(hq), dk(hk), dv(hv), dout(hq.size() * 4), dlse(rl.size() * 4);
    KVS_TEST_CK(cudaMemsetAsync(dout.p, 0xff, hq.size() * 4, stream));  // NaN poison
    KVS_TEST_CK(cudaMemsetAsync(dlse.p, 0xff, rl.size() * 4, stream));
    kvs_error_t e = nullptr;
    if (mode == 0) {
      for (int b = 0; b < B && !e; ++b) {
        Tensor gq(static_cast<float*>(dq.p) + b * qs, true, F32, {sh.hq, sh.d}),
            gk(static_cast<uint16_t*>(dk.p) + b * ks, true, dt16(sh.kv), {sh.hkv, sh.d}),
            gv(static_cast<uint16_t*>(dv.p) + b * ks, true, dt16(sh.kv), {sh.hkv, sh.d}),
            go(static_cast<float*>(dout.p) + b * qs, true, F32, {sh.hq, sh.d}),
            gl(static_cast<float*>(dlse.p) + size_t(b) * sh.hq, true, F32, {sh.hq});
        e = kvs_session_decode(gpu[size_t(b)], uint32_t(l), &gq.t, &gk.t, &gv.t, &go.t, &gl.t, stream);
      }
    } else {
      Tensor gq(dq.p, true, F32, {B, sh.hq, sh.d}), gk(dk.p, true, dt16(sh.kv), {B, sh.hkv, sh.d}),
          gv(dv.p, true, dt16(sh.kv), {B, sh.hkv, sh.d}), go(dout.p, true, F32, {B, sh.hq, sh.d}),
          gl(dlse.p, true, F32, {B, sh.hq});
      e = mode == 1 ? kvs_decode_batch(gpu.data(), size_t(B), uint32_t(l), &gq.t, &gk.t, &gv.t, &go.t, &gl.t, stream)
                    : kvs_batch_decode(batch, uint32_t(l), &gq.t, &gk.t, &gv.t, &go.t, &gl.t, stream);
    }
    if (!ok(e, name + " device decode")) return;
    KVS_TEST_CK(cudaStreamSynchronize(stream));
    std::vector<float> o(hq.size()), lse(rl.size());
    KVS_TEST_CK(cudaMemcpy(o.data(), dout.p, o.size() * 4, cudaMemcpyDeviceToHost));
    KVS_TEST_CK(cudaMemcpy(lse.data(), dlse.p, lse.size() * 4, cudaMemcpyDeviceToHost));
    compare_out(o, lse, ro, rl, sh.d, c);
  }
}

struct Case {
  const char* method;
  const char* params;
  double budget;
  int64_t budget_tokens;
  bool exact_sel;  // index-free selection: must match exactly
  // The index is built on the cpu and the cuda session made from it by kvs_session_to (methods
  // whose index build is randomised, csattention's k-means: both then decode with the same tables).
  bool cpu_index = false;
};

bool stat(kvs_session_t s, const char* name, double* out) {
  kvs_error_t e = kvs_session_method_stat(s, name, out);
  if (!e) return true;
  kvs_error_destroy(e);
  return false;
}

// Whether a hybrid session of this case takes the split step.
bool g_split_off = false;  // KVS_HYBRID_SPLIT=0 for the sessions being created
bool expect_split(const Case& m) {
  const std::string mp = m.params;
  if (g_split_off) return false;
  if (std::string(m.method) == "lfps") return mp.find("sinks=0") == std::string::npos;
  return std::string(m.method) == "ctkvr" && mp.find("merge=lse") == std::string::npos;
}

void run_case(const Case& m, const Shape& sh, std::vector<int64_t> n0, int steps, uint32_t seed) {
  const int B = int(n0.size());
  char label[256];
  std::snprintf(label, sizeof label, "%s(%s) budget=%g/%lld L=%d hq=%d hkv=%d d=%d %s B=%d n0=%lld", m.method, m.params,
                m.budget, (long long)m.budget_tokens, sh.layers, sh.hq, sh.hkv, sh.d,
                sh.kv == KVS_SCALAR_BF16 ? "bf16" : "f16", B, (long long)n0[0]);
  const std::string name = label;
  const int64_t extra = 40;  // the appended turn
  // Tokens read after the steps and the turn: the turn's step, save/load, kvs_session_to, and the
  // fork's own token one past the parent's (pos + 1), with one to spare.
  const int64_t tail = 6;
  std::vector<Seq> seqs;
  for (int b = 0; b < B; ++b) seqs.push_back(random_seq(sh, n0[size_t(b)] + steps + extra + tail, seed + uint32_t(b)));
  std::vector<kvs_session_t> cpu(static_cast<size_t>(B)), gpu(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) {
    auto pc = params(sh, m.method, m.params, m.budget, m.budget_tokens, KVS_BACKEND_CPU);
    auto pg = params(sh, m.method, m.params, m.budget, m.budget_tokens, g_other);
    if (!ok(kvs_session_create(&pc, &cpu[size_t(b)]), name + " create cpu")) return;
    if (!add(cpu[size_t(b)], false, sh, seqs[size_t(b)], 0, n0[size_t(b)], false, name + " prefill cpu")) return;
    if (m.cpu_index) {
      if (!ok(kvs_session_build_index(cpu[size_t(b)], nullptr), name + " build cpu")) return;
      if (!ok(kvs_session_to(cpu[size_t(b)], g_other, 0, &gpu[size_t(b)]), name + " to cuda")) return;
      continue;
    }
    if (!ok(kvs_session_create(&pg, &gpu[size_t(b)]), name + " create cuda")) return;
    // The device prompt in two chunks (prefill chunks must compose).
    const int64_t half = n0[size_t(b)] / 2;
    if (half > 0 && !add(gpu[size_t(b)], true, sh, seqs[size_t(b)], 0, half, false, name + " prefill cuda")) return;
    if (!add(gpu[size_t(b)], true, sh, seqs[size_t(b)], half, n0[size_t(b)], false, name + " prefill cuda")) return;
    if (!ok(kvs_session_build_index(cpu[size_t(b)], nullptr), name + " build cpu")) return;
    if (!ok(kvs_session_build_index(gpu[size_t(b)], nullptr), name + " build cuda")) return;
  }
  kvs_batch_t batch = nullptr;
  if (!ok(kvs_batch_create(gpu.data(), size_t(B), &batch), name + " kvs_batch_create")) return;
  cudaStream_t stream;
  KVS_TEST_CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Cmp c;
  std::vector<int64_t> pos = n0;
  for (int s = 0; s < steps; ++s) {
    step(cpu, gpu, batch, B == 1 ? (s % 2 ? 2 : 0) : s % 3, sh, seqs, pos, stream, c, name);
    compare_sel(cpu[0], gpu[0], sh, m.exact_sel, c);
    for (auto& p : pos) ++p;
  }
  report(c.err <= 1e-2 && c.lse <= 1e-3, name + " decode",
         "rel err " + std::to_string(c.err) + ", lse err " + std::to_string(c.lse));
  report(c.sel, name + " selections", c.sel_detail);

  // A chat turn appended on both, then a step.
  Cmp a;
  for (int b = 0; b < B; ++b) {
    if (!add(cpu[size_t(b)], false, sh, seqs[size_t(b)], pos[size_t(b)], pos[size_t(b)] + extra, true, name + " append cpu")) return;
    if (!add(gpu[size_t(b)], true, sh, seqs[size_t(b)], pos[size_t(b)], pos[size_t(b)] + extra, true, name + " append cuda")) return;
    pos[size_t(b)] += extra;
  }
  step(cpu, gpu, batch, 2, sh, seqs, pos, stream, a, name);
  compare_sel(cpu[0], gpu[0], sh, m.exact_sel, a);
  for (auto& p : pos) ++p;
  report(a.err <= 1e-2 && a.lse <= 1e-3 && a.sel, name + " append",
         "rel err " + std::to_string(a.err) + ", lse err " + std::to_string(a.lse) + " " + a.sel_detail);

  // Statistics agree (keys attended on the last step, steps counted).
  kvs_session_stats sc, sg;
  sc.struct_size = sg.struct_size = sizeof(kvs_session_stats);
  kvs_session_get_stats(cpu[0], &sc);
  kvs_session_get_stats(gpu[0], &sg);
  const bool pq = std::strstr(m.params, "per_query_head") != nullptr;  // cpu: union over the group
  report(sc.decode_steps == sg.decode_steps && sc.tokens == sg.tokens &&
             (pq || std::fabs(sc.last_selected_keys - sg.last_selected_keys) <= 0.05 * sc.last_selected_keys + 1),
         name + " stats",
         "steps " + std::to_string(sc.decode_steps) + "/" + std::to_string(sg.decode_steps) + ", keys " +
             std::to_string(sc.last_selected_keys) + "/" + std::to_string(sg.last_selected_keys));

  // The hybrid's split step (methods with a static set: lfps, ctkvr with merge=union): the static
  // keys attended on the GPU, the rest of the selection on the CPU, as its statistics say.
  if (g_other == KVS_BACKEND_HYBRID) {
    const bool want = expect_split(m);
    double on = -1, gk = -1, hk = -1;
    bool good = stat(gpu[0], "hybrid_split", &on) && on == (want ? 1.0 : 0.0);
    if (want) good = good && stat(gpu[0], "hybrid_static_keys", &gk) && gk > 0 && stat(gpu[0], "hybrid_host_keys", &hk) && hk > 0;
    report(good, name + " split step",
           "hybrid_split " + std::to_string(on) + " (expected " + (want ? "1" : "0") + "), static keys on the GPU " +
               std::to_string(gk) + ", keys per list on the CPU " + std::to_string(hk));
  }

  // Save on each placement (tables + KV), load on the other, decode one more step on all four.
  if (B == 1) {
    // Per process: two harness runs at once (e.g. --backend cuda and hybrid) must not share files.
    const std::string tag = std::to_string(long(getpid()));
    const std::string fc = "/tmp/kvs_consistency_cpu_" + tag + ".kvt", fg = "/tmp/kvs_consistency_gpu_" + tag + ".kvt";
    Cmp x;
    if (ok(kvs_session_save(cpu[0], fc.c_str(), KVS_SAVE_INCLUDE_KV), name + " save cpu") &&
        ok(kvs_session_save(gpu[0], fg.c_str(), KVS_SAVE_INCLUDE_KV), name + " save cuda")) {
      kvs_load_params lc, lg;
      kvs_load_params_init(&lc);
      kvs_load_params_init(&lg);
      lc.backend = g_other;  // the cpu-built file onto the GPU
      lg.backend = KVS_BACKEND_CPU;   // the GPU-built file onto the CPU
      std::vector<kvs_session_t> cpu2(1), gpu2(1);
      if (ok(kvs_session_load(fc.c_str(), &lc, &gpu2[0]), name + " load cpu file on cuda") &&
          ok(kvs_session_load(fg.c_str(), &lg, &cpu2[0]), name + " load cuda file on cpu")) {
        step(cpu2, gpu2, nullptr, 0, sh, seqs, pos, stream, x, name + " loaded");
        compare_sel(cpu2[0], gpu2[0], sh, m.exact_sel, x);
        // The two originals take the same step and must agree with the loaded ones.
        Cmp y;
        step(cpu, gpu, batch, 0, sh, seqs, pos, stream, y, name + " originals");
        report(x.err <= 1e-2 && x.lse <= 1e-3 && x.sel && y.err <= 1e-2, name + " save/load across placements",
               "rel err " + std::to_string(x.err) + ", lse err " + std::to_string(x.lse) + " " + x.sel_detail);
        for (auto& p : pos) ++p;
      }
      kvs_session_destroy(cpu2[0]);
      kvs_session_destroy(gpu2[0]);
    }
    std::remove(fc.c_str());
    std::remove(fg.c_str());

    // kvs_session_to, in memory: the cpu session onto the GPU and the GPU session onto the cpu;
    // one more step on all four, as after save/load.
    {
      std::vector<kvs_session_t> cpu3(1), gpu3(1);
      Cmp x, y;
      if (ok(kvs_session_to(cpu[0], g_other, 0, &gpu3[0]), name + " to cuda") &&
          ok(kvs_session_to(gpu[0], KVS_BACKEND_CPU, 0, &cpu3[0]), name + " to cpu")) {
        step(cpu3, gpu3, nullptr, 0, sh, seqs, pos, stream, x, name + " moved");
        compare_sel(cpu3[0], gpu3[0], sh, m.exact_sel, x);
        step(cpu, gpu, batch, 0, sh, seqs, pos, stream, y, name + " originals after move");
        report(x.err <= 1e-2 && x.lse <= 1e-3 && x.sel && y.err <= 1e-2, name + " kvs_session_to across placements",
               "rel err " + std::to_string(x.err) + ", lse err " + std::to_string(x.lse) + " " + x.sel_detail);
        for (auto& p : pos) ++p;
      }
      kvs_session_destroy(cpu3[0]);
      kvs_session_destroy(gpu3[0]);
    }

    // Fork on the device: the fork and its parent take different tokens; the parent matches a cpu
    // fork that took the parent's token, the fork matches the cpu parent fed the fork's token.
    kvs_session_t gfork = nullptr, cfork = nullptr;
    if (ok(kvs_session_fork(gpu[0], &gfork), name + " fork cuda") && ok(kvs_session_fork(cpu[0], &cfork), name + " fork cpu")) {
      std::vector<kvs_session_t> cf{cfork}, gf{gfork};
      Cmp f1, f2;
      std::vector<int64_t> other{pos[0] + 1};
      step(cf, gf, nullptr, 0, sh, seqs, other, stream, f1, name + " fork");
      step(cpu, gpu, batch, 0, sh, seqs, pos, stream, f2, name + " parent after fork");
      report(f1.err <= 1e-2 && f2.err <= 1e-2 && f1.lse <= 1e-3 && f2.lse <= 1e-3, name + " fork",
             "fork rel err " + std::to_string(f1.err) + ", parent rel err " + std::to_string(f2.err));
    }
    kvs_session_destroy(gfork);
    kvs_session_destroy(cfork);
  }
  kvs_batch_destroy(batch);
  KVS_TEST_CK(cudaStreamDestroy(stream));
  for (int b = 0; b < B; ++b) {
    kvs_session_destroy(cpu[size_t(b)]);
    kvs_session_destroy(gpu[size_t(b)]);
  }
}

// The hybrid backend with its steps queued ahead of the CPU (quest: the unsplit step; ctkvr: the
// split step): every layer of 40 decoded for 3 tokens
// across a page boundary (each step takes a new pinned page inside a host function: reserved before
// it was queued) without a synchronisation, on two streams in turn, then compared with the cpu; and
// a step whose host part fails (a NaN in k_new): the call returns, the step and the ones queued
// after it on the session are taken back, the next call returns the error, and decoding then goes
// on as on a cpu session that never saw the bad token.
void run_hybrid_queue(const char* method) {
  const Shape sh{40, 8, 2, 64, KVS_SCALAR_BF16, 0.f};
  const int64_t n0 = 255, steps = 3;
  const std::string name = std::string("hybrid queued steps (") + method + ", 40 layers, page boundary, two streams)";
  Seq sq = random_seq(sh, n0 + steps + 2, 77);
  auto pc = params(sh, method, "", 0.2, 0, KVS_BACKEND_CPU), pg = params(sh, method, "", 0.2, 0, KVS_BACKEND_HYBRID);
  kvs_session_t cpu = nullptr, hyb = nullptr;
  if (!ok(kvs_session_create(&pc, &cpu), name + " create cpu") || !ok(kvs_session_create(&pg, &hyb), name + " create")) return;
  add(cpu, false, sh, sq, 0, n0, false, name);
  add(hyb, true, sh, sq, 0, n0, false, name);
  kvs_session_build_index(cpu, nullptr);
  kvs_session_build_index(hyb, nullptr);
  cudaStream_t st[2];
  for (auto& x : st) KVS_TEST_CK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  const size_t qs = size_t(sh.hq) * sh.d, ks = size_t(sh.hkv) * sh.d;
  const size_t per = size_t(steps) * sh.layers;
  std::vector<float> hq(per * qs);
  std::vector<uint16_t> hk(per * ks), hv(per * ks);
  std::vector<float> ro(per * qs), rl(per * sh.hq);
  for (int64_t s = 0; s < steps; ++s)
    for (int l = 0; l < sh.layers; ++l) {
      const size_t i = size_t(s) * sh.layers + size_t(l);
      const int64_t t = n0 + s;
      const float* qp = sq.q[size_t(l)].data() + t * qs;
      const float* kp = sq.k[size_t(l)].data() + t * ks;
      const float* vp = sq.v[size_t(l)].data() + t * ks;
      std::copy(qp, qp + qs, hq.begin() + std::ptrdiff_t(i * qs));
      auto k16 = to16(kp, ks, sh.kv), v16 = to16(vp, ks, sh.kv);
      std::copy(k16.begin(), k16.end(), hk.begin() + std::ptrdiff_t(i * ks));
      std::copy(v16.begin(), v16.end(), hv.begin() + std::ptrdiff_t(i * ks));
      Tensor tq(qp, false, F32, {sh.hq, sh.d}), tk(kp, false, F32, {sh.hkv, sh.d}), tv(vp, false, F32, {sh.hkv, sh.d});
      Tensor to(ro.data() + i * qs, false, F32, {sh.hq, sh.d}), tl(rl.data() + i * sh.hq, false, F32, {sh.hq});
      if (!ok(kvs_session_decode(cpu, uint32_t(l), &tq.t, &tk.t, &tv.t, &to.t, &tl.t, nullptr), name + " cpu decode")) return;
    }
  Dev dq(hq), dk(hk), dv(hv), dout(hq.size() * 4), dlse(rl.size() * 4);
  for (size_t i = 0; i < per; ++i) {
    const int l = int(i % size_t(sh.layers));
    Tensor gq(static_cast<float*>(dq.p) + i * qs, true, F32, {sh.hq, sh.d}),
        gk(static_cast<uint16_t*>(dk.p) + i * ks, true, dt16(sh.kv), {sh.hkv, sh.d}),
        gv(static_cast<uint16_t*>(dv.p) + i * ks, true, dt16(sh.kv), {sh.hkv, sh.d}),
        go(static_cast<float*>(dout.p) + i * qs, true, F32, {sh.hq, sh.d}),
        gl(static_cast<float*>(dlse.p) + i * sh.hq, true, F32, {sh.hq});
    if (!ok(kvs_session_decode(hyb, uint32_t(l), &gq.t, &gk.t, &gv.t, &go.t, &gl.t, st[(i / sh.layers) % 2]),
            name + " decode"))
      return;
  }
  int64_t toks = 0;
  kvs_session_layer_tokens(hyb, 0, &toks);  // counts the steps in flight
  std::vector<float> o(hq.size()), lse(rl.size());
  KVS_TEST_CK(cudaDeviceSynchronize());
  KVS_TEST_CK(cudaMemcpy(o.data(), dout.p, o.size() * 4, cudaMemcpyDeviceToHost));
  KVS_TEST_CK(cudaMemcpy(lse.data(), dlse.p, lse.size() * 4, cudaMemcpyDeviceToHost));
  Cmp c;
  compare_out(o, lse, ro, rl, sh.d, c);
  report(c.err <= 1e-2 && c.lse <= 1e-3 && toks == n0 + steps, name,
         "rel err " + std::to_string(c.err) + ", lse err " + std::to_string(c.lse) + ", tokens " + std::to_string(toks));

  // A failing host part: NaN in k_new of layer 1's next token; layers 1 and 2 queued behind it.
  const std::string fname = std::string("hybrid deferred error (") + method + ", NaN k_new)";
  const int64_t t = n0 + steps;
  std::vector<uint16_t> bad(ks, 0x7fc0);  // bf16 NaN
  Dev dbad(bad);
  // The error comes with the session's next call after the failed step ran: the call queueing
  // layer 2 if the CPU was quick, else the statistics (which wait); exactly once either way.
  bool good = true;
  int reported = 0;
  std::string msg = "(no error)";
  auto seen = [&](kvs_error_t e) {
    if (!e) return;
    if (std::strstr(kvs_error_message(e), "k_new")) ++reported;
    else good = false;
    msg = kvs_error_message(e);
    kvs_error_destroy(e);
  };
  for (int l = 1; l <= 2; ++l) {
    Tensor gq(static_cast<float*>(dq.p), true, F32, {sh.hq, sh.d}),
        gk(l == 1 ? dbad.p : dk.p, true, dt16(sh.kv), {sh.hkv, sh.d}), gv(dv.p, true, dt16(sh.kv), {sh.hkv, sh.d}),
        go(dout.p, true, F32, {sh.hq, sh.d}), gl(dlse.p, true, F32, {sh.hq});
    kvs_error_t e = kvs_session_decode(hyb, uint32_t(l), &gq.t, &gk.t, &gv.t, &go.t, &gl.t, st[0]);
    if (l == 1) good &= ok(e, fname + " queued");
    else seen(e);
  }
  int64_t t1 = -1, t2 = -1;
  kvs_session_stats stt;
  stt.struct_size = sizeof(stt);
  seen(kvs_session_get_stats(hyb, &stt));
  seen(kvs_session_get_stats(hyb, &stt));  // once only
  kvs_session_layer_tokens(hyb, 1, &t1);
  kvs_session_layer_tokens(hyb, 2, &t2);
  // The failed and refused steps wrote zeros (with the split step too: its GPU part is not merged).
  KVS_TEST_CK(cudaDeviceSynchronize());
  std::vector<float> z(qs);
  KVS_TEST_CK(cudaMemcpy(z.data(), dout.p, qs * 4, cudaMemcpyDeviceToHost));
  bool zeros = true;
  for (float x : z) zeros = zeros && x == 0.f;
  // Then the good token on layers 1 and 2 matches the cpu's step.
  Cmp d;
  for (int l = 1; l <= 2 && good; ++l) {
    const float* qp = sq.q[size_t(l)].data() + t * qs;
    const float* kp = sq.k[size_t(l)].data() + t * ks;
    const float* vp = sq.v[size_t(l)].data() + t * ks;
    std::vector<float> co(qs), cl(size_t(sh.hq));
    Tensor tq(qp, false, F32, {sh.hq, sh.d}), tk(kp, false, F32, {sh.hkv, sh.d}), tv(vp, false, F32, {sh.hkv, sh.d}),
        to(co.data(), false, F32, {sh.hq, sh.d}), tl(cl.data(), false, F32, {sh.hq});
    good &= ok(kvs_session_decode(cpu, uint32_t(l), &tq.t, &tk.t, &tv.t, &to.t, &tl.t, nullptr), fname + " cpu");
    std::vector<float> q1(qp, qp + qs);
    auto k16 = to16(kp, ks, sh.kv), v16 = to16(vp, ks, sh.kv);
    Dev gq1(q1), gk1(k16), gv1(v16), go1(qs * 4), gl1(size_t(sh.hq) * 4);
    Tensor gq(gq1.p, true, F32, {sh.hq, sh.d}), gk(gk1.p, true, dt16(sh.kv), {sh.hkv, sh.d}),
        gv(gv1.p, true, dt16(sh.kv), {sh.hkv, sh.d}), go(go1.p, true, F32, {sh.hq, sh.d}), gl(gl1.p, true, F32, {sh.hq});
    good &= ok(kvs_session_decode(hyb, uint32_t(l), &gq.t, &gk.t, &gv.t, &go.t, &gl.t, st[1]), fname + " after");
    KVS_TEST_CK(cudaStreamSynchronize(st[1]));
    std::vector<float> ho(qs), hl(size_t(sh.hq));
    KVS_TEST_CK(cudaMemcpy(ho.data(), go1.p, qs * 4, cudaMemcpyDeviceToHost));
    KVS_TEST_CK(cudaMemcpy(hl.data(), gl1.p, hl.size() * 4, cudaMemcpyDeviceToHost));
    compare_out(ho, hl, co, cl, sh.d, d);
  }
  report(good && reported == 1 && zeros && t1 == t && t2 == t && d.err <= 1e-2 && d.lse <= 1e-3, fname,
         msg.substr(0, 160) + "; tokens " + std::to_string(t1) + "/" + std::to_string(t2) + " (want " +
             std::to_string(t) + "), outputs of the failed step " + (zeros ? "zeros" : "NOT zeros") +
             ", then rel err " + std::to_string(d.err));
  for (auto& x : st) KVS_TEST_CK(cudaStreamDestroy(x));
  kvs_session_destroy(cpu);
  kvs_session_destroy(hyb);
}

// A real trace: stories260K (head dim 8) zero-padded to head dim 64; scale stays 1/sqrt(8).
void run_trace(const char* path) {
  kvs_trace_t tr = nullptr;
  if (!ok(kvs_trace_open(path, &tr), std::string("open trace ") + path)) return;
  kvs_trace_info info;
  kvs_trace_info_init(&info);
  kvs_trace_get_info(tr, &info);
  const int D = 64, d0 = int(info.head_dim);
  Shape sh{int(info.num_present_layers), int(info.num_q_heads), int(info.num_kv_heads), D, KVS_SCALAR_BF16,
           info.softmax_scale};
  Seq s;
  const int64_t T = info.total_len;
  for (uint32_t i = 0; i < info.num_present_layers; ++i) {
    uint32_t layer = 0;
    kvs_trace_layer_index(tr, i, &layer);
    std::vector<float> out[3];
    const char* names[3] = {"q", "k", "v"};
    for (int w = 0; w < 3; ++w) {
      kvs_tensor t{};
      if (!ok(kvs_trace_tensor(tr, layer, names[w], &t), "trace tensor")) return;
      const int H = int(t.shape[1]);
      out[w].assign(size_t(T) * H * D, 0.f);
      const float* src = static_cast<const float*>(t.data);  // F32 traces (stories260k.py)
      for (int64_t r = 0; r < T * H; ++r)
        for (int j = 0; j < d0; ++j)
          out[w][size_t(r) * D + j] = w ? rnd16(src[r * d0 + j], sh.kv) : src[r * d0 + j];
    }
    s.q.push_back(std::move(out[0]));
    s.k.push_back(std::move(out[1]));
    s.v.push_back(std::move(out[2]));
  }
  kvs_trace_destroy(tr);
  const int64_t n0 = info.prefill_len, steps = g_small ? 16 : T - n0 - 1;
  const Case cases[] = {{"full", "", 0, 0, true},
                        {"exact_topk", "", 0.1, 0, false},
                        {"exact_topk", "mode=per_query_head,sinks=4,local=16", 0.2, 0, false},
                        {"streaming", "", 0.1, 0, true},
                        {"quest", "gqa=sum", 0.2, 0, false},
                        {"quest", "gqa=per_query_head", 0.2, 0, false},
                        {"csattention", "", 0.1, 0, false, true},
                        {"csattention", "gqa=per_query_head,sinks=4", 0.2, 0, false, true}};
  for (const auto& m : cases) {
    std::vector<kvs_session_t> cpu(1), gpu(1);
    auto pc = params(sh, m.method, m.params, m.budget, m.budget_tokens, KVS_BACKEND_CPU);
    auto pg = params(sh, m.method, m.params, m.budget, m.budget_tokens, g_other);
    const std::string name = std::string("trace ") + m.method + "(" + m.params + ")";
    if (!ok(kvs_session_create(&pc, &cpu[0]), name)) return;
    add(cpu[0], false, sh, s, 0, n0, false, name);
    kvs_session_build_index(cpu[0], nullptr);
    if (m.cpu_index) {
      if (!ok(kvs_session_to(cpu[0], g_other, 0, &gpu[0]), name + " to cuda")) return;
    } else {
      if (!ok(kvs_session_create(&pg, &gpu[0]), name)) return;
      add(gpu[0], true, sh, s, 0, n0, false, name);
      kvs_session_build_index(gpu[0], nullptr);
    }
    cudaStream_t stream;
    KVS_TEST_CK(cudaStreamCreate(&stream));
    Cmp c;
    std::vector<int64_t> pos{n0};
    const std::vector<Seq> seqs{s};
    for (int64_t t = 0; t < steps; ++t, ++pos[0]) {
      step(cpu, gpu, nullptr, 0, sh, seqs, pos, stream, c, name);
      compare_sel(cpu[0], gpu[0], sh, m.exact_sel, c);
    }
    report(c.err <= 1e-2 && c.lse <= 1e-3 && c.sel, name + " " + std::to_string(steps) + " steps",
           "rel err " + std::to_string(c.err) + ", lse err " + std::to_string(c.lse) + " " + c.sel_detail);
    KVS_TEST_CK(cudaStreamDestroy(stream));
    kvs_session_destroy(cpu[0]);
    kvs_session_destroy(gpu[0]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  install_crash_report();
  const char* trace = nullptr;
  bool only_split = false;  // --only-split (with --backend hybrid): the split step's cases alone
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--small") g_small = true;
    if (std::string(argv[i]) == "--only-split") only_split = true;
    if (std::string(argv[i]) == "--trace" && i + 1 < argc) trace = argv[++i];
    if (std::string(argv[i]) == "--backend" && i + 1 < argc) {
      const std::string b = argv[++i];
      if (b != "cuda" && b != "hybrid") {
        std::fprintf(stderr, "--backend: expected cuda or hybrid, got %s\n", b.c_str());
        return 2;
      }
      g_other = b == "hybrid" ? KVS_BACKEND_HYBRID : KVS_BACKEND_CUDA;
    }
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  // Which pairs exist in this build: every method the other placement runs.
  std::printf("methods on %s:", g_other == KVS_BACKEND_HYBRID ? "hybrid" : "cuda");
  for (size_t i = 0; i < kvs_method_count(); ++i) {
    const char* m = kvs_method_name(i);
    const char* why = kvs_method_unsupported_reason(m, g_other);
    std::printf(" %s%s", m, why ? "(no)" : "");
  }
  std::printf("\n");
  const Case cases[] = {
      {"full", "", 0, 0, true},
      {"exact_topk", "", 0.05, 0, false},
      {"exact_topk", "mode=per_query_head", 0.05, 0, false},
      {"exact_topk", "sinks=4,local=64", 0.05, 0, false},
      {"exact_topk", "", 0, 100, false},
      {"streaming", "", 0.05, 0, true},
      {"streaming", "sinks=2,window=50", 0, 0, true},
      {"quest", "gqa=sum", 0.05, 0, false},
      {"quest", "gqa=per_query_head", 0.05, 0, false},
      {"quest", "page_size=64,dense_layers=1", 0.1, 0, false},
      {"csattention", "", 0.05, 0, false, true},
      {"csattention", "preset=paper", 0.05, 0, false, true},
      {"csattention", "group_pick=sum,schedule=0.15-step-4", 0.05, 0, false, true},
      {"csattention", "gqa=per_query_head,missing=zero", 0, 100, false, true},
      {"csattention", "rerank=2,sinks=4", 0.05, 0, false, true},
      {"retroinfer", "", 0.05, 0, false, true},
      {"retroinfer", "budget=paper,meta_dtype=f32", 0.05, 0, false, true},
  };
  if (g_other == KVS_BACKEND_HYBRID) {
    // Every method (the cpu's selection, the GPU's attention over pinned host pages): one case per
    // selection kind and the methods with an extra state (hgca: its whole state; retroinfer: the
    // estimated part; lfps: the bypass), with randomised index builds done once on the cpu.
    const Case hybrid_cases[] = {
        {"full", "", 0, 0, true},
        {"exact_topk", "", 0.05, 0, false},
        {"exact_topk", "mode=per_query_head", 0.05, 0, false},
        {"streaming", "", 0.05, 0, true},
        {"quest", "gqa=sum", 0.05, 0, false},
        {"csattention", "", 0.05, 0, false, true},
        {"csattention", "gqa=per_query_head", 0.05, 0, false, true},
        {"ctkvr", "", 0.05, 0, false, true},
        {"lfps", "", 0.05, 0, false, true},
        {"hgca", "", 0.05, 0, false, true},
        {"retroinfer", "", 0.05, 0, false, true},
    };
    const int n = g_small ? 700 : 3000;
    const Shape shapes[] = {{2, 32, 8, 128, KVS_SCALAR_BF16, 0.f}, {2, 8, 8, 64, KVS_SCALAR_F16, 0.f}};
    uint32_t seed = 1;
    for (const auto& m : hybrid_cases)
      for (const auto& sh : shapes) {
        if (only_split && !expect_split(m)) continue;
        run_case(m, sh, {n + 3}, 4, seed++);
        run_case(m, sh, {n, 300, 1 + 256}, 3, seed++);
      }
    // The split step over many steps: the ring's window wraps (local 16 of a budget that would allow
    // more), sessions of different lengths and static sets in one batch, sinks alone (lfps), the
    // static set attended through extra() instead (merge=lse: no split), and the split turned off.
    const Case split_cases[] = {
        {"ctkvr", "local=16,sinks=2", 0.05, 0, false, true},
        {"ctkvr", "merge=lse", 0.05, 0, false, true},
        {"lfps", "sinks=8", 0.05, 0, false, true},
        {"lfps", "sinks=0", 0.05, 0, false, true},
    };
    for (const auto& m : split_cases) run_case(m, shapes[0], {n, 40, 1 + 256}, g_small ? 40 : 80, seed++);
    {  // a batch of more sessions than one ring launch takes (kRingBatch, 32)
      std::vector<int64_t> lens;
      for (int b = 0; b < 37; ++b) lens.push_back(20 + 7 * b);
      run_case({"lfps", "sinks=3", 0.1, 0, false, true}, shapes[1], lens, 3, seed++);
    }
    setenv("KVS_HYBRID_SPLIT", "0", 1);
    g_split_off = true;
    run_case({"ctkvr", "", 0.05, 0, false, true}, shapes[1], {n}, 3, seed++);
    unsetenv("KVS_HYBRID_SPLIT");
    g_split_off = false;
    if (!only_split) run_hybrid_queue("quest");
    run_hybrid_queue("ctkvr");  // the split step: its ring refilled after the failed step
    if (trace) run_trace(trace);
    std::printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
  }
  const int big = g_small ? 700 : 5000;
  const Shape shapes[] = {
      {2, 32, 8, 128, KVS_SCALAR_BF16, 0.f},  // the benchmark's head layout
      {2, 8, 8, 64, KVS_SCALAR_F16, 0.f},     // MHA, fp16
      {1, 12, 4, 256, KVS_SCALAR_BF16, 0.f},  // head dim 256, G = 3
      {2, 6, 1, 64, KVS_SCALAR_BF16, 0.f},    // G = 6
  };
  uint32_t seed = 1;
  for (const auto& m : cases)
    for (const auto& sh : shapes) {
      run_case(m, sh, {big + 3}, 4, seed++);
      run_case(m, sh, {big, 300, 1 + 256}, 3, seed++);  // a batch of different lengths
    }
  // A context of a single prompt token, and one spanning many pages; prompts that end exactly where
  // the device page tables and the Quest bounds buffers are full (their next step grows them).
  run_case({"quest", "gqa=sum", 0.05, 0, false}, shapes[0], {1}, 3, seed++);
  run_case({"quest", "gqa=sum", 0.05, 0, false}, shapes[1], {1024, 4096}, 3, seed++);
  run_case({"quest", "gqa=per_query_head", 0.05, 0, false}, shapes[0], {1024}, 3, seed++);
  // A budget in tokens past the context (a partial last page): every page, as on the cpu.
  run_case({"quest", "", 0, 100, false}, shapes[0], {40, 90, 77}, 3, seed++);
  run_case({"quest", "gqa=per_query_head", 0, 64, false}, shapes[1], {50}, 3, seed++);
  run_case({"exact_topk", "", 0.05, 0, false}, shapes[1], {4096}, 3, seed++);
  run_case({"exact_topk", "", 0.02, 0, false}, shapes[0], {g_small ? 3000 : 40000}, 2, seed++);
  if (trace) run_trace(trace);
  std::printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
