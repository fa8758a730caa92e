// SPDX-License-Identifier: Apache-2.0
// Sessions through the public C API: decode against float64 references, the baselines' selections,
// save/load, fork, batch decode, append, and argument errors that must leave state unchanged.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <set>
#include <string>

#include "backends/cpu/host_part.hpp"
#include "core/error.hpp"
#include "core/params.hpp"
#include "io/tables.hpp"
#include "kvsieve/kvsieve.h"
#include "methods/quest/quest.hpp"
#include "capi_helpers.hpp"
#include "reference.hpp"

using namespace kvt;

namespace {

std::string tmp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kvsieve_test_" + std::to_string(::getpid()) + "_" + name)).string();
}

// A trace of random tokens: q [T][Hq][d], k, v [T][Hkv][d] (fp32; rounded to the KV dtype for refs).
struct Data {
  int hq, hkv, d;
  int64_t T;
  std::vector<float> q, k, v;
  Data(Rng& rng, int hq_, int hkv_, int d_, int64_t T_) : hq(hq_), hkv(hkv_), d(d_), T(T_) {
    q = rng.normals(size_t(T) * hq * d);
    k = rng.normals(size_t(T) * hkv * d);
    v = rng.normals(size_t(T) * hkv * d);
    // A few heavy keys make top-k selections meaningful.
    for (int64_t t = 0; t < T; t += 37)
      for (int i = 0; i < hkv * d; ++i) k[size_t(t) * hkv * d + i] *= 2.5f;
  }
  float* qt(int64_t t) { return q.data() + t * hq * d; }
  float* kt(int64_t t) { return k.data() + t * hkv * d; }
  float* vt(int64_t t) { return v.data() + t * hkv * d; }
};

kvs_session_params params(const Data& D, const char* method, kvs_scalar_type kv = KVS_SCALAR_F32, double budget = 0.0) {
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = 2;
  p.num_q_heads = uint32_t(D.hq);
  p.num_kv_heads = uint32_t(D.hkv);
  p.head_dim = uint32_t(D.d);
  p.kv_dtype = kv;
  p.method = method;
  p.budget = budget;
  p.num_threads = 2;
  return p;
}

void prefill(kvs_session_t s, Data& D, uint32_t layer, int64_t n) {
  T q(D.q.data(), f32(), {n, D.hq, D.d}), k(D.k.data(), f32(), {n, D.hkv, D.d}), v(D.v.data(), f32(), {n, D.hkv, D.d});
  OK(kvs_session_prefill(s, layer, &q.t, &k.t, &v.t, nullptr, nullptr));
}

void decode(kvs_session_t s, Data& D, uint32_t layer, int64_t t, std::vector<float>& o, std::vector<float>& lse) {
  o.assign(size_t(D.hq) * D.d, NAN);
  lse.assign(size_t(D.hq), NAN);
  T q(D.qt(t), f32(), {D.hq, D.d}), k(D.kt(t), f32(), {D.hkv, D.d}), v(D.vt(t), f32(), {D.hkv, D.d});
  T ot(o.data(), f32(), {D.hq, D.d}), lt(lse.data(), f32(), {D.hq});
  OK(kvs_session_decode(s, layer, &q.t, &k.t, &v.t, &ot.t, &lt.t, nullptr));
}

// Creates the session of p, prefills layer 0 with the first n tokens and builds the index.
void build(Sess& S, Data& D, const kvs_session_params& p, int64_t n) {
  OK(kvs_session_create(&p, &S.s));
  prefill(S.s, D, 0, n);
  OK(kvs_session_build_index(S.s, nullptr));
}

std::vector<int32_t> selection(kvs_session_t s, uint32_t layer, uint32_t h) {
  size_t n = 0;
  OK(kvs_session_last_selection(s, layer, h, nullptr, 0, &n));
  std::vector<int32_t> out(n);
  OK(kvs_session_last_selection(s, layer, h, out.data(), n, &n));
  return out;
}

// Checks o/lse of step t against exact attention over keys[h / G] (or all of [0, t]).
void check_against(Data& D, int64_t t, const std::vector<float>& o, const std::vector<float>& lse,
                   const std::vector<std::vector<int32_t>>* keys_per_kv, double tol) {
  const int G = D.hq / D.hkv;
  for (int h = 0; h < D.hq; ++h) {
    std::vector<int64_t> keys;
    if (keys_per_kv) keys.assign((*keys_per_kv)[size_t(h / G)].begin(), (*keys_per_kv)[size_t(h / G)].end());
    else { keys.resize(size_t(t + 1)); std::iota(keys.begin(), keys.end(), 0); }
    std::vector<double> ref;
    double lref;
    attention_ref(D.qt(t), D.k.data(), D.v.data(), h, G, D.hkv, D.d, keys, 1.0 / std::sqrt(double(D.d)), ref, lref);
    INFO("step " << t << " head " << h);
    CHECK(rel_err(ref, o.data() + size_t(h) * D.d, D.d) < tol);
    CHECK(std::abs(double(lse[size_t(h)]) - lref) < 1e-4);
  }
}

}  // namespace

