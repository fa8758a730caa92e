// SPDX-License-Identifier: Apache-2.0
// The KV cache of one layer: fixed-size pages of kPageTokens tokens, each page holding
// K [Hkv][P][d] then V [Hkv][P][d] in the storage dtype. Pages are reference-counted so a forked
// session or a memory-mapped tables file can share them read-only; a shared page is copied before
// it is written (copy-on-write; only the last, partly filled page is ever written).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/dtype.hpp"

namespace kvs {

constexpr int64_t kPageTokens = 256;
constexpr int32_t kPageShift = 8;  // log2(kPageTokens), for the device page tables
static_assert(int64_t(1) << kPageShift == kPageTokens);

// Process-wide figures of the KV page pool (tests, diagnostics).
struct PagePoolStats {
  uint64_t mapped_bytes = 0;  // extents currently mapped
  uint64_t live_pages = 0;    // pages handed out from extents
  uint64_t extents = 0;
  bool huge_hint = false;     // extents are advised for transparent huge pages
  uint64_t pinned_bytes = 0;  // extents pinned for a GPU to read in place (the hybrid placement)
};
PagePoolStats page_pool_stats();

// Page-locked ("pinned") KV pages, which a GPU reads in place over the bus (the hybrid placement).
// The pool keeps them in extents of their own, locked by `pin` when mapped and released by `unpin`
// before they are unmapped. The hooks are set once per process by the backend that knows how to
// pin (cuda: cudaHostRegister); until then a pinned page cannot be made (OUT_OF_MEMORY naming why).
struct PinHooks {
  bool (*pin)(void* p, size_t bytes) = nullptr;  // false: not pinned (the mapping is dropped)
  void (*unpin)(void* p) = nullptr;
};
void set_pin_hooks(const PinHooks& hooks);
// Reserves n free pinned pages of `bytes` for work queued to run later where pinning is not
// allowed (a CUDA host function), mapping and pinning extents as needed (call where the pin hook
// may run). Reservations add up until unreserve_pinned_pages gives them back (when that work has
// run); pinned pages allocated outside a NoPinScope never take reserved ones. A thread inside a
// NoPinScope takes free pinned pages and fails (OUT_OF_MEMORY) rather than pin, and never unpins.
void reserve_pinned_pages(size_t bytes, uint32_t n);
void unreserve_pinned_pages(size_t bytes, uint32_t n);
struct NoPinScope {
  NoPinScope();
  ~NoPinScope();
  NoPinScope(const NoPinScope&) = delete;
  NoPinScope& operator=(const NoPinScope&) = delete;
};

class Page {
 public:
  // Allocates an owned page. Pages of at least kPoolMinBytes come from the page pool: 2 MiB-aligned
  // extents of several pages, advised for transparent huge pages on Linux (a sparse method gathers
  // scattered rows, and 4 KiB pages put a TLB miss on nearly every one). A freed 2 MiB range that no
  // live page overlaps goes back to the OS; an extent is unmapped when its last page is freed (one
  // empty extent per page size is kept). KVS_HUGE_PAGES=0 in the
  // environment leaves out the advice. Smaller pages come from mimalloc (64-byte aligned).
  explicit Page(size_t bytes, bool pinned = false);  // pinned: page-locked, from the pool whatever its size
  static constexpr size_t kPoolMinBytes = size_t(256) << 10;
  // Wraps external read-only memory kept alive by `owner` (e.g. a mapped file).
  Page(const std::byte* external, size_t bytes, std::shared_ptr<const void> owner);
  ~Page();
  Page(const Page&) = delete;
  Page& operator=(const Page&) = delete;

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  bool owned() const { return owner_ == nullptr; }
  bool pinned() const { return pinned_; }

 private:
  std::byte* data_;
  size_t bytes_;
  std::shared_ptr<const void> owner_;
  void* extent_ = nullptr;  // the pool extent holding an owned page, or null (mimalloc)
  bool pinned_ = false;
};

class KVLayer {
 public:
  KVLayer(DType dtype, int num_kv_heads, int head_dim);

  DType dtype() const { return dtype_; }
  int num_kv_heads() const { return hkv_; }
  int head_dim() const { return d_; }
  int64_t size() const { return n_; }
  int64_t num_pages() const { return int64_t(pages_.size()); }
  size_t page_bytes() const { return page_bytes_; }
  size_t elem_size() const { return dtype_size(dtype_); }
  // Pages this layer allocates from now on (appends, copies on write) are pinned (see PinHooks);
  // with `now`, the pages it holds that are not are replaced by pinned copies too.
  void set_pinned(bool on, bool now);
  bool pinned() const { return pinned_; }

  // Base of key / value block [P][d] of head h in page p.
  const std::byte* k_block(int64_t p, int h) const {
    return pages_[size_t(p)]->data() + size_t(h) * block_bytes_;
  }
  const std::byte* v_block(int64_t p, int h) const {
    return pages_[size_t(p)]->data() + (size_t(hkv_) + size_t(h)) * block_bytes_;
  }
  // Row of token t (< size()) for head h.
  const std::byte* k_row(int h, int64_t t) const {
    return k_block(t / kPageTokens, h) + size_t(t % kPageTokens) * row_bytes_;
  }
  const std::byte* v_row(int h, int64_t t) const {
    return v_block(t / kPageTokens, h) + size_t(t % kPageTokens) * row_bytes_;
  }

  // Appends n tokens given as fp32 rows k[n][Hkv][d], v[n][Hkv][d] (converted to the storage dtype).
  void append(const float* k, const float* v, int64_t n);
  // Keeps the first n tokens (a failed call rolled back, kvs_session_truncate). The rest of the
  // last page is zeroed again when this layer alone holds it, so a saved page reads as if the
  // dropped tokens had never been appended (a shared page is left as it is: never copied here).
  void truncate(int64_t n);
  // A read-only view of the first n tokens (shares the pages; nothing is copied or zeroed): the
  // layer as it was when it held n tokens, for replaying a method's calls.
  KVLayer prefix(int64_t n) const;

  // Read-only access to pages (for save and for sharing on fork/load).
  const std::vector<std::shared_ptr<Page>>& pages() const { return pages_; }
  // Replaces content with shared pages holding n tokens (load, fork).
  void adopt(std::vector<std::shared_ptr<Page>> pages, int64_t n);

  uint64_t bytes() const { return uint64_t(pages_.size()) * page_bytes_; }
  uint64_t shared_bytes() const;

 private:
  Page& writable_last_page();

  DType dtype_;
  int hkv_, d_;
  size_t row_bytes_, block_bytes_, page_bytes_;
  int64_t n_ = 0;
  bool pinned_ = false;
  std::vector<std::shared_ptr<Page>> pages_;
};

}  // namespace kvs
