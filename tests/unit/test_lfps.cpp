// SPDX-License-Identifier: Apache-2.0
// lfps (docs/methods/lfps.md) against float64 brute force on random inputs: the initial tables of eq. (4),
// the lazy-decay tables and incremental moments against an explicit replay of eq. (10), the
// candidate sets of eqs. (7)-(9), exact top-k when every key is a candidate, the sink-value bypass
// output, save/load and rollback.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

#include "backends/cpu/attention.hpp"
#include "core/error.hpp"
#include "core/method.hpp"
#include "io/tables.hpp"
#include "kvsieve/kvsieve.h"
#include "methods/lfps/lfps.hpp"
#include "reference.hpp"

using namespace kvt;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Random data with heavy keys and a few strong sinks, so attention is peaked and the tables matter.
struct Data {
  int hq, hkv, d;
  int64_t T;
  std::vector<float> q, k, v;
  Data(Rng& rng, int hq_, int hkv_, int d_, int64_t T_) : hq(hq_), hkv(hkv_), d(d_), T(T_) {
    q = rng.normals(size_t(T) * hq * d);
    k = rng.normals(size_t(T) * hkv * d, 0.7f);
    v = rng.normals(size_t(T) * hkv * d);
    for (int64_t t = 5; t < T; t += 23)
      for (int i = 0; i < hkv * d; ++i) k[size_t(t) * hkv * d + i] *= 2.2f;
  }
  const float* qt(int64_t t) const { return q.data() + t * hq * d; }
  const float* kt(int64_t t) const { return k.data() + t * hkv * d; }
  const float* vt(int64_t t) const { return v.data() + t * hkv * d; }
  double score(int qh, int64_t t, int64_t j, double scale) const {
    const int G = hq / hkv;
    double s = 0;
    for (int i = 0; i < d; ++i) s += double(qt(t)[qh * d + i]) * k[(size_t(j) * hkv + qh / G) * d + i];
    return s * scale;
  }
};

struct Rig {
  kvs::ModelShape shape;
  kvs::ThreadPool pool;
  kvs::KVLayer kv;
  std::unique_ptr<kvs::lfps::Lfps> m;
  kvs::Budget budget;
  Rig(const Data& D, const std::string& params, double frac, unsigned threads = 2)
      : shape{1, uint32_t(D.hq), uint32_t(D.hkv), uint32_t(D.d), float(1.0 / std::sqrt(double(D.d))), kvs::DType::F32},
        pool(threads),
        kv(kvs::DType::F32, D.hkv, D.d) {
    budget.fraction = frac;
    const kvs::MethodSpec* spec = kvs::find_method("lfps");
    REQUIRE(spec != nullptr);
    kvs::MethodContext ctx{shape, budget, &pool, int32_t(KVS_GEMM_ONEDNN)};
    m = std::make_unique<kvs::lfps::Lfps>(ctx, kvs::lfps::parse_params(kvs::ParamSet::parse("lfps", spec->params, params.c_str())));
  }
  void prefill(const Data& D, int64_t P) {
    kv.append(D.k.data(), D.v.data(), P);
    // two chunks, as chunked prefill delivers them
    const int64_t a = P / 3;
    kvs::KVLayer tmp(kvs::DType::F32, D.hkv, D.d);
    m->on_prefill(0, D.q.data(), a, kv_prefix(D, a));
    m->on_prefill(0, D.qt(a), P - a, kv);
    m->build_index(0, kv);
  }
  // A KV layer holding the first n tokens (only its size is read by on_prefill).
  kvs::KVLayer& kv_prefix(const Data& D, int64_t n) {
    prefix = std::make_unique<kvs::KVLayer>(kvs::DType::F32, D.hkv, D.d);
    prefix->append(D.k.data(), D.v.data(), n);
    return *prefix;
  }
  void step(const Data& D, int64_t t, kvs::Selection& sel) {
    kv.append(D.kt(t), D.vt(t), 1);
    m->on_append(0, D.qt(t), 1, kv, true);
    m->select(0, D.qt(t), kv, sel);
  }
  std::unique_ptr<kvs::KVLayer> prefix;
};

