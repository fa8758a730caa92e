// SPDX-License-Identifier: Apache-2.0
// csattention: the degenerate exact case (m = 1, C = prompt queries as centroids, L = N), the
// streaming lists against a float64 brute-force Top-L over every key seen, save/load bit-exactness,
// the k-means objective, the search period, parameter errors, and the step's forced keys (step_keys).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "backends/cpu/gemm.hpp"
#include "backends/cpu/topk.hpp"
#include "core/kv_store.hpp"
#include "core/method.hpp"
#include "core/params.hpp"
#include "core/thread_pool.hpp"
#include "io/tables.hpp"
#include "kvsieve/kvsieve.h"
#include "methods/csattention/csattention.hpp"
#include "capi_helpers.hpp"
#include "reference.hpp"

using namespace kvt;

namespace {

std::string tmp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kvsieve_csa_" + std::to_string(::getpid()) + "_" + name)).string();
}

struct Data {
  int hq, hkv, d;
  int64_t T;
  std::vector<float> q, k, v;
  Data(Rng& rng, int hq_, int hkv_, int d_, int64_t T_) : hq(hq_), hkv(hkv_), d(d_), T(T_) {
    q = rng.normals(size_t(T) * hq * d);
    k = rng.normals(size_t(T) * hkv * d);
    v = rng.normals(size_t(T) * hkv * d);
  }
  float* qt(int64_t t) { return q.data() + t * hq * d; }
  float* kt(int64_t t) { return k.data() + t * hkv * d; }
  float* vt(int64_t t) { return v.data() + t * hkv * d; }
};

kvs_session_params params(const Data& D, const char* mp, uint32_t layers = 1, double budget = 0.0,
                          kvs_scalar_type kv = KVS_SCALAR_F32) {
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = layers;
  p.num_q_heads = uint32_t(D.hq);
  p.num_kv_heads = uint32_t(D.hkv);
  p.head_dim = uint32_t(D.d);
  p.kv_dtype = kv;
  p.method = "csattention";
  p.method_params = mp;
  p.budget = budget;
  p.num_threads = 2;
  return p;
}

void prefill(kvs_session_t s, Data& D, uint32_t layer, int64_t from, int64_t n) {
  T q(D.qt(from), f32(), {n, D.hq, D.d}), k(D.kt(from), f32(), {n, D.hkv, D.d}), v(D.vt(from), f32(), {n, D.hkv, D.d});
  OK(kvs_session_prefill(s, layer, &q.t, &k.t, &v.t, nullptr, nullptr));
}

// A one-layer session with parameters mp and budget, its first N tokens prefilled and indexed.
void build(Sess& S, Data& D, const std::string& mp, double budget, int64_t N) {
  auto p = params(D, mp.c_str(), 1, budget);
  OK(kvs_session_create(&p, &S.s));
  prefill(S.s, D, 0, 0, N);
  OK(kvs_session_build_index(S.s, nullptr));
}

// Decode token t with query q (default: the trace's).
void decode(kvs_session_t s, Data& D, uint32_t layer, int64_t t, std::vector<float>& o, std::vector<float>& lse,
            const float* q = nullptr) {
  o.assign(size_t(D.hq) * D.d, NAN);
  lse.assign(size_t(D.hq), NAN);
  T qt(const_cast<float*>(q ? q : D.qt(t)), f32(), {D.hq, D.d}), k(D.kt(t), f32(), {D.hkv, D.d}),
      v(D.vt(t), f32(), {D.hkv, D.d});
  T ot(o.data(), f32(), {D.hq, D.d}), lt(lse.data(), f32(), {D.hq});
  OK(kvs_session_decode(s, layer, &qt.t, &k.t, &v.t, &ot.t, &lt.t, nullptr));
}

std::vector<int32_t> selection(kvs_session_t s, uint32_t layer, uint32_t h) {
  size_t n = 0;
  OK(kvs_session_last_selection(s, layer, h, nullptr, 0, &n));
  std::vector<int32_t> out(n);
  OK(kvs_session_last_selection(s, layer, h, out.data(), n, &n));
  return out;
}

