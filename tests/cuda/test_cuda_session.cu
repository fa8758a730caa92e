// SPDX-License-Identifier: Apache-2.0
// The cuda backend through the public C API against the CPU backend (the reference), on the GPU
// machine: full and exact_topk, bf16 and fp16 KV, head dims 64 and 128, GQA, batched decode across
// sessions of different lengths, and the argument errors specific to the backend.
// Built into kvsieve_cuda_tests (its main lives in test_cuda_attention.cu, which calls
// run_session_tests()); skips with the rest when no GPU is present.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "kvsieve/kvsieve.h"
#include "capi_check.hpp"

namespace {

// One configuration: B sessions per backend with prompt lengths n0 + 37 b, `steps` decode steps.
// kv_memory: the cuda sessions' params->kv_memory (KVS_DEVICE_CUDA_HOST: KV in pinned host memory).
// per_session_k: exact_topk batches keep their fractional budget, so each session has its own k.
void run_case(const char* method, kvs_scalar_type kvdt, int hq, int hkv, int d, int64_t n0, int B, int steps,
              double budget, int32_t kv_memory = 0, bool per_session_k = false, int32_t lse_base = KVS_LSE_BASE_E) {
  std::mt19937 rng(uint32_t(n0 + d + hq));
  std::normal_distribution<float> nd;
  const int64_t T = n0 + 37 * (B - 1) + steps;
  std::vector<std::vector<float>> q(B), k(B), v(B);
  for (int b = 0; b < B; ++b) {
    q[b].resize(size_t(T) * hq * d);
    k[b].resize(size_t(T) * hkv * d);
    v[b].resize(size_t(T) * hkv * d);
    for (auto& x : q[b]) x = nd(rng);
    for (auto& x : k[b]) x = nd(rng);
    for (auto& x : v[b]) x = nd(rng);
    for (int64_t t = 0; t < T; t += 29)
      for (int i = 0; i < hkv * d; ++i) k[b][size_t(t) * hkv * d + i] *= 3.f;
  }
  kvs_session_params p = one_layer_params(method, kvdt, hq, hkv, d, budget);
  p.lse_base = lse_base;  // both backends: the CPU reference writes the same base
  if (B > 1 && std::string(method) == "exact_topk" && !per_session_k) p.budget_tokens = 128;  // one k for the batch
  std::vector<kvs_session_t> cpu(B), gpu(B);
  for (int b = 0; b < B; ++b) {
    p.backend = KVS_BACKEND_CPU;
    p.kv_memory = 0;
    if (!ok(kvs_session_create(&p, &cpu[b]), "create cpu")) return;
    p.backend = KVS_BACKEND_CUDA;
    p.kv_memory = kv_memory;
    if (!ok(kvs_session_create(&p, &gpu[b]), "create cuda")) return;
    const int64_t n = n0 + 37 * b;
    Tensor tq(q[b].data(), KVS_DEVICE_CPU, F32, {n, hq, d}), tk(k[b].data(), KVS_DEVICE_CPU, F32, {n, hkv, d}),
        tv(v[b].data(), KVS_DEVICE_CPU, F32, {n, hkv, d});
    ok(kvs_session_prefill(cpu[b], 0, &tq.t, &tk.t, &tv.t, nullptr, nullptr), "prefill cpu");
    auto k16 = to16(k[b], kvdt), v16 = to16(v[b], kvdt);
    uint16_t* dk = upload(k16);
    uint16_t* dv = upload(v16);
    float* dq = upload(q[b]);
    Tensor gq(dq, KVS_DEVICE_CUDA, F32, {n, hq, d}), gk(dk, KVS_DEVICE_CUDA, dt16(kvdt), {n, hkv, d}),
        gv(dv, KVS_DEVICE_CUDA, dt16(kvdt), {n, hkv, d});
    ok(kvs_session_prefill(gpu[b], 0, &gq.t, &gk.t, &gv.t, nullptr, nullptr), "prefill cuda");
    cudaDeviceSynchronize();
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dq);
    ok(kvs_session_build_index(cpu[b], nullptr), "build cpu");
    ok(kvs_session_build_index(gpu[b], nullptr), "build cuda");
  }
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  double worst = 0, worst_lse = 0;
  bool sel_equal = true;
  for (int s = 0; s < steps; ++s) {
    // Batched on the GPU, one by one on the CPU.
    std::vector<float> hq_(size_t(B) * hq * d), ref(size_t(B) * hq * d), rlse(size_t(B) * hq);
    std::vector<uint16_t> hk(size_t(B) * hkv * d), hv(size_t(B) * hkv * d);
    for (int b = 0; b < B; ++b) {
      const int64_t t = n0 + 37 * b + s;
      std::copy(q[b].begin() + t * hq * d, q[b].begin() + (t + 1) * hq * d, hq_.begin() + size_t(b) * hq * d);
      auto kr = to16(std::vector<float>(k[b].begin() + t * hkv * d, k[b].begin() + (t + 1) * hkv * d), kvdt);
      auto vr = to16(std::vector<float>(v[b].begin() + t * hkv * d, v[b].begin() + (t + 1) * hkv * d), kvdt);
      std::copy(kr.begin(), kr.end(), hk.begin() + size_t(b) * hkv * d);
      std::copy(vr.begin(), vr.end(), hv.begin() + size_t(b) * hkv * d);
      Tensor tq(q[b].data() + t * hq * d, KVS_DEVICE_CPU, F32, {hq, d});
      Tensor tk(k[b].data() + t * hkv * d, KVS_DEVICE_CPU, F32, {hkv, d}), tv(v[b].data() + t * hkv * d, KVS_DEVICE_CPU, F32, {hkv, d});
      Tensor to(ref.data() + size_t(b) * hq * d, KVS_DEVICE_CPU, F32, {hq, d}), tl(rlse.data() + size_t(b) * hq, KVS_DEVICE_CPU, F32, {hq});
      ok(kvs_session_decode(cpu[b], 0, &tq.t, &tk.t, &tv.t, &to.t, &tl.t, nullptr), "decode cpu");
    }
    std::vector<float> out, lse;
    gpu_decode_batch(gpu, hq_, hk, hv, hq, hkv, d, kvdt, stream, out, lse);
    fold_errors(out, ref, lse, rlse, d, worst, worst_lse);
    if (std::string(method) == "exact_topk" || std::string(method) == "quest")
      for (int b = 0; b < B; ++b)
        for (uint32_t h = 0; h < uint32_t(hkv); ++h) {
          size_t nc = 0, ng = 0;
          kvs_session_last_selection(cpu[b], 0, h, nullptr, 0, &nc);
          kvs_session_last_selection(gpu[b], 0, h, nullptr, 0, &ng);
          std::vector<int32_t> sc(nc), sg(ng);
          kvs_session_last_selection(cpu[b], 0, h, sc.data(), nc, &nc);
          kvs_session_last_selection(gpu[b], 0, h, sg.data(), ng, &ng);
          // bf16 scores may reorder near-ties: demand at least 95% overlap.
          size_t common = 0;
          for (int32_t x : sg) common += std::binary_search(sc.begin(), sc.end(), x);
          if (nc != ng || common < size_t(0.95 * double(nc))) sel_equal = false;
        }
  }
  const char* mem = kv_memory == KVS_DEVICE_CUDA_HOST ? " kv_memory=cuda_host" : "";
  const char* ks = per_session_k ? " k per session" : lse_base == KVS_LSE_BASE_2 ? " lse_base=2" : "";
  CAPI_CHECK(worst < 1e-2, "%s kv=%d hq=%d hkv=%d d=%d n0=%lld B=%d%s%s: worst rel err %.3g", method, int(kvdt), hq, hkv,
             d, (long long)n0, B, mem, ks, worst);
  CAPI_CHECK(worst_lse < 2e-2, "%s%s%s: worst lse err %.3g", method, mem, ks, worst_lse);
  CAPI_CHECK(sel_equal, "%s%s%s: GPU and CPU selections differ beyond near-ties", method, mem, ks);
  std::printf("session %-10s kv=%s hq=%d hkv=%d d=%d n0=%lld B=%d steps=%d%s%s: rel err %.2e, lse err %.2e\n", method,
              kvdt == KVS_SCALAR_BF16 ? "bf16" : "f16", hq, hkv, d, (long long)n0, B, steps, mem, ks, worst, worst_lse);
  cudaStreamDestroy(stream);
  for (int b = 0; b < B; ++b) {
    kvs_session_destroy(cpu[b]);
    kvs_session_destroy(gpu[b]);
  }
}

