// SPDX-License-Identifier: Apache-2.0
// Scalar types and conversions. bf16 and fp16 are stored as raw uint16_t bit patterns; all
// arithmetic happens in fp32 (fp64 in references).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

#include "kvsieve/kvsieve.h"

namespace kvs {

enum class DType : int32_t { F32 = KVS_SCALAR_F32, F16 = KVS_SCALAR_F16, BF16 = KVS_SCALAR_BF16 };

inline size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }
inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
  }
  return "?";
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float f16_to_f32(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return float(x);
}
inline uint16_t f32_to_f16(float f) {
  _Float16 x = _Float16(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

// Element i of a buffer of dtype t, as float.
inline float load_as_f32(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.f;
}
inline void store_from_f32(void* p, DType t, size_t i, float v) {
  switch (t) {
    case DType::F32: static_cast<float*>(p)[i] = v; break;
    case DType::F16: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
  }
}

// Converts n contiguous elements.
void convert_to_f32(const void* src, DType t, float* dst, size_t n);
void convert_from_f32(const float* src, void* dst, DType t, size_t n);

}  // namespace kvs