TEST_CASE("full: prefill + decode equal float64 attention at every step (GQA 4, fp32 KV)") {
  Rng rng(1);
  Data D(rng, 8, 2, 64, 400);
  Sess S;
  auto p = params(D, "full");
  build(S, D, p, 300);
  std::vector<float> o, lse;
  for (int64_t t = 300; t < 320; ++t) {
    decode(S.s, D, 0, t, o, lse);
    check_against(D, t, o, lse, nullptr, 2e-5);
  }
  int64_t n = 0;
  OK(kvs_session_layer_tokens(S.s, 0, &n));
  CHECK(n == 320);
  kvs_session_stats st;
  st.struct_size = sizeof st;
  OK(kvs_session_get_stats(S.s, &st));
  CHECK(st.tokens == 320);
  CHECK(st.decode_steps == 20);
  CHECK(st.last_selected_keys == 320.0);
  CHECK(selection(S.s, 0, 1).size() == 320);
}

TEST_CASE("decode phase timings: three session statistics, zero before decoding, growing within the decode wall time") {
  Rng rng(11);
  Data D(rng, 8, 2, 64, 2400);
  Sess S;
  auto p = params(D, "csattention", KVS_SCALAR_F32, 0.05);
  build(S, D, p, 2048);
  const char* names[3] = {"decode_update_seconds", "decode_select_seconds", "decode_attend_seconds"};
  auto read = [&](double* out) {
    for (int i = 0; i < 3; ++i) OK(kvs_session_method_stat(S.s, names[i], &out[i]));
  };
  double before[3], after[3];
  read(before);
  for (double b : before) CHECK(b == 0.0);
  std::vector<float> o, lse;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t t = 2048; t < 2048 + 64; ++t) decode(S.s, D, 0, t, o, lse);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  read(after);
  double sum = 0;
  for (int i = 0; i < 3; ++i) {
    INFO(names[i]);
    CHECK(after[i] > 0.0);  // each phase does work on every step (the lists take every new key)
    sum += after[i];
  }
  CHECK(sum <= wall);
  // The method's own statistics are still answered, and unknown names are refused.
  double v = 0;
  OK(kvs_session_method_stat(S.s, "searches", &v));
  CHECK(v == 64.0);
  kvs_error_t e = kvs_session_method_stat(S.s, "decode_other_seconds", &v);
  CHECK(kvs_error_code(e) == KVS_STATUS_INVALID_ARGUMENT);
  kvs_error_destroy(e);
}

// The group's summed softmax in float64 of KV head h's query heads at token t over keys [0, n):
// exact_topk's ranking.
std::vector<double> group_softmax_ref(Data& D, int64_t t, uint32_t h, int64_t n) {
  const int G = D.hq / D.hkv, d = D.d, hkv = D.hkv;
  std::vector<double> agg(size_t(n), 0.0);
  for (int g = 0; g < G; ++g) {
    std::vector<double> sc(static_cast<size_t>(n));
    double mx = -1e300, z = 0;
    for (int64_t j = 0; j < n; ++j) {
      double a = 0;
      for (int i = 0; i < d; ++i) a += double(D.qt(t)[(h * G + g) * d + i]) * double(D.k[(size_t(j) * hkv + h) * d + i]);
      sc[size_t(j)] = a / std::sqrt(double(d));
      mx = std::max(mx, sc[size_t(j)]);
    }
    for (double x : sc) z += std::exp(x - mx);
    for (int64_t j = 0; j < n; ++j) agg[size_t(j)] += std::exp(sc[size_t(j)] - mx) / z;
  }
  return agg;
}

TEST_CASE("exact_topk at budget 1.0 equals full; at 5% it picks the group-summed-softmax top-k") {
  Rng rng(2);
  Data D(rng, 8, 2, 32, 900);
  for (const char* mode : {"mode=per_kv_head", "mode=per_query_head"}) {
    Sess F, E, K;
    auto pf = params(D, "full", KVS_SCALAR_BF16);
    auto pe = params(D, "exact_topk", KVS_SCALAR_BF16, 1.0);
    pe.method_params = mode;
    auto pk = params(D, "exact_topk", KVS_SCALAR_F32, 0.05);
    pk.method_params = mode;
    OK(kvs_session_create(&pf, &F.s));
    OK(kvs_session_create(&pe, &E.s));
    OK(kvs_session_create(&pk, &K.s));
    for (auto* s : {F.s, E.s, K.s}) {
      prefill(s, D, 1, 800);
      OK(kvs_session_build_index(s, nullptr));
    }
    std::vector<float> of, lf, oe, le, ok, lk;
    for (int64_t t = 800; t < 810; ++t) {
      decode(F.s, D, 1, t, of, lf);
      decode(E.s, D, 1, t, oe, le);
      for (size_t i = 0; i < of.size(); ++i) CHECK(oe[i] == doctest::Approx(of[i]).epsilon(1e-5));
      decode(K.s, D, 1, t, ok, lk);
      const int64_t n = t + 1, k = int64_t(std::ceil(0.05 * double(n)));
      const int G = 4;
      std::vector<std::vector<int32_t>> sel(2);
      for (uint32_t h = 0; h < 2; ++h) {
        sel[h] = selection(K.s, 1, h);
        if (std::string(mode) == "mode=per_kv_head") {
          CHECK(int64_t(sel[h].size()) == k);
          // Reference top-k by the group's summed softmax in float64.
          const std::vector<double> agg = group_softmax_ref(D, t, h, n);
          std::vector<int32_t> idx(static_cast<size_t>(n));
          std::iota(idx.begin(), idx.end(), 0);
          std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) { return agg[size_t(a)] > agg[size_t(b)]; });
          std::set<int32_t> want(idx.begin(), idx.begin() + k), got(sel[h].begin(), sel[h].end());
          CHECK(want == got);
        } else {
          CHECK(int64_t(sel[h].size()) >= k);  // union over the group
          CHECK(int64_t(sel[h].size()) <= G * k);
        }
      }
      if (std::string(mode) == "mode=per_kv_head") check_against(D, t, ok, lk, &sel, 2e-5);
    }
  }
}

