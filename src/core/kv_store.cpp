// SPDX-License-Identifier: Apache-2.0
#include "core/kv_store.hpp"

#include <mimalloc.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>

#include "core/error.hpp"

namespace kvs {

namespace {

// The page pool. Extents are anonymous mappings of a multiple of 2 MiB, 2 MiB-aligned, holding
// `capacity` pages of one size; the lowest free slot is taken first. Thread-safe (pages are
// created and freed from any session and from pool threads).
constexpr size_t kHuge = size_t(2) << 20;
constexpr size_t kExtentTarget = size_t(32) << 20;

struct Extent {
  std::byte* base;
  size_t len, page_bytes;
  std::vector<bool> in_use;  // per slot
  uint32_t capacity, used = 0;
  bool pinned = false;
  void (*unpin)(void*) = nullptr;
};

thread_local int t_no_pin = 0;  // NoPinScope depth on this thread

class PagePool {
 public:
  static PagePool& get() {
    static PagePool* pool = new PagePool;  // never destroyed: pages may outlive static destructors
    return *pool;
  }

  std::byte* allocate(size_t bytes, bool pinned, Extent** out) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      Extent* e = nullptr;
      for (Extent* x : extents_)
        if (x->page_bytes == bytes && x->pinned == pinned && x->used < x->capacity && (!e || x->used > e->used))
          e = x;  // fullest first
      // Outside a step's host function, the pinned pages queued steps reserved are not taken.
      if (e && pinned && !t_no_pin && free_pinned(bytes) <= reserved(bytes)) e = nullptr;
      if (e) {
        const uint32_t slot = uint32_t(std::find(e->in_use.begin(), e->in_use.end(), false) - e->in_use.begin());
        e->in_use[slot] = true;
        ++e->used;
        ++live_;
        *out = e;
        return e->base + size_t(slot) * bytes;
      }
      if (pinned && t_no_pin)
        fail(KVS_STATUS_OUT_OF_MEMORY, "KV pages: no pinned page was reserved for this step (hybrid backend)");
      lock.unlock();
      Extent* fresh = map_extent(bytes, pinned);  // mapping and pinning outside the lock
      lock.lock();
      if (!fresh) return nullptr;
      insert(fresh);
    }
  }

  void release(std::byte* p, Extent* e) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint32_t slot = uint32_t(size_t(p - e->base) / e->page_bytes);
    e->in_use[slot] = false;
    --e->used;
    --live_;
    if (e->used == 0) {
      // Keep one empty extent per page size, so a session that frees and takes one page at an
      // extent boundary does not map and unmap 32 MiB each time. A pinned one stays while steps
      // in flight count on its pages, and inside a step's host function (no CUDA call there).
      bool keep = e->pinned && (t_no_pin || free_pinned(e->page_bytes) < reserved(e->page_bytes) + e->capacity);
      for (Extent* x : extents_)
        if (!keep && x != e && x->page_bytes == e->page_bytes && x->pinned == e->pinned && x->used == 0) {
          extents_.erase(std::find(extents_.begin(), extents_.end(), e));
          lock.unlock();
          unmap(e);  // unpinning may wait for the device: never under the lock
          return;
        }
    }
    if (!e->pinned) give_back(e, slot);  // pinned memory stays resident while pinned
  }

  void set_hooks(const PinHooks& h) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!hooks_.pin) hooks_ = h;
  }

  void reserve_pinned(size_t bytes, uint32_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    while (free_pinned(bytes) < reserved(bytes) + n) {
      lock.unlock();
      Extent* e = map_extent(bytes, true);
      lock.lock();
      if (!e) fail(KVS_STATUS_OUT_OF_MEMORY, "KV pages: could not map and pin " + std::to_string(bytes) + "-byte pages");
      insert(e);
    }
    reserved_[bytes] += n;
  }

  void unreserve_pinned(size_t bytes, uint32_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& r = reserved_[bytes];
    r -= std::min<uint64_t>(r, n);
  }

  PagePoolStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    PagePoolStats s;
    for (Extent* x : extents_) {
      s.mapped_bytes += x->len;
      if (x->pinned) s.pinned_bytes += x->len;
    }
    s.live_pages = live_;
    s.extents = extents_.size();
    s.huge_hint = huge_;
    return s;
  }

 private:
  PagePool() {
    const char* e = std::getenv("KVS_HUGE_PAGES");
    huge_ = !(e && std::strcmp(e, "0") == 0);
  }

  // Returns the memory of the huge pages that no page in use overlaps any more, around a freed
  // slot, to the OS (MADV_DONTNEED: read back as zeros; whole 2 MiB ranges only, so the huge
  // pages still in use are not split).
  static void give_back(Extent* e, uint32_t slot) {
    const size_t b = size_t(slot) * e->page_bytes, end = b + e->page_bytes;
    for (size_t h = b / kHuge * kHuge; h < end; h += kHuge) {
      const size_t first = h / e->page_bytes, last = std::min<size_t>((h + kHuge - 1) / e->page_bytes, e->capacity - 1);
      bool free = true;
      for (size_t i = first; i <= last && free; ++i) free = !e->in_use[i];
      if (free) madvise(e->base + h, kHuge, MADV_DONTNEED);
    }
  }

  // Called without mu_ (pinning may take a while). A pinned extent is pinned by the hook before it
  // is handed out; null if the mapping or the pinning fails (a pinned extent without hooks throws,
  // saying why). Not yet in extents_: see insert.
  Extent* map_extent(size_t bytes, bool pinned) {
    PinHooks hooks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      hooks = hooks_;
    }
    if (pinned && !hooks.pin)
      fail(KVS_STATUS_OUT_OF_MEMORY, "KV pages: pinned pages were asked for, but no backend that pins host memory is loaded");
    const size_t per = std::max<size_t>(1, kExtentTarget / bytes);
    const size_t len = (per * bytes + kHuge - 1) / kHuge * kHuge;
    // Everything that can throw first, so a failure leaks no mapping.
    auto e = std::make_unique<Extent>(Extent{nullptr, len, bytes, {}, uint32_t(len / bytes)});
    e->in_use.assign(e->capacity, false);
    // Over-map by 2 MiB and trim, so the extent starts on a huge-page boundary.
    void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t r = reinterpret_cast<uintptr_t>(raw), a = (r + kHuge - 1) / kHuge * kHuge;
    if (a > r) munmap(raw, a - r);
    munmap(reinterpret_cast<void*>(a + len), r + kHuge - a);  // a - r < 2 MiB: the tail is never empty
