// SPDX-License-Identifier: Apache-2.0
// The KV page pool (2 MiB-aligned extents with a huge-page hint) and KVLayer storage on top of it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
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

  // Free two pages of the first extent, the lower first: the next allocations still take the lower
  // slot first (a last-in-first-out free list would hand back p7).
  const std::byte* p3 = pages[3]->data();
  const std::byte* p7 = pages[7]->data();
  pages[3].reset();
  pages[7].reset();
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

TEST_CASE("page pool: a 2 MiB range no page in use overlaps goes back to the OS (reads as zeros), one still in use is kept") {
  // 1280 KiB pages: slot 0 = [0, 1.25 MiB), slot 1 = [1.25, 2.5 MiB), slot 2 = [2.5, 3.75 MiB). The
  // first huge page [0, 2 MiB) overlaps slots 0 and 1; the second [2, 4 MiB) slots 1 and 2.
  const size_t bytes = size_t(1280) << 10;
  std::vector<std::unique_ptr<kvs::Page>> p;
  for (int i = 0; i < 3; ++i) {
    p.push_back(std::make_unique<kvs::Page>(bytes));
    std::memset(p.back()->data(), 0xAB, bytes);
  }
  REQUIRE(p[1]->data() == p[0]->data() + bytes);
  REQUIRE(p[2]->data() == p[0]->data() + 2 * bytes);
  const std::byte* base = p[0]->data();
  p[0].reset();
  p[1].reset();  // now [0, 2 MiB) is free: returned; [2, 4 MiB) still holds slot 2
  auto a = std::make_unique<kvs::Page>(bytes);
  REQUIRE(a->data() == base);
  CHECK(std::all_of(a->data(), a->data() + bytes, [](std::byte b) { return b == std::byte{0}; }));
  auto b = std::make_unique<kvs::Page>(bytes);
  REQUIRE(b->data() == base + bytes);
  const size_t in_first = (size_t(2) << 20) - bytes;  // the part of slot 1 below 2 MiB
  CHECK(std::all_of(b->data(), b->data() + in_first, [](std::byte x) { return x == std::byte{0}; }));
  CHECK(std::all_of(b->data() + in_first, b->data() + bytes, [](std::byte x) { return x == std::byte{0xAB}; }));
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
  // a's page has nothing in b's new slot (its pages are zero-filled beyond the last token).
  const std::vector<float> zeros(size_t(d), 0.f);
  CHECK(std::memcmp(a.k_row(1, n), zeros.data(), d * 4) == 0);
  // Truncating both layers below two pages returns the pages nobody holds any more.
  a.truncate(kvs::kPageTokens + 1);
  b.truncate(kvs::kPageTokens + 1);
  CHECK(kvs::page_pool_stats().live_pages == live - 2);
}

// Pinned pages (the hybrid placement's KV, read in place by a GPU): extents of their own, locked by
// the pin hook when mapped and released by the unpin hook before they are unmapped. Fake hooks
// here (the cuda backend installs cudaHostRegister/cudaHostUnregister): they record what is pinned.
namespace {
std::set<std::pair<uintptr_t, size_t>> g_pinned;
bool g_pin_fails = false;
bool fake_pin(void* p, size_t n) {
  if (g_pin_fails) return false;
  g_pinned.insert({reinterpret_cast<uintptr_t>(p), n});
  return true;
}
void fake_unpin(void* p) {
  for (auto it = g_pinned.begin(); it != g_pinned.end(); ++it)
    if (it->first == reinterpret_cast<uintptr_t>(p)) {
      g_pinned.erase(it);
      return;
    }
  FAIL("unpin of memory that was not pinned");
}
bool in_pinned(const std::byte* p, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const auto& [b, n] : g_pinned)
    if (a >= b && a + bytes <= b + n) return true;
  return false;
}
}  // namespace

