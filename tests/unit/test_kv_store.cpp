// The KV page pool (2 MiB-aligned extents with a huge-page hint) and KVLayer storage on top of it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <vector>

#include "core/kv_store.hpp"
#include "reference.hpp"

using namespace kvt;

TEST_CASE("page pool: pooled pages are distinct, writable, reused lowest first, and extents are unmapped when empty") {
  const kvs::PagePoolStats base = kvs::page_pool_stats();
  // An odd size (768 KiB does not divide 2 MiB), so slots straddle huge-page boundaries.
  const size_t bytes = size_t(768) << 10;
  const size_t per_extent = (size_t(32) << 20) / bytes;  // 42 pages in a 32 MiB extent
  std::vector<std::unique_ptr<kvs::Page>> pages;
  const size_t n = 3 * per_extent + 5;  // four extents
  for (size_t i = 0; i < n; ++i) {
    pages.push_back(std::make_unique<kvs::Page>(bytes));
    std::memset(pages.back()->data(), int(i & 0xff), bytes);
  }
  kvs::PagePoolStats s = kvs::page_pool_stats();
  CHECK(s.live_pages == base.live_pages + n);
  CHECK(s.extents == base.extents + 4);
  // No overlap: sorted by address, each page ends before the next begins; contents survive.
  std::vector<const std::byte*> addr;
  for (size_t i = 0; i < n; ++i) {
    addr.push_back(pages[i]->data());
    CHECK(pages[i]->bytes() == bytes);
    CHECK(pages[i]->owned());
    CHECK(std::to_integer<int>(pages[i]->data()[bytes - 1]) == int(i & 0xff));
    CHECK(reinterpret_cast<uintptr_t>(pages[i]->data()) % 64 == 0);
  }
  std::sort(addr.begin(), addr.end());
  for (size_t i = 1; i < n; ++i) CHECK(addr[i] >= addr[i - 1] + bytes);
  // The first page of an extent starts on a 2 MiB boundary.
  CHECK(reinterpret_cast<uintptr_t>(pages[0]->data()) % (size_t(2) << 20) == 0);

  // Free two pages of the first extent: the next allocations take the lower slot first.
  const std::byte* p3 = pages[3]->data();
  const std::byte* p7 = pages[7]->data();
  pages[7].reset();
  pages[3].reset();
  CHECK(kvs::page_pool_stats().live_pages == base.live_pages + n - 2);
  pages[3] = std::make_unique<kvs::Page>(bytes);
  CHECK(pages[3]->data() == p3);
  pages[7] = std::make_unique<kvs::Page>(bytes);
  CHECK(pages[7]->data() == p7);

  // Free everything: at most one empty extent of this size stays mapped.
  pages.clear();
  s = kvs::page_pool_stats();
  CHECK(s.live_pages == base.live_pages);
  CHECK(s.extents <= base.extents + 1);
  CHECK(s.mapped_bytes <= base.mapped_bytes + (size_t(32) << 20));
  // Small pages bypass the pool.
  kvs::Page small(4096);
  CHECK(kvs::page_pool_stats().live_pages == base.live_pages);
}

TEST_CASE("KV layer on pooled pages: rows read back, truncate frees pages, copy-on-write keeps a shared page intact") {
  Rng rng(7);
  const int hkv = 4, d = 64;  // page = 256 * 4 * 64 * 4 B * 2 = 512 KiB: pooled
  kvs::KVLayer a(kvs::DType::F32, hkv, d);
  REQUIRE(a.page_bytes() >= kvs::Page::kPoolMinBytes);
  const int64_t n = 3 * kvs::kPageTokens + 17;
  const std::vector<float> K = rng.normals(size_t(n) * hkv * d), V = rng.normals(size_t(n) * hkv * d);
  a.append(K.data(), V.data(), n);
  const uint64_t live = kvs::page_pool_stats().live_pages;
  for (int64_t t : {int64_t(0), int64_t(255), int64_t(256), n - 1})
    for (int h = 0; h < hkv; ++h) {
      CHECK(std::memcmp(a.k_row(h, t), &K[(size_t(t) * hkv + h) * d], d * 4) == 0);
      CHECK(std::memcmp(a.v_row(h, t), &V[(size_t(t) * hkv + h) * d], d * 4) == 0);
    }
  // A second layer sharing the pages; appending to it copies the last page only.
  kvs::KVLayer b(kvs::DType::F32, hkv, d);
  b.adopt(a.pages(), n);
  const std::vector<float> k1 = rng.normals(size_t(hkv) * d), v1 = rng.normals(size_t(hkv) * d);
  b.append(k1.data(), v1.data(), 1);
  CHECK(kvs::page_pool_stats().live_pages == live + 1);
  CHECK(std::memcmp(b.k_row(1, n), &k1[size_t(d)], d * 4) == 0);
  CHECK(a.size() == n);
  CHECK(std::memcmp(a.k_row(1, n - 1), &K[(size_t(n - 1) * hkv + 1) * d], d * 4) == 0);
  // Truncating both layers below two pages returns the pages nobody holds any more.
  a.truncate(kvs::kPageTokens + 1);
  b.truncate(kvs::kPageTokens + 1);
  CHECK(kvs::page_pool_stats().live_pages == live - 2);
}