#ifdef MADV_HUGEPAGE
    if (huge_) madvise(reinterpret_cast<void*>(a), len, MADV_HUGEPAGE);  // advice: failure is harmless
#endif
    e->base = reinterpret_cast<std::byte*>(a);
    if (pinned) {
      if (!hooks.pin(e->base, len)) {
        munmap(e->base, len);
        return nullptr;
      }
      e->pinned = true;
      e->unpin = hooks.unpin;
    }
    return e.release();
  }

  // Called with mu_ held: a mapped extent joins the pool (unmapped again if that fails).
  void insert(Extent* e) {
    try {
      extents_.push_back(e);
    } catch (...) {
      unmap(e);
      throw;
    }
  }

  // Called without mu_, on an extent no longer in extents_.
  static void unmap(Extent* e) {
    if (e->pinned) e->unpin(e->base);
    munmap(e->base, e->len);
    delete e;
  }

  // Called with mu_ held.
  uint64_t free_pinned(size_t bytes) const {
    uint64_t f = 0;
    for (const Extent* x : extents_)
      if (x->pinned && x->page_bytes == bytes) f += x->capacity - x->used;
    return f;
  }
  uint64_t reserved(size_t bytes) const {
    const auto it = reserved_.find(bytes);
    return it == reserved_.end() ? 0 : it->second;
  }

  std::mutex mu_;
  std::vector<Extent*> extents_;
  uint64_t live_ = 0;
  bool huge_ = true;
  PinHooks hooks_;
  std::map<size_t, uint64_t> reserved_;  // pinned pages per page size promised to steps in flight
};

}  // namespace

PagePoolStats page_pool_stats() { return PagePool::get().stats(); }
void set_pin_hooks(const PinHooks& hooks) { PagePool::get().set_hooks(hooks); }
void reserve_pinned_pages(size_t bytes, uint32_t n) { PagePool::get().reserve_pinned(bytes, n); }
void unreserve_pinned_pages(size_t bytes, uint32_t n) { PagePool::get().unreserve_pinned(bytes, n); }
NoPinScope::NoPinScope() { ++t_no_pin; }
NoPinScope::~NoPinScope() { --t_no_pin; }

Page::Page(size_t bytes, bool pinned) : bytes_(bytes), pinned_(pinned) {
  if (bytes >= kPoolMinBytes || pinned) {
    Extent* e = nullptr;
    data_ = PagePool::get().allocate(bytes, pinned, &e);
    extent_ = e;
  } else {
    data_ = static_cast<std::byte*>(mi_malloc_aligned(bytes, 64));
  }
  if (!data_) throw std::bad_alloc();
}