TEST_CASE("exact_topk with sinks and a local window: forced keys first (sinks, then the window's oldest), the rest by the group's summed softmax") {
  Rng rng(21);
  Data D(rng, 8, 2, 32, 820);
  // budget 5% at ~810 tokens: 41 keys = 3 sinks + 5 window + 33 chosen; 0.5%: 5 keys = 3 sinks + the
  // window's 2 oldest, nothing chosen.
  for (double budget : {0.05, 0.005}) {
    Sess K;
    auto pk = params(D, "exact_topk", KVS_SCALAR_F32, budget);
    pk.method_params = "sinks=3,local=5";
    OK(kvs_session_create(&pk, &K.s));
    prefill(K.s, D, 1, 800);
    OK(kvs_session_build_index(K.s, nullptr));
    std::vector<float> o, lse;
    for (int64_t t = 800; t < 806; ++t) {
      decode(K.s, D, 1, t, o, lse);
      const int64_t n = t + 1, k = int64_t(std::ceil(budget * double(n)));
      for (uint32_t h = 0; h < 2; ++h) {
        const std::vector<double> agg = group_softmax_ref(D, t, h, n);
        std::set<int32_t> want;
        for (int32_t j = 0; j < 3 && int64_t(want.size()) < k; ++j) want.insert(j);
        for (int64_t j = n - 5; j < n && int64_t(want.size()) < k; ++j) want.insert(int32_t(j));
        std::vector<int32_t> mid(static_cast<size_t>(n - 8));
        std::iota(mid.begin(), mid.end(), 3);
        const int64_t rest = k - int64_t(want.size());
        std::partial_sort(mid.begin(), mid.begin() + rest, mid.end(),
                          [&](int32_t a, int32_t b) { return agg[size_t(a)] > agg[size_t(b)]; });
        want.insert(mid.begin(), mid.begin() + rest);
        const auto got = selection(K.s, 1, h);
        INFO("budget " << budget << " t " << t << " h " << h);
        CHECK(std::is_sorted(got.begin(), got.end()));
        CHECK(std::set<int32_t>(got.begin(), got.end()) == want);
        CHECK(int64_t(got.size()) == k);
      }
    }
  }
}

TEST_CASE("streaming selects the sinks and the recent window") {
  Rng rng(3);
  Data D(rng, 4, 4, 16, 600);
  Sess S;
  auto p = params(D, "streaming", KVS_SCALAR_F32);
  p.method_params = "sinks=4,window=100";
  build(S, D, p, 500);
  std::vector<float> o, lse;
  decode(S.s, D, 0, 500, o, lse);
  std::vector<int32_t> want;
  for (int i = 0; i < 4; ++i) want.push_back(i);
  for (int i = 401; i <= 500; ++i) want.push_back(i);
  std::vector<std::vector<int32_t>> sel;
  for (uint32_t h = 0; h < 4; ++h) {
    sel.push_back(selection(S.s, 0, h));
    CHECK(sel.back() == want);
  }
  check_against(D, 500, o, lse, &sel, 2e-5);
}

