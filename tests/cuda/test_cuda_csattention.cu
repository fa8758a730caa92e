// SPDX-License-Identifier: Apache-2.0
// csattention on the cuda placement through the public C API against the CPU backend (the
// reference). The index is built on one backend and moved to the other with kvs_session_to (the
// tables format, in memory), so both decode with the same tables: the GPU step (streaming update,
// nearest centroids, reduce by key, top-k, forced keys, the search period) must give the CPU's
// selections up to near-ties (its sums add in another order: fp32 atomics) and the same outputs.
// With gpu_build the index is built on the GPU and moved to the CPU (the GPU build's tables decode
// the same on both). Also: a batch of sessions of different lengths, hundreds of appended tokens
// (lists updated by the stream), a chat turn appended outside a step, save/load across placements
// (kvs_session_to both ways), and the rollback floor.
// Built into kvsieve_cuda_tests (main in test_cuda_attention.cu calls run_csattention_tests()).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "capi_check.hpp"
#include "kvsieve/kvsieve.h"

namespace {

struct Seq {
  std::vector<float> q, k, v;
};

// Random tokens with structure the centroids can find: queries and keys drawn around a few shared
// directions (so lists differ in quality), every 29th key louder.
Seq make_seq(int64_t T, int hq, int hkv, int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> dirs(size_t(6) * d);
  for (auto& x : dirs) x = nd(rng);
  Seq s;
  s.q.resize(size_t(T) * hq * d);
  s.k.resize(size_t(T) * hkv * d);
  s.v.resize(size_t(T) * hkv * d);
  for (int64_t t = 0; t < T; ++t) {
    for (int h = 0; h < hq; ++h) {
      const float* u = &dirs[size_t((t + h) % 6) * d];
      for (int i = 0; i < d; ++i) s.q[(size_t(t) * hq + h) * d + i] = 0.8f * u[i] + nd(rng);
    }
    for (int h = 0; h < hkv; ++h) {
      const float* u = &dirs[size_t((t * 7 + h) % 6) * d];
      const float g = t % 29 == 0 ? 3.f : 1.f;
      for (int i = 0; i < d; ++i) s.k[(size_t(t) * hkv + h) * d + i] = g * (0.5f * u[i] + nd(rng));
    }
  }
  for (auto& x : s.v) x = nd(rng);
  return s;
}

struct Cmp {
  double err = 0, lse = 0, min_overlap = 1;
  bool count_equal = true;
};

// Appends tokens [t0, t1) of seq: on the CPU from host fp32, on the GPU from device tensors.
bool add(kvs_session_t s, bool gpu, const Seq& x, int hq, int hkv, int d, kvs_scalar_type kvdt, int64_t t0, int64_t t1,
         bool append, const char* what) {
  const int64_t n = t1 - t0;
  std::vector<float> q(x.q.begin() + t0 * hq * d, x.q.begin() + t1 * hq * d);
  std::vector<float> k(x.k.begin() + t0 * hkv * d, x.k.begin() + t1 * hkv * d);
  std::vector<float> v(x.v.begin() + t0 * hkv * d, x.v.begin() + t1 * hkv * d);
  kvs_error_t e;
  if (!gpu) {
    Tensor tq(q.data(), KVS_DEVICE_CPU, F32, {n, hq, d}), tk(k.data(), KVS_DEVICE_CPU, F32, {n, hkv, d}),
        tv(v.data(), KVS_DEVICE_CPU, F32, {n, hkv, d});
    e = append ? kvs_session_append(s, 0, &tq.t, &tk.t, &tv.t, nullptr, nullptr)
               : kvs_session_prefill(s, 0, &tq.t, &tk.t, &tv.t, nullptr, nullptr);
  } else {
    float* dq = upload(q);
    uint16_t* dk = upload(to16(k, kvdt));
    uint16_t* dv = upload(to16(v, kvdt));
    Tensor tq(dq, KVS_DEVICE_CUDA, F32, {n, hq, d}), tk(dk, KVS_DEVICE_CUDA, dt16(kvdt), {n, hkv, d}),
        tv(dv, KVS_DEVICE_CUDA, dt16(kvdt), {n, hkv, d});
    e = append ? kvs_session_append(s, 0, &tq.t, &tk.t, &tv.t, nullptr, nullptr)
               : kvs_session_prefill(s, 0, &tq.t, &tk.t, &tv.t, nullptr, nullptr);
    cudaDeviceSynchronize();
    cudaFree(dq);
    cudaFree(dk);
    cudaFree(dv);
  }
  return ok(e, what);
}

// One decode step of token pos[b] for every session: the CPU one by one, the GPU as one batch.
void step(std::vector<kvs_session_t>& cpu, std::vector<kvs_session_t>& gpu, const std::vector<Seq>& seqs,
          const std::vector<int64_t>& pos, int hq, int hkv, int d, kvs_scalar_type kvdt, cudaStream_t stream, Cmp& c) {
  const int B = int(cpu.size());
  std::vector<float> hq_(size_t(B) * hq * d), ref(size_t(B) * hq * d), rlse(size_t(B) * hq);
  std::vector<float> hk(size_t(B) * hkv * d), hv(size_t(B) * hkv * d);
  for (int b = 0; b < B; ++b) {
    const auto& x = seqs[size_t(b)];
    const int64_t t = pos[size_t(b)];
    std::copy(x.q.begin() + t * hq * d, x.q.begin() + (t + 1) * hq * d, hq_.begin() + size_t(b) * hq * d);
    std::copy(x.k.begin() + t * hkv * d, x.k.begin() + (t + 1) * hkv * d, hk.begin() + size_t(b) * hkv * d);
    std::copy(x.v.begin() + t * hkv * d, x.v.begin() + (t + 1) * hkv * d, hv.begin() + size_t(b) * hkv * d);
    Tensor tq(hq_.data() + size_t(b) * hq * d, KVS_DEVICE_CPU, F32, {hq, d});
    Tensor tk(hk.data() + size_t(b) * hkv * d, KVS_DEVICE_CPU, F32, {hkv, d}),
        tv(hv.data() + size_t(b) * hkv * d, KVS_DEVICE_CPU, F32, {hkv, d});
    Tensor to(ref.data() + size_t(b) * hq * d, KVS_DEVICE_CPU, F32, {hq, d}),
        tl(rlse.data() + size_t(b) * hq, KVS_DEVICE_CPU, F32, {hq});
    ok(kvs_session_decode(cpu[size_t(b)], 0, &tq.t, &tk.t, &tv.t, &to.t, &tl.t, nullptr), "decode cpu");
  }
  std::vector<float> out, lse;
  gpu_decode_batch(gpu, hq_, to16(hk, kvdt), to16(hv, kvdt), hq, hkv, d, kvdt, stream, out, lse);
  fold_errors(out, ref, lse, rlse, d, c.err, c.lse);
  for (int b = 0; b < B; ++b)
    for (uint32_t h = 0; h < uint32_t(hkv); ++h) {
      size_t nc = 0, ng = 0;
      kvs_session_last_selection(cpu[size_t(b)], 0, h, nullptr, 0, &nc);
      kvs_session_last_selection(gpu[size_t(b)], 0, h, nullptr, 0, &ng);
      std::vector<int32_t> sc(nc), sg(ng);
      kvs_session_last_selection(cpu[size_t(b)], 0, h, sc.data(), nc, &nc);
      kvs_session_last_selection(gpu[size_t(b)], 0, h, sg.data(), ng, &ng);
      size_t common = 0;
      for (int32_t x : sg) common += std::binary_search(sc.begin(), sc.end(), x);
      c.count_equal &= nc == ng;
      c.min_overlap = std::min(c.min_overlap, nc ? double(common) / double(nc) : 1.0);
    }
}

// One layer of csattention with these parameters (backend: the cpu until set).
kvs_session_params csa_params(const char* params, kvs_scalar_type kvdt, int hq, int hkv, int d, double budget) {
  kvs_session_params p = one_layer_params("csattention", kvdt, hq, hkv, d, budget);
  p.method_params = params;
  return p;
}

// B sessions of n0 + 37 b prompt tokens, `steps` decode steps, a 60-token turn appended, 3 steps.
void run_case(const char* params, kvs_scalar_type kvdt, int hq, int hkv, int d, int64_t n0, int B, int steps,
              double budget, bool gpu_build = false) {
  char name[320];
  std::snprintf(name, sizeof name, "csattention(%s) %s hq=%d hkv=%d d=%d n0=%lld B=%d steps=%d budget=%g%s", params,
                kvdt == KVS_SCALAR_BF16 ? "bf16" : "f16", hq, hkv, d, (long long)n0, B, steps, budget,
                gpu_build ? " gpu-built" : "");
  const int64_t turn = 60;
  std::vector<Seq> seqs;
  for (int b = 0; b < B; ++b)
    seqs.push_back(make_seq(n0 + 37 * b + steps + turn + 4, hq, hkv, d, uint32_t(1000 + 17 * b + d + hq)));
  kvs_session_params p = csa_params(params, kvdt, hq, hkv, d, budget);
  std::vector<kvs_session_t> cpu(size_t(B), nullptr), gpu(size_t(B), nullptr);
  for (int b = 0; b < B; ++b) {
    const int64_t n = n0 + 37 * b;
    kvs_session_t src = nullptr;
    p.backend = gpu_build ? KVS_BACKEND_CUDA : KVS_BACKEND_CPU;
    if (!ok(kvs_session_create(&p, &src), "create")) return;
    // The prompt in two chunks (the query sample must compose across chunks).
    if (!add(src, gpu_build, seqs[size_t(b)], hq, hkv, d, kvdt, 0, n / 3, false, "prefill") ||
        !add(src, gpu_build, seqs[size_t(b)], hq, hkv, d, kvdt, n / 3, n, false, "prefill"))
      return;
    if (!ok(kvs_session_build_index(src, nullptr), "build")) return;
    kvs_session_t other = nullptr;
    if (!ok(kvs_session_to(src, gpu_build ? KVS_BACKEND_CPU : KVS_BACKEND_CUDA, 0, &other), "kvs_session_to")) return;
    cpu[size_t(b)] = gpu_build ? other : src;
    gpu[size_t(b)] = gpu_build ? src : other;
  }
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  std::vector<int64_t> pos(static_cast<size_t>(B), 0);
  for (int b = 0; b < B; ++b) pos[size_t(b)] = n0 + 37 * b;
  Cmp c;
  for (int s = 0; s < steps; ++s) {
    step(cpu, gpu, seqs, pos, hq, hkv, d, kvdt, stream, c);
    for (auto& x : pos) ++x;
  }
  CAPI_CHECK(c.err < 1e-2 && c.lse < 2e-2, "%s: decode rel err %.3g, lse err %.3g", name, c.err, c.lse);
  CAPI_CHECK(c.count_equal && c.min_overlap >= 0.95, "%s: selections: counts equal %d, least overlap %.4f", name,
             int(c.count_equal), c.min_overlap);
  if (steps > 256) {  // more tokens than the token-ordered lists' room (256 here): rebuilt at least once
    double sorts = 0;
    CAPI_CHECK(kvs_session_method_stat(gpu[0], "list_sorts", &sorts) == nullptr && sorts >= 2,
               "%s: the token-ordered lists were made %g times (want the load's and a rebuild)", name, sorts);
  }
  // A turn appended outside a step (its keys enter the lists at the next step), then steps.
  Cmp a;
  for (int b = 0; b < B; ++b) {
    add(cpu[size_t(b)], false, seqs[size_t(b)], hq, hkv, d, kvdt, pos[size_t(b)], pos[size_t(b)] + turn, true, "append cpu");
    add(gpu[size_t(b)], true, seqs[size_t(b)], hq, hkv, d, kvdt, pos[size_t(b)], pos[size_t(b)] + turn, true, "append cuda");
    pos[size_t(b)] += turn;
  }
  for (int s = 0; s < 3; ++s) {
    step(cpu, gpu, seqs, pos, hq, hkv, d, kvdt, stream, a);
    for (auto& x : pos) ++x;
  }
  CAPI_CHECK(a.err < 1e-2 && a.lse < 2e-2 && a.count_equal && a.min_overlap >= 0.95,
             "%s: after an appended turn: rel err %.3g, lse err %.3g, counts equal %d, least overlap %.4f", name, a.err,
             a.lse, int(a.count_equal), a.min_overlap);
  std::printf("session %s: rel err %.2e, lse err %.2e, least overlap %.4f; after the turn %.2e / %.4f\n", name, c.err,
              c.lse, c.min_overlap, a.err, a.min_overlap);
  cudaStreamDestroy(stream);
  for (int b = 0; b < B; ++b) {
    kvs_session_destroy(cpu[size_t(b)]);
    kvs_session_destroy(gpu[size_t(b)]);
  }
}

// The GPU session saved back to the CPU after decoding (lists updated on the device, the cached
// search of a period) decodes like the CPU session that saw the same tokens; and the rollback floor.
void run_roundtrip() {
  const int hq = 8, hkv = 2, d = 64;
  const int64_t n0 = 1500;
  const kvs_scalar_type kvdt = KVS_SCALAR_BF16;
  Seq x = make_seq(n0 + 80, hq, hkv, d, 7);
  kvs_session_params p = csa_params("period=4,sinks=4", kvdt, hq, hkv, d, 0.1);
  kvs_session_t cpu = nullptr, gpu = nullptr, back = nullptr;
  if (!ok(kvs_session_create(&p, &cpu), "create")) return;
  add(cpu, false, x, hq, hkv, d, kvdt, 0, n0, false, "prefill");
  ok(kvs_session_build_index(cpu, nullptr), "build");
  if (!ok(kvs_session_to(cpu, KVS_BACKEND_CUDA, 0, &gpu), "to cuda")) return;
  std::vector<kvs_session_t> c1{cpu}, g1{gpu};
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  Cmp c;
  std::vector<int64_t> pos{n0};
  for (int s = 0; s < 30; ++s, ++pos[0]) step(c1, g1, {x}, pos, hq, hkv, d, kvdt, stream, c);
  // The GPU's state (lists after 30 inserts, the period's cached search) moved to the CPU.
  if (!ok(kvs_session_to(gpu, KVS_BACKEND_CPU, 0, &back), "to cpu")) return;
  Cmp r;
  for (int s = 0; s < 10; ++s, ++pos[0]) {
    step(c1, g1, {x}, pos, hq, hkv, d, kvdt, stream, c);
    // `back` decodes the same token on the cpu: it must select as the cpu session does.
    std::vector<float> q(x.q.begin() + pos[0] * hq * d, x.q.begin() + (pos[0] + 1) * hq * d);
    std::vector<float> k(x.k.begin() + pos[0] * hkv * d, x.k.begin() + (pos[0] + 1) * hkv * d);
    std::vector<float> v(x.v.begin() + pos[0] * hkv * d, x.v.begin() + (pos[0] + 1) * hkv * d);
    std::vector<float> o(size_t(hq) * d), l(hq);
    Tensor tq(q.data(), KVS_DEVICE_CPU, F32, {hq, d}), tk(k.data(), KVS_DEVICE_CPU, F32, {hkv, d}),
        tv(v.data(), KVS_DEVICE_CPU, F32, {hkv, d}), to(o.data(), KVS_DEVICE_CPU, F32, {hq, d}),
        tl(l.data(), KVS_DEVICE_CPU, F32, {hq});
    ok(kvs_session_decode(back, 0, &tq.t, &tk.t, &tv.t, &to.t, &tl.t, nullptr), "decode back");
    for (uint32_t h = 0; h < uint32_t(hkv); ++h) {
      size_t n1 = 0, n2 = 0;
      kvs_session_last_selection(back, 0, h, nullptr, 0, &n1);
      kvs_session_last_selection(cpu, 0, h, nullptr, 0, &n2);
      std::vector<int32_t> s1(n1), s2(n2);
      kvs_session_last_selection(back, 0, h, s1.data(), n1, &n1);
      kvs_session_last_selection(cpu, 0, h, s2.data(), n2, &n2);
      size_t common = 0;
      for (int32_t t : s1) common += std::binary_search(s2.begin(), s2.end(), t);
      r.count_equal &= n1 == n2;
      r.min_overlap = std::min(r.min_overlap, n2 ? double(common) / double(n2) : 1.0);
    }
  }
  CAPI_CHECK(c.err < 1e-2 && c.count_equal && c.min_overlap >= 0.95, "roundtrip: gpu vs cpu: err %.3g, overlap %.4f",
             c.err, c.min_overlap);
  CAPI_CHECK(r.count_equal && r.min_overlap >= 0.95, "roundtrip: gpu state moved to the cpu: overlap %.4f", r.min_overlap);
  // The lists keep no undo log on the GPU: a rollback below the indexed tokens is refused, naming it.
  kvs_error_t e = kvs_session_truncate(gpu, n0 - 10);
  CAPI_CHECK(e && kvs_error_code(e) == KVS_STATUS_INVALID_ARGUMENT &&
                 std::string(kvs_error_message(e)).find("csattention") != std::string::npos,
             "truncate below the indexed tokens on cuda: %s", e ? kvs_error_message(e) : "accepted");
  kvs_error_destroy(e);
  cudaStreamDestroy(stream);
  kvs_session_destroy(cpu);
  kvs_session_destroy(gpu);
  kvs_session_destroy(back);
}

}  // namespace