// Rollback on the GPU: session A decodes `extra` tokens more than B, is truncated back to B's
// length, then both decode the same `after` tokens (a decode appends): A's outputs and LSE must be
// B's bit for bit (same kernels, same data), for a cut inside a page and across pages (KV pages of
// 256 tokens, Quest pages of 16), with KV in GPU or pinned host memory.
void run_truncate(const char* method, int64_t n0, int extra, int cut_back, int after, int32_t kv_memory = 0) {
  const int hq = 16, hkv = 4, d = 128;
  const kvs_scalar_type kvdt = KVS_SCALAR_BF16;
  std::mt19937 rng(uint32_t(n0 + extra));
  std::normal_distribution<float> nd;
  const int64_t T = n0 + extra + after + 1;
  std::vector<float> q(size_t(T) * hq * d), k(size_t(T) * hkv * d), v(size_t(T) * hkv * d);
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.kv_dtype = kvdt;
  p.method = method;
  p.budget = 0.1;
  p.backend = KVS_BACKEND_CUDA;
  p.kv_memory = kv_memory;
  kvs_session_t A = nullptr, B = nullptr;
  if (!ok(kvs_session_create(&p, &A), "create A") || !ok(kvs_session_create(&p, &B), "create B")) return;
  auto k16 = to16(k, kvdt), v16 = to16(v, kvdt);
  float* dq = upload(q);
  uint16_t* dk = upload(k16);
  uint16_t* dv = upload(v16);
  float *dout = nullptr, *dlse = nullptr;
  cudaMalloc(&dout, size_t(2) * hq * d * 4);
  cudaMalloc(&dlse, size_t(2) * hq * 4);
  for (kvs_session_t s : {A, B}) {
    Tensor gq(dq, KVS_DEVICE_CUDA, F32, {n0, hq, d}), gk(dk, KVS_DEVICE_CUDA, dt16(kvdt), {n0, hkv, d}),
        gv(dv, KVS_DEVICE_CUDA, dt16(kvdt), {n0, hkv, d});
    ok(kvs_session_prefill(s, 0, &gq.t, &gk.t, &gv.t, nullptr, nullptr), "prefill");
    ok(kvs_session_build_index(s, nullptr), "build");
  }
  // A decodes tokens n0 .. n0 + extra - 1; B stops cut_back tokens earlier.
  auto step = [&](kvs_session_t s, int64_t t, int slot) {
    Tensor gq(dq + t * hq * d, KVS_DEVICE_CUDA, F32, {hq, d}), gk(dk + t * hkv * d, KVS_DEVICE_CUDA, dt16(kvdt), {hkv, d}),
        gv(dv + t * hkv * d, KVS_DEVICE_CUDA, dt16(kvdt), {hkv, d}), go(dout + size_t(slot) * hq * d, KVS_DEVICE_CUDA, F32, {hq, d}),
        gl(dlse + size_t(slot) * hq, KVS_DEVICE_CUDA, F32, {hq});
    return ok(kvs_session_decode(s, 0, &gq.t, &gk.t, &gv.t, &go.t, &gl.t, nullptr), "decode");
  };
  for (int64_t t = n0; t < n0 + extra; ++t) step(A, t, 0);
  for (int64_t t = n0; t < n0 + extra - cut_back; ++t) step(B, t, 1);
  const int64_t keep = n0 + extra - cut_back;
  ok(kvs_session_truncate(A, keep), "truncate");
  kvs_session_stats st{};
  st.struct_size = sizeof st;
  ok(kvs_session_get_stats(A, &st), "stats");
  bool same = st.tokens == keep;
  double worst = 0;
  for (int64_t t = keep; t < keep + after; ++t) {
    step(A, t, 0);
    step(B, t, 1);
    cudaDeviceSynchronize();
    std::vector<float> o(size_t(2) * hq * d), l(size_t(2) * hq);
    cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(l.data(), dlse, l.size() * 4, cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < size_t(hq) * d; ++i) worst = std::max(worst, double(std::fabs(o[i] - o[hq * d + i])));
    for (int h = 0; h < hq; ++h) worst = std::max(worst, double(std::fabs(l[h] - l[hq + h])));
    same &= std::memcmp(o.data(), o.data() + size_t(hq) * d, size_t(hq) * d * 4) == 0 &&
            std::memcmp(l.data(), l.data() + hq, size_t(hq) * 4) == 0;
    for (uint32_t h = 0; h < uint32_t(hkv); ++h) {
      size_t na = 0, nb = 0;
      kvs_session_last_selection(A, 0, h, nullptr, 0, &na);
      kvs_session_last_selection(B, 0, h, nullptr, 0, &nb);
      std::vector<int32_t> sa(na), sb(nb);
      kvs_session_last_selection(A, 0, h, sa.data(), na, &na);
      kvs_session_last_selection(B, 0, h, sb.data(), nb, &nb);
      same &= sa == sb;
    }
  }
  const char* mem = kv_memory == KVS_DEVICE_CUDA_HOST ? " kv_memory=cuda_host" : "";
  CAPI_CHECK(same, "truncate %s n0=%lld extra=%d cut_back=%d%s: outputs/selections differ from a session that never "
             "saw the dropped tokens (max |diff| %.3g)", method, (long long)n0, extra, cut_back, mem, worst);
  std::printf("session truncate %-10s n0=%lld extra=%d cut_back=%d after=%d%s: %s\n", method, (long long)n0, extra,
              cut_back, after, mem, same ? "bit-identical" : "DIFFERENT");
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
  cudaFree(dlse);
  kvs_session_destroy(A);
  kvs_session_destroy(B);
}