Page::Page(const std::byte* external, size_t bytes, std::shared_ptr<const void> owner)
    : data_(const_cast<std::byte*>(external)), bytes_(bytes), owner_(std::move(owner)) {}

Page::~Page() {
  if (owner_) return;
  if (extent_) PagePool::get().release(data_, static_cast<Extent*>(extent_));
  else mi_free(data_);
}

KVLayer::KVLayer(DType dtype, int num_kv_heads, int head_dim)
    : dtype_(dtype), hkv_(num_kv_heads), d_(head_dim) {
  row_bytes_ = size_t(d_) * dtype_size(dtype_);
  block_bytes_ = row_bytes_ * size_t(kPageTokens);
  page_bytes_ = block_bytes_ * size_t(hkv_) * 2;
}

Page& KVLayer::writable_last_page() {
  auto& last = pages_.back();
  if (last.use_count() > 1 || !last->owned() || last->pinned() != pinned_) {
    auto copy = std::make_shared<Page>(page_bytes_, pinned_);
    std::memcpy(copy->data(), last->data(), page_bytes_);
    last = std::move(copy);
  }
  return *last;
}

void KVLayer::append(const float* k, const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = n_ + i;
    const int64_t slot = t % kPageTokens;
    if (slot == 0 && t / kPageTokens == num_pages()) {
      auto p = std::make_shared<Page>(page_bytes_, pinned_);
      // Zero-fill so whole pages can be written to files deterministically.
      std::memset(p->data(), 0, page_bytes_);
      pages_.push_back(std::move(p));
    }
    Page& pg = writable_last_page();
    for (int h = 0; h < hkv_; ++h) {
      std::byte* kd = pg.data() + size_t(h) * block_bytes_ + size_t(slot) * row_bytes_;
      std::byte* vd = pg.data() + (size_t(hkv_) + size_t(h)) * block_bytes_ + size_t(slot) * row_bytes_;
      convert_from_f32(k + (i * hkv_ + h) * d_, kd, dtype_, size_t(d_));
      convert_from_f32(v + (i * hkv_ + h) * d_, vd, dtype_, size_t(d_));
    }
  }
  n_ += n;
}

void KVLayer::truncate(int64_t n) {
  if (n < 0 || n > n_) invalid("truncate: bad length");
  if (n == n_) return;
  const int64_t old = n_;
  n_ = n;
  pages_.resize(size_t((n + kPageTokens - 1) / kPageTokens));
  const int64_t slot = n % kPageTokens;
  if (slot == 0) return;
  // A page shared with a fork (or mapped from a file) keeps its bytes: the other holder may still
  // read those rows, and this layer copies the page before it writes it anyway.
  const auto& last = pages_.back();
  if (last.use_count() > 1 || !last->owned()) return;
  const int64_t end = std::min<int64_t>(kPageTokens, old - (n - slot));  // slots the dropped tokens used
  Page& pg = *last;
  for (int h = 0; h < 2 * hkv_; ++h)
    std::memset(pg.data() + size_t(h) * block_bytes_ + size_t(slot) * row_bytes_, 0, size_t(end - slot) * row_bytes_);
}

KVLayer KVLayer::prefix(int64_t n) const {
  if (n < 0 || n > n_) invalid("prefix: bad length");
  KVLayer v(dtype_, hkv_, d_);
  v.pages_.assign(pages_.begin(), pages_.begin() + (n + kPageTokens - 1) / kPageTokens);
  v.n_ = n;
  return v;
}

void KVLayer::adopt(std::vector<std::shared_ptr<Page>> pages, int64_t n) {
  if (int64_t(pages.size()) != (n + kPageTokens - 1) / kPageTokens)
    fail(KVS_STATUS_FORMAT_INVALID, "KV pages do not match the token count");
  for (auto& p : pages)
    if (p->bytes() != page_bytes_) fail(KVS_STATUS_FORMAT_INVALID, "KV page size mismatch");
  pages_ = std::move(pages);
  n_ = n;
}

void KVLayer::set_pinned(bool on, bool now) {
  pinned_ = on;
  if (!now) return;
  for (auto& p : pages_)
    if (p->pinned() != on) {
      auto copy = std::make_shared<Page>(page_bytes_, on);
      std::memcpy(copy->data(), p->data(), page_bytes_);
      p = std::move(copy);
    }
}

uint64_t KVLayer::shared_bytes() const {
  uint64_t s = 0;
  for (auto& p : pages_)
    if (p.use_count() > 1 || !p->owned()) s += page_bytes_;
  return s;
}

}  // namespace kvs
