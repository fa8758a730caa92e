// kvsieve from C++ through kvsieve.hpp (header-only RAII over the C ABI): prefill a random prompt,
// decode one token with exact_topk at the whole-context budget, check against a double-precision
// reference, then show an error. Exit code 0 when everything matched.
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
