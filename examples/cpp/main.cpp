// SPDX-License-Identifier: Apache-2.0
// kvsieve from C++ through kvsieve.hpp (header-only RAII over the C ABI): prefill a random prompt,
// decode one token with exact_topk at the whole-context budget, check against a double-precision
// reference; decode two sessions together through a kvsieve::Batch (plan per token, decode per
// layer) and check it against per-session decodes of forks; then show an error. Exit code 0 when
// everything matched.
#include <kvsieve/kvsieve.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  constexpr int Hq = 4, Hkv = 2, d = 32, n = 200;
  kvsieve::abi_check();
  std::mt19937 gen(42);
  std::normal_distribution<float> nd;
  auto rnd = [&](size_t count) {
    std::vector<float> x(count);
    for (auto& v : x) v = nd(gen);
    return x;
  };
  // K and V hold the prompt and, in their last row, the decoded token.
  std::vector<float> q = rnd(n * Hq * d), k = rnd((n + 1) * Hkv * d), v = rnd((n + 1) * Hkv * d);
  std::vector<float> q1 = rnd(Hq * d), o(Hq * d), lse(Hq);

  kvsieve::Session s(kvsieve::SessionParams{}.layers(1).heads(Hq, Hkv).head_dim(d).method("exact_topk").budget(1.0)
                         .kv_dtype(KVS_SCALAR_F32));
  s.prefill(0, kvsieve::tensor(q.data(), {n, Hq, d}), kvsieve::tensor(k.data(), {n, Hkv, d}),
            kvsieve::tensor(v.data(), {n, Hkv, d}));
  s.build_index();
  kvsieve::Tensor lse_t = kvsieve::tensor(lse.data(), {Hq});
  s.decode(0, kvsieve::tensor(q1.data(), {Hq, d}), kvsieve::tensor(&k[n * Hkv * d], {Hkv, d}),
           kvsieve::tensor(&v[n * Hkv * d], {Hkv, d}), kvsieve::tensor(o.data(), {Hq, d}), &lse_t);

  double worst = 0;
  const double scale = 1.0 / std::sqrt(double(d));
  for (int h = 0; h < Hq; ++h) {
    const int kh = h / (Hq / Hkv);
    std::vector<double> sc(n + 1);
    double m = -INFINITY, sum = 0;
    for (int j = 0; j <= n; ++j) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += double(q1[h * d + c]) * k[(j * Hkv + kh) * d + c];
      m = std::fmax(m, sc[j] = scale * dot);
    }
    for (int j = 0; j <= n; ++j) sum += std::exp(sc[j] - m);
    worst = std::fmax(worst, std::fabs(m + std::log(sum) - lse[h]));
    for (int c = 0; c < d; ++c) {
      double acc = 0;
      for (int j = 0; j <= n; ++j) acc += std::exp(sc[j] - m) * v[(j * Hkv + kh) * d + c];
      worst = std::fmax(worst, std::fabs(acc / sum - o[h * d + c]));
    }
  }
  std::printf("kvsieve %s: %zu methods; decode of %d keys, max |error| vs double reference = %.2e\n", kvs_version(),
              kvsieve::method_names().size(), int(s.layer_tokens(0)), worst);
  if (!(worst < 1e-4)) return 1;

  // A batch of two 2-layer quest sessions (different prompts); forks taken before the batch steps
  // decode the same tokens one session at a time, as the reference.
  {
    constexpr int L = 2, B = 2, steps = 3;
    std::vector<kvsieve::Session> sessions, forks;
    for (int b = 0; b < B; ++b) {
      sessions.emplace_back(kvsieve::SessionParams{}.layers(L).heads(Hq, Hkv).head_dim(d).method("quest").budget(0.25)
                                .kv_dtype(KVS_SCALAR_F32));
      std::vector<float> pq = rnd(n * Hq * d), pk = rnd(n * Hkv * d), pv = rnd(n * Hkv * d);
      for (uint32_t l = 0; l < L; ++l)
        sessions[b].prefill(l, kvsieve::tensor(pq.data(), {n, Hq, d}), kvsieve::tensor(pk.data(), {n, Hkv, d}),
                            kvsieve::tensor(pv.data(), {n, Hkv, d}));
      sessions[b].build_index();
      forks.push_back(sessions[b].fork());
    }
    if (kvsieve::method_unsupported_reason("quest", KVS_BACKEND_CPU)) return 1;  // runs on the CPU
    kvsieve::Batch batch(sessions);
    double batch_worst = 0;
    for (int t = 0; t < steps; ++t) {
      batch.plan();
      for (uint32_t l = 0; l < L; ++l) {
        std::vector<float> bq = rnd(B * Hq * d), bk = rnd(B * Hkv * d), bv = rnd(B * Hkv * d);
        std::vector<float> bo(B * Hq * d), bl(B * Hq), so(Hq * d), sl(Hq);
        kvsieve::Tensor bl_t = kvsieve::tensor(bl.data(), {B, Hq});
        batch.decode(l, kvsieve::tensor(bq.data(), {B, Hq, d}), kvsieve::tensor(bk.data(), {B, Hkv, d}),
                     kvsieve::tensor(bv.data(), {B, Hkv, d}), kvsieve::tensor(bo.data(), {B, Hq, d}), &bl_t);
        for (int b = 0; b < B; ++b) {
          kvsieve::Tensor sl_t = kvsieve::tensor(sl.data(), {Hq});
          forks[b].decode(l, kvsieve::tensor(&bq[b * Hq * d], {Hq, d}), kvsieve::tensor(&bk[b * Hkv * d], {Hkv, d}),
                          kvsieve::tensor(&bv[b * Hkv * d], {Hkv, d}), kvsieve::tensor(so.data(), {Hq, d}), &sl_t);
          for (int i = 0; i < Hq * d; ++i) batch_worst = std::fmax(batch_worst, std::fabs(so[i] - bo[b * Hq * d + i]));
          for (int h = 0; h < Hq; ++h) batch_worst = std::fmax(batch_worst, std::fabs(sl[h] - bl[b * Hq + h]));
        }
      }
    }
    std::printf("batch of %zu sessions, %d tokens x %d layers: max |batch - per-session decode| = %.2e\n",
                batch.size(), steps, L, batch_worst);
    if (!(batch_worst < 1e-5) || sessions[1].layer_tokens(L - 1) != n + steps) return 1;
    std::vector<float> zq(B * Hq * d), zkv(B * Hkv * d), zo(B * Hq * d);
    try {
      batch.decode(0, kvsieve::tensor(zq.data(), {B, Hq, d}), kvsieve::tensor(zkv.data(), {B, Hkv, d}),
                   kvsieve::tensor(zkv.data(), {B, Hkv, d}), kvsieve::tensor(zo.data(), {B, Hq, d}));
      std::printf("expected an error for a layer decoded twice under one plan\n");
      return 1;
    } catch (const kvsieve::Error& e) {
      if (e.code() != KVS_STATUS_INVALID_STATE) return 1;
    }
  }

  try {
    s.decode(7, kvsieve::tensor(q1.data(), {Hq, d}), kvsieve::tensor(k.data(), {Hkv, d}),
             kvsieve::tensor(v.data(), {Hkv, d}), kvsieve::tensor(o.data(), {Hq, d}));
    std::printf("expected an error for layer 7\n");
    return 1;
  } catch (const kvsieve::Error& e) {
    std::printf("error handled: code %d: %s\n", e.code(), e.what());
    if (e.code() != KVS_STATUS_INVALID_ARGUMENT) return 1;
  }
  return 0;
}