// Brute-force eq. (4): last T rows of causal prompt attention, renormalised over O, weighted
// gamma^tau, scaled to total mass 0.5 / (1 - gamma).
void initial_tables(const Data& D, int64_t P, int64_t ns, int64_t T, double gamma, double scale, int qh,
                    std::vector<double>& V, std::vector<double>& S) {
  const int64_t m = P - ns;
  V.assign(size_t(m), 0.0);
  S.assign(size_t(m), 0.0);
  double wsum = 0;
  for (int64_t i = std::max<int64_t>(P - T, ns); i < P; ++i) wsum += std::pow(gamma, double(P - 1 - i));
  const double lam = 0.5 / (1 - gamma) / wsum;
  for (int64_t i = std::max<int64_t>(P - T, ns); i < P; ++i) {
    std::vector<double> s;
    double mx = -kInf;
    for (int64_t j = ns; j <= i; ++j) {
      s.push_back(D.score(qh, i, j, scale));
      mx = std::max(mx, s.back());
    }
    double z = 0;
    for (double x : s) z += std::exp(x - mx);
    for (int64_t j = ns; j <= i; ++j) {
      const double a = lam * std::pow(gamma, double(P - 1 - i)) * std::exp(s[size_t(j - ns)] - mx) / z;
      V[size_t(j - ns)] += a;
      S[size_t(i - j)] += a;
    }
  }
}

double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double mx = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    mx = std::max(mx, std::abs(a[i] - b[i]));
    norm = std::max(norm, std::abs(b[i]));
  }

  return mx / std::max(norm, 1e-300);
}

}  // namespace

TEST_CASE("lfps: initial tables and priors equal a float64 recomputation of eq. (4)") {
  Rng rng(11);
  const int64_t P = 300;
  Data D(rng, 4, 2, 16, P + 1);
  Rig r(D, "last_q=40", 0.05);
  r.prefill(D, P);
  const double scale = r.shape.softmax_scale;
  for (int qh = 0; qh < 4; ++qh) {
    std::vector<double> V, S;
    initial_tables(D, P, 4, 40, 0.95, scale, qh, V, S);
    CHECK(max_rel_diff(r.m->table(0, qh, 0), V) < 1e-5);
    CHECK(max_rel_diff(r.m->table(0, qh, 1), S) < 1e-5);
    double sum = 0;
    for (double x : r.m->table(0, qh, 0)) sum += x;
    CHECK(sum == doctest::Approx(10.0).epsilon(1e-5));
    // rho = Var_j(q_p . k_j) / |q_p|^2 over O with q_p the last prompt query
    std::vector<double> dots;
    for (int64_t j = 4; j < P; ++j) dots.push_back(D.score(qh, P - 1, j, 1.0));
    double mu = 0, var = 0, qn = 0;
    for (double x : dots) mu += x;
    mu /= double(dots.size());
    for (double x : dots) var += (x - mu) * (x - mu);
    var /= double(dots.size());
    for (int i = 0; i < 16; ++i) qn += double(D.qt(P - 1)[qh * 16 + i]) * D.qt(P - 1)[qh * 16 + i];
    CHECK(r.m->rho(0, qh) == doctest::Approx(var / qn).epsilon(1e-4));
  }
  for (int h = 0; h < 2; ++h) {
    const auto kb = r.m->mean_key(0, h), vb = r.m->mean_value(0, h);
    for (int i = 0; i < 16; ++i) {
      double ks = 0, vs = 0;
      for (int64_t j = 4; j < P; ++j) {
        ks += D.k[(size_t(j) * 2 + h) * 16 + i];
        vs += D.v[(size_t(j) * 2 + h) * 16 + i];
      }
      CHECK(kb[size_t(i)] == doctest::Approx(ks / double(P - 4)).epsilon(1e-9));
      CHECK(vb[size_t(i)] == doctest::Approx(vs / double(P - 4)).epsilon(1e-9));
    }
  }
}

