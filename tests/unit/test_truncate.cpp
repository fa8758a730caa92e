// SPDX-License-Identifier: Apache-2.0
// kvs_session_truncate (rollback) and kvs_session_params.lse_base through the public C API. The
// reference for a rolled-back session is always a fresh session that never saw the dropped tokens:
// same prompt, same appended and decoded tokens up to the kept point; from there both decode the
// same new tokens and must agree bit for bit (outputs, lse, selections) for every method.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kvsieve/kvsieve.h"
#include "capi_helpers.hpp"
#include "reference.hpp"
#include "session_steps.hpp"

using namespace kvt;

namespace {

using Data = TokenData;
using Step = StepOut;

constexpr uint32_t kLayers = 2;
const char* const kMethods[] = {"full", "exact_topk", "streaming", "quest", "csattention",
                                "ctkvr", "lfps", "hgca", "retroinfer"};
bool keeps_history(const std::string& m) {
  return m == "csattention" || m == "ctkvr" || m == "lfps" || m == "hgca" || m == "retroinfer";
}

kvs_session_params params(const Data& D, const char* method, int64_t max_rollback) {
  return session_params(D, method, kLayers, max_rollback);
}

// Tokens [a, b) of D into every layer: prefill or append (one call per layer).
void chunk(kvs_session_t s, Data& D, int64_t a, int64_t b, bool prompt) {
  const int64_t n = b - a;
  T q(D.qt(a), f32(), {n, D.hq, D.d}), k(D.kt(a), f32(), {n, D.hkv, D.d}), v(D.vt(a), f32(), {n, D.hkv, D.d});
  for (uint32_t l = 0; l < kLayers; ++l)
    OK(prompt ? kvs_session_prefill(s, l, &q.t, &k.t, &v.t, nullptr, nullptr)
              : kvs_session_append(s, l, &q.t, &k.t, &v.t, nullptr, nullptr));
}

// Token t of D decoded in every layer; the outputs of each layer.
std::vector<Step> decode(kvs_session_t s, Data& D, int64_t t) {
  std::vector<Step> out(kLayers);
  for (uint32_t l = 0; l < kLayers; ++l) {
    auto& st = out[l];
    st.o.assign(size_t(D.hq) * D.d, NAN);
    st.lse.assign(size_t(D.hq), NAN);
    T q(D.qt(t), f32(), {D.hq, D.d}), k(D.kt(t), f32(), {D.hkv, D.d}), v(D.vt(t), f32(), {D.hkv, D.d});
    T ot(st.o.data(), f32(), {D.hq, D.d}), lt(st.lse.data(), f32(), {D.hq});
    OK(kvs_session_decode(s, l, &q.t, &k.t, &v.t, &ot.t, &lt.t, nullptr));
    for (uint32_t h = 0; h < uint32_t(D.hkv); ++h) st.sel.push_back(selection(s, l, h));
  }
  return out;
}

// A script of calls: prompt [0, P), build, an appended turn [P, P + a), decodes up to `end`.
void run(kvs_session_t s, Data& D, int64_t P, int64_t a, int64_t end) {
  chunk(s, D, 0, P, true);
  OK(kvs_session_build_index(s, nullptr));
  if (a > 0) chunk(s, D, P, P + a, false);
  for (int64_t t = P + a; t < end; ++t) decode(s, D, t);
}

}  // namespace

