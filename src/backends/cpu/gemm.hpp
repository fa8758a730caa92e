// SPDX-License-Identifier: Apache-2.0
// Single-precision GEMM through oneDNN (dnnl_sgemm) or OpenBLAS (cblas_sgemm), chosen per session
// (kvs_session_params.gemm) or by the KVS_GEMM environment variable ("onednn" / "openblas").
// Row-major: C[M][N] = alpha * op(A)[M][K] * op(B)[K][N] + beta * C.
#pragma once
#include <cstdint>

#include "kvsieve/kvsieve.h"

namespace kvs::cpu {

enum class GemmProvider { OneDnn = KVS_GEMM_ONEDNN, OpenBlas = KVS_GEMM_OPENBLAS };

// Resolves KVS_GEMM_AUTO through the environment (default oneDNN); throws on an unknown value.
GemmProvider resolve_gemm(int32_t requested);
const char* gemm_name(GemmProvider p);

void sgemm(GemmProvider p, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace kvs::cpu