// The expansion of eq. (9) with other offsets: within a word's reach (-5, -2, 3, 7: read from each
// word and its neighbours) and at the limit (-64, 64, and more than eight offsets: the general path),
// against brute force from the tables as they were before each step.
TEST_CASE("lfps: candidates with other expansion offsets equal brute force") {
  for (const char* offs : {"-5;-2;0;3;7", "-64;-5;0;3;64", "-9;-8;-7;-6;-5;-4;-3;-2;-1;1"}) {
    CAPTURE(offs);
    Rng rng(29);
    const int64_t P = 150, steps = 60, ns = 4;
    Data D(rng, 4, 2, 16, P + steps);
    Rig r(D, std::string("bypass=false,alpha_scale=30,offsets=") + offs, 0.08);
    r.prefill(D, P);
    std::vector<int> o;
    std::string rest = offs;
    for (size_t at; (at = rest.find(';')) != std::string::npos; rest = rest.substr(at + 1)) o.push_back(std::stoi(rest.substr(0, at)));
    o.push_back(std::stoi(rest));
    kvs::Selection sel;
    int64_t checked = 0, expanded = 0;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t t = P + s, n = t + 1;
      std::vector<std::vector<double>> V(static_cast<size_t>(r.m->owners())), S(V.size());
      for (int u = 0; u < r.m->owners(); ++u) {
        V[size_t(u)] = r.m->table(0, u, 0);
        S[size_t(u)] = r.m->table(0, u, 1);
        V[size_t(u)].push_back(0.0);  // the new token's entries
        S[size_t(u)].push_back(0.0);
      }
      r.step(D, t, sel);
      for (int u = 0; u < r.m->owners(); ++u) {
        const auto& v = V[size_t(u)];
        const auto& sl = S[size_t(u)];
        const auto sv = r.m->brute_stats(v), ss = r.m->brute_stats(sl);
        auto above = [&](int64_t j, bool mean) {
          return v[size_t(j - ns)] > (mean ? sv.mean : sv.tau) || sl[size_t(t - j)] > (mean ? ss.mean : ss.tau);
        };
        std::set<int64_t> c0, c;
        for (int64_t j = ns; j < n; ++j)
          if (above(j, false)) c0.insert(j);
        if (c0.empty())
          for (int64_t j = ns; j < n; ++j)
            if (above(j, true)) c0.insert(j);
        c = c0;
        for (int64_t j : c0)
          for (int x : o) {
            const int64_t jj = j + x;
            if (x != 0 && jj >= ns && jj <= t && above(jj, true)) c.insert(jj);
          }
        expanded += int64_t(c.size() - c0.size());
        const auto got = r.m->last_candidates(0, u);
        CHECK(std::set<int64_t>(got.begin(), got.end()) == c);
        ++checked;
      }
    }
    CHECK(checked == steps * r.m->owners());
    CHECK(expanded > 0);  // the offsets added candidates
  }
}