TEST_CASE("quest: saved page bounds are never below the true page maximum; selections are whole pages") {
  Rng rng(4);
  Data D(rng, 4, 2, 32, 700);
  for (auto kv : {KVS_SCALAR_F32, KVS_SCALAR_BF16}) {
    Sess S;
    auto p = params(D, "quest", kv, 0.1);
    build(S, D, p, 650);
    std::vector<float> o, lse;
    for (int64_t t = 650; t < 660; ++t) decode(S.s, D, 0, t, o, lse);
    const std::string path = tmp_path("quest.kvt");
    OK(kvs_session_save(S.s, path.c_str(), KVS_SAVE_TABLES));
    auto f = kvs::io::TablesFile::open(path);
    const auto& sec = f->require("quest.bounds", 0, -1);
    const float* b = reinterpret_cast<const float*>(sec.data);
    const int64_t n = 660, pages = (n + 15) / 16;
    REQUIRE(sec.length == uint64_t(pages) * 2 * 2 * 32 * 4);
    auto Kr = rounded(D.k, kv == KVS_SCALAR_BF16 ? kvs::DType::BF16 : kvs::DType::F32);
    for (int trial = 0; trial < 20; ++trial) {
      auto q = rng.normals(32, 3.f);
      for (int64_t pg = 0; pg < pages; ++pg)
        for (int h = 0; h < 2; ++h) {
          const float* mm = b + (size_t(pg) * 2 + h) * 2 * 32;
          double mx = -1e300;
          for (int64_t t = pg * 16; t < std::min(n, pg * 16 + 16); ++t) {
            double a = 0;
            for (int i = 0; i < 32; ++i) a += double(q[size_t(i)]) * double(Kr[(size_t(t) * 2 + h) * 32 + i]);
            mx = std::max(mx, a);
          }
          const double u = kvs::quest_upper_bound(q.data(), mm, mm + 32, 32);
          CHECK(u >= mx - 1e-4 * (1 + std::abs(mx)));
        }
    }
    for (uint32_t h = 0; h < 2; ++h) {
      auto sel = selection(S.s, 0, h);
      CHECK(std::binary_search(sel.begin(), sel.end(), 659));  // current page always
      std::set<int64_t> pages_hit;
      for (int32_t t : sel) pages_hit.insert(t / 16);
      size_t expect = 0;
      for (int64_t pg : pages_hit) expect += size_t(std::min<int64_t>(n, pg * 16 + 16) - pg * 16);
      CHECK(sel.size() == expect);
    }
    std::remove(path.c_str());
  }
}

TEST_CASE("save/load round trip reproduces decode outputs bit for bit, with and without KV") {
  Rng rng(5);
  Data D(rng, 4, 2, 32, 700);
  for (const char* method : {"quest", "exact_topk", "full"}) {
    Sess A;
    auto p = params(D, method, KVS_SCALAR_BF16, 0.1);
    OK(kvs_session_create(&p, &A.s));
    prefill(A.s, D, 0, 600);
    prefill(A.s, D, 1, 600);
    OK(kvs_session_build_index(A.s, nullptr));
    const std::string kvp = tmp_path(std::string(method) + "_kv.kvt"), tp = tmp_path(std::string(method) + "_t.kvt");
    OK(kvs_session_save(A.s, kvp.c_str(), KVS_SAVE_INCLUDE_KV));
    OK(kvs_session_save(A.s, tp.c_str(), KVS_SAVE_TABLES));
    Sess B, C;
    OK(kvs_session_load(kvp.c_str(), nullptr, &B.s));
    OK(kvs_session_load(tp.c_str(), nullptr, &C.s));
    // The tables-only session must get its KV again before decoding.
    std::vector<float> o1, l1, o2, l2, o3, l3;
    {
      T q(D.qt(600), f32(), {D.hq, D.d}), k(D.kt(600), f32(), {D.hkv, D.d}), v(D.vt(600), f32(), {D.hkv, D.d});
      std::vector<float> o(size_t(D.hq) * D.d);
      T ot(o.data(), f32(), {D.hq, D.d});
      Err e{kvs_session_decode(C.s, 0, &q.t, &k.t, &v.t, &ot.t, nullptr, nullptr)};
      CHECK(e.code() == KVS_STATUS_INVALID_STATE);
    }
    prefill(C.s, D, 0, 300);  // half the prompt: still not decodable
    {
      T q(D.qt(600), f32(), {D.hq, D.d}), k(D.kt(600), f32(), {D.hkv, D.d}), v(D.vt(600), f32(), {D.hkv, D.d});
      std::vector<float> o(size_t(D.hq) * D.d);
      T ot(o.data(), f32(), {D.hq, D.d});
      Err e{kvs_session_decode(C.s, 0, &q.t, &k.t, &v.t, &ot.t, nullptr, nullptr)};
      CHECK(e.code() == KVS_STATUS_INVALID_STATE);
    }
    {
      T q(D.qt(300), f32(), {300, D.hq, D.d}), k(D.kt(300), f32(), {300, D.hkv, D.d}), v(D.vt(300), f32(), {300, D.hkv, D.d});
      OK(kvs_session_prefill(C.s, 0, &q.t, &k.t, &v.t, nullptr, nullptr));
    }
    prefill(C.s, D, 1, 600);
    kvs_session_stats st;
    st.struct_size = sizeof st;
    OK(kvs_session_get_stats(B.s, &st));
    CHECK(st.kv_shared_bytes == 0);  // pages copied out of the file (KVS_LOAD_MMAP maps them)
    for (int64_t t = 600; t < 620; ++t)
      for (uint32_t l = 0; l < 2; ++l) {
        decode(A.s, D, l, t, o1, l1);
        decode(B.s, D, l, t, o2, l2);
        decode(C.s, D, l, t, o3, l3);
        CHECK(std::memcmp(o1.data(), o2.data(), o1.size() * 4) == 0);
        CHECK(std::memcmp(l1.data(), l2.data(), l1.size() * 4) == 0);
        CHECK(std::memcmp(o1.data(), o3.data(), o1.size() * 4) == 0);
      }
    std::remove(kvp.c_str());
    std::remove(tp.c_str());
  }
}

