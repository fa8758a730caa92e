// SPDX-License-Identifier: Apache-2.0
// A CUDA runtime call that must succeed in a test program: on an error, print it with the call and
// its place and end the program (exit 2). Shared by the CUDA test programs (tests/cuda,
// tests/backends); needs only the CUDA runtime.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define KVS_TEST_CK(call)                                                                          \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #call); \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)