// The mandatory property: lazy decay (global scale, rescaled every ~270 steps) and the incremental
// power sums equal an explicit O(N)-per-step replay of eq. (10) after many steps; the update is
// half the softmax over the selected non-sink keys; candidates follow eqs. (7)-(9) exactly.
TEST_CASE("lfps: lazy-decay tables, incremental moments and candidates equal brute force over many steps") {
  for (const char* gqa : {"per_query_head", "per_kv_head"}) {
    CAPTURE(gqa);
    Rng rng(23);
    const int64_t P = 160, steps = 420;  // crosses the rescale at g < 1e-6 (step ~270)
    Data D(rng, 4, 2, 16, P + steps);
    Rig r(D, std::string("bypass=false,alpha_scale=30,gqa=") + gqa, 0.08);
    r.prefill(D, P);
    const bool kvh = std::string(gqa) == "per_kv_head";
    const int U = r.m->owners(), G = 2;
    const double scale = r.shape.softmax_scale, gamma = 0.95;
    std::vector<std::vector<double>> bv(static_cast<size_t>(U)), bs(static_cast<size_t>(U));
    for (int u = 0; u < U; ++u) {
      bv[size_t(u)] = r.m->table(0, u, 0);
      bs[size_t(u)] = r.m->table(0, u, 1);
    }
    bool rescaled = false;
    int64_t updates = 0, cands = 0;
    kvs::Selection sel;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t t = P + s, n = t + 1, ns = 4;
      for (int u = 0; u < U; ++u) {  // new token: zero entries
        bv[size_t(u)].push_back(0.0);
        bs[size_t(u)].push_back(0.0);
      }
      r.step(D, t, sel);
      REQUIRE(sel.lists.size() == 4);
      for (int u = 0; u < U; ++u) {
        auto& V = bv[size_t(u)];
        auto& S = bs[size_t(u)];
        // candidates of eqs. (7)-(9) from the tables before this step's update
        if (s % 37 == 0) {
          const auto sv = r.m->brute_stats(V), ss = r.m->brute_stats(S);
          std::set<int64_t> c0, c;
          for (int64_t j = ns; j < n; ++j)
            if (V[size_t(j - ns)] > sv.tau || S[size_t(t - j)] > ss.tau) c0.insert(j);
          if (c0.empty())  // empty_fallback: the means serve as thresholds
            for (int64_t j = ns; j < n; ++j)
              if (V[size_t(j - ns)] > sv.mean || S[size_t(t - j)] > ss.mean) c0.insert(j);
          c = c0;
          for (int64_t j : c0)
            for (int o : {-1, 1, 2}) {
              const int64_t jj = j + o;
              if (jj >= ns && jj <= t && (V[size_t(jj - ns)] > sv.mean || S[size_t(t - jj)] > ss.mean)) c.insert(jj);
            }
          const auto& got = r.m->last_candidates(0, u);
          CHECK(std::set<int64_t>(got.begin(), got.end()) == c);
        }
        // the update: a~ = 0.5 * softmax over the selected non-sink keys (summed over the group)
        const auto& upd = r.m->last_update(0, u);
        const auto& list = sel.lists[size_t(kvh ? u * G : u)];
        updates += int64_t(upd.size());
        cands += int64_t(r.m->last_candidates(0, u).size());
        REQUIRE(upd.size() + ns == list.size());
        std::vector<double> at(upd.size(), 0.0);
        for (int g = 0; g < (kvh ? G : 1); ++g) {
          const int qh = kvh ? u * G + g : u;
          std::vector<double> sc;
          double mx = -kInf;
          for (auto& [j, a] : upd) {
            sc.push_back(D.score(qh, t, j, scale));
            mx = std::max(mx, sc.back());
          }
          double z = 0;
          for (double x : sc) z += std::exp(x - mx);
          for (size_t i = 0; i < upd.size(); ++i) at[i] += 0.5 * std::exp(sc[i] - mx) / z;
        }
        for (size_t i = 0; i < upd.size(); ++i) CHECK(upd[i].second == doctest::Approx(at[i]).epsilon(1e-4));
        for (auto& x : V) x *= gamma;
        for (auto& x : S) x *= gamma;
        for (size_t i = 0; i < upd.size(); ++i) {
          V[size_t(upd[i].first - ns)] += at[i];
          S[size_t(t - upd[i].first)] += at[i];
        }
        if (r.m->scale(0, u) > 0.5 && s > 100) rescaled = true;
      }
    }
    CHECK(rescaled);
    CHECK(updates > steps * U);  // the tables really were updated, from real candidate sets
    CHECK(cands > updates);
    for (int u = 0; u < U; ++u) {
      for (int w = 0; w < 2; ++w) {
        const auto got = r.m->table(0, u, w);
        CHECK(max_rel_diff(got, w == 0 ? bv[size_t(u)] : bs[size_t(u)]) < 2e-4);
        // incremental moments vs a float64 pass over the method's own values
        const auto inc = r.m->table_stats(0, u, w), ref = r.m->brute_stats(got);
        CHECK(inc.count == ref.count);
        CHECK(inc.mean == doctest::Approx(ref.mean).epsilon(1e-9));
        CHECK(inc.stddev == doctest::Approx(ref.stddev).epsilon(1e-6));
        CHECK(inc.kurtosis == doctest::Approx(ref.kurtosis).epsilon(1e-6));
        CHECK(inc.tau == doctest::Approx(ref.tau).epsilon(1e-6));
      }
    }
  }
}

// A one-layer C API session (fp32 KV, 2 threads) of `method` at `budget`, prefilled with D's first P
// tokens and its index built.
kvs_session_t prefilled_session(const Data& D, int64_t P, const char* method, const char* params, double budget) {
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = 1;
  p.num_q_heads = uint32_t(D.hq);
  p.num_kv_heads = uint32_t(D.hkv);
  p.head_dim = uint32_t(D.d);
  p.kv_dtype = KVS_SCALAR_F32;
  p.num_threads = 2;
  p.method = method;
  p.method_params = params;
  p.budget = budget;
  kvs_session_t s = nullptr;
  REQUIRE(kvs_session_create(&p, &s) == nullptr);
  const int64_t hq = D.hq, hkv = D.hkv, d = D.d;
  T qq(const_cast<float*>(D.q.data()), f32(), {P, hq, d}), kk(const_cast<float*>(D.k.data()), f32(), {P, hkv, d}),
      vv(const_cast<float*>(D.v.data()), f32(), {P, hkv, d});
  REQUIRE(kvs_session_prefill(s, 0, qq.ptr(), kk.ptr(), vv.ptr(), nullptr, nullptr) == nullptr);
  REQUIRE(kvs_session_build_index(s, nullptr) == nullptr);
  return s;
}