TEST_CASE("kvs_session_to: a copy on the cpu decodes every method the same, bit for bit; the source is unchanged") {
  Rng rng(11);
  Data D(rng, 8, 2, 32, 900);
  for (const char* method : {"full", "exact_topk", "streaming", "quest", "csattention", "ctkvr", "lfps", "hgca",
                             "retroinfer"}) {
    INFO(std::string(method));
    Sess A;
    auto p = params(D, method, KVS_SCALAR_BF16, 0.1);
    OK(kvs_session_create(&p, &A.s));
    prefill(A.s, D, 0, 800);
    prefill(A.s, D, 1, 800);
    OK(kvs_session_build_index(A.s, nullptr));
    std::vector<float> o1, l1, o2, l2;
    for (int64_t t = 800; t < 805; ++t)  // some decode history (history-based methods keep state)
      for (uint32_t l = 0; l < 2; ++l) decode(A.s, D, l, t, o1, l1);
    Sess B;
    OK(kvs_session_to(A.s, KVS_BACKEND_CPU, 0, &B.s));
    kvs_session_stats sa, sb;
    sa.struct_size = sb.struct_size = sizeof sa;
    OK(kvs_session_get_stats(A.s, &sa));
    OK(kvs_session_get_stats(B.s, &sb));
    CHECK(sb.tokens == sa.tokens);
    CHECK(sb.decode_steps == sa.decode_steps);  // (index_bytes counts capacity: a loaded index may hold less)
    for (int64_t t = 805; t < 830; ++t)
      for (uint32_t l = 0; l < 2; ++l) {
        decode(A.s, D, l, t, o1, l1);
        decode(B.s, D, l, t, o2, l2);
        REQUIRE(std::memcmp(o1.data(), o2.data(), o1.size() * 4) == 0);
        REQUIRE(std::memcmp(l1.data(), l2.data(), l1.size() * 4) == 0);
        for (uint32_t h = 0; h < 2; ++h) CHECK(selection(A.s, l, h) == selection(B.s, l, h));
      }
  }
}

