// SPDX-License-Identifier: Apache-2.0
// Validation and access of caller tensors (kvs_tensor, DLTensor-compatible). Every check names the
// argument and what was expected, so the C API can return a useful error.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/dtype.hpp"
#include "kvsieve/kvsieve.h"

namespace kvs {

enum class Where { Host, Cuda, Any };

// A validated view: at most 4 dims, strides in elements (never NULL here).
struct View {
  const char* base = nullptr;  // data + byte_offset
  DType dtype = DType::F32;
  int32_t device_type = KVS_DEVICE_CPU;
  int32_t device_id = 0;
  int ndim = 0;
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t strides[4] = {0, 0, 0, 0};

  int64_t numel() const;
  bool contiguous() const;
  bool on_host() const { return device_type == KVS_DEVICE_CPU || device_type == KVS_DEVICE_CUDA_HOST; }
  // Element offset of a multi-index (ndim entries).
  int64_t offset(const int64_t* idx) const;
  void* mutable_base() const { return const_cast<char*>(base); }
};

// Maps a DLPack dtype to DType or throws naming `name`.
DType dtype_from_dl(const kvs_dtype& dt, const char* name);
kvs_dtype dl_from_dtype(DType t);

// Validates t (non-NULL, non-NULL data when numel > 0, ndim, exact shape where expected[i] >= 0,
// float dtype, device) and returns a view. `expected` entries of -1 accept any extent >= 1.
View check_tensor(const kvs_tensor* t, const char* name, std::initializer_list<int64_t> expected,
                  Where where);

// check_tensor for a tensor the library writes (o, lse): also refuses strides that put two elements
// at one address (a zero stride on an extent > 1, or any other overlap), naming `name`; whichever
// element was written last would win, and the cuda kernels would race on it.
View check_output_tensor(const kvs_tensor* t, const char* name, std::initializer_list<int64_t> expected,
                         Where where);
// Throws INVALID_ARGUMENT naming `name` unless no two elements of v share an address. Exact for
// views of up to 2^22 elements; larger views must have nested strides (ordered by stride, each
// dimension steps past everything the smaller-stride dimensions span), as every dense layout has.
void check_no_overlap(const View& v, const char* name);

// Copies a (possibly strided) tensor into a contiguous fp32 buffer of numel() elements (host only).
void read_f32(const View& v, float* dst);
// Writes a contiguous fp32 buffer into a (possibly strided) host tensor, converting dtype.
void write_f32(const View& v, const float* src);

std::string shape_str(const View& v);

}  // namespace kvs