// Thresholds at -inf, no bypass and kv_budget=union: every key of O is a candidate, so the selection
// is the sinks plus the exact top-(k - sinks) of O per query head, and the output is exact attention over it.
TEST_CASE("lfps: alpha=-inf without bypass is exact top-k (selection and float64 output)") {
  Rng rng(5);
  const int64_t P = 500, steps = 6;
  const int hq = 4, hkv = 2, d = 16, G = 2;
  Data D(rng, hq, hkv, d, P + steps);
  auto make = [&](const char* method, const char* params) { return prefilled_session(D, P, method, params, 0.06); };
  // kv_budget=union: each query head keeps its own top-k (the paper's form; cap shares one set per KV head).
  kvs_session_t a = make("lfps", "alpha=-inf,bypass=false,kv_budget=union");
  kvs_session_t b = make("exact_topk", "mode=per_query_head,sinks=4");
  const double scale = 1.0 / std::sqrt(double(d));
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t t = P + s, n = t + 1;
    std::vector<float> oa(hq * d), ob(hq * d), la(hq), lb(hq);
    T qt(const_cast<float*>(D.qt(t)), f32(), {hq, d}), kt(const_cast<float*>(D.kt(t)), f32(), {hkv, d}),
        vt(const_cast<float*>(D.vt(t)), f32(), {hkv, d});
    T toa(oa.data(), f32(), {hq, d}), tob(ob.data(), f32(), {hq, d}), tla(la.data(), f32(), {hq}), tlb(lb.data(), f32(), {hq});
    REQUIRE(kvs_session_decode(a, 0, qt.ptr(), kt.ptr(), vt.ptr(), toa.ptr(), tla.ptr(), nullptr) == nullptr);
    REQUIRE(kvs_session_decode(b, 0, qt.ptr(), kt.ptr(), vt.ptr(), tob.ptr(), tlb.ptr(), nullptr) == nullptr);
    const int64_t k = int64_t(std::ceil(0.06 * double(n)));
    for (int qh = 0; qh < hq; ++qh) {
      // float64 reference: sinks + top-(k-4) of [4, n) by exact score
      std::vector<int64_t> idx;
      for (int64_t j = 4; j < n; ++j) idx.push_back(j);
      std::sort(idx.begin(), idx.end(), [&](int64_t x, int64_t y) { return D.score(qh, t, x, scale) > D.score(qh, t, y, scale); });
      idx.resize(size_t(k - 4));
      for (int64_t j = 0; j < 4; ++j) idx.push_back(j);
      std::vector<double> o;
      double lse;
      attention_ref(D.qt(t), D.k.data(), D.v.data(), qh, G, hkv, d, idx, scale, o, lse);
      CHECK(rel_err(o, oa.data() + qh * d, d) < 1e-5);
      CHECK(la[size_t(qh)] == doctest::Approx(lse).epsilon(1e-5));
      CHECK(rel_err(o, ob.data() + qh * d, d) < 1e-5);
    }
    for (uint32_t h = 0; h < uint32_t(hkv); ++h) {  // same union per KV head as the oracle
      size_t na = 0, nb = 0;
      REQUIRE(kvs_session_last_selection(a, 0, h, nullptr, 0, &na) == nullptr);
      REQUIRE(kvs_session_last_selection(b, 0, h, nullptr, 0, &nb) == nullptr);
      std::vector<int32_t> la_(na), lb_(nb);
      REQUIRE(kvs_session_last_selection(a, 0, h, la_.data(), na, &na) == nullptr);
      REQUIRE(kvs_session_last_selection(b, 0, h, lb_.data(), nb, &nb) == nullptr);
      CHECK(la_ == lb_);
    }
  }
  double cf = 0;
  REQUIRE(kvs_session_method_stat(a, "candidate_fraction", &cf) == nullptr);
  CHECK(cf == 1.0);
  kvs_session_destroy(a);
  kvs_session_destroy(b);
}