// Exact top-k of q . k_j over keys [0, n) of KV head h (float64, ties to the lower index).
std::vector<int32_t> exact_topk(Data& D, const float* q, int h, int64_t n, int64_t k) {
  std::vector<double> s(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    double a = 0;
    for (int i = 0; i < D.d; ++i) a += double(q[i]) * D.kt(j)[h * D.d + i];
    s[size_t(j)] = a;
  }
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
  idx.resize(size_t(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace

TEST_CASE("csattention: m=1, C=#prompt queries with the normalised queries as centroids, L=N selects exact top-K") {
  Rng rng(11);
  for (const char* mode : {"per_kv_head", "per_query_head"}) {
    const bool pq = std::string(mode) == "per_query_head";
    // per_kv_head with G = 1 (the table head is the query head); per_query_head with G = 2.
    Data D(rng, pq ? 4 : 2, 2, 16, 240);
    const int64_t N = 200;
    const std::string mp = std::string("subspaces=1,centroids=200,init=queries,list_frac=1,recent=0,sinks=0,"
                                       "score_dtype=f32,gqa=") + mode;
    Sess S;
    build(S, D, mp, 0.1, N);
    std::vector<float> o, l;
    const int G = D.hq / D.hkv;
    for (int64_t t = N; t < D.T; ++t) {
      // The decode query of every head is (twice) the prompt query of that head at a random token,
      // so its nearest centroid is that query's own direction.
      const int64_t src = rng.uniform(0, N - 1);
      std::vector<float> q(D.qt(src), D.qt(src) + D.hq * D.d);
      for (auto& x : q) x *= 2.f;
      decode(S.s, D, 0, t, o, l, q.data());
      const int64_t n = t + 1, K = int64_t(std::ceil(0.1 * double(n)));
      for (int h = 0; h < D.hkv; ++h) {
        std::set<int32_t> want;
        for (int g = 0; g < G; ++g)
          for (int32_t j : exact_topk(D, q.data() + size_t(h * G + g) * D.d, h, n, K)) want.insert(j);
        const auto got = selection(S.s, 0, uint32_t(h));
        INFO(mode << " step " << t << " kv head " << h);
        CHECK(std::vector<int32_t>(want.begin(), want.end()) == got);
      }
    }
  }
}

TEST_CASE("csattention: rerank over lists holding every key keeps the exact top-K' by the group's summed softmax") {
  // list_frac=1: every list holds every prompt key, and the decode steps stay inside the window, so
  // with a large rerank factor the candidates are all keys outside the forced ones and the rerank
  // alone decides: float64 scores, per-head softmax over those candidates, summed over the group.
  Rng rng(21);
  for (int G : {1, 2}) {
    Data D(rng, 2 * G, 2, 32, 330);
    const int64_t N = 300;
    const std::string mp = "subspaces=4,centroids=8,iters=3,list_frac=1,recent=32,sinks=2,rerank=64";
    Sess S;
    build(S, D, mp, 0.2, N);
    std::vector<float> o, l;
    const double scale = 1.0 / std::sqrt(double(D.d));
    for (int64_t t = N; t < D.T; ++t) {
      decode(S.s, D, 0, t, o, l);
      const int64_t n = t + 1, K = int64_t(std::ceil(0.2 * double(n)));
      const int64_t w_begin = n - 32, rest = K - 2 - 32;
      for (int h = 0; h < D.hkv; ++h) {
        std::vector<double> agg(size_t(w_begin - 2), 0.0);
        for (int g = 0; g < G; ++g) {
          const float* qh = D.qt(t) + size_t(h * G + g) * D.d;
          std::vector<double> s(agg.size());
          for (int64_t j = 2; j < w_begin; ++j) {
            double a = 0;
            for (int i = 0; i < D.d; ++i) a += double(qh[i]) * D.kt(j)[h * D.d + i];
            s[size_t(j - 2)] = a * scale;
          }
          const double mx = *std::max_element(s.begin(), s.end());
          double z = 0;
          for (double x : s) z += std::exp(x - mx);
          for (size_t j = 0; j < s.size(); ++j) agg[j] += std::exp(s[j] - mx) / z;
        }
        std::vector<int32_t> idx(agg.size());
        std::iota(idx.begin(), idx.end(), 0);
        std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return agg[a] > agg[b] || (agg[a] == agg[b] && a < b); });
        std::vector<int32_t> want = {0, 1};
        for (int64_t i = 0; i < rest; ++i) want.push_back(idx[size_t(i)] + 2);
        for (int64_t j = w_begin; j < n; ++j) want.push_back(int32_t(j));
        std::sort(want.begin(), want.end());
        INFO("G " << G << " step " << t << " kv head " << h);
        CHECK(selection(S.s, 0, uint32_t(h)) == want);
      }
    }
  }
  // Without the rerank the same tables rank by the summed list scores: a different selection.
  Data D(rng, 4, 2, 32, 310);
  Sess S;
  build(S, D, "subspaces=4,centroids=8,iters=3,list_frac=1,recent=32,sinks=2", 0.2, 300);
  Sess R;
  build(R, D, "subspaces=4,centroids=8,iters=3,list_frac=1,recent=32,sinks=2,rerank=64", 0.2, 300);
  int differ = 0;
  std::vector<float> o, l;
  for (int64_t t = 300; t < 310; ++t) {
    decode(S.s, D, 0, t, o, l);
    decode(R.s, D, 0, t, o, l);
    differ += selection(S.s, 0, 0) != selection(R.s, 0, 0);
  }
  CHECK(differ > 0);
  // Bad values are refused with the parameter named.
  Sess B;
  auto pb = params(D, "rerank=0.5");
  Err e{kvs_session_create(&pb, &B.s)};
  CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(e.msg().find("rerank") != std::string::npos);
}

TEST_CASE("csattention: streaming lists equal a float64 brute-force top-L over every key seen") {
  Rng rng(12);
  Data D(rng, 4, 2, 32, 420);
  for (const char* dt : {"f16", "f32"}) {
    const int64_t N = 300, L = 40;
    const int m = 4, C = 8, db = D.d / m;
    const std::string mp = std::string("subspaces=4,centroids=8,list_len=40,iters=3,batch=64,score_dtype=") + dt;
    Sess S;
    build(S, D, mp, 0.0, N);
    std::vector<float> o, lse;
    for (int64_t t = N; t < N + 60; ++t) decode(S.s, D, 0, t, o, lse);
    {  // an appended turn streams in too
      const int64_t n = 60;
      T q(D.qt(N + 60), f32(), {n, D.hq, D.d}), k(D.kt(N + 60), f32(), {n, D.hkv, D.d}),
          v(D.vt(N + 60), f32(), {n, D.hkv, D.d});
      OK(kvs_session_append(S.s, 0, &q.t, &k.t, &v.t, nullptr, nullptr));
    }
    const int64_t n = D.T;
    const std::string path = tmp_path(std::string("stream_") + dt + ".kvt");
    OK(kvs_session_save(S.s, path.c_str(), KVS_SAVE_TABLES));
    auto f = kvs::io::TablesFile::open(path);
    const auto& meta = f->header()["method"]["meta"]["layers"]["0"];
    REQUIRE(meta["indexed_tokens"].get<int64_t>() == n);
    REQUIRE(meta["list_len"].get<int64_t>() == L);
    const float* cent = reinterpret_cast<const float*>(f->require("csa.cent", 0, -1).data);
    const int32_t* idx = reinterpret_cast<const int32_t*>(f->require("csa.idx", 0, -1).data);
    const std::byte* val = f->require("csa.val", 0, -1).data;
    const bool f16 = std::string(dt) == "f16";
    int64_t checked = 0, boundary = 0;
    for (int h = 0; h < D.hkv; ++h)
      for (int b = 0; b < m; ++b)
        for (int j = 0; j < C; ++j) {
          const float* c = cent + size_t(h) * C * D.d + size_t(C) * b * db + size_t(j) * db;
          double cn = 0;
          for (int i = 0; i < db; ++i) cn += double(c[i]) * c[i];
          CHECK(std::abs(cn - 1.0) < 1e-5);  // unit centroids
          std::vector<double> ref(static_cast<size_t>(n));
          for (int64_t t = 0; t < n; ++t) {
            double s = 0;
            for (int i = 0; i < db; ++i) s += double(c[i]) * D.kt(t)[h * D.d + b * db + i];
            ref[size_t(t)] = s;
          }
          std::vector<double> sorted = ref;
          std::sort(sorted.begin(), sorted.end(), std::greater<double>());
          const double tau = sorted[size_t(L - 1)];
          const double eps = f16 ? std::abs(tau) * std::ldexp(1.0, -10) + 1e-4 : 1e-5;
          const size_t base = ((size_t(h) * m + b) * C + j) * size_t(L);
          std::set<int32_t> got;
          for (int64_t e = 0; e < L; ++e) {
            const int32_t t = idx[base + size_t(e)];
            REQUIRE(t >= 0);
            REQUIRE(t < n);
            got.insert(t);
            const float sv = f16 ? kvs::f16_to_f32(reinterpret_cast<const uint16_t*>(val)[base + size_t(e)])
                                 : reinterpret_cast<const float*>(val)[base + size_t(e)];
            CHECK(std::abs(double(sv) - ref[size_t(t)]) <= (f16 ? std::abs(ref[size_t(t)]) * std::ldexp(1.0, -10) + 1e-6 : 1e-5));
            CHECK(ref[size_t(t)] >= tau - eps);  // nothing below the L-th best
          }
          CHECK(got.size() == size_t(L));  // distinct
          for (int64_t t = 0; t < n; ++t) {
            if (ref[size_t(t)] > tau + eps) CHECK(got.count(int32_t(t)) == 1);  // everything clearly above is kept
            else if (ref[size_t(t)] >= tau - eps) ++boundary;
          }
          ++checked;
        }
    CHECK(checked == D.hkv * m * C);
    MESSAGE(std::string(dt) << ": " << checked << " lists checked, " << boundary << " keys within rounding of a threshold");
    std::remove(path.c_str());
  }
}

TEST_CASE("csattention: a failed call's inserts undone (truncate) leave the lists as if they never came") {
  // The method's own rollback (a call that fails after its inserts): the lists and the minima the
  // streaming update keeps beside them go back, so later keys enter exactly as without that call.
  Rng rng(31);
  Data D(rng, 4, 2, 32, 480);
  kvs::ThreadPool pool(2);
  const kvs::MethodSpec* spec = kvs::find_method("csattention");
  REQUIRE(spec);
  const kvs::MethodContext ctx{{1, uint32_t(D.hq), uint32_t(D.hkv), uint32_t(D.d), float(1.0 / std::sqrt(double(D.d))),
                                kvs::DType::F32},
                               {}, &pool, int32_t(kvs::cpu::resolve_gemm(KVS_GEMM_AUTO))};
  for (const char* dt : {"f16", "f32"}) {
    const std::string mp = std::string("subspaces=4,centroids=8,list_len=40,iters=3,batch=64,score_dtype=") + dt;
    const int64_t N = 300;
    auto a = spec->create(ctx, kvs::ParamSet::parse("csattention", spec->params, mp.c_str()));
    auto b = spec->create(ctx, kvs::ParamSet::parse("csattention", spec->params, mp.c_str()));
    kvs::KVLayer ka(kvs::DType::F32, D.hkv, D.d), kb(kvs::DType::F32, D.hkv, D.d);
    ka.append(D.kt(0), D.vt(0), N);
    kb.append(D.kt(0), D.vt(0), N);
    for (auto* m : {a.get(), b.get()}) m->on_prefill(0, D.qt(0), N, m == a.get() ? ka : kb);
    a->build_index(0, ka);
    b->build_index(0, kb);
    for (int64_t t = N; t < N + 40; ++t) {  // both stream the same keys (the minima get used)
      ka.append(D.kt(t), D.vt(t), 1);
      kb.append(D.kt(t), D.vt(t), 1);
      a->on_append(0, D.qt(t), 1, ka, true);
      b->on_append(0, D.qt(t), 1, kb, true);
    }
    // a: a call of 60 louder keys (they enter many lists, raising their minima), undone
    std::vector<float> loud(D.kt(N + 40), D.kt(N + 40) + size_t(60) * D.hkv * D.d);
    for (float& x : loud) x *= 3.f;
    ka.append(loud.data(), D.vt(N + 40), 60);
    a->on_append(0, D.qt(N + 40), 60, ka, false);
    ka.truncate(N + 40);
    a->truncate(0, N + 40);
    // then both take the same 100 keys
    ka.append(D.kt(N + 40), D.vt(N + 40), 100);
    kb.append(D.kt(N + 40), D.vt(N + 40), 100);
    a->on_append(0, D.qt(N + 40), 100, ka, false);
    b->on_append(0, D.qt(N + 40), 100, kb, false);
    const kvs::csa::LayerTables ta = kvs::csa::tables_of(*a, 0);
    const kvs::csa::LayerTables tb = kvs::csa::tables_of(*b, 0);
    INFO("score_dtype " << dt);
    CHECK(*ta.indexed == N + 140);
    CHECK(*ta.idx == *tb.idx);
    CHECK(*ta.v16 == *tb.v16);
    CHECK(*ta.v32 == *tb.v32);
  }
}

TEST_CASE("csattention: the search ranks the union of the picked lists by their reduce-by-key (missing = 0 or the list minimum)") {
  // A float64 re-implementation of the search from the saved tables: nearest centroid per subspace,
  // the union of the picked lists, scores summed per key with an absent key's term 0 (paper) or the
  // list's minimum (missing=list_min, the default), each subspace's terms weighted by 1 (paper) or
  // by the query sub-vector's norm (weights=qnorm, the default), the K best. G = 1, no window, no sinks.
  Rng rng(23);
  Data D(rng, 2, 2, 32, 301);
  const int64_t N = 300, Lz = 40;
  const int m = 4, C = 8, db = D.d / m;
  for (const auto& [miss, wts] : {std::pair<const char*, const char*>{"zero", "uniform"}, {"list_min", "uniform"},
                                  {"zero", "qnorm"}, {"list_min", "qnorm"}}) {
    const std::string mp = std::string("subspaces=4,centroids=8,list_len=40,iters=3,batch=64,score_dtype=f32,recent=0,"
                                       "sinks=0,missing=") + miss + ",weights=" + wts;
    Sess S;
    build(S, D, mp, 0.1, N);
    std::vector<float> o, lse;
    decode(S.s, D, 0, N, o, lse);
    const std::string path = tmp_path(std::string("reduce_") + miss + "_" + wts + ".kvt");
    OK(kvs_session_save(S.s, path.c_str(), KVS_SAVE_TABLES));
    auto f = kvs::io::TablesFile::open(path);
    const float* cent = reinterpret_cast<const float*>(f->require("csa.cent", 0, -1).data);
    const int32_t* idx = reinterpret_cast<const int32_t*>(f->require("csa.idx", 0, -1).data);
    const float* val = reinterpret_cast<const float*>(f->require("csa.val", 0, -1).data);
    const bool lmin = std::string(miss) == "list_min", qnorm = std::string(wts) == "qnorm";
    const int64_t n = N + 1, K = int64_t(std::ceil(0.1 * double(n)));
    for (int h = 0; h < D.hkv; ++h) {
      const float* qh = D.qt(N) + size_t(h) * D.d;
      std::vector<double> score(static_cast<size_t>(n), 0.0);
      std::vector<int> hits(static_cast<size_t>(n), 0);
      double base_sum = 0;  // the absent terms' scale, for the tolerance: sum of w |minimum| over the picked lists
      std::vector<std::tuple<size_t, double, double>> picked;  // list, its minimum, the subspace's weight
      for (int b = 0; b < m; ++b) {
        int best = 0;
        double bs = -1e300;
        for (int j = 0; j < C; ++j) {
          const float* c = cent + size_t(h) * C * D.d + size_t(C) * b * db + size_t(j) * db;
          double s = 0;
          for (int i = 0; i < db; ++i) s += double(c[i]) * qh[b * db + i];
          if (s > bs) {
            bs = s;
            best = j;
          }
        }
        const size_t base = ((size_t(h) * m + b) * C + best) * size_t(Lz);
        double mn = 1e300, nn = 0;
        for (int64_t e = 0; e < Lz; ++e) mn = std::min(mn, double(val[base + size_t(e)]));
        for (int i = 0; i < db; ++i) nn += double(qh[b * db + i]) * qh[b * db + i];
        const double w = qnorm ? std::sqrt(nn) : 1.0;
        picked.emplace_back(base, mn, w);
        base_sum += w * std::abs(mn);
      }
      for (auto [base, mn, w] : picked)
        for (int64_t e = 0; e < Lz; ++e) {
          const int32_t t = idx[base + size_t(e)];
          score[size_t(t)] += w * (double(val[base + size_t(e)]) - (lmin ? mn : 0.0));
          ++hits[size_t(t)];
        }
      std::vector<double> cand;
      for (int64_t t = 0; t < n; ++t)
        if (hits[size_t(t)]) cand.push_back(score[size_t(t)]);
      REQUIRE(int64_t(cand.size()) > K);
      std::sort(cand.begin(), cand.end(), std::greater<double>());
      const double kth = cand[size_t(K - 1)], eps = 1e-5 * (1.0 + std::abs(kth) + std::abs(base_sum));
      const auto got = selection(S.s, 0, uint32_t(h));
      INFO(miss << " " << wts << " kv head " << h);
      CHECK(int64_t(got.size()) == K);
      std::set<int32_t> gs(got.begin(), got.end());
      for (int32_t t : got) CHECK((hits[size_t(t)] > 0 && score[size_t(t)] >= kth - eps));
      for (int64_t t = 0; t < n; ++t)
        if (hits[size_t(t)] && score[size_t(t)] > kth + eps) CHECK(gs.count(int32_t(t)) == 1);
    }
    std::remove(path.c_str());
  }
}

TEST_CASE("csattention: the defaults are missing=list_min, weights=qnorm; preset=paper restores the paper's zero and uniform") {
  // The defaults select and attend exactly as the two options given explicitly, preset=paper exactly
  // as missing=zero,weights=uniform (the defaults before 2026-11-27); the saved tables record the
  // resolved values, and an explicit value wins over the preset.
  Rng rng(31);
  Data D(rng, 4, 2, 32, 301);
  const int64_t N = 280;
  const std::string base = "subspaces=4,centroids=8,iters=3,batch=64";
  const std::pair<const char*, const char*> same[] = {{"", "missing=list_min,weights=qnorm"},
                                                      {"preset=paper", "missing=zero,weights=uniform"}};
  for (const auto& [a, b] : same) {
    Sess A, B;
    build(A, D, base + (*a ? "," : "") + a, 0.1, N);
    build(B, D, base + "," + b, 0.1, N);
    for (int64_t t = N; t < N + 8; ++t) {
      std::vector<float> oa, la, ob, lb;
      decode(A.s, D, 0, t, oa, la);
      decode(B.s, D, 0, t, ob, lb);
      INFO(a << " vs " << b << " step " << t);
      CHECK(std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) == 0);
      for (uint32_t h = 0; h < uint32_t(D.hkv); ++h) CHECK(selection(A.s, 0, h) == selection(B.s, 0, h));
    }
  }
  // The two settings differ on this data (else the checks above would not tell them apart).
  {
    Sess A, B;
    build(A, D, base, 0.1, N);
    build(B, D, base + ",preset=paper", 0.1, N);
    bool differ = false;
    for (int64_t t = N; t < N + 8; ++t) {
      std::vector<float> oa, la, ob, lb;
      decode(A.s, D, 0, t, oa, la);
      decode(B.s, D, 0, t, ob, lb);
      for (uint32_t h = 0; h < uint32_t(D.hkv); ++h) differ |= selection(A.s, 0, h) != selection(B.s, 0, h);
    }
    CHECK(differ);
  }
  const std::tuple<const char*, const char*, const char*> recorded[] = {{"", "list_min", "qnorm"},
                                                                        {"preset=paper", "zero", "uniform"},
                                                                        {"preset=paper,missing=list_min", "list_min", "uniform"},
                                                                        {"weights=uniform", "list_min", "uniform"}};
  for (const auto& [mp, miss, wts] : recorded) {
    Sess S;
    build(S, D, base + (*mp ? "," : "") + mp, 0.1, N);
    const std::string path = tmp_path("preset.kvt");
    OK(kvs_session_save(S.s, path.c_str(), KVS_SAVE_TABLES));
    char* js = nullptr;
    OK(kvs_tables_describe(path.c_str(), &js));
    const std::string text = js;
    kvs_string_free(js);
    std::remove(path.c_str());
    const auto j = nlohmann::json::parse(text);
    INFO(std::string(mp) << ": " << text.substr(0, 3000));
    REQUIRE(j.contains("header"));
    const auto& prm = j["header"]["method"]["params"];
    CHECK(prm.value("missing", "") == miss);
    CHECK(prm.value("weights", "") == wts);
  }
}