TEST_CASE("truncate: every method decodes on exactly as a session that never saw the dropped tokens") {
  Rng rng(2101);
  Data D(rng, 8, 2, 32, 700);
  Data E(rng, 8, 2, 32, 40);  // the tokens decoded after the rollback (not the dropped ones)
  // The prompt ends 10 tokens before a KV page boundary (256 tokens) and mid quest page (16): the
  // decoded tokens cross both, and the rollback crosses them back.
  const int64_t P = 502, A = 3, END = P + A + 18;
  struct Case {
    int64_t keep;
    const char* what;
  };
  for (const Case c : {Case{P + A + 5, "into the decoded tokens"}, Case{P + 2, "into the appended turn"},
                       Case{P, "to exactly the prompt"}}) {
    for (const char* method : kMethods) {
      INFO(method << ", " << c.what);
      Sess X, R;
      auto p = params(D, method, 32);
      OK(kvs_session_create(&p, &X.s));
      OK(kvs_session_create(&p, &R.s));
      run(X.s, D, P, A, END);
      OK(kvs_session_truncate(X.s, c.keep));
      for (uint32_t l = 0; l < kLayers; ++l) REQUIRE(layer_tokens(X.s, l) == c.keep);
      // The reference: the same calls, stopped at the kept point (an appended turn cut in part
      // is the shorter turn).
      chunk(R.s, D, 0, P, true);
      OK(kvs_session_build_index(R.s, nullptr));
      if (c.keep > P) chunk(R.s, D, P, std::min(c.keep, P + A), false);
      for (int64_t t = P + A; t < c.keep; ++t) decode(R.s, D, t);
      // The same new tokens into both.
      for (int64_t t = 0; t < 20; ++t) {
        INFO("new token " << t);
        require_same(decode(X.s, E, t), decode(R.s, E, t));
      }
      // A second rollback after the first (the history was cut back and grows again).
      OK(kvs_session_truncate(X.s, c.keep + 10));
      OK(kvs_session_truncate(R.s, c.keep + 10));
      for (int64_t t = 30; t < 34; ++t) require_same(decode(X.s, E, t), decode(R.s, E, t));
    }
  }
}

TEST_CASE("truncate: far back through a long history (two checkpoints), and refused beyond it") {
  Rng rng(2102);
  Data D(rng, 4, 2, 32, 400);
  Data E(rng, 4, 2, 32, 12);
  const int64_t P = 300, END = P + 40, W = 6;
  for (const char* method : kMethods) {
    INFO(method);
    Sess X;
    auto p = params(D, method, W);
    OK(kvs_session_create(&p, &X.s));
    run(X.s, D, P, 0, END);
    if (keeps_history(method)) {
      // At least W back is always reachable, at most 2W; below that: a clear error.
      Err e{kvs_session_truncate(X.s, P + 2)};
      CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
      CHECK(e.msg().find("num_tokens") != std::string::npos);
      CHECK(e.msg().find("max_rollback") != std::string::npos);
      for (uint32_t l = 0; l < kLayers; ++l) CHECK(layer_tokens(X.s, l) == END);  // nothing changed
    }
    double hist = -1;
    OK(kvs_session_method_stat(X.s, "rollback_history_bytes", &hist));
    if (keeps_history(method)) {
      // Two copies of the index and the queries of at most 2W tokens per layer.
      CHECK(hist > double(kLayers) * W * D.hq * D.d * 4);
      kvs_session_stats st;
      st.struct_size = sizeof st;
      OK(kvs_session_get_stats(X.s, &st));
      CHECK(hist <= 2.0 * double(st.index_bytes) + double(kLayers) * (2 * W + 1) * D.hq * D.d * 4);
    } else {
      CHECK(hist == 0);
    }
    const int64_t keep = END - W;
    OK(kvs_session_truncate(X.s, keep));
    Sess R;
    OK(kvs_session_create(&p, &R.s));
    run(R.s, D, P, 0, keep);
    for (int64_t t = 0; t < 12; ++t) require_same(decode(X.s, E, t), decode(R.s, E, t));
  }
}