// theta = 0 bypasses every head: the output is the LSE merge of exact attention over the sinks and
// the state (V-bar, log A_glob), A_glob = |O| exp(q.K-bar s + rho |q|^2 s^2 / 2) (documented output).
// kv_budget=cap (the default): the G query heads of a KV head rank the union of their candidates
// (with widen=recent's recent keys) by their summed softmax. Contexts of 12K tokens give unions of
// two or more score chunks (4096 keys each, scored on different threads): the chosen keys must be the
// best of that union by a float64 summed softmax (up to float rounding), every head of the group
// attends the same list, and 1 and 3 threads choose bit-identically.
TEST_CASE("lfps: the group's choice over several score chunks equals a float64 ranking of the union") {
  for (const char* params : {"bypass=false", "bypass=false,alpha=-inf"}) {
  CAPTURE(params);
  Rng rng(41);
  const int64_t P = 12000, steps = 6, ns = 4;
  Data D(rng, 4, 2, 16, P + steps);
  Rig r(D, params, 0.05, 3), r1(D, params, 0.05, 1);
  r.prefill(D, P);
  r1.prefill(D, P);
  const int G = 2;
  const double scale = r.shape.softmax_scale;
  int64_t big = 0;
  kvs::Selection sel, sel1;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t t = P + s, n = t + 1;
    r.step(D, t, sel);
    r1.step(D, t, sel1);
    CHECK(sel.lists == sel1.lists);
    for (int h = 0; h < 2; ++h) {
      const auto& list = sel.lists[size_t(h * G)];
      CHECK(sel.lists[size_t(h * G + 1)] == list);  // one set per KV head
      REQUIRE(list.size() > size_t(ns));
      const int64_t want = int64_t(list.size()) - ns;
      std::set<int32_t> rest;
      for (int g = 0; g < G; ++g)
        for (int32_t j : r.m->last_candidates(0, h * G + g)) rest.insert(j);
      for (int64_t j = std::max(ns, n - want); j < n; ++j) rest.insert(int32_t(j));  // widen=recent
      big += rest.size() > 4096;
      std::vector<double> agg(size_t(n), 0.0);
      for (int g = 0; g < G; ++g) {
        const int qh = h * G + g;
        double mx = -kInf, z = 0;
        for (int32_t j : rest) mx = std::max(mx, D.score(qh, t, j, scale));
        for (int32_t j : rest) z += std::exp(D.score(qh, t, j, scale) - mx);
        for (int32_t j : rest) agg[size_t(j)] += std::exp(D.score(qh, t, j, scale) - mx) / z;
      }
      std::set<int32_t> chosen(list.begin() + ns, list.end());
      CHECK(chosen.size() == size_t(want));
      CHECK(std::is_sorted(list.begin(), list.end()));
      double lo = kInf, hi = 0, top = 0;
      for (int32_t j : rest) {
        top = std::max(top, agg[size_t(j)]);
        if (chosen.count(j)) lo = std::min(lo, agg[size_t(j)]);
        else hi = std::max(hi, agg[size_t(j)]);
      }
      for (int32_t j : chosen) CHECK(rest.count(j) == 1);
      CHECK(lo >= hi - 1e-5 * top);  // nothing left out ranks above what was kept
    }
  }
  CHECK(big > 0);  // unions of more than one score chunk were ranked
  }
}