TEST_CASE("csattention: the candidate collection's fallback (lists added again, all collected) selects the same keys") {
  // The sampled threshold normally lets enough candidates through, so the fallback is rare; the hook
  // forces it on every search of session B. A slot it failed to reset (forced ranges, the second
  // pass) would change later selections.
  Rng rng(29);
  Data D(rng, 8, 2, 32, 700);
  for (const char* mp : {"centroids=16,subspaces=4,iters=4,recent=8", "centroids=16,subspaces=4,iters=4,recent=8,preset=paper",
                         "centroids=16,subspaces=4,iters=4,sinks=2,missing=list_min,weights=qnorm,rerank=3"}) {
    INFO(mp);
    Sess A, B;
    build(A, D, mp, 0.1, 600);
    build(B, D, mp, 0.1, 600);
    std::vector<float> o1, l1, o2, l2;
    for (int64_t t = 600; t < 660; ++t) {
      decode(A.s, D, 0, t, o1, l1);
      kvs::csa::g_force_recollect = true;
      decode(B.s, D, 0, t, o2, l2);
      kvs::csa::g_force_recollect = false;
      CHECK(std::memcmp(o1.data(), o2.data(), o1.size() * 4) == 0);
      CHECK(std::memcmp(l1.data(), l2.data(), l1.size() * 4) == 0);
      for (uint32_t h = 0; h < 2; ++h) CHECK(selection(A.s, 0, h) == selection(B.s, 0, h));
    }
    double ua = 0, ub = 0;
    OK(kvs_session_method_stat(A.s, "mean_union", &ua));
    OK(kvs_session_method_stat(B.s, "mean_union", &ub));
    CHECK(ua == ub);
  }
}

