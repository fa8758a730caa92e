// SPDX-License-Identifier: Apache-2.0
// Standalone tests of src/backends/cuda/cuda_attention.cu against float64 CPU references computed
// from the same bf16/fp16-rounded inputs, K/V in the paged layout of kv_layout.cuh (pages in
// shuffled pool order, NaN wherever no valid token lives). Prints "N passed, M failed"; exit 0 iff
// all pass. Exits 77 with "SKIPPED: no CUDA device" where no device is usable. Also runs the
// session tests (unless KVS_NO_SESSION_TESTS) and, where the build defines KVS_HAVE_TOPK_TESTS /
// KVS_HAVE_QUEST_TESTS / KVS_HAVE_CSA_BUILD_TESTS, the top-k, quest and CSAttention index-build
// kernel tests, counting them in the final line.
// Usage: test_cuda_attention [--small]   (--small: short contexts only, for compute-sanitizer)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_attention.cuh"
#include "crash_report.hpp"
#include "late_copy.cuh"
#include "kernel_test_util.cuh"

using kvs::cuda::Scalar;

namespace {

int g_pass = 0, g_fail = 0;
bool g_small = false;
int g_variant = 0;  // dense kernel variant under test (kvs::cuda::detail::set_dense_variant)

bool g_quiet = false;  // --pdl-stress: FAIL lines only
void report(bool ok, const std::string& name, const std::string& detail) {
  if (ok) ++g_pass;
  else ++g_fail;
  if (ok && g_quiet) return;
  std::printf("%s %s %s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.c_str());
  std::fflush(stdout);
}




// 16-bit encode/decode on the host.

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

// One batch of sequences in the paged layout of kv_layout.cuh, in one device pool of pages placed
// in shuffled order (page i+1 of a sequence is never page i's neighbour in the pool by design of
// the test, and pages of different sequences interleave). Host copies keep the logical view.
struct Problem {
  int B, Hq, Hkv, D, G;
  int P = 256;        // page tokens
  int64_t cap;        // host stride: tokens per (sequence, head) in k/v below
  Scalar kvt, qt, ot;
  float scale;
  std::vector<int> lens;          // per sequence
  std::vector<float> q;           // [B,Hq,D], values as the device sees them (rounded if 16-bit)
  std::vector<std::vector<float>> k, v;  // per sequence [Hkv, cap, D] as floats (rounded)
  int max_pages = 0;
  DevBuf dq, dpool, dtable, dlens;
  kvs::cuda::PagedKv paged() const {
    kvs::cuda::PagedKv kv;
    kv.pages = dtable.as<const void* const>();
    kv.max_pages = max_pages;
    kv.page_tokens = P;
    kv.page_shift = 0;
    while ((1 << kv.page_shift) < P) ++kv.page_shift;
    return kv;
  }
};

// Fills q, K, V with random (never zero-biased) values. Sequence b stores `stored[b]` tokens
// (ceil(stored / P) pages; the page-table entries past them are null). Every pool element that is
// not a valid token is NaN on the device (poison: reading one would show up as NaN output): the
// tail of each last page, spare pages, and the tokens `poison_mask` marks 0 (else tokens past
// lens[b]).
void build(Problem& P, float qamp, const std::vector<int>& stored,
           const std::vector<std::vector<uint8_t>>* poison_mask = nullptr) {
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

  const int Pt = P.P;
  std::vector<int> npages(P.B);
  int total = 0;
  P.max_pages = 1;
  for (int b = 0; b < P.B; ++b) {
    npages[b] = (stored[b] + Pt - 1) / Pt;
    total += npages[b];
    P.max_pages = std::max(P.max_pages, npages[b] + 1);  // + one null entry past the last page
  }
  const int spare = 3;  // NaN pages nobody references
  const int slots = total + spare;
  std::vector<int> slot(slots);
  std::iota(slot.begin(), slot.end(), 0);
  std::shuffle(slot.begin(), slot.end(), g_rng);
  const size_t half = size_t(P.Hkv) * Pt * P.D;  // elements of a page's K (or V) half
  const size_t page_elems = 2 * half;
  const uint16_t nan16 = P.kvt == Scalar::BF16 ? 0x7fc0 : 0x7e00;
  std::vector<uint16_t> pool(size_t(slots) * page_elems, nan16);
  P.dpool.alloc(pool.size() * 2);
  std::vector<uint64_t> table(size_t(P.B) * P.max_pages, 0);
  P.k.assign(P.B, {});
  P.v.assign(P.B, {});
  int next = 0;
  for (int b = 0; b < P.B; ++b) {
    const size_t n = size_t(P.Hkv) * P.cap * P.D;
    P.k[b].assign(n, NAN);
    P.v[b].assign(n, NAN);
    std::vector<int> my(npages[b]);
    for (int i = 0; i < npages[b]; ++i) {
      my[i] = slot[next++];
      table[size_t(b) * P.max_pages + i] =
          reinterpret_cast<uint64_t>(P.dpool.as<char>() + size_t(my[i]) * page_elems * 2);
    }
    for (int h = 0; h < P.Hkv; ++h)
      for (int64_t t = 0; t < stored[b]; ++t) {
        bool poison;
        if (poison_mask) poison = !(*poison_mask)[size_t(b) * P.Hkv + h][size_t(t)];
        else poison = t >= P.lens[b];
        if (poison) continue;  // NaN in the pool and in the host copy
        uint16_t* pk = &pool[size_t(my[t / Pt]) * page_elems + (size_t(h) * Pt + t % Pt) * P.D];
        uint16_t* pv = pk + half;
        for (int j = 0; j < P.D; ++j) {
          const size_t i = (size_t(h) * P.cap + t) * P.D + j;
          pk[j] = enc(urand(-1.f, 1.f), P.kvt);
          pv[j] = enc(urand(-1.f, 1.f) + 0.25f, P.kvt);
          P.k[b][i] = dec(pk[j], P.kvt);
          P.v[b][i] = dec(pv[j], P.kvt);
        }
      }
  }
  KVS_TEST_CK(cudaMemcpy(P.dpool.p, pool.data(), pool.size() * 2, cudaMemcpyHostToDevice));
  upload(P.dtable, table);
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

// Downloads o/lse (poisoned beforehand) and compares with the per-row references, computed on
// all host cores. rows_toks(b, h) returns the token list of that row (called concurrently).
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
  std::vector<double> ref_o(rows * P.D), ref_l(rows);
  {
    const unsigned nt = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
    std::atomic<size_t> next{0};
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < nt; ++t)
      pool.emplace_back([&] {
        std::vector<double> ro;
        for (size_t row; (row = next.fetch_add(1)) < rows;) {
          const int b = int(row / P.Hq), h = int(row % P.Hq);
          ref_attend(P, b, h, rows_toks(b, h), ro, ref_l[row]);
          std::copy(ro.begin(), ro.end(), ref_o.begin() + row * P.D);
        }
      });
    for (auto& th : pool) th.join();
  }
  double num = 0, den = 0, lse_err = 0;
  bool finite_ok = true, empty_ok = true;
  for (size_t row = 0; row < rows; ++row) {
    const double rl = ref_l[row];
    const double* ro = &ref_o[row * P.D];
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

struct Opt {
  int page = 256;       // page tokens
  float qamp = 2.f;     // |q| bound
  float scale = -1.f;   // softmax scale (< 0: 1/sqrt(d))
  bool graph = false;   // run the call through a captured CUDA graph (after one plain warm-up)
  bool runs = false;    // gathered: select whole aligned 16-token runs (page-friendly lists)
  bool pdl = false;     // call with pdl = true right after a slow kernel that writes the inputs
};

// With opt.pdl: stages copies of `bufs`, and returns what to enqueue before the call (poison the
// buffers, then the late copy); the call itself must then pass pdl = true.
struct LateInputs {
  std::vector<std::unique_ptr<DevBuf>> stage;
  LateCopy copy;
  explicit LateInputs(std::initializer_list<DevBuf*> bufs) {
    int r = 0;
    for (DevBuf* b : bufs) {
      stage.push_back(std::make_unique<DevBuf>(b->n));
      KVS_TEST_CK(cudaMemcpy(stage.back()->p, b->p, b->n, cudaMemcpyDeviceToDevice));
      copy.dst[r] = b->p;
      copy.src[r] = stage.back()->p;
      copy.bytes[r] = b->n;
      ++r;
    }
  }
  void enqueue(cudaStream_t st) const { KVS_TEST_CK(enqueue_late_copy(copy, st)); }
};

std::string lens_str(const std::vector<int>& lens) {
  std::string s;
  for (int l : lens) s += (s.empty() ? "" : ",") + std::to_string(l);
  return s;
}

// Runs `call(stream)` on a fresh stream, directly or as a captured graph; outputs poisoned first.
template <typename C>
kvs::cuda::Status run_call(const Opt& opt, DevBuf& dout, DevBuf& dlse, C call) {
  cudaStream_t st;
  KVS_TEST_CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  kvs::cuda::Status r;
  if (opt.graph) {
    r = call(st);  // warm-up: one-time kernel set-up happens outside the capture
    KVS_TEST_CK(cudaStreamSynchronize(st));
    if (r.ok()) {
      KVS_TEST_CK(cudaMemsetAsync(dout.p, 0xff, dout.n, st));
      KVS_TEST_CK(cudaMemsetAsync(dlse.p, 0xff, dlse.n, st));
      cudaGraph_t g;
      cudaGraphExec_t ge;
      KVS_TEST_CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      r = call(st);
      KVS_TEST_CK(cudaStreamEndCapture(st, &g));
      KVS_TEST_CK(cudaGraphInstantiate(&ge, g, 0));
      KVS_TEST_CK(cudaGraphLaunch(ge, st));
      KVS_TEST_CK(cudaStreamSynchronize(st));
      KVS_TEST_CK(cudaGraphExecDestroy(ge));
      KVS_TEST_CK(cudaGraphDestroy(g));
    }
  } else {
    // NaN poison, on the call's stream: st does not synchronise with the legacy default stream
    // (cudaStreamNonBlocking), so a cudaMemset there could land after the kernel's writes.
    KVS_TEST_CK(cudaMemsetAsync(dout.p, 0xff, dout.n, st));
    KVS_TEST_CK(cudaMemsetAsync(dlse.p, 0xff, dlse.n, st));
    r = call(st);
  }
  KVS_TEST_CK(cudaStreamSynchronize(st));
  KVS_TEST_CK(cudaGetLastError());
  KVS_TEST_CK(cudaStreamDestroy(st));
  return r;
}

void run_dense(Scalar kvt, Scalar qt, Scalar ot, int D, int G, int Hkv, std::vector<int> lens,
               Opt opt = {}) {
  Problem P;
  P.B = int(lens.size());
  P.Hkv = Hkv;
  P.Hq = G * Hkv;
  P.D = D;
  P.P = opt.page;
  P.kvt = kvt;
  P.qt = qt;
  P.ot = ot;
  P.scale = opt.scale > 0 ? opt.scale : 1.f / std::sqrt(float(D));
  P.lens = lens;
  const int maxlen = *std::max_element(lens.begin(), lens.end());
  P.cap = std::max(maxlen, 1);
  build(P, opt.qamp, lens);  // tokens past each length (the last page's tail) are NaN-poisoned
  const auto s = shape_of(P);
  const size_t rows = size_t(P.B) * P.Hq;
  DevBuf dout(rows * D * (ot == Scalar::F32 ? 4 : 2)), dlse(rows * 4);
  DevBuf ws(kvs::cuda::dense_decode_workspace_bytes(s, maxlen));
  kvs::cuda::Query q{P.dq.p, qt};
  const auto kv = P.paged();
  kvs::cuda::Output out{dout.p, ot, dlse.as<float>()};
  std::unique_ptr<LateInputs> late;
  if (opt.pdl) late = std::make_unique<LateInputs>(std::initializer_list<DevBuf*>{&P.dpool, &P.dlens});
  auto r = run_call(opt, dout, dlse, [&](cudaStream_t st) {
    if (late) late->enqueue(st);
    return kvs::cuda::dense_decode(s, q, kv, kvt, P.dlens.as<int32_t>(), maxlen, out,
                                   kvs::cuda::Workspace{ws.p, ws.n}, st, opt.pdl);
  });
  char name[256];
  std::snprintf(name, sizeof name,
                "dense v%d kv=%s q=%s o=%s d=%d G=%d Hkv=%d P=%d B=%d lens=[%s] splits=%d%s%s", g_variant,
                sname(kvt), sname(qt), sname(ot), D, G, Hkv, P.P, P.B, lens_str(lens).c_str(),
                kvs::cuda::decode_num_splits(s, maxlen, kvt), opt.graph ? " graph" : "", opt.pdl ? " pdl" : "");
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

// Gathered decode over random lists (per KV head, or per query head): random subsets in random
// order (or whole 16-token runs), some lists empty, one full-size; sequence b stores cap >> b
// tokens; every unselected token is NaN.
void run_gathered(Scalar kvt, Scalar qt, Scalar ot, int D, int G, int Hkv, int B, int cap,
                  int max_sel, bool per_q, Opt opt = {}) {
  Problem P;
  P.B = B;
  P.Hkv = Hkv;
  P.Hq = G * Hkv;
  P.D = D;
  P.P = opt.page;
  P.kvt = kvt;
  P.qt = qt;
  P.ot = ot;
  P.scale = opt.scale > 0 ? opt.scale : 1.f / std::sqrt(float(D));
  std::vector<int> stored(B);
  for (int b = 0; b < B; ++b) stored[b] = std::max(1, cap >> b);
  P.lens = stored;
  P.cap = cap;
  const int lh = per_q ? P.Hq : Hkv;  // lists per sequence
  std::vector<int32_t> idx(size_t(B) * lh * max_sel, -7), cnt(size_t(B) * lh);
  std::vector<std::vector<int>> lists(size_t(B) * lh);
  std::vector<std::vector<uint8_t>> mask(size_t(B) * Hkv, std::vector<uint8_t>(cap, 0));
  for (size_t sg = 0; sg < lists.size(); ++sg) {
    const int b = int(sg / lh), kvh = per_q ? int(sg % lh) / G : int(sg % lh);
    const int n_tok = stored[b];
    int n = irand(0, std::min(max_sel, n_tok));
    if (sg % 3 == 1) n = 0;
    if (sg == 2) n = std::min(max_sel, n_tok);
    std::vector<int> perm;
    if (opt.runs) {  // whole aligned 16-token runs in random order, the last one maybe cut
      std::vector<int> runs((n_tok + 15) / 16);
      std::iota(runs.begin(), runs.end(), 0);
      std::shuffle(runs.begin(), runs.end(), g_rng);
      for (int r : runs)
        for (int t = r * 16; t < std::min(n_tok, r * 16 + 16); ++t) perm.push_back(t);
    } else {
      perm.resize(n_tok);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), g_rng);
    }
    lists[sg].assign(perm.begin(), perm.begin() + n);
    cnt[sg] = n;
    for (int i = 0; i < n; ++i) {
      idx[sg * max_sel + i] = lists[sg][i];
      mask[size_t(b) * Hkv + kvh][lists[sg][i]] = 1;
    }
  }
  build(P, 2.f, stored, &mask);  // every unselected token is NaN: reading one would show
  DevBuf didx, dcnt;
  upload(didx, idx);
  upload(dcnt, cnt);
  const auto s = shape_of(P);
  const size_t rows = size_t(P.B) * P.Hq;
  DevBuf dout(rows * D * (ot == Scalar::F32 ? 4 : 2)), dlse(rows * 4);
  DevBuf ws(kvs::cuda::gathered_decode_workspace_bytes(s, max_sel, per_q));
  kvs::cuda::Query q{P.dq.p, qt};
  const auto kv = P.paged();
  kvs::cuda::Output out{dout.p, ot, dlse.as<float>()};
  std::unique_ptr<LateInputs> late;
  if (opt.pdl) late = std::make_unique<LateInputs>(std::initializer_list<DevBuf*>{&P.dpool, &didx, &dcnt});
  auto r = run_call(opt, dout, dlse, [&](cudaStream_t st) {
    if (late) late->enqueue(st);
    return kvs::cuda::gathered_decode(s, q, kv, kvt, didx.as<int32_t>(), dcnt.as<int32_t>(),
                                      max_sel, out, kvs::cuda::Workspace{ws.p, ws.n}, st, per_q, opt.pdl);
  });
  char name[256];
  std::snprintf(name, sizeof name,
                "gathered %s kv=%s q=%s o=%s d=%d G=%d Hkv=%d P=%d B=%d cap=%d max_sel=%d%s%s%s",
                per_q ? "per-q-head" : "per-kv-head", sname(kvt), sname(qt), sname(ot), D, G, Hkv,
                P.P, B, cap, max_sel, opt.runs ? " runs16" : "", opt.graph ? " graph" : "",
                opt.pdl ? " pdl" : "");
  if (!r.ok()) {
    report(false, name, std::string("status ") + r.message);
    return;
  }
  check_output(name, P, dout, dlse,
               [&](int b, int h) { return lists[size_t(b) * lh + (per_q ? h : h / G)]; });
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
  KVS_TEST_CK(cudaMemset(doo.p, 0xff, doo.n));
  KVS_TEST_CK(cudaMemset(dlo.p, 0xff, dlo.n));
  float* o_out = in_place ? doa.as<float>() : doo.as<float>();
  float* l_out = in_place ? dla.as<float>() : dlo.as<float>();
  auto r = kvs::cuda::merge_states(doa.as<float>(), dla.as<float>(), dob.as<float>(), dlb.as<float>(),
                                   o_out, l_out, rows, D, nullptr);
  KVS_TEST_CK(cudaDeviceSynchronize());
  KVS_TEST_CK(cudaGetLastError());
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

void run_errors() {
  kvs::cuda::AttnShape s;
  s.batch = 1;
  s.num_q_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 96;
  s.scale = 0.1f;
  const Scalar BF = Scalar::BF16;
  auto r = kvs::cuda::dense_decode(s, {}, {}, BF, nullptr, 0, {}, {}, nullptr);
  report(r.code == 3, "error: head_dim 96 -> UNSUPPORTED", r.message);
  s.head_dim = 64;
  s.num_q_heads = 3;
  r = kvs::cuda::dense_decode(s, {}, {}, BF, nullptr, 0, {}, {}, nullptr);
  report(r.code == 1, "error: Hq % Hkv != 0 -> INVALID_ARGUMENT", r.message);
  s.num_q_heads = 4;
  r = kvs::cuda::dense_decode(s, {}, {}, BF, nullptr, 0, {}, {}, nullptr);
  report(r.code == 1, "error: null pointers -> INVALID_ARGUMENT", r.message);
  r = kvs::cuda::merge_states(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 4, 64, nullptr);
  report(r.code == 1, "error: merge null -> INVALID_ARGUMENT", r.message);
  // Page-table checks (before any launch, so dummy non-null pointers are fine).
  DevBuf q(4 * 64 * 4), o(4 * 64 * 4), lse(16), lens(16), table(64);
  kvs::cuda::Query qq{q.p, Scalar::F32};
  kvs::cuda::Output out{o.p, Scalar::F32, lse.as<float>()};
  kvs::cuda::PagedKv kv;
  kv.pages = table.as<const void* const>();
  kv.max_pages = 4;
  kv.page_tokens = 24;
  kv.page_shift = 4;
  r = kvs::cuda::dense_decode(s, qq, kv, BF, lens.as<int32_t>(), 10, out, {}, nullptr);
  report(r.code == 1, "error: page_tokens 24 -> INVALID_ARGUMENT", r.message);
  kv.page_tokens = 2048;
  kv.page_shift = 11;
  r = kvs::cuda::dense_decode(s, qq, kv, BF, lens.as<int32_t>(), 10, out, {}, nullptr);
  report(r.code == 1, "error: page_tokens 2048 -> INVALID_ARGUMENT", r.message);
  kv.page_tokens = 16;
  kv.page_shift = 5;
  r = kvs::cuda::dense_decode(s, qq, kv, BF, lens.as<int32_t>(), 10, out, {}, nullptr);
  report(r.code == 1, "error: page_shift != log2(page_tokens) -> INVALID_ARGUMENT", r.message);
  kv.page_shift = 4;
  r = kvs::cuda::dense_decode(s, qq, kv, BF, lens.as<int32_t>(), 65, out, {}, nullptr);
  report(r.code == 1, "error: max_length > max_pages * P -> INVALID_ARGUMENT", r.message);
  r = kvs::cuda::gathered_decode(s, qq, kv, BF, nullptr, lens.as<int32_t>(), 8, out, {}, nullptr, true);
  report(r.code == 1, "error: gathered null indices -> INVALID_ARGUMENT", r.message);
  r = kvs::cuda::dense_decode(s, qq, kv, Scalar::F32, lens.as<int32_t>(), 10, out, {}, nullptr);
  report(r.code == 3, "error: f32 KV -> UNSUPPORTED", r.message);
}

}  // namespace

int run_session_tests();
int run_session_passed();
int run_graph_tests(bool small);  // CUDA graphs of batched steps (test_cuda_graphs.cu)
int run_graph_passed();
int run_csattention_tests(bool small);  // csattention sessions against the cpu (test_cuda_csattention.cu)
int run_csattention_passed();
int run_retroinfer_tests(bool small);  // retroinfer sessions against the cpu (test_cuda_retroinfer.cu)
int run_retroinfer_layer_updates(int times);  // run_layer_updates alone, N times
int run_retroinfer_passed();
int run_caller_kv_tests(bool small);  // sessions over a caller's paged KV cache (test_cuda_caller_kv.cu)
int run_caller_kv_passed();
#ifdef KVS_HAVE_TOPK_TESTS
int run_topk_tests(bool small);  // radix top-k (topk.cu's tests); returns failures
int run_topk_passed();
#endif
#ifdef KVS_HAVE_QUEST_TESTS
int run_quest_tests(bool small);  // quest kernels' tests; returns failures
int run_quest_passed();
#endif
#ifdef KVS_HAVE_CSA_BUILD_TESTS
int run_csa_build_tests(bool small);  // CSAttention index build (test_cuda_csa_build.cu); returns failures
int run_csa_build_passed();
#endif

int main(int argc, char** argv) {
  install_crash_report();
  int stress = 0;
  bool only_csa = false, only_csa_build = false, only_quest = false, only_retro = false, only_caller = false,
       only_graphs = false, only_topk = false;
  int retro_updates = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--small") g_small = true;
    if (a == "--only-csattention") only_csa = true;  // the csattention session tests alone
    if (a == "--only-csa-build") only_csa_build = true;  // the csattention index build tests alone
    if (a == "--only-quest") only_quest = true;  // the quest kernels' tests alone
    if (a == "--only-retroinfer") only_retro = true;  // the retroinfer session tests alone
    if (a == "--retro-layer-updates" && i + 1 < argc) retro_updates = std::atoi(argv[++i]);  // that test, N times
    if (a == "--only-caller-kv") only_caller = true;  // sessions over a caller's KV cache alone
    if (a == "--only-graphs") only_graphs = true;  // batched steps as CUDA graphs against eager ones alone
    if (a == "--only-topk") only_topk = true;  // the exact_topk kernels' tests alone (score pass, radix top-k)
    if (a == "--pdl-stress" && i + 1 < argc) stress = std::atoi(argv[++i]);
    if (a == "--pdl-wait-first") kvs::cuda::detail::set_pdl_wait_first(true);
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;  // ctest's SKIP_RETURN_CODE (tests/CMakeLists.txt)
  }
#ifndef KVS_NO_SESSION_TESTS
  if (only_csa) return run_csattention_tests(g_small) ? 1 : 0;
  if (only_retro) return run_retroinfer_tests(g_small) ? 1 : 0;
  if (retro_updates > 0) return run_retroinfer_layer_updates(retro_updates) ? 1 : 0;
  if (only_caller) return run_caller_kv_tests(g_small) ? 1 : 0;
  if (only_graphs) return run_graph_tests(g_small) ? 1 : 0;
#endif
#ifdef KVS_HAVE_CSA_BUILD_TESTS
  if (only_csa_build) return run_csa_build_tests(g_small) ? 1 : 0;
#endif
#ifdef KVS_HAVE_TOPK_TESTS
  if (only_topk) {
    const int failed = run_topk_tests(g_small);
    std::printf("topk: %d failed\n", failed);
    return failed ? 1 : 0;
  }
#endif
#ifdef KVS_HAVE_QUEST_TESTS
  if (only_quest) {
    const int failed = run_quest_tests(g_small);
    std::printf("quest: %d passed, %d failed\n", run_quest_passed(), failed);
    return failed ? 1 : 0;
  }
#endif
  const Scalar BF = Scalar::BF16, F16 = Scalar::F16, F32 = Scalar::F32;
  const int L = g_small ? 1000 : 70000;  // long context
  const int M = g_small ? 700 : 5000;    // medium context
  auto pg = [](int page) {
    Opt o;
    o.page = page;
    return o;
  };

  if (stress > 0) {  // the programmatic-dependent-launch cases, repeated (FAIL lines only)
    g_quiet = true;
    for (int it = 0; it < stress; ++it)
      for (bool graph : {false, true}) {
        Opt o = pg(16);
        o.pdl = true;
        o.graph = graph;
        run_dense(BF, BF, F32, 128, 4, 2, {M, 333, 17}, o);  // the suite's cases, in its order
        run_dense(BF, F32, BF, 128, 2, 2, {L, 1000}, o);
        run_dense(F16, F16, F16, 64, 8, 1, {40}, o);
        run_gathered(BF, BF, F32, 128, 4, 2, 2, M, 1024, false, o);
      }
    std::printf("pdl stress x%d: %d passed, %d failed\n", stress, g_pass, g_fail);
    return g_fail ? 1 : 0;
  }
  run_errors();
  // Dense: d x G x lengths (not multiples of the page), pages of 16 and 256, B = 1 and B = 3 with
  // different lengths; q/o dtypes alternate.
  int variant = 0;
  for (int D : {64, 128, 256})
    for (int G : {1, 4, 8}) {
      for (int len : {1, 17, 1000, M}) {
        const Scalar qt = (variant & 1) ? BF : F32, ot = (variant & 2) ? BF : F32;
        run_dense(BF, qt, ot, D, G, 2, {len}, pg((variant & 4) ? 16 : 256));
        ++variant;
      }
      run_dense(BF, F32, BF, D, G, 2, {17, D == 128 ? L : M, 1000}, pg(G == 4 ? 16 : 256));
    }
  for (int D : {64, 128, 256}) {
    run_dense(F16, F32, F32, D, 4, 2, {1, 1000, M}, pg(16));
    run_dense(F16, F16, F16, D, 1, 2, {M, 17, 1000}, pg(256));
    run_dense(F16, F32, F32, D, 8, 2, {M, 17, 1000}, pg(16));  // f16 through the tensor-core kernel
  }
  run_dense(F16, F16, F16, 128, 4, 2, {L, 17, 1000}, pg(256));
  run_dense(BF, F32, F32, 128, 3, 2, {1000, 5000}, pg(16));   // G not a power of two
  run_dense(BF, F32, F32, 256, 3, 2, {1000, 2500}, pg(256));
  run_dense(BF, F32, F32, 128, 16, 1, {1000, 5000}, pg(256));  // G > 8: two query groups
  run_dense(BF, F32, F32, 256, 16, 1, {3000}, pg(16));
  run_dense(BF, F32, F32, 64, 6, 3, {2500}, pg(16));
  run_dense(BF, F32, F32, 256, 6, 1, {2500}, pg(256));
  run_dense(F16, F16, F16, 64, 8, 1, {3000}, pg(256));
  for (int page : {32, 64, 128, 512, 1024})  // the other page sizes
    run_dense(BF, F32, F32, 128, page == 64 ? 1 : 4, 2, {page * 3 + 5, 1000, 1}, pg(page));
  run_dense(BF, BF, F32, 128, 8, 8, {g_small ? 3000 : 131072}, pg(256));
  {
    Opt o = pg(256);
    o.qamp = 4.f;
    o.scale = 1.f;
    run_dense(BF, F32, F32, 128, 8, 2, {4000}, o);  // peaked softmax, tensor-core kernel
    run_dense(BF, F32, F32, 128, 4, 2, {4000}, o);
    run_dense(BF, F32, F32, 256, 2, 2, {4000}, o);  // peaked, CUDA-core kernel
  }
  run_dense(BF, F32, F32, 128, 4, 8, {g_small ? 3000 : 131072}, pg(256));  // the benchmark shape
  if (!g_small) run_dense(BF, BF, BF, 128, 4, 8, {131072}, pg(16));
  run_dense(BF, F32, F32, 128, 4, 2, {2000, 0, 333}, pg(16));  // an empty sequence
  run_dense(BF, F32, F32, 256, 1, 2, {0, 333, 2000}, pg(256));
  run_dense(BF, F32, F32, 64, 8, 2, {0}, pg(16));  // only empty sequences
  {
    Opt o = pg(16);  // through a captured CUDA graph (split + merge with programmatic launch)
    o.graph = true;
    run_dense(BF, F32, F32, 128, 4, 2, {M, 333, 17}, o);
    run_dense(BF, F32, BF, 256, 2, 2, {M, 1000}, o);
  }
  // Programmatic dependent launch (pdl = true) right after a kernel that writes the KV pool and the
  // lengths 20 us late: the decode may read only the query before that kernel ends. Eager and
  // captured; tensor-core (G 4) and CUDA-core (G 2) kernels, split and not.
  for (bool graph : {false, true}) {
    Opt o = pg(16);
    o.pdl = true;
    o.graph = graph;
    run_dense(BF, BF, F32, 128, 4, 2, {M, 333, 17}, o);
    run_dense(BF, F32, BF, 128, 2, 2, {L, 1000}, o);
    run_dense(F16, F16, F16, 64, 8, 1, {40}, o);  // one chunk: the chunk kernel writes the output
  }
  // Many splits per row (one KV head, one query head): the merge's loop past its first 8 per thread.
  for (int D : {64, 128, 256}) run_dense(BF, F32, F32, D, 1, 1, {L, 3 * M}, pg(256));
  // The other dense kernel variants (bf16 only): 1 = CUDA-core 4x4 for every group size,
  // 2, 3 = tensor-core kernel for every group size (padding small groups).
  for (int v = 1; v < 4; ++v) {
    if (!kvs::cuda::detail::set_dense_variant(v)) {
      report(false, "set_dense_variant", std::to_string(v));
      continue;
    }
    g_variant = v;
    for (int D : {64, 128, 256})
      for (int G : {1, 4, 8}) {
        run_dense(BF, F32, BF, D, G, 2, {17, M, 1000, 1}, pg(G == 4 ? 256 : 16));
        run_dense(BF, BF, F32, D, G, 2, {g_small ? 333 : L / 7}, pg(G == 4 ? 16 : 256));
      }
    if (!g_small) run_dense(BF, F32, F32, 128, 4, 8, {131072}, pg(v == 2 ? 16 : 256));
  }
  kvs::cuda::detail::set_dense_variant(0);
  g_variant = 0;
  // No programmatic launch for the merge (the plain-launch fallback).
  kvs::cuda::detail::set_merge_pdl(false);
  run_dense(BF, F32, F32, 128, 4, 2, {M, 17}, pg(16));
  run_gathered(BF, F32, F32, 128, 4, 2, 2, M, 1024, false, pg(16));
  kvs::cuda::detail::set_merge_pdl(true);

  // Gathered: random subsets in random order, empty lists, NaN on every unselected token; lists
  // per KV head and per query head; sequences of different sizes.
  const int cap = g_small ? 1500 : 20000, sel = g_small ? 700 : 3000;
  int gv = 0;
  for (int D : {64, 128, 256})
    for (int G : {1, 4, 8}) {
      const Scalar qt = (gv & 1) ? BF : F32, ot = (gv & 2) ? BF : F32;
      run_gathered(BF, qt, ot, D, G, 2, 2, cap, sel, false, pg((gv & 4) ? 16 : 256));
      run_gathered(BF, ot, qt, D, G, 2, 2, cap, sel, true, pg((gv & 4) ? 256 : 16));
      ++gv;
    }
  for (int D : {64, 128, 256}) {
    run_gathered(F16, F32, F32, D, 4, 2, 3, M, 1024, false, pg(16));
    run_gathered(F16, F16, F32, D, 8, 2, 3, M, 1024, false, pg(256));
    run_gathered(F16, F32, F16, D, 3, 2, 3, M, 1024, true, pg(16));
  }
  run_gathered(BF, F32, F32, 64, 6, 2, 2, 3000, 777, false, pg(16));
  run_gathered(BF, F32, F32, 128, 6, 2, 2, 3000, 777, true, pg(256));
  run_gathered(BF, F32, F32, 128, 16, 1, 3, 3000, 777, false, pg(16));
  run_gathered(BF, F32, F32, 256, 16, 1, 1, 3000, 777, true, pg(16));
  run_gathered(BF, F32, F32, 64, 2, 2, 1, 100, 17, false, pg(16));
  run_gathered(BF, F32, F32, 64, 2, 2, 1, 100, 17, true, pg(16));
  run_gathered(BF, F32, F32, 128, 4, 2, 3, 1000, 0, false, pg(256));  // max_selected = 0
  run_gathered(BF, F32, F32, 128, 1, 2, 3, 1000, 0, true, pg(16));
  for (int page : {16, 256}) {  // whole 16-token runs (block selections)
    Opt o = pg(page);
    o.runs = true;
    run_gathered(BF, F32, F32, 128, 4, 2, 2, cap, sel, false, o);
    run_gathered(BF, F32, F32, 128, 8, 2, 2, cap, sel, false, o);
    run_gathered(BF, F32, F32, 128, 4, 2, 2, cap, sel, true, o);
  }
  {
    Opt o = pg(16);
    o.graph = true;
    run_gathered(BF, F32, F32, 128, 4, 2, 2, M, 1024, false, o);
    run_gathered(BF, F32, F32, 128, 4, 2, 2, M, 1024, true, o);
  }
  for (bool graph : {false, true}) {  // after a late writer of the pool, indices and counts
    Opt o = pg(16);
    o.pdl = true;
    o.graph = graph;
    run_gathered(BF, BF, F32, 128, 4, 2, 2, M, 1024, false, o);
    run_gathered(BF, F32, F32, 128, 2, 2, 2, M, 1024, true, o);
  }
  // Merge
  for (int D : {64, 128, 256, 5}) run_merge(37, D, false);
  run_merge(1000, 128, true);
  std::printf("kernel tests: %d passed, %d failed\n", g_pass, g_fail);

  int other_failures = 0, other_passed = 0;
#ifndef KVS_NO_SESSION_TESTS
  // Sessions through the C API, cuda backend against the CPU backend (test_cuda_session.cu).
  other_failures += run_session_tests();
  other_passed += run_session_passed();
  other_failures += run_graph_tests(g_small);
  other_passed += run_graph_passed();
  other_failures += run_csattention_tests(g_small);
  other_passed += run_csattention_passed();
  other_failures += run_retroinfer_tests(g_small);
  other_passed += run_retroinfer_passed();
  other_failures += run_caller_kv_tests(g_small);
  other_passed += run_caller_kv_passed();
#endif  // KVS_NO_SESSION_TESTS: the kernels-only build of tools/device/cuda_check.sh
#ifdef KVS_HAVE_TOPK_TESTS
  other_failures += run_topk_tests(g_small);
  other_passed += run_topk_passed();
#endif
#ifdef KVS_HAVE_QUEST_TESTS
  other_failures += run_quest_tests(g_small);
  other_passed += run_quest_passed();
#endif
#ifdef KVS_HAVE_CSA_BUILD_TESTS
  other_failures += run_csa_build_tests(g_small);
  other_passed += run_csa_build_passed();
#endif
  std::printf("%d passed, %d failed\n", g_pass + other_passed, g_fail + other_failures);
  return g_fail == 0 && other_failures == 0 ? 0 : 1;
}