void run_errors() {
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_q_heads = 8;
  p.num_kv_heads = 2;
  p.head_dim = 96;
  p.backend = KVS_BACKEND_CUDA;
  kvs_session_t s = nullptr;
  kvs_error_t e = kvs_session_create(&p, &s);
  CAPI_CHECK(e && kvs_error_code(e) == KVS_STATUS_UNSUPPORTED, "head_dim 96 on cuda: %s", kvs_error_message(e));
  kvs_error_destroy(e);
  p.head_dim = 64;
  p.method = "hgca";  // no cuda implementation yet: refused with the registry's reason
  e = kvs_session_create(&p, &s);
  CAPI_CHECK(e && kvs_error_code(e) == KVS_STATUS_UNSUPPORTED &&
             std::string(kvs_error_message(e)).find(kvs_method_unsupported_reason("hgca", KVS_BACKEND_CUDA)) !=
                 std::string::npos,
         "hgca on cuda: %s", kvs_error_message(e));
  kvs_error_destroy(e);
  p.method = "full";
  {  // one cuda batch, two lse bases: refused before anything changes
    kvs_session_t two[2] = {nullptr, nullptr};
    p.lse_base = KVS_LSE_BASE_2;
    ok(kvs_session_create(&p, &two[0]), "create base 2");
    p.lse_base = KVS_LSE_BASE_E;
    ok(kvs_session_create(&p, &two[1]), "create base e");
    std::vector<float> x(size_t(2) * 16 * 8 * 64);
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(i % 7) * 0.1f - 0.3f;
    auto x16 = to16(x, KVS_SCALAR_BF16);
    float* dq = upload(x);
    uint16_t* dkv = upload(x16);
    for (auto* t : two) {
      Tensor gq(dq, KVS_DEVICE_CUDA, F32, {16, 8, 64}), gk(dkv, KVS_DEVICE_CUDA, dt16(KVS_SCALAR_BF16), {16, 2, 64});
      ok(kvs_session_prefill(t, 0, &gq.t, &gk.t, &gk.t, nullptr, nullptr), "prefill");
      ok(kvs_session_build_index(t, nullptr), "build");
    }
    Tensor bq(dq, KVS_DEVICE_CUDA, F32, {2, 8, 64}), bk(dkv, KVS_DEVICE_CUDA, dt16(KVS_SCALAR_BF16), {2, 2, 64}),
        bo(dq + 2 * 8 * 64, KVS_DEVICE_CUDA, F32, {2, 8, 64});
    e = kvs_decode_batch(two, 2, 0, &bq.t, &bk.t, &bk.t, &bo.t, nullptr, nullptr);
    CAPI_CHECK(e && kvs_error_code(e) == KVS_STATUS_INVALID_ARGUMENT && std::string(kvs_error_message(e)).find("lse_base") != std::string::npos,
               "cuda batch with two lse bases: %s", e ? kvs_error_message(e) : "accepted");
    kvs_error_destroy(e);
    kvs_session_stats st{};
    st.struct_size = sizeof st;
    ok(kvs_session_get_stats(two[0], &st), "stats");
    CAPI_CHECK(st.tokens == 16, "refused batch left the session at %lld tokens", (long long)st.tokens);
    cudaFree(dq);
    cudaFree(dkv);
    kvs_session_destroy(two[0]);
    kvs_session_destroy(two[1]);
  }
  if (!ok(kvs_session_create(&p, &s), "create")) return;
  std::vector<float> hq(16 * 8 * 64, 0.5f);
  Tensor host(hq.data(), KVS_DEVICE_CPU, F32, {16, 8, 64});
  e = kvs_session_prefill(s, 0, &host.t, &host.t, &host.t, nullptr, nullptr);
  CAPI_CHECK(e && kvs_error_code(e) == KVS_STATUS_INVALID_ARGUMENT && std::string(kvs_error_message(e)).find("CUDA") != std::string::npos,
         "host tensor on cuda: %s", kvs_error_message(e));
  kvs_error_destroy(e);
  kvs_session_destroy(s);
}

}  // namespace

