// SPDX-License-Identifier: Apache-2.0
#include "backends/cpu/gemm.hpp"

#include <cblas.h>
#include <dnnl.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/error.hpp"

namespace kvs::cpu {

GemmProvider resolve_gemm(int32_t requested) {
  switch (requested) {
    case KVS_GEMM_ONEDNN: return GemmProvider::OneDnn;
    case KVS_GEMM_OPENBLAS: return GemmProvider::OpenBlas;
    case KVS_GEMM_AUTO: {
      const char* env = std::getenv("KVS_GEMM");
      if (!env || !*env || std::strcmp(env, "onednn") == 0) return GemmProvider::OneDnn;
      if (std::strcmp(env, "openblas") == 0) return GemmProvider::OpenBlas;
      invalid(std::string("KVS_GEMM environment variable: expected \"onednn\" or \"openblas\", got \"") + env + "\"");
    }
    default:
      invalid("gemm: expected KVS_GEMM_AUTO (0), KVS_GEMM_ONEDNN (1) or KVS_GEMM_OPENBLAS (2), got " +
              std::to_string(requested));
  }
}

const char* gemm_name(GemmProvider p) { return p == GemmProvider::OneDnn ? "onednn" : "openblas"; }

void sgemm(GemmProvider p, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (p == GemmProvider::OneDnn) {
    const dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B,
                                        ldb, beta, C, ldc);
    if (st != dnnl_success) fail(KVS_STATUS_BACKEND, "oneDNN dnnl_sgemm failed", int64_t(st));
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              blasint(M), blasint(N), blasint(K), alpha, A, blasint(lda), B, blasint(ldb), beta, C,
              blasint(ldc));
}

}  // namespace kvs::cpu
