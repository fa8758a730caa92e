// SPDX-License-Identifier: Apache-2.0
// The GEMM layer: oneDNN and OpenBLAS against a float64 reference, every transpose combination.
#include <doctest/doctest.h>

#include <cstdlib>

#include "backends/cpu/gemm.hpp"
#include "core/error.hpp"
#include "reference.hpp"

using namespace kvt;

TEST_CASE("sgemm through oneDNN and OpenBLAS equals a float64 reference") {
  Rng rng(21);
  for (auto prov : {kvs::cpu::GemmProvider::OneDnn, kvs::cpu::GemmProvider::OpenBlas})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const int64_t M = 37, N = 53, K = 129;
        auto A = rng.normals(size_t(M * K)), B = rng.normals(size_t(K * N)), C = rng.normals(size_t(M * N));
        auto C0 = C;
        const int64_t lda = ta ? M : K, ldb = tb ? K : N;
        kvs::cpu::sgemm(prov, ta, tb, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, 2.f, C.data(), N);
        double worst = 0;
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j) {
            double acc = 0;
            for (int64_t k = 0; k < K; ++k) {
              const double a = ta ? A[size_t(k * lda + i)] : A[size_t(i * lda + k)];
              const double b = tb ? B[size_t(j * ldb + k)] : B[size_t(k * ldb + j)];
              acc += a * b;
            }
            const double ref = 0.5 * acc + 2.0 * C0[size_t(i * N + j)];
            worst = std::max(worst, std::abs(ref - C[size_t(i * N + j)]) / (1 + std::abs(ref)));
          }
        INFO(kvs::cpu::gemm_name(prov) << " ta " << ta << " tb " << tb);
        CHECK(worst < 1e-4);
      }
}

TEST_CASE("the GEMM provider is chosen by argument or by KVS_GEMM") {
  CHECK(kvs::cpu::resolve_gemm(KVS_GEMM_OPENBLAS) == kvs::cpu::GemmProvider::OpenBlas);
  CHECK(kvs::cpu::resolve_gemm(KVS_GEMM_ONEDNN) == kvs::cpu::GemmProvider::OneDnn);
  setenv("KVS_GEMM", "openblas", 1);
  CHECK(kvs::cpu::resolve_gemm(KVS_GEMM_AUTO) == kvs::cpu::GemmProvider::OpenBlas);
  setenv("KVS_GEMM", "mkl", 1);
  CHECK_THROWS_AS(kvs::cpu::resolve_gemm(KVS_GEMM_AUTO), kvs::Error);
  unsetenv("KVS_GEMM");
  CHECK(kvs::cpu::resolve_gemm(KVS_GEMM_AUTO) == kvs::cpu::GemmProvider::OneDnn);
  CHECK_THROWS_AS(kvs::cpu::resolve_gemm(42), kvs::Error);
}