int run_csattention_passed() { return g_pass; }

// Returns the number of failures.
int run_csattention_tests(bool small) {
  const int64_t n = small ? 700 : 4000;
  const int steps = small ? 6 : 40;
  for (auto kv : {KVS_SCALAR_BF16, KVS_SCALAR_F16}) {
    run_case("", kv, 32, 8, 128, n, 1, steps, 0.05);
    run_case("", kv, 16, 2, 64, n, 3, steps, 0.1);
  }
  // The defaults are missing=list_min, weights=qnorm; preset=paper: missing=zero, weights=uniform.
  run_case("preset=paper", KVS_SCALAR_BF16, 32, 8, 128, n, 1, steps, 0.05);
  run_case("gqa=per_query_head", KVS_SCALAR_BF16, 16, 4, 64, n, 2, steps, 0.05);
  run_case("group_pick=sum,weights=uniform", KVS_SCALAR_BF16, 16, 4, 128, n, 2, steps, 0.05);
  run_case("missing=zero,score_dtype=f32,splits=16:16:32,subspaces=3", KVS_SCALAR_F16, 8, 2, 64, n, 1, steps, 0.05);
  run_case("schedule=0.15-step-4,sinks=4", KVS_SCALAR_BF16, 32, 8, 128, n, 2, small ? 9 : 40, 0.05);
  run_case("period=3,window_in_budget=false,recent=16,sinks=2", KVS_SCALAR_BF16, 8, 8, 64, n, 2, steps, 0.05);
  // The exact rerank of rerank * K' candidates (group softmax, or each query head's own).
  run_case("rerank=2", KVS_SCALAR_BF16, 32, 8, 128, n, 2, steps, 0.05);
  run_case("rerank=3,gqa=per_query_head,sinks=4", KVS_SCALAR_F16, 16, 4, 64, n, 1, steps, 0.05);
  run_case("rerank=1.5,period=2,preset=paper", KVS_SCALAR_BF16, 8, 2, 128, n, 2, steps, 0.1);
  // Hundreds of decode tokens: the lists change under the streaming update.
  if (!small) run_case("list_frac=0.05", KVS_SCALAR_BF16, 16, 4, 128, 2000, 2, 300, 0.05);
#ifdef KVS_HAVE_CSA_BUILD_TESTS
  run_case("", KVS_SCALAR_BF16, 32, 8, 128, n, 2, steps, 0.05, /*gpu_build=*/true);
  run_case("gqa=per_query_head,score_dtype=f32", KVS_SCALAR_F16, 16, 4, 64, n, 1, steps, 0.05, true);
#endif
  run_roundtrip();
  std::printf("csattention session tests: %d passed, %d failed\n", g_pass, g_fail);
  return g_fail;
}