TEST_CASE("csattention: save/load round trip reproduces decode outputs bit for bit, with and without KV") {
  Rng rng(13);
  Data D(rng, 8, 2, 32, 760);
  for (const char* mp : {"centroids=16,subspaces=4,iters=4", "centroids=16,subspaces=4,iters=4,preset=paper",
                         "centroids=16,splits=8:8:16,subspaces=3,period=4,weights=qnorm,missing=list_min,rerank=3",
                         "centroids=8,gqa=per_query_head,schedule=0.15-step-4,sinks=4"}) {
    INFO(mp);
    Sess A;
    auto p = params(D, mp, 2, 0.08, KVS_SCALAR_BF16);
    OK(kvs_session_create(&p, &A.s));
    prefill(A.s, D, 0, 0, 600);
    prefill(A.s, D, 1, 0, 600);
    OK(kvs_session_build_index(A.s, nullptr));
    std::vector<float> o1, l1, o2, l2, o3, l3;
    for (int64_t t = 600; t < 606; ++t)  // mid-period state is saved too
      for (uint32_t l = 0; l < 2; ++l) decode(A.s, D, l, t, o1, l1);
    const std::string kvp = tmp_path("rt_kv.kvt"), tp = tmp_path("rt_t.kvt");
    OK(kvs_session_save(A.s, kvp.c_str(), KVS_SAVE_INCLUDE_KV));
    OK(kvs_session_save(A.s, tp.c_str(), KVS_SAVE_TABLES));
    Sess B, C;
    OK(kvs_session_load(kvp.c_str(), nullptr, &B.s));
    OK(kvs_session_load(tp.c_str(), nullptr, &C.s));
    for (uint32_t l = 0; l < 2; ++l) {
      prefill(C.s, D, l, 0, 300);  // the prompt again, in two chunks, plus the decoded tokens
      prefill(C.s, D, l, 300, 306);
    }
    for (int64_t t = 606; t < 626; ++t)
      for (uint32_t l = 0; l < 2; ++l) {
        decode(A.s, D, l, t, o1, l1);
        decode(B.s, D, l, t, o2, l2);
        decode(C.s, D, l, t, o3, l3);
        CHECK(std::memcmp(o1.data(), o2.data(), o1.size() * 4) == 0);
        CHECK(std::memcmp(l1.data(), l2.data(), l1.size() * 4) == 0);
        CHECK(std::memcmp(o1.data(), o3.data(), o1.size() * 4) == 0);
        CHECK(std::memcmp(l1.data(), l3.data(), l1.size() * 4) == 0);
        for (uint32_t h = 0; h < 2; ++h) CHECK(selection(A.s, l, h) == selection(B.s, l, h));
      }
    std::remove(kvp.c_str());
    std::remove(tp.c_str());
  }
}