TEST_CASE("truncate: into the prompt, and to 0, where the method's index is a function of the keys") {
  Rng rng(2103);
  Data D(rng, 8, 2, 32, 600);
  Data E(rng, 8, 2, 32, 10);
  const int64_t P = 520;
  for (const char* method : {"full", "exact_topk", "streaming", "quest"}) {
    INFO(method);
    auto p = params(D, method, 0);
    Sess X, R;
    OK(kvs_session_create(&p, &X.s));
    OK(kvs_session_create(&p, &R.s));
    run(X.s, D, P, 0, P + 8);
    const int64_t keep = 263;  // below the prompt, past a KV page and mid quest page
    OK(kvs_session_truncate(X.s, keep));
    run(R.s, D, keep, 0, keep);
    for (int64_t t = 0; t < 6; ++t) require_same(decode(X.s, E, t), decode(R.s, E, t));
    // To 0: the layers start again (prefill, build) and decode as new.
    OK(kvs_session_truncate(X.s, 0));
    {
      Err e{kvs_session_build_index(X.s, nullptr)};
      CHECK(e.code() == KVS_STATUS_INVALID_STATE);
    }
    Sess N;
    OK(kvs_session_create(&p, &N.s));
    run(X.s, D, 100, 0, 104);
    run(N.s, D, 100, 0, 104);
    for (int64_t t = 0; t < 4; ++t) require_same(decode(X.s, E, t), decode(N.s, E, t));
  }
}

