#include "core/kv_store.hpp"

#include <mimalloc.h>

#include <cstring>
#include <new>

#include "core/error.hpp"

namespace kvs {

Page::Page(size_t bytes) : bytes_(bytes) {
  data_ = static_cast<std::byte*>(mi_malloc_aligned(bytes, 64));
  if (!data_) throw std::bad_alloc();
}

Page::Page(const std::byte* external, size_t bytes, std::shared_ptr<const void> owner)
    : data_(const_cast<std::byte*>(external)), bytes_(bytes), owner_(std::move(owner)) {}

Page::~Page() {
  if (!owner_) mi_free(data_);
}

KVLayer::KVLayer(DType dtype, int num_kv_heads, int head_dim)
    : dtype_(dtype), hkv_(num_kv_heads), d_(head_dim) {
  row_bytes_ = size_t(d_) * dtype_size(dtype_);
  block_bytes_ = row_bytes_ * size_t(kPageTokens);
  page_bytes_ = block_bytes_ * size_t(hkv_) * 2;
}

Page& KVLayer::writable_last_page() {
  auto& last = pages_.back();
  if (last.use_count() > 1 || !last->owned()) {
    auto copy = std::make_shared<Page>(page_bytes_);
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
      auto p = std::make_shared<Page>(page_bytes_);
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
  n_ = n;
  pages_.resize(size_t((n + kPageTokens - 1) / kPageTokens));
}

void KVLayer::adopt(std::vector<std::shared_ptr<Page>> pages, int64_t n) {
  if (int64_t(pages.size()) != (n + kPageTokens - 1) / kPageTokens)
    fail(KVS_STATUS_FORMAT_INVALID, "KV pages do not match the token count");
  for (auto& p : pages)
    if (p->bytes() != page_bytes_) fail(KVS_STATUS_FORMAT_INVALID, "KV page size mismatch");
  pages_ = std::move(pages);
  n_ = n;
}

uint64_t KVLayer::shared_bytes() const {
  uint64_t s = 0;
  for (auto& p : pages_)
    if (p.use_count() > 1 || !p->owned()) s += page_bytes_;
  return s;
}

}  // namespace kvs