TEST_CASE("csattention: spherical k-means objective never increases (full batch); mini-batch lowers it") {
  Rng rng(14);
  const int n = 3000, db = 8, C = 16;
  // Points around 12 directions, normalised (the method clusters unit query sub-vectors).
  std::vector<float> dirs = rng.normals(12 * db), X(size_t(n) * db);
  for (int r = 0; r < n; ++r) {
    const int c = int(rng.uniform(0, 11));
    double nn = 0;
    for (int i = 0; i < db; ++i) {
      X[size_t(r) * db + i] = dirs[size_t(c) * db + i] + 0.4f * rng.normal();
      nn += double(X[size_t(r) * db + i]) * X[size_t(r) * db + i];
    }
    for (int i = 0; i < db; ++i) X[size_t(r) * db + i] = float(X[size_t(r) * db + i] / std::sqrt(nn));
  }
  // Independent float64 objective: sum over points of the squared distance to the nearest centroid.
  auto objective = [&](const float* cent) {
    double total = 0;
    for (int r = 0; r < n; ++r) {
      double best = 1e300;
      for (int j = 0; j < C; ++j) {
        double s = 0;
        for (int i = 0; i < db; ++i) {
          const double e = double(X[size_t(r) * db + i]) - cent[size_t(j) * db + i];
          s += e * e;
        }
        best = std::min(best, s);
      }
      total += best;
    }
    return total;
  };
  const auto gemm = kvs::cpu::resolve_gemm(KVS_GEMM_AUTO);
  for (uint64_t seed : {1u, 2u, 3u}) {
    std::vector<double> hist;
    std::function<void(int, const float*)> cb = [&](int it, const float* cent) {
      CHECK(it == int(hist.size()));
      for (int j = 0; j < C; ++j) {
        double nn = 0;
        for (int i = 0; i < db; ++i) nn += double(cent[size_t(j) * db + i]) * cent[size_t(j) * db + i];
        CHECK(std::abs(nn - 1.0) < 1e-5);
      }
      hist.push_back(objective(cent));
    };
    std::vector<float> cent(size_t(C) * db);
    kvs::csa::KMeansConfig kc;
    kc.C = C;
    kc.iters = 12;
    kc.full_batch = true;
    kc.seed = seed;
    kvs::csa::spherical_kmeans(X.data(), n, db, kc, gemm, cent.data(), &cb);
    REQUIRE(hist.size() == 13);
    for (size_t i = 1; i < hist.size(); ++i) {
      INFO("seed " << seed << " iteration " << i << ": " << hist[i - 1] << " -> " << hist[i]);
      CHECK(hist[i] <= hist[i - 1] * (1 + 1e-6) + 1e-9);
    }
    CHECK(hist.back() < hist.front());
    CHECK(std::abs(kvs::csa::kmeans_objective(X.data(), n, db, cent.data(), C) - hist.back()) < 1e-6 * hist.back());
    // Mini-batch (the default): the full-set objective ends below the k-means++ seeding.
    hist.clear();
    kc.full_batch = false;
    kc.batch = 256;
    kvs::csa::spherical_kmeans(X.data(), n, db, kc, gemm, cent.data(), &cb);
    REQUIRE(hist.size() == 13);
    CHECK(hist.back() < hist.front());
  }
}