TEST_CASE("page pool: pinned pages come from pinned extents, reserved ahead, unpinned before unmapping") {
  const size_t bytes = size_t(8) << 20;  // 4 pages per 32 MiB extent
  // No backend installed the hooks yet: a pinned page is refused with a reason.
  try {
    kvs::Page p(bytes, true);
    FAIL("a pinned page without pin hooks");
  } catch (const kvs::Error& e) {
    CHECK(e.code() == KVS_STATUS_OUT_OF_MEMORY);
    CHECK(std::string(e.what()).find("pins host memory") != std::string::npos);
  }
  kvs::set_pin_hooks(kvs::PinHooks{&fake_pin, &fake_unpin});
  const kvs::PagePoolStats base = kvs::page_pool_stats();
  {
    kvs::Page a(bytes, true), b(bytes, false);
    CHECK(a.pinned());
    CHECK(!b.pinned());
    CHECK(in_pinned(a.data(), bytes));
    CHECK(!in_pinned(b.data(), bytes));  // an ordinary page never lands in a pinned extent
    CHECK(kvs::page_pool_stats().pinned_bytes >= base.pinned_bytes + bytes);
    // Small pinned pages come from the pool too (pinned), not from the allocator.
    kvs::Page s(4096, true);
    CHECK(s.pinned());
    CHECK(in_pinned(s.data(), 4096));
  }
  // Reserved pages can be taken where pinning is not allowed (a CUDA host function); one more fails.
  kvs::reserve_pinned_pages(bytes, 3);
  {
    std::vector<std::unique_ptr<kvs::Page>> taken;
    kvs::NoPinScope no_pin;
    size_t free_slots = 0;
    try {
      for (;; ++free_slots) taken.push_back(std::make_unique<kvs::Page>(bytes, true));
    } catch (const kvs::Error& e) {
      CHECK(e.code() == KVS_STATUS_OUT_OF_MEMORY);
      CHECK(std::string(e.what()).find("reserved") != std::string::npos);
    }
    CHECK(free_slots >= 3);
    for (auto& p : taken) CHECK(in_pinned(p->data(), bytes));
  }
  kvs::unreserve_pinned_pages(bytes, 3);
  // Reservations add up: pages allocated outside a host function leave the reserved ones free.
  kvs::reserve_pinned_pages(bytes, 2);
  kvs::reserve_pinned_pages(bytes, 2);
  {
    std::vector<std::unique_ptr<kvs::Page>> outside;
    for (int i = 0; i < 6; ++i) outside.push_back(std::make_unique<kvs::Page>(bytes, true));  // maps more
    kvs::NoPinScope no_pin;
    std::vector<std::unique_ptr<kvs::Page>> inside;
    for (int i = 0; i < 4; ++i) inside.push_back(std::make_unique<kvs::Page>(bytes, true));  // all four there
    CHECK(inside.size() == 4);
  }
  kvs::unreserve_pinned_pages(bytes, 4);
  // A pin that fails: the page is not made (the mapping is dropped), nothing stays pinned for it.
  {
    const size_t pinned_before = g_pinned.size();
    std::vector<std::unique_ptr<kvs::Page>> fill;
    for (int i = 0; i < 8; ++i) fill.push_back(std::make_unique<kvs::Page>(bytes, true));  // use the free slots
    g_pin_fails = true;
    bool threw = false;
    std::vector<std::unique_ptr<kvs::Page>> more;
    try {
      for (int i = 0; i < 8; ++i) more.push_back(std::make_unique<kvs::Page>(bytes, true));
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    g_pin_fails = false;
    CHECK(threw);
    CHECK(g_pinned.size() >= pinned_before);
  }
  // Everything freed: at most one empty pinned extent per page size (8 MiB, 4 KiB) stays pinned,
  // and the pool's figure is what the hooks pinned.
  CHECK(g_pinned.size() <= 2);
  size_t pinned = 0;
  for (const auto& [b, n] : g_pinned) pinned += n;
  CHECK(kvs::page_pool_stats().pinned_bytes == pinned);

  // A KV layer switched to pinned pages copies the pages it holds (contents kept) and appends into
  // pinned pages; its copies on write stay pinned.
  kvs::KVLayer lay(kvs::DType::BF16, 8, 128);  // 1 MiB pages
  const int64_t n = 300;                       // two pages
  std::vector<float> k(size_t(n) * 8 * 128), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = float(i % 97) * 0.25f;
    v[i] = -float(i % 89) * 0.5f;
  }
  lay.append(k.data(), v.data(), n);
  CHECK(!lay.pages()[0]->pinned());
  std::vector<std::byte> before(lay.page_bytes());
  std::memcpy(before.data(), lay.pages()[1]->data(), before.size());
  lay.set_pinned(true, true);
  for (const auto& p : lay.pages()) CHECK(p->pinned());
  CHECK(std::memcmp(before.data(), lay.pages()[1]->data(), before.size()) == 0);
  kvs::KVLayer fork = lay;  // shares the pages; the next append copies the last one, pinned
  fork.append(k.data(), v.data(), 1);
  CHECK(fork.pages().back()->pinned());
  CHECK(fork.pages().back() != lay.pages().back());
  lay.append(k.data(), v.data(), kvs::kPageTokens);  // a third page
  CHECK(lay.pages().size() == 3);
  CHECK(lay.pages()[2]->pinned());
}