int run_session_passed() { return g_pass; }

// Returns the number of failures.
int run_session_tests() {
  for (auto kv : {KVS_SCALAR_BF16, KVS_SCALAR_F16}) {
    run_case("full", kv, 32, 8, 128, 5000, 1, 3, 0.0);
    run_case("full", kv, 8, 8, 64, 1, 1, 3, 0.0);
    run_case("full", kv, 16, 2, 64, 3000, 3, 3, 0.0);
    run_case("exact_topk", kv, 32, 8, 128, 8000, 1, 3, 0.05);
    run_case("exact_topk", kv, 8, 1, 64, 2000, 2, 2, 0.1);
    // Sessions of one batch with different budgets in keys: one top-k launch, each row its own k
    // (read on the device, so a captured step serves them as the context grows).
    run_case("exact_topk", kv, 16, 4, 128, 3000, 3, 40, 0.05, 0, true);
    // KV in pinned host memory, read by the kernels over the bus: same results as in GPU memory.
    run_case("full", kv, 32, 8, 128, 5000, 2, 3, 0.0, KVS_DEVICE_CUDA_HOST);
    run_case("exact_topk", kv, 32, 8, 128, 4000, 2, 3, 0.05, KVS_DEVICE_CUDA_HOST, true);
    run_case("quest", kv, 32, 8, 128, 6000, 2, 20, 0.05, KVS_DEVICE_CUDA_HOST);
    run_case("streaming", kv, 16, 4, 64, 3000, 1, 3, 0.05, KVS_DEVICE_CUDA_HOST);
    // lse in base 2: one chunk (the attention kernel writes it), split chunks (the merge kernel).
    run_case("full", kv, 8, 8, 64, 1, 1, 3, 0.0, 0, false, KVS_LSE_BASE_2);
    run_case("full", kv, 32, 8, 128, 5000, 2, 3, 0.0, 0, false, KVS_LSE_BASE_2);
    run_case("quest", kv, 32, 8, 128, 6000, 2, 5, 0.05, 0, false, KVS_LSE_BASE_2);
  }
  // Rollback: inside a Quest page, across Quest pages, across a KV page (256 tokens), to the prompt.
  for (const char* m : {"full", "exact_topk", "streaming", "quest"}) {
    run_truncate(m, 1000, 5, 3, 40);
    run_truncate(m, 1000, 40, 37, 40);
    run_truncate(m, 250, 20, 20, 30);
  }
  run_truncate("quest", 3000, 300, 290, 60, KVS_DEVICE_CUDA_HOST);
  run_errors();
  std::printf("session tests: %d passed, %d failed\n", g_pass, g_fail);
  return g_fail;
}