TEST_CASE("csattention: search period reuses the selection with the current window; bad parameters are refused") {
  Rng rng(15);
  Data D(rng, 4, 2, 32, 400);
  {
    Sess S;
    build(S, D, "centroids=8,period=4,recent=8", 0.1, 300);
    std::vector<float> o, l;
    std::vector<std::vector<int32_t>> searched(2);
    for (int64_t t = 300; t < 316; ++t) {
      decode(S.s, D, 0, t, o, l);
      const int64_t n = t + 1;
      for (uint32_t h = 0; h < 2; ++h) {
        auto sel = selection(S.s, 0, h);
        std::vector<int32_t> mid, win;
        for (int32_t x : sel) (x >= n - 8 ? win : mid).push_back(x);
        CHECK(win.size() == 8);  // the current window
        if ((t - 300) % 4 == 0) {
          searched[h] = mid;
          CHECK(int64_t(sel.size()) == int64_t(std::ceil(0.1 * double(n))));
        } else {
          // The searched keys of the last search, less those now inside the window.
          std::vector<int32_t> want;
          for (int32_t x : searched[h])
            if (x < n - 8) want.push_back(x);
          CHECK(mid == want);
        }
      }
    }
  }
  {
    // Default window: R = min(64, round(recent_frac * K)) of the budget K, always fully selected;
    // the rest of K comes from the search (so a small budget is not all window).
    for (auto [extra, frac, budget] : {std::tuple{"", 0.5, 0.1}, std::tuple{"recent_frac=0.25", 0.25, 0.1},
                                       std::tuple{"", 0.5, 0.9}}) {
      INFO(extra << " budget " << budget);
      Sess S;
      const std::string mp = std::string("centroids=8") + (*extra ? "," : "") + extra;
      build(S, D, mp, budget, 300);
      std::vector<float> o, l;
      for (int64_t t = 300; t < 304; ++t) {
        decode(S.s, D, 0, t, o, l);
        const int64_t n = t + 1, K = int64_t(std::ceil(budget * double(n)));
        const int64_t R = std::min<int64_t>(64, std::llround(frac * double(K)));
        for (uint32_t h = 0; h < 2; ++h) {
          auto sel = selection(S.s, 0, h);
          // (at 0.9 the union of the lists can hold fewer than K - R keys: only they are candidates)
          if (budget < 0.5) CHECK(int64_t(sel.size()) == K);
          else CHECK(int64_t(sel.size()) <= K);
          int64_t in_win = 0;
          for (int32_t x : sel) in_win += x >= n - R;
          CHECK(in_win == R);
          CHECK(R < K);
        }
      }
    }
  }
  for (const char* bad : {"subspaces=5", "splits=8:8", "splits=8:8:8:9,subspaces=4", "list_frac=0", "centroids=0",
                          "period=0", "weight_list=1:2", "recent=-2", "recent_frac=1.5", "init=queries,centroids=7"}) {
    INFO(bad);
    Sess S;
    auto p = params(D, bad);
    Err e{kvs_session_create(&p, &S.s)};
    if (e.e == nullptr) {  // some checks need the prompt (init=queries)
      prefill(S.s, D, 0, 0, 100);
      Err e2{kvs_session_build_index(S.s, nullptr)};
      CHECK(e2.code() == KVS_STATUS_INVALID_ARGUMENT);
      CHECK(e2.msg().find("csattention") != std::string::npos);
    } else {
      CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
      CHECK(e.msg().find("csattention") != std::string::npos);
    }
  }
}