TEST_CASE("lfps: bypassed heads output sink attention merged with (V-bar, log A_glob)") {
  Rng rng(7);
  const int64_t P = 400;
  const int hq = 4, hkv = 2, d = 16, G = 2;
  Data D(rng, hq, hkv, d, P + 3);
  Rig r(D, "theta=0", 0.05);
  r.prefill(D, P);
  const double scale = r.shape.softmax_scale;
  for (int64_t t = P; t < P + 3; ++t) {
    kvs::Selection sel;
    r.step(D, t, sel);
    std::vector<float> eo(hq * d), el(hq);
    REQUIRE(r.m->extra(0, D.qt(t), r.kv, eo.data(), el.data()));
    const int64_t n = t + 1, m = n - 4;
    for (int qh = 0; qh < hq; ++qh) {
      CHECK(r.m->last_bypassed(0, qh));
      CHECK(sel.lists[size_t(qh)] == std::vector<int32_t>{0, 1, 2, 3});
      // priors from the prompt, by brute force
      const int h = qh / G;
      std::vector<double> kb(d, 0.0), vb(d, 0.0);
      for (int64_t j = 4; j < P; ++j)
        for (int i = 0; i < d; ++i) {
          kb[size_t(i)] += D.k[(size_t(j) * hkv + h) * d + i] / double(P - 4);
          vb[size_t(i)] += D.v[(size_t(j) * hkv + h) * d + i] / double(P - 4);
        }
      double qk = 0, qn = 0;
      for (int i = 0; i < d; ++i) {
        qk += double(D.qt(t)[qh * d + i]) * kb[size_t(i)];
        qn += double(D.qt(t)[qh * d + i]) * D.qt(t)[qh * d + i];
      }
      const double log_glob = std::log(double(m)) + qk * scale + 0.5 * r.m->rho(0, qh) * qn * scale * scale;
      CHECK(el[size_t(qh)] == doctest::Approx(log_glob).epsilon(1e-5));
      for (int i = 0; i < d; ++i) CHECK(eo[size_t(qh * d + i)] == doctest::Approx(vb[size_t(i)]).epsilon(1e-5));
      // the documented output: merge(exact sinks, (V-bar, log A_glob)) in float64
      std::vector<double> os;
      double ls;
      attention_ref(D.qt(t), D.k.data(), D.v.data(), qh, G, hkv, d, {0, 1, 2, 3}, scale, os, ls);
      const double L = std::max(ls, log_glob) + std::log(std::exp(ls - std::max(ls, log_glob)) + std::exp(log_glob - std::max(ls, log_glob)));
      std::vector<double> ref(d);
      for (int i = 0; i < d; ++i) ref[size_t(i)] = std::exp(ls - L) * os[size_t(i)] + std::exp(log_glob - L) * vb[size_t(i)];
      // what the session computes: sinks selected exactly, then merge_states with the extra state
      std::vector<float> o(hq * d), lse(hq);
      kvs::cpu::attend_gather_q(r.kv, D.qt(t), G, sel.lists, float(scale), o.data(), lse.data(), r.pool);
      kvs::cpu::merge_states(o.data(), lse.data(), eo.data(), el.data(), hq, d);
      CHECK(rel_err(ref, o.data() + qh * d, d) < 1e-5);
      CHECK(lse[size_t(qh)] == doctest::Approx(L).epsilon(1e-5));
    }
    CHECK(r.m->last_update(0, 0).empty());  // no table update for bypassed heads
  }
  double bf = 0;
  REQUIRE(r.m->stat("bypass_fraction", &bf));
  CHECK(bf == 1.0);
}

TEST_CASE("lfps: save/load round trip and rollback of a decode step") {
  Rng rng(9);
  const int64_t P = 300;
  const int hq = 4, hkv = 2, d = 16;
  Data D(rng, hq, hkv, d, P + 40);
  Rig r(D, "bypass=false", 0.05);
  r.prefill(D, P);
  kvs::Selection sel;
  for (int64_t t = P; t < P + 30; ++t) r.step(D, t, sel);
  // rollback: a step then truncate restores tables and moments exactly
  const auto v0 = r.m->table(0, 1, 0), s0 = r.m->table(0, 1, 1);
  const auto st0 = r.m->table_stats(0, 1, 0);
  r.step(D, P + 30, sel);
  CHECK(!r.m->last_update(0, 1).empty());
  r.kv.truncate(P + 30);
  r.m->truncate(0, P + 30);
  CHECK(r.m->table(0, 1, 0) == v0);
  CHECK(r.m->table(0, 1, 1) == s0);
  CHECK(r.m->table_stats(0, 1, 0).kurtosis == doctest::Approx(st0.kurtosis).epsilon(1e-9));

  const std::string path = (std::filesystem::temp_directory_path() / ("kvsieve_lfps_" + std::to_string(::getpid()))).string();
  nlohmann::json h = {{"format", "test"}};
  kvs::io::TablesWriter w(h);
  r.m->save(w);
  const nlohmann::json meta = r.m->save_meta();
  w.write_atomic(path);
  auto f = kvs::io::TablesFile::open(path);
  Rig r2(D, "bypass=false", 0.05);
  r2.m->load(*f, meta);
  r2.kv.append(D.k.data(), D.v.data(), P + 30);
  r2.m->on_prefill(0, D.q.data(), P + 30, r2.kv);  // the prompt comes again: the tables stay
  for (int u = 0; u < hq; ++u)
    for (int wch = 0; wch < 2; ++wch) CHECK(r2.m->table(0, u, wch) == r.m->table(0, u, wch));
  kvs::Selection s1, s2;
  r.step(D, P + 30, s1);
  r2.step(D, P + 30, s2);
  CHECK(s1.lists == s2.lists);

  // a mismatched GQA mode is refused as a format error
  Rig r3(D, "gqa=per_kv_head", 0.05);
  try {
    r3.m->load(*f, meta);
    FAIL("accepted");
  } catch (const kvs::Error& e) {
    CHECK(e.code() == KVS_STATUS_FORMAT_INVALID);
  }
  std::filesystem::remove(path);
}