TEST_CASE("truncate: bad arguments are refused with the argument and range named; nothing changes") {
  Rng rng(2104);
  Data D(rng, 4, 2, 32, 300);
  {
    Err e{kvs_session_truncate(nullptr, 0)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
  }
  for (const char* method : kMethods) {
    INFO(method);
    Sess X;
    auto p = params(D, method, 0);
    OK(kvs_session_create(&p, &X.s));
    run(X.s, D, 200, 2, 206);
    for (int64_t bad : {int64_t(-1), int64_t(207), int64_t(1) << 40}) {
      Err e{kvs_session_truncate(X.s, bad)};
      CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
      CHECK(e.msg().find("num_tokens: expected 0..206") != std::string::npos);
    }
    OK(kvs_session_truncate(X.s, 206));  // the current length: nothing to do
    if (keeps_history(method)) {
      // No history kept (max_rollback = 0): the message says how to get one.
      Err e{kvs_session_truncate(X.s, 205)};
      CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
      CHECK(e.msg().find("expected 206..206") != std::string::npos);
      CHECK(e.msg().find("max_rollback > 0") != std::string::npos);
    } else {
      OK(kvs_session_truncate(X.s, 205));
    }
  }
  kvs_session_params p = params(D, "full", -1);
  Sess X;
  Err e{kvs_session_create(&p, &X.s)};
  CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(e.msg().find("params->max_rollback") != std::string::npos);
  CHECK(X.s == nullptr);
}

TEST_CASE("truncate: a fork rolls back on its own; the parent decodes on unchanged") {
  Rng rng(2105);
  Data D(rng, 4, 2, 32, 320);
  Data E(rng, 4, 2, 32, 8);
  for (const char* method : kMethods) {
    INFO(method);
    auto p = params(D, method, 16);
    Sess A, R;
    OK(kvs_session_create(&p, &A.s));
    OK(kvs_session_create(&p, &R.s));
    run(A.s, D, 250, 0, 262);
    run(R.s, D, 250, 0, 262);
    Sess F;
    OK(kvs_session_fork(A.s, &F.s));
    OK(kvs_session_truncate(F.s, 255));
    for (int64_t t = 0; t < 4; ++t) require_same(decode(A.s, E, t), decode(R.s, E, t));
    Sess G;
    OK(kvs_session_create(&p, &G.s));
    run(G.s, D, 250, 0, 255);
    for (int64_t t = 0; t < 4; ++t) require_same(decode(F.s, E, t), decode(G.s, E, t));
  }
}

TEST_CASE("lse_base: KVS_LSE_BASE_2 writes lse_e * log2(e); outputs unchanged; bad values refused") {
  Rng rng(2106);
  Data D(rng, 8, 2, 32, 300);
  for (const char* method : {"full", "quest", "hgca"}) {
    INFO(method);
    auto pe = params(D, method, 0), p2 = pe;
    p2.lse_base = KVS_LSE_BASE_2;
    Sess A, B;
    OK(kvs_session_create(&pe, &A.s));
    OK(kvs_session_create(&p2, &B.s));
    run(A.s, D, 256, 0, 256);
    run(B.s, D, 256, 0, 256);
    for (int64_t t = 256; t < 262; ++t) {
      const auto a = decode(A.s, D, t), b = decode(B.s, D, t);
      for (uint32_t l = 0; l < kLayers; ++l) {
        REQUIRE(std::memcmp(a[l].o.data(), b[l].o.data(), a[l].o.size() * 4) == 0);
        for (size_t h = 0; h < a[l].lse.size(); ++h) {
          const double want = double(a[l].lse[h]) / std::log(2.0);
          CHECK(std::abs(double(b[l].lse[h]) - want) <= 1e-6 * std::max(1.0, std::abs(want)));
          CHECK(b[l].lse[h] != a[l].lse[h]);
        }
      }
    }
    // kvs_decode_batch mixing both bases: each session gets its own.
    std::vector<float> q(size_t(2) * D.hq * D.d), k(size_t(2) * D.hkv * D.d), v(k.size());
    for (int b = 0; b < 2; ++b) {
      std::memcpy(q.data() + b * D.hq * D.d, D.qt(262), size_t(D.hq) * D.d * 4);
      std::memcpy(k.data() + b * D.hkv * D.d, D.kt(262), size_t(D.hkv) * D.d * 4);
      std::memcpy(v.data() + b * D.hkv * D.d, D.vt(262), size_t(D.hkv) * D.d * 4);
    }
    std::vector<float> o(q.size()), lse(size_t(2) * D.hq);
    T qt(q.data(), f32(), {2, D.hq, D.d}), kt(k.data(), f32(), {2, D.hkv, D.d}), vt(v.data(), f32(), {2, D.hkv, D.d});
    T ot(o.data(), f32(), {2, D.hq, D.d}), lt(lse.data(), f32(), {2, D.hq});
    kvs_session_t both[2] = {A.s, B.s};
    OK(kvs_decode_batch(both, 2, 0, &qt.t, &kt.t, &vt.t, &ot.t, &lt.t, nullptr));
    for (int h = 0; h < D.hq; ++h)
      CHECK(std::abs(double(lse[size_t(D.hq + h)]) - double(lse[size_t(h)]) / std::log(2.0)) <=
            1e-6 * std::max(1.0, std::abs(double(lse[size_t(h)]))));
  }
  auto p = params(D, "full", 0);
  p.lse_base = 2;  // not an enum value (KVS_LSE_BASE_2 is 1)
  Sess X;
  Err e{kvs_session_create(&p, &X.s)};
  CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(e.msg().find("params->lse_base") != std::string::npos);
}

TEST_CASE("session params: a 0.1.0 caller's smaller struct_size is accepted, the appended fields default") {
  Rng rng(2107);
  Data D(rng, 4, 2, 32, 40);
  auto p = params(D, "full", 0);
  p.lse_base = KVS_LSE_BASE_2;  // beyond the old size: must be ignored
  p.struct_size = uint32_t(offsetof(kvs_session_params, lse_base));
  Sess A, B;
  OK(kvs_session_create(&p, &A.s));
  auto pe = params(D, "full", 0);
  OK(kvs_session_create(&pe, &B.s));
  run(A.s, D, 32, 0, 32);
  run(B.s, D, 32, 0, 32);
  require_same(decode(A.s, D, 32), decode(B.s, D, 32));  // natural log: the default
  p.struct_size = uint32_t(offsetof(kvs_session_params, lse_base) - 1);
  Sess C;
  Err e{kvs_session_create(&p, &C.s)};
  CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(e.msg().find("params->struct_size") != std::string::npos);
}