TEST_CASE("cpu::kth_largest (radix select) equals nth_element's k-th largest value") {
  // Used by csattention's and retroinfer's Top-K thresholds: same value as
  // nth_element(std::greater) on inputs without NaN or -0.0, including many ties and tiny spreads.
  std::mt19937 rng(7);
  std::vector<uint32_t> tmp;
  int checked = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t n = 1 + int64_t(rng() % 5000);
    std::vector<float> x(static_cast<size_t>(n));
    std::normal_distribution<float> nd;
    std::exponential_distribution<float> ex(3.f);
    for (auto& v : x) {
      switch (trial % 5) {
        case 0: v = ex(rng); break;
        case 1: v = nd(rng); break;
        case 2: v = float(int(rng() % 7)) - 3.f; break;          // heavy ties, both signs
        case 3: v = 5.f + 1e-3f * nd(rng); break;                  // one binade
        default: v = nd(rng) * std::ldexp(1.f, int(rng() % 60) - 30); break;  // wide range
      }
      if (v == 0.f) v = 0.f;  // +0.0 only
    }
    for (int64_t k : {int64_t(1), n, 1 + int64_t(rng() % n)}) {
      std::vector<float> y = x;
      std::nth_element(y.begin(), y.begin() + (k - 1), y.end(), std::greater<float>());
      CHECK(kvs::cpu::kth_largest(x.data(), n, k, tmp) == y[size_t(k - 1)]);
      ++checked;
    }
  }
  CHECK(checked == 1200);
  // Outside 1 <= k <= n: a threshold that admits nothing (k <= 0 or n = 0) or everything (k > n).
  const std::vector<float> x = {3.f, -1.f, 2.f};
  CHECK(kvs::cpu::kth_largest(x.data(), 3, 0, tmp) == std::numeric_limits<float>::infinity());
  CHECK(kvs::cpu::kth_largest(x.data(), 0, 1, tmp) == std::numeric_limits<float>::infinity());
  CHECK(kvs::cpu::kth_largest(x.data(), 3, 4, tmp) == -std::numeric_limits<float>::infinity());
}


