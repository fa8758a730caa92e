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
#include "session_pair.hpp"
#include "kvsieve/kvsieve.h"

namespace {

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
  std::vector<kvs_session_t> cpu, gpu;
  if (!make_pairs(p, seqs, hq, hkv, d, kvdt, n0, gpu_build, cpu, gpu)) return;
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  std::vector<int64_t> pos(static_cast<size_t>(B), 0);
  for (int b = 0; b < B; ++b) pos[size_t(b)] = n0 + 37 * b;
  Cmp c;
  run_steps(cpu, gpu, seqs, pos, steps, hq, hkv, d, kvdt, stream, c);
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
  append_turn(cpu, gpu, seqs, pos, turn, hq, hkv, d, kvdt);
  run_steps(cpu, gpu, seqs, pos, 3, hq, hkv, d, kvdt, stream, a);
  CAPI_CHECK(a.err < 1e-2 && a.lse < 2e-2 && a.count_equal && a.min_overlap >= 0.95,
             "%s: after an appended turn: rel err %.3g, lse err %.3g, counts equal %d, least overlap %.4f", name, a.err,
             a.lse, int(a.count_equal), a.min_overlap);
  std::printf("session %s: rel err %.2e, lse err %.2e, least overlap %.4f; after the turn %.2e / %.4f\n", name, c.err,
              c.lse, c.min_overlap, a.err, a.min_overlap);
  cudaStreamDestroy(stream);
  destroy_pairs(cpu, gpu);
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
    follow(back, cpu, x, pos[0], hq, hkv, d, r);
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