TEST_CASE("kvs_session_to: bad arguments and a layer without KV") {
  Rng rng(12);
  Data D(rng, 4, 2, 32, 300);
  Sess A;
  auto p = params(D, "quest", KVS_SCALAR_F32, 0.1);
  build(A, D, p, 200);
  prefill(A.s, D, 1, 200);
  kvs_session_t out = nullptr;
  {
    Err e{kvs_session_to(A.s, 7, 0, &out)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("backend") != std::string::npos);
  }
  {
    Err e{kvs_session_to(A.s, KVS_BACKEND_CPU, -1, &out)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("device_id") != std::string::npos);
  }
  {
    Err e{kvs_session_to(A.s, KVS_BACKEND_CPU, 0, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
  }
  {
    Err e{kvs_session_to(nullptr, KVS_BACKEND_CPU, 0, &out)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
  }
  CHECK(out == nullptr);
  // A tables-only load has no KV to move until its layers are prefilled again.
  const std::string tp = tmp_path("to_tables.kvt");
  OK(kvs_session_save(A.s, tp.c_str(), KVS_SAVE_TABLES));
  Sess C;
  OK(kvs_session_load(tp.c_str(), nullptr, &C.s));
  {
    Err e{kvs_session_to(C.s, KVS_BACKEND_CPU, 0, &out)};
    CHECK(e.code() == KVS_STATUS_INVALID_STATE);
    CHECK(e.msg().find("kvs_session_to") != std::string::npos);
  }
  CHECK(out == nullptr);
  std::remove(tp.c_str());
}

TEST_CASE("corrupt tables files are rejected with the right code") {
  Rng rng(6);
  Data D(rng, 2, 1, 16, 300);
  Sess A;
  auto p = params(D, "quest", KVS_SCALAR_F32, 0.1);
  build(A, D, p, 300);
  const std::string path = tmp_path("corrupt.kvt");
  OK(kvs_session_save(A.s, path.c_str(), KVS_SAVE_INCLUDE_KV));
  std::vector<char> bytes;
  {
    FILE* f = std::fopen(path.c_str(), "rb");
    std::fseek(f, 0, SEEK_END);
    bytes.resize(size_t(std::ftell(f)));
    std::fseek(f, 0, SEEK_SET);
    REQUIRE(std::fread(bytes.data(), 1, bytes.size(), f) == bytes.size());
    std::fclose(f);
  }
  auto write = [&](const std::vector<char>& b) {
    FILE* f = std::fopen(path.c_str(), "wb");
    std::fwrite(b.data(), 1, b.size(), f);
    std::fclose(f);
  };
  auto load_code = [&]() {
    kvs_session_t s = nullptr;
    Err e{kvs_session_load(path.c_str(), nullptr, &s)};
    CHECK(s == nullptr);
    return e.code();
  };
  auto t = bytes;
  t.resize(bytes.size() - 100);
  write(t);
  CHECK(load_code() == KVS_STATUS_FORMAT_TRUNCATED);
  auto fl = bytes;
  fl[bytes.size() - 200] ^= 0x10;  // inside the last payload
  write(fl);
  CHECK(load_code() == KVS_STATUS_FORMAT_CHECKSUM);
  auto ver = bytes;
  ver[4] = char(99);  // major version (u16 after the 4-byte magic)
  write(ver);
  CHECK(load_code() == KVS_STATUS_FORMAT_VERSION);
  auto mg = bytes;
  mg[0] = 'X';
  write(mg);
  CHECK(load_code() == KVS_STATUS_FORMAT_MAGIC);
  std::remove(path.c_str());
  kvs_session_t s = nullptr;
  Err e{kvs_session_load(path.c_str(), nullptr, &s)};
  CHECK(e.code() == KVS_STATUS_IO);
}

TEST_CASE("fork shares the prefix and diverges copy-on-write") {
  Rng rng(7);
  Data D(rng, 4, 2, 32, 520);
  Data D2 = D;
  for (int64_t t = 500; t < 520; ++t)  // the child's continuation differs
    for (int i = 0; i < 2 * 32; ++i) { D2.kt(t)[i] = rng.normal(); D2.vt(t)[i] = rng.normal(); }
  Sess P, C;
  auto p = params(D, "full", KVS_SCALAR_F32);
  build(P, D, p, 500);  // 500 = a partly filled second page
  OK(kvs_session_fork(P.s, &C.s));
  std::vector<float> o, lse;
  for (int64_t t = 500; t < 510; ++t) {
    decode(C.s, D2, 0, t, o, lse);
    check_against(D2, t, o, lse, nullptr, 2e-5);
    decode(P.s, D, 0, t, o, lse);
    check_against(D, t, o, lse, nullptr, 2e-5);
  }
  kvs_session_destroy(P.s);  // the child outlives its parent
  P.s = nullptr;
  for (int64_t t = 510; t < 520; ++t) {
    decode(C.s, D2, 0, t, o, lse);
    check_against(D2, t, o, lse, nullptr, 2e-5);
  }
}

TEST_CASE("decode_batch equals one decode per session; append writes causal outputs") {
  Rng rng(8);
  Data D(rng, 4, 1, 16, 300);
  Sess a, b, r1, r2;
  auto p = params(D, "full", KVS_SCALAR_F16);
  for (auto* s : {&a.s, &b.s, &r1.s, &r2.s}) OK(kvs_session_create(&p, s));
  prefill(a.s, D, 0, 200);
  prefill(r1.s, D, 0, 200);
  prefill(b.s, D, 0, 150);
  prefill(r2.s, D, 0, 150);
  for (auto* s : {a.s, b.s, r1.s, r2.s}) OK(kvs_session_build_index(s, nullptr));
  // batch rows: a decodes token 200, b decodes token 150
  std::vector<float> q(2 * 4 * 16), k(2 * 16), v(2 * 16), o(2 * 4 * 16), lse(2 * 4);
  std::copy(D.qt(200), D.qt(200) + 64, q.begin());
  std::copy(D.qt(150), D.qt(150) + 64, q.begin() + 64);
  std::copy(D.kt(200), D.kt(200) + 16, k.begin());
  std::copy(D.kt(150), D.kt(150) + 16, k.begin() + 16);
  std::copy(D.vt(200), D.vt(200) + 16, v.begin());
  std::copy(D.vt(150), D.vt(150) + 16, v.begin() + 16);
  T qt(q.data(), f32(), {2, 4, 16}), kt(k.data(), f32(), {2, 1, 16}), vt(v.data(), f32(), {2, 1, 16});
  T ot(o.data(), f32(), {2, 4, 16}), lt(lse.data(), f32(), {2, 4});
  kvs_session_t batch[2] = {a.s, b.s};
  OK(kvs_decode_batch(batch, 2, 0, &qt.t, &kt.t, &vt.t, &ot.t, &lt.t, nullptr));
  std::vector<float> o1, l1, o2, l2;
  decode(r1.s, D, 0, 200, o1, l1);
  decode(r2.s, D, 0, 150, o2, l2);
  CHECK(std::equal(o1.begin(), o1.end(), o.begin()));
  CHECK(std::equal(o2.begin(), o2.end(), o.begin() + 64));
  // append 50 tokens (201..250) with outputs, check causal attention per row.
  std::vector<float> ao(50 * 64);
  T aq(D.qt(201), f32(), {50, 4, 16}), ak(D.kt(201), f32(), {50, 1, 16}), av(D.vt(201), f32(), {50, 1, 16});
  T aot(ao.data(), f32(), {50, 4, 16});
  OK(kvs_session_append(a.s, 0, &aq.t, &ak.t, &av.t, &aot.t, nullptr));
  auto Dr = D;
  Dr.k = rounded(D.k, kvs::DType::F16);
  Dr.v = rounded(D.v, kvs::DType::F16);
  for (int64_t i = 0; i < 50; i += 7) {
    std::vector<float> row(ao.begin() + i * 64, ao.begin() + i * 64 + 64), lrow(4, 0.f);
    const int64_t t = 201 + i;
    for (int h = 0; h < 4; ++h) {
      std::vector<int64_t> keys(static_cast<size_t>(t + 1));
      std::iota(keys.begin(), keys.end(), 0);
      std::vector<double> ref;
      double lref;
      attention_ref(D.qt(t), Dr.k.data(), Dr.v.data(), h, 4, 1, 16, keys, 0.25, ref, lref);
      CHECK(rel_err(ref, row.data() + h * 16, 16) < 2e-5);
    }
  }
  int64_t n = 0;
  OK(kvs_session_layer_tokens(a.s, 0, &n));
  CHECK(n == 251);
}

// The batch tests of every method: a batch of sessions of different prompt lengths, each with a
// reference session of the same length stepped alone.
struct BatchCase {
  const char* method;
  const char* params;
};
const std::vector<BatchCase> kBatchCases = {
    {"full", nullptr},  {"exact_topk", nullptr}, {"streaming", nullptr}, {"quest", nullptr},
    {"csattention", "centroids=8"}, {"ctkvr", nullptr}, {"lfps", nullptr}, {"hgca", nullptr},
    {"retroinfer", "update_segment=64,index_min=0,local=16"}};

struct BatchRun {
  Data& D;
  std::vector<int64_t> lens;
  std::vector<Sess> bs, rs;  // the batch's sessions and their references
  std::vector<kvs_session_t> batch;
  size_t qn, kn;
  std::vector<float> q, k, v, o, lse;  // the step's tensors

  BatchRun(Data& data, const BatchCase& c, std::vector<int64_t> lengths)
      : D(data), lens(std::move(lengths)), bs(lens.size()), rs(lens.size()) {
    auto p = params(D, c.method, KVS_SCALAR_BF16, 0.1);
    p.method_params = c.params;
    p.num_threads = 3;
    for (size_t b = 0; b < lens.size(); ++b) {
      build(bs[b], D, p, lens[b]);
      build(rs[b], D, p, lens[b]);
      batch.push_back(bs[b].s);
    }
    qn = size_t(D.hq) * D.d;
    kn = size_t(D.hkv) * D.d;
  }
  // kvs_decode_batch of decode step `step` (token lens[b] + step of session b).
  kvs_error_t decode(int step) {
    const int64_t B = int64_t(lens.size());
    q.assign(B * qn, 0.f), k.assign(B * kn, 0.f), v.assign(B * kn, 0.f);
    o.assign(B * qn, NAN), lse.assign(B * size_t(D.hq), NAN);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t t = lens[size_t(b)] + step;
      std::copy(D.qt(t), D.qt(t) + qn, q.begin() + b * qn);
      std::copy(D.kt(t), D.kt(t) + kn, k.begin() + b * kn);
      std::copy(D.vt(t), D.vt(t) + kn, v.begin() + b * kn);
    }
    T qt(q.data(), f32(), {B, D.hq, D.d}), kt(k.data(), f32(), {B, D.hkv, D.d}), vt(v.data(), f32(), {B, D.hkv, D.d});
    T ot(o.data(), f32(), {B, D.hq, D.d}), lt(lse.data(), f32(), {B, D.hq});
    return kvs_decode_batch(batch.data(), size_t(B), 0, &qt.t, &kt.t, &vt.t, &ot.t, &lt.t, nullptr);
  }
  // After a decode(step) that succeeded: every session's output, LSE and selection bit for bit those
  // of its reference stepped alone.
  void check_alone(int step) {
    for (size_t b = 0; b < lens.size(); ++b) {
      INFO("step " << step << ", session " << b);
      std::vector<float> o1, l1;
      ::decode(rs[b].s, D, 0, lens[b] + step, o1, l1);
      CHECK(std::memcmp(o1.data(), o.data() + b * qn, qn * 4) == 0);
      CHECK(std::memcmp(l1.data(), lse.data() + b * size_t(D.hq), size_t(D.hq) * 4) == 0);
      for (uint32_t h = 0; h < uint32_t(D.hkv); ++h) CHECK(selection(bs[b].s, 0, h) == selection(rs[b].s, 0, h));
    }
  }
};

TEST_CASE("decode_batch of every method: sessions of different lengths stepped as one pool job equal each stepped alone") {
  Rng rng(21);
  Data D(rng, 8, 2, 32, 700);
  for (const auto& c : kBatchCases) {
    INFO("method " << c.method);
    BatchRun R(D, c, {300, 430, 517, 610});
    for (int step = 0; step < 12; ++step) {
      OK(R.decode(step));
      R.check_alone(step);
    }
  }
}

TEST_CASE("decode_batch of every method: a session failing mid-batch leaves every session of the batch as it was") {
  // A failure past the argument checks (testing::fail_step_at: the step of the session whose layer
  // holds that many tokens fails after its method's update and selection) while the batch's sessions
  // step at once on the pool: the call fails, no session keeps the token, and the batch then decodes
  // bit for bit like sessions that never saw the call (methods' state rolled back exactly).
  Rng rng(23);
  Data D(rng, 8, 2, 32, 700);
  for (const auto& c : kBatchCases) {
    for (int failing = 0; failing < 3; ++failing) {
      INFO("method " << c.method << ", failing session " << failing);
      BatchRun R(D, c, {300, 430, 517});
      for (int step = 0; step < 8; ++step) {
        if (step == 3) {  // this call fails in one session; the others have stepped (or step) beside it
          kvs::testing::fail_step_at(R.lens[size_t(failing)] + step);
          Err e{R.decode(step)};
          kvs::testing::fail_step_at(-1);
          CHECK(e.code() == KVS_STATUS_INTERNAL);
          CHECK(e.msg().find("injected failure") != std::string::npos);
          for (size_t b = 0; b < 3; ++b) {
            int64_t n = 0;
            OK(kvs_session_layer_tokens(R.bs[b].s, 0, &n));
            CHECK(n == R.lens[b] + step);
          }
        }
        OK(R.decode(step));
        R.check_alone(step);
      }
    }
  }
}

TEST_CASE("chunked prefill equals one prefill; prefill after build_index is refused") {
  Rng rng(9);
  Data D(rng, 4, 2, 32, 700);
  Sess A, B;
  auto p = params(D, "quest", KVS_SCALAR_BF16, 0.1);
  OK(kvs_session_create(&p, &A.s));
  OK(kvs_session_create(&p, &B.s));
  prefill(A.s, D, 0, 600);
  std::vector<float> oc(size_t(600) * 4 * 32);
  for (int64_t c0 : {int64_t(0), int64_t(100), int64_t(355)}) {
    const int64_t c1 = c0 == 0 ? 100 : c0 == 100 ? 355 : 600, n = c1 - c0;
    T q(D.qt(c0), f32(), {n, 4, 32}), k(D.kt(c0), f32(), {n, 2, 32}), v(D.vt(c0), f32(), {n, 2, 32});
    T o(oc.data() + c0 * 128, f32(), {n, 4, 32});
    OK(kvs_session_prefill(B.s, 0, &q.t, &k.t, &v.t, &o.t, nullptr));
  }
  // Chunk outputs are causal over the whole prompt so far.
  auto Dr = D;
  Dr.k = rounded(D.k, kvs::DType::BF16);
  Dr.v = rounded(D.v, kvs::DType::BF16);
  for (int64_t t : {int64_t(0), int64_t(99), int64_t(100), int64_t(400), int64_t(599)})
    for (int h = 0; h < 4; ++h) {
      std::vector<int64_t> keys(static_cast<size_t>(t + 1));
      std::iota(keys.begin(), keys.end(), 0);
      std::vector<double> ref;
      double lref;
      attention_ref(D.qt(t), Dr.k.data(), Dr.v.data(), h, 2, 2, 32, keys, 1.0 / std::sqrt(32.0), ref, lref);
      CHECK(rel_err(ref, oc.data() + t * 128 + h * 32, 32) < 2e-5);
    }
  OK(kvs_session_build_index(A.s, nullptr));
  OK(kvs_session_build_index(B.s, nullptr));
  std::vector<float> o1, l1, o2, l2;
  for (int64_t t = 600; t < 610; ++t) {
    decode(A.s, D, 0, t, o1, l1);
    decode(B.s, D, 0, t, o2, l2);
    CHECK(std::memcmp(o1.data(), o2.data(), o1.size() * 4) == 0);
  }
  T q(D.qt(0), f32(), {1, 4, 32}), k(D.kt(0), f32(), {1, 2, 32}), v(D.vt(0), f32(), {1, 2, 32});
  Err e{kvs_session_prefill(A.s, 0, &q.t, &k.t, &v.t, nullptr, nullptr)};
  CHECK(e.code() == KVS_STATUS_INVALID_STATE);
}

TEST_CASE("preset=paper: parameters without an explicit value take their paper value; explicit values win") {
  const std::vector<kvs::ParamSpec> specs = {{"preset", "enum:kvsieve|paper", "kvsieve", "preset"},
                                             {"a", "int", "0", "a", "2"},
                                             {"b", "enum:x|y", "x", "b", "y"},
                                             {"c", "int", "7", "c (no paper value)"}};
  auto v = [](const kvs::ParamSet& p) { return p.get_string("a") + p.get_string("b") + p.get_string("c"); };
  CHECK(v(kvs::ParamSet::parse("m", specs, "")) == "0x7");
  CHECK(v(kvs::ParamSet::parse("m", specs, "preset=paper")) == "2y7");
  CHECK(v(kvs::ParamSet::parse("m", specs, "a=5,preset=paper")) == "5y7");
  CHECK(v(kvs::ParamSet::parse("m", specs, "preset=paper,b=x,c=1")) == "2x1");
  // The recorded values are the resolved ones: a reload (from_json) gives the same settings.
  const auto p = kvs::ParamSet::parse("m", specs, "preset=paper,a=3");
  CHECK(v(kvs::ParamSet::from_json("m", specs, p.to_json())) == "3y7");
  try {
    kvs::ParamSet::parse("m", specs, "preset=authors");
    FAIL("accepted");
  } catch (const kvs::Error& e) {
    CHECK(std::string(e.what()).find("preset") != std::string::npos);
  }
}