// csa::step_keys (shared by the cpu method and its cuda implementation) against the rule written
// out as a list: sinks [0, s) and the window [n - R, n) forced; when they exceed K, the first sinks
// then the newest keys; the search gets K minus the forced keys (or K with window_in_budget=false).
TEST_CASE("csattention: step_keys gives the forced keys and the search budget of the rule") {
  int cases = 0;
  for (int64_t n : {1, 2, 5, 17, 64, 100, 1000})
    for (int64_t budget_tokens : {1, 2, 3, 8, 40, 120})
      for (int64_t sinks : {0, 1, 4, 30})
        for (int64_t recent : {-1, 0, 3, 16, 80})
          for (bool in_budget : {true, false}) {
            kvs::csa::Params p;
            p.sinks = sinks;
            p.recent = recent;
            p.recent_frac = 0.5;
            p.window_in_budget = in_budget;
            kvs::Budget b;
            b.tokens = budget_tokens;
            const int64_t k = std::clamp<int64_t>(budget_tokens, 1, n);
            const int64_t R = recent >= 0 ? recent : std::min<int64_t>(64, std::llround(0.5 * double(k)));
            const int64_t s_end = std::min(sinks, n), w_begin = std::max(s_end, n - R);
            std::vector<int64_t> forced;
            for (int64_t t = 0; t < s_end; ++t) forced.push_back(t);
            for (int64_t t = w_begin; t < n; ++t) forced.push_back(t);
            if (int64_t(forced.size()) > k) {
              std::vector<int64_t> f(forced.begin(), forced.begin() + std::min<int64_t>(s_end, k));
              const int64_t kept_sinks = int64_t(f.size());
              for (int64_t t = n - (k - kept_sinks); t < n; ++t)
                if (t >= s_end) f.push_back(t);
              forced.swap(f);
            }
            const auto sk = kvs::csa::step_keys(p, b, n);
            std::vector<int64_t> got;
            for (int64_t t = 0; t < sk.s_emit; ++t) got.push_back(t);
            for (int64_t t = sk.w_emit; t < n; ++t) got.push_back(t);
            CHECK(sk.k == k);
            CHECK(sk.s_end == s_end);
            CHECK(sk.w_begin == w_begin);
            CHECK(got == forced);
            CHECK(sk.rest == (in_budget ? std::max<int64_t>(0, k - int64_t(forced.size())) : k));
            ++cases;
          }
  CHECK(cases == 7 * 6 * 4 * 5 * 2);
}
