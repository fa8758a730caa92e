// SPDX-License-Identifier: Apache-2.0
// Method::static_keys, the contract the hybrid backend's split step relies on (src/hybrid/): at every
// step, every list of the selection holds all of [0, sinks) and [n - recent, n), the two ranges are
// disjoint and within static_capacity(); methods without a static set say {0, 0}. Checked on lfps
// and ctkvr driven directly (append, on_append, select, as the session does) over contexts from
// a handful of tokens to a few thousand and several budgets, on random keys with a few loud ones.
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "backends/cpu/gemm.hpp"
#include "core/kv_store.hpp"
#include "core/method.hpp"
#include "core/thread_pool.hpp"
#include "reference.hpp"

using namespace kvt;

namespace {

constexpr int kHq = 8, kHkv = 2, kD = 32;

struct Run {
  kvs::ThreadPool pool{2};
  kvs::KVLayer kv{kvs::DType::F32, kHkv, kD};
  std::unique_ptr<kvs::Method> m;
  Run(const char* method, const char* params, double fraction, int64_t tokens) {
    const kvs::MethodSpec* spec = kvs::find_method(method);
    REQUIRE(spec);
    kvs::MethodContext ctx{{1, uint32_t(kHq), uint32_t(kHkv), uint32_t(kD), float(1.0 / std::sqrt(double(kD))), kvs::DType::F32},
                           {}, &pool, int32_t(kvs::cpu::resolve_gemm(KVS_GEMM_AUTO))};
    ctx.budget.fraction = fraction;
    ctx.budget.tokens = tokens;
    m = spec->create(ctx, kvs::ParamSet::parse(method, spec->params, params));
  }
};

// Prefills n0 tokens, then decodes `steps` tokens, checking the static set of every step.
void check(const char* method, const char* params, double fraction, int64_t tokens, int64_t n0, int64_t steps,
           uint64_t seed) {
  Rng rng(seed);
  const int64_t T = n0 + steps;
  std::vector<float> q = rng.normals(size_t(T) * kHq * kD), k = rng.normals(size_t(T) * kHkv * kD),
                     v = rng.normals(size_t(T) * kHkv * kD);
  for (int64_t t = 5; t < T; t += 41)
    for (int i = 0; i < kHkv * kD; ++i) k[size_t(t) * kHkv * kD + i] *= 3.f;
  Run r(method, params, fraction, tokens);
  const kvs::StaticKeys cap = r.m->static_capacity();
  INFO(method << "(" << params << ") budget " << fraction << "/" << tokens << " n0 " << n0);
  REQUIRE(cap.total() > 0);
  r.kv.append(k.data(), v.data(), n0);
  r.m->on_prefill(0, q.data(), n0, r.kv);
  r.m->build_index(0, r.kv);
  int64_t static_steps = 0;
  for (int64_t t = n0; t < T; ++t) {
    r.kv.append(k.data() + t * kHkv * kD, v.data() + t * kHkv * kD, 1);
    r.m->on_append(0, q.data() + t * kHq * kD, 1, r.kv, true);
    kvs::Selection sel;
    r.m->select(0, q.data() + t * kHq * kD, r.kv, sel);
    const int64_t n = t + 1;
    const kvs::StaticKeys sk = r.m->static_keys(0, n);
    INFO("step of token " << t << ": sinks " << sk.sinks << ", recent " << sk.recent);
    REQUIRE(sk.sinks >= 0);
    REQUIRE(sk.recent >= 0);
    REQUIRE(sk.sinks <= cap.sinks);
    REQUIRE(sk.recent <= cap.recent);
    REQUIRE(sk.sinks <= n - sk.recent);  // disjoint, inside the layer
    REQUIRE(sel.attend);
    REQUIRE(sel.kind != kvs::Selection::Kind::All);
    static_steps += sk.total() > 0;
    for (const auto& l : sel.lists) {
      int64_t found = 0;
      for (int32_t x : l) found += x < sk.sinks || x >= n - sk.recent;
      REQUIRE(found == sk.total());  // the lists' keys are distinct: all of the static set
    }
  }
  CHECK(static_steps > 0);
}

}  // namespace

TEST_CASE("static set: lfps's sinks are in every list at every step, within its capacity") {
  uint64_t seed = 11;
  for (const char* p : {"", "sinks=8", "kv_budget=union", "preset=paper", "gqa=per_kv_head", "sinks=1,bypass=false"})
    for (double f : {0.02, 0.05, 0.2}) {
      check("lfps", p, f, 0, 300, 40, seed++);
      check("lfps", p, f, 0, 3, 12, seed++);  // contexts shorter than the sinks first
    }
  check("lfps", "", 0, 3, 200, 20, seed++);  // a budget of fewer keys than sinks: clipped
}

TEST_CASE("static set: ctkvr's sinks and local window are in every list at every step, within its capacity") {
  uint64_t seed = 101;
  for (const char* p : {"", "local=16,sinks=2", "static_share=0", "topk=20", "local=300"})
    for (double f : {0.02, 0.05, 0.2}) {
      check("ctkvr", p, f, 0, 600, 40, seed++);
      check("ctkvr", p, f, 0, 40, 30, seed++);
    }
  check("ctkvr", "", 0, 5, 300, 20, seed++);
  // merge=lse attends the static set through extra(): no static set in the selection.
  Run r("ctkvr", "merge=lse", 0.05, 0);
  CHECK(r.m->static_capacity().total() == 0);
  CHECK(r.m->static_keys(0, 1000).total() == 0);
}

TEST_CASE("static set: methods without one say so") {
  for (const char* m : {"full", "exact_topk", "streaming", "quest", "csattention", "hgca", "retroinfer"}) {
    Run r(m, "", 0.05, 0);
    INFO(m);
    CHECK(r.m->static_capacity().total() == 0);
    CHECK(r.m->static_keys(0, 5000).total() == 0);
  }
}
