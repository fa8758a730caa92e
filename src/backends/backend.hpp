// SPDX-License-Identifier: Apache-2.0
// The private backend interface (cpu, cuda): memory, copies, stream order, and the one op every
// placement shares, the exact merge of two attention states. Attention over a KV store and the
// methods' own kernels belong to the placement that owns the store (src/backends/<b>/placement.*)
// and to the method's folder. Backends are listed in src/backends/registry.cpp; a backend this
// build lacks is still listed, with the reason it cannot run.
//
// Streams cross as void* (a cudaStream_t on CUDA, ignored on the CPU). Nothing here synchronises a
// stream unless its comment says so.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>

#include "core/device.hpp"

namespace kvs {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual int32_t id() const = 0;  // kvs_backend
  virtual const char* name() const = 0;

  // Memory of the given kind (Mem::Device: the current device). alloc throws OUT_OF_MEMORY.
  virtual void* alloc(size_t bytes, Mem where) const = 0;
  virtual void free(void* p, Mem where) const noexcept = 0;
  // Stream-ordered copy of `bytes` between any two kinds of memory this backend reaches.
  virtual void copy(void* dst, Mem dst_mem, const void* src, Mem src_mem, size_t bytes, void* stream) const = 0;
  // Runs fn on the host once the stream reaches this point (CPU: now). fn must not call the backend.
  virtual void host_fn(void* stream, std::function<void()> fn) const = 0;
  // Blocks the host until the stream's work is done (CPU: returns at once).
  virtual void sync(void* stream) const = 0;

  // dst <- merge(dst, src) for rows = B * Hq rows of head_dim (fp32 o, fp32 natural-log lse), in
  // stream order. src may be pinned host memory on the CUDA backend (read zero-copy).
  virtual void merge(const AttnState& dst, const AttnState& src, int64_t rows, int32_t head_dim, void* stream) const = 0;
};

// The backend with this kvs_backend id, or nullptr with the reason in *why_not.
const Backend* find_backend(int32_t id, const char** why_not);

}  // namespace kvs