TEST_CASE("lfps: the default alpha is 0.1; preset=paper restores the paper's alpha, per-head union and no fill") {
  // Sessions with no parameters decode exactly as alpha=0.1 given explicitly; preset=paper exactly as
  // alpha=0.2,kv_budget=union,fill=none,widen=none; an explicit value wins over the preset; and the
  // two settings differ on this data (else the comparisons could not tell them apart).
  Rng rng(41);
  const int64_t P = 400, steps = 10;
  const int hq = 4, hkv = 2, d = 16;
  Data D(rng, hq, hkv, d, P + steps);
  auto make = [&](const char* params) { return prefilled_session(D, P, "lfps", params, 0.08); };
  // Decodes every step on both sessions; returns whether any output or selection differed.
  auto run = [&](const char* pa, const char* pb) {
    kvs_session_t a = make(pa), b = make(pb);
    bool differ = false;
    for (int64_t t = P; t < P + steps; ++t) {
      std::vector<float> oa(hq * d), ob(hq * d), la(hq), lb(hq);
      T qt(const_cast<float*>(D.qt(t)), f32(), {hq, d}), kt(const_cast<float*>(D.kt(t)), f32(), {hkv, d}),
          vt(const_cast<float*>(D.vt(t)), f32(), {hkv, d});
      T toa(oa.data(), f32(), {hq, d}), tob(ob.data(), f32(), {hq, d}), tla(la.data(), f32(), {hq}),
          tlb(lb.data(), f32(), {hq});
      REQUIRE(kvs_session_decode(a, 0, qt.ptr(), kt.ptr(), vt.ptr(), toa.ptr(), tla.ptr(), nullptr) == nullptr);
      REQUIRE(kvs_session_decode(b, 0, qt.ptr(), kt.ptr(), vt.ptr(), tob.ptr(), tlb.ptr(), nullptr) == nullptr);
      differ |= std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)) != 0;
      differ |= std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) != 0;
      for (uint32_t h = 0; h < uint32_t(hkv); ++h) {
        size_t na = 0, nb = 0;
        REQUIRE(kvs_session_last_selection(a, 0, h, nullptr, 0, &na) == nullptr);
        REQUIRE(kvs_session_last_selection(b, 0, h, nullptr, 0, &nb) == nullptr);
        std::vector<int32_t> sa(na), sb(nb);
        REQUIRE(kvs_session_last_selection(a, 0, h, sa.data(), na, &na) == nullptr);
        REQUIRE(kvs_session_last_selection(b, 0, h, sb.data(), nb, &nb) == nullptr);
        differ |= sa != sb;
      }
    }
    kvs_session_destroy(a);
    kvs_session_destroy(b);
    return differ;
  };
  CHECK_FALSE(run("", "alpha=0.1"));
  CHECK_FALSE(run("preset=kvsieve", "alpha=0.1,kv_budget=cap,fill=recent,widen=recent"));
  CHECK_FALSE(run("preset=paper", "alpha=0.2,kv_budget=union,fill=none,widen=none"));
  CHECK_FALSE(run("preset=paper,alpha=0.1", "alpha=0.1,kv_budget=union,fill=none,widen=none"));
  CHECK(run("", "preset=paper"));
  CHECK(run("", "alpha=0.2"));
}

TEST_CASE("lfps: bad parameters are rejected naming the parameter") {
  const kvs::MethodSpec* spec = kvs::find_method("lfps");
  REQUIRE(spec != nullptr);
  kvs::ModelShape shape{1, 4, 2, 16, 0.25f, kvs::DType::F32};
  kvs::ThreadPool pool(1);
  kvs::MethodContext ctx{shape, kvs::Budget{}, &pool, int32_t(KVS_GEMM_ONEDNN)};
  for (const char* bad : {"gamma=1", "gamma=0", "theta=1.5", "sinks=-1", "last_q=0", "alpha_scale=-1", "offsets=1;x",
                          "alpha=inf", "local_window=-2"}) {
    CAPTURE(bad);
    const std::string key = std::string(bad).substr(0, std::string(bad).find('='));
    try {
      kvs::lfps::Lfps m(ctx, kvs::lfps::parse_params(kvs::ParamSet::parse("lfps", spec->params, bad)));
      FAIL("accepted");
    } catch (const kvs::Error& e) {
      CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
      CHECK(std::string(e.what()).find(key) != std::string::npos);
    }
  }
}
