// SPDX-License-Identifier: Apache-2.0
// Where bytes live, and the descriptors that cross between a session, its method and a backend:
// a typed reference to memory (Ref), an attention state (o, lse) and a selection of keys.
// Nothing here copies: a Ref says where its bytes are, and only a placement decides to move them.
#pragma once
#include <cstdint>

#include "core/dtype.hpp"

namespace kvs {

// Host: pageable host memory; Pinned: page-locked host memory a GPU reads directly (zero-copy);
// Device: GPU memory of `Ref::device`.
enum class Mem : uint8_t { Host, Pinned, Device };

inline const char* mem_name(Mem m) { return m == Mem::Host ? "host" : m == Mem::Pinned ? "pinned" : "device"; }

// A dense tensor reference (strides in elements, up to 4 dims).
struct Ref {
  void* data = nullptr;
  Mem mem = Mem::Host;
  int device = 0;
  DType dtype = DType::F32;
  int ndim = 0;
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t stride[4] = {0, 0, 0, 0};

  bool empty() const { return data == nullptr; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  template <class T>
  T* as() const { return static_cast<T*>(data); }
  // A contiguous tensor of the given shape.
  static Ref contiguous(void* data, Mem mem, int device, DType dt, std::initializer_list<int64_t> dims) {
    Ref r;
    r.data = data;
    r.mem = mem;
    r.device = device;
    r.dtype = dt;
    r.ndim = int(dims.size());
    int i = 0;
    for (int64_t d : dims) r.shape[i++] = d;
    int64_t s = 1;
    for (int k = r.ndim - 1; k >= 0; --k) {
      r.stride[k] = s;
      s *= r.shape[k];
    }
    return r;
  }
};

// An attention state over some set of keys: o [B, Hq, d] and lse [B, Hq] (fp32, natural log).
// The empty state (lse = -inf, o = 0) is the identity of the merge.
struct AttnState {
  Ref o;
  Ref lse;
};

// The keys a step attends: idx int32 [B, H, max_selected] (-1 padded), cnt int32 [B, H], with H the
// KV heads (one list serves the whole group) or the query heads (per_query_head).
struct SelectionBuf {
  Ref idx;
  Ref cnt;
  int32_t max_selected = 0;
  bool per_query_head = false;
};

}  // namespace kvs
