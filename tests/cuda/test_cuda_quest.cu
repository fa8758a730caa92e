// SPDX-License-Identifier: Apache-2.0
// Tests of src/backends/cuda/quest.cu (Quest bounds and page selection) and selection.cu
// (StreamingLLM's window) against host references written from the CPU methods' rules
// (src/methods/quest/quest.cpp, src/methods/streaming/streaming.cpp):
//  - bounds: the element-wise max/min of the stored keys, exact; single-token appends after a
//    partial prefill give the same bytes as one rebuild; pages outside the range stay untouched.
//  - selection: page bounds scored in float64 (summed over the group or per query head), the
//    top want-1 pages of 0..pages-2 (ties: lower page) plus the last page, tokens ascending. The
//    device's page set must equal the host's, except for pages whose host scores tie with the
//    boundary within 1e-5 relative (counted and printed as "ties").
//  - window: sinks + recent window, the same list for every head.
// Keys are random normals scaled per 16-token block (page bounds then differ clearly), pages of the
// paged KV cache sit in shuffled order in one pool. Outputs are poisoned before every call and
// every element is checked.
// Entry points (the binary's main is elsewhere): run_quest_tests(small) returns the failures,
// run_quest_passed() the passes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/quest.cuh"
#include "backends/cuda/selection.cuh"
#include "late_copy.cuh"
#include "kernel_test_util.cuh"

namespace {

using kvs::cuda::Scalar;

int g_pass = 0, g_fail = 0;
bool g_small = false;

void report(bool ok, const std::string& name, const std::string& detail) {
  if (ok) ++g_pass;
  else ++g_fail;
  std::printf("%s %s %s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.c_str());
  std::fflush(stdout);
}


// A kvs Status that is not OK fails the named test.
bool status_ok(const kvs::cuda::Status& s, const std::string& name) {
  if (s.ok()) return true;
  report(false, name, std::string("status ") + std::to_string(s.code) + ": " + s.message);
  return false;
}




std::mt19937_64 g_rng(20261113);
uint64_t g_x = 0x9e3779b97f4a7c15ull;  // xorshift64* for the bulk values (fast)
float u01() {
  g_x ^= g_x >> 12;
  g_x ^= g_x << 25;
  g_x ^= g_x >> 27;
  return float((g_x * 0x2545f4914f6cdd1dull) >> 40) * (1.f / 16777216.f);
}
// Roughly normal (Irwin-Hall of 4, unit variance): cheap, continuous, never exactly zero-biased.
float nrand() { return (u01() + u01() + u01() + u01() - 2.f) * 1.7320508f; }
float urand(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(g_rng); }

// B sequences in the paged layout of kv_layout.cuh (K then V per page), pages of P tokens in
// shuffled order in one pool; table entries past a sequence's pages are null. keys[b] holds the
// stored keys as floats, [Hkv][n_b][d].
struct Cache {
  Scalar t = Scalar::BF16;
  int B = 0, Hkv = 0, D = 0, P = 0, max_pages = 0;
  std::vector<int> lens;
  std::vector<std::vector<float>> keys;
  DevBuf pool, table;
  kvs::cuda::PagedKv paged() const {
    kvs::cuda::PagedKv kv;
    kv.pages = table.as<const void* const>();
    kv.max_pages = max_pages;
    kv.page_tokens = P;
    kv.page_shift = 0;
    while ((1 << kv.page_shift) < P) ++kv.page_shift;
    return kv;
  }
};

void build_cache(Cache& c, Scalar t, int Hkv, int D, int P, const std::vector<int>& lens) {
  c.t = t;
  c.B = int(lens.size());
  c.Hkv = Hkv;
  c.D = D;
  c.P = P;
  c.lens = lens;
  std::vector<int> npages(c.B);
  int total = 0;
  for (int b = 0; b < c.B; ++b) {
    npages[b] = std::max(1, (lens[b] + P - 1) / P);
    c.max_pages = std::max(c.max_pages, npages[b] + 1);  // one spare (null) entry per sequence
    total += npages[b];
  }
  const size_t page_elems = size_t(2) * Hkv * P * D;
  std::vector<int> slot(total);
  std::iota(slot.begin(), slot.end(), 0);
  std::shuffle(slot.begin(), slot.end(), g_rng);
  std::vector<uint16_t> pool(page_elems * total);
  for (auto& x : pool) x = enc(nrand(), t);  // V, and K past each length: random too
  c.pool.alloc(pool.size() * 2);
  std::vector<const void*> table(size_t(c.B) * c.max_pages, nullptr);
  c.keys.assign(c.B, {});
  int next = 0;
  for (int b = 0; b < c.B; ++b) {
    const int n = lens[b];
    c.keys[b].assign(size_t(Hkv) * n * D, 0.f);
    for (int i = 0; i < npages[b]; ++i) {
      const int s = slot[next++];
      table[size_t(b) * c.max_pages + i] = c.pool.as<char>() + size_t(s) * page_elems * 2;
    }
    for (int h = 0; h < Hkv; ++h) {
      float amp = 1.f, bias = 0.f;
      for (int tok = 0; tok < n; ++tok) {
        if (tok % 16 == 0) amp = urand(0.2f, 2.f), bias = urand(-0.3f, 0.3f);
        const int page = tok / P;
        const int s = slot[std::accumulate(npages.begin(), npages.begin() + b, 0) + page];
        uint16_t* row = pool.data() + size_t(s) * page_elems + (size_t(h) * P + tok % P) * D;
        for (int j = 0; j < D; ++j) {
          row[j] = enc(nrand() * amp + bias, t);
          c.keys[b][(size_t(h) * n + tok) * D + j] = dec(row[j], t);
        }
      }
    }
  }
  KVS_TEST_CK(cudaMemcpy(c.pool.p, pool.data(), pool.size() * 2, cudaMemcpyHostToDevice));
  upload(c.table, table);
}

// Host bounds of tokens [0, n) of sequence b: [pages][Hkv][2][D] floats.
std::vector<float> host_bounds(const Cache& c, int b, int n, int ps) {
  const int pages = (n + ps - 1) / ps, D = c.D;
  std::vector<float> out(size_t(pages) * c.Hkv * 2 * D);
  const int nb = c.lens[b];
  for (int p = 0; p < pages; ++p)
    for (int h = 0; h < c.Hkv; ++h) {
      float* mm = out.data() + (size_t(p) * c.Hkv + h) * 2 * D;
      for (int j = 0; j < D; ++j) mm[j] = -INFINITY, mm[D + j] = INFINITY;
      for (int tok = p * ps; tok < std::min(n, (p + 1) * ps); ++tok)
        for (int j = 0; j < D; ++j) {
          const float x = c.keys[b][(size_t(h) * nb + tok) * D + j];
          mm[j] = std::max(mm[j], x);
          mm[D + j] = std::min(mm[D + j], x);
        }
    }
  return out;
}

// Compares device bounds (16-bit) of `pages` pages with the host's; also checks that page `pages`
// (the spare) still holds the 0xFF poison.
bool same_bounds(const std::vector<uint16_t>& dev, const std::vector<float>& ref, int pages, int per_page,
                 Scalar t, std::string& why) {
  for (size_t i = 0; i < size_t(pages) * per_page; ++i)
    if (!(dec(dev[i], t) == ref[i])) {
      why = "element " + std::to_string(i) + ": " + std::to_string(dec(dev[i], t)) + " vs " + std::to_string(ref[i]);
      return false;
    }
  for (size_t i = size_t(pages) * per_page; i < size_t(pages + 1) * per_page; ++i)
    if (dev[i] != 0xFFFF) {
      why = "spare page written at " + std::to_string(i);
      return false;
    }
  return true;
}

void run_bounds(Scalar t, int D, int Hkv, int P, int ps, const std::vector<int>& lens) {
  Cache c;
  build_cache(c, t, Hkv, D, P, lens);
  kvs::cuda::AttnShape shape{c.B, Hkv, Hkv, D, 1.f};
  const int per_page = Hkv * 2 * D;
  std::string name = std::string("quest_bounds ") + sname(t) + " d=" + std::to_string(D) + " Hkv=" +
                     std::to_string(Hkv) + " P=" + std::to_string(P) + " ps=" + std::to_string(ps);
  for (int b = 0; b < c.B; ++b) {
    const int n = lens[b], pages = (n + ps - 1) / ps;
    const size_t bytes = size_t(pages + 1) * per_page * 2;
    DevBuf full(bytes), inc(bytes);
    KVS_TEST_CK(cudaMemset(full.p, 0xFF, bytes));
    KVS_TEST_CK(cudaMemset(inc.p, 0xFF, bytes));
    std::string detail = "b=" + std::to_string(b) + " n=" + std::to_string(n), why;
    if (!status_ok(kvs::cuda::quest_update_bounds(shape, c.paged(), t, b, 0, n, ps, full.p, nullptr), name)) return;
    KVS_TEST_CK(cudaGetLastError());
    KVS_TEST_CK(cudaDeviceSynchronize());
    auto dfull = download<uint16_t>(full.p, size_t(pages + 1) * per_page);
    bool ok = same_bounds(dfull, host_bounds(c, b, n, ps), pages, per_page, t, why);
    report(ok, name + " rebuild", detail + " " + why);
    // Partial prefill (not a page multiple), then single-token appends.
    const int n0 = std::max(1, std::min(n, n / 3 + 5));
    const int pages0 = (n0 + ps - 1) / ps;
    if (!status_ok(kvs::cuda::quest_update_bounds(shape, c.paged(), t, b, 0, n0, ps, inc.p, nullptr), name)) return;
    KVS_TEST_CK(cudaDeviceSynchronize());
    auto dinc0 = download<uint16_t>(inc.p, size_t(pages0 + 1) * per_page);
    ok = same_bounds(dinc0, host_bounds(c, b, n0, ps), pages0, per_page, t, why);
    report(ok, name + " prefill", detail + " n0=" + std::to_string(n0) + " " + why);
    for (int tok = n0; tok < n; ++tok)
      if (!status_ok(kvs::cuda::quest_update_bounds(shape, c.paged(), t, b, tok, tok + 1, ps, inc.p, nullptr), name))
        return;
    KVS_TEST_CK(cudaGetLastError());
    KVS_TEST_CK(cudaDeviceSynchronize());
    auto dinc = download<uint16_t>(inc.p, size_t(pages + 1) * per_page);
    ok = std::memcmp(dinc.data(), dfull.data(), dinc.size() * 2) == 0;
    report(ok, name + " appends", detail + " appends=" + std::to_string(n - n0));
  }
}

// want of the CPU method (quest.cpp: clamp(k / page, 1, pages)).
int host_want(int n, int keys, int ps) {
  const int pages = (n + ps - 1) / ps;
  if (pages == 0) return 0;
  return std::clamp(keys / ps, 1, pages);
}

struct SelCase {
  Scalar t = Scalar::BF16, qt = Scalar::F32;
  int D = 128, G = 4, Hkv = 2, P = 16, ps = 16;
  bool per_query = false;
  std::vector<int> lens, budgets;
  int want_extra = 0;  // max_want above the largest want
  int len_extra = 0;   // max_length above the longest sequence
  bool pdl = false;    // pdl = true right after a kernel that writes sequence 0's bounds late
  bool timing = false; // afterwards, print the time of one call per score tiling (informational)
};

// Checks quest_select's lists (idx, cnt: [B * H] rows of max_sel) against float64 page scores:
// counts, the layout of every row, and the page sets up to ties at the boundary score.
bool check_select(const SelCase& sc, const Cache& c, const std::vector<float>& q, int B, int V, int max_sel,
                  const std::vector<int32_t>& idx, const std::vector<int32_t>& cnt, const std::string& name,
                  int max_want) {
  const int Hkv = sc.Hkv, G = sc.G, Hq = Hkv * G, D = sc.D, ps = sc.ps;
  int ties = 0, bad = 0;
  std::string why;
  for (int b = 0; b < B && !bad; ++b) {
    const int n = sc.lens[b], pages = (n + ps - 1) / ps, want = host_want(n, sc.budgets[b], ps);
    const std::vector<float> hb = n > 0 ? host_bounds(c, b, n, ps) : std::vector<float>();
    for (int h = 0; h < Hkv && !bad; ++h)
      for (int v = 0; v < V && !bad; ++v) {
        const int r = (b * Hkv + h) * V + v;
        // Host scores (float64) of pages 0..pages-2.
        std::vector<double> s(std::max(pages - 1, 0), 0.0);
        for (int p = 0; p + 1 < pages; ++p) {
          const float* mm = hb.data() + (size_t(p) * Hkv + h) * 2 * D;
          for (int g = sc.per_query ? v : 0; g < (sc.per_query ? v + 1 : G); ++g) {
            const float* qv = q.data() + (size_t(b) * Hq + h * G + g) * D;
            for (int i = 0; i < D; ++i) s[p] += std::max(double(qv[i]) * mm[i], double(qv[i]) * mm[D + i]);
          }
        }
        std::vector<int> order(s.size());
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int bb) { return s[a] > s[bb]; });
        const int k = std::max(want - 1, 0);
        std::vector<char> host_pick(std::max(pages, 1), 0), dev_pick(std::max(pages, 1), 0);
        for (int i = 0; i < k; ++i) host_pick[order[i]] = 1;
        // Device list: count, every slot, full pages then the last page's tokens, ascending.
        const int32_t* row = idx.data() + size_t(r) * max_sel;
        const int expect_cnt = n > 0 ? k * ps + (n - (pages - 1) * ps) : 0;
        if (cnt[r] != expect_cnt) {
          why = "row " + std::to_string(r) + " count " + std::to_string(cnt[r]) + " vs " + std::to_string(expect_cnt);
          ++bad;
          break;
        }
        for (int i = 0; i < max_sel && !bad; ++i) {
          const int pi = i / ps, j = i % ps;
          if (i >= expect_cnt) {
            if (row[i] != -1) why = "row " + std::to_string(r) + " slot " + std::to_string(i) + " not -1", ++bad;
            continue;
          }
          if (pi == k) {  // the last page
            if (row[i] != (pages - 1) * ps + j) why = "row " + std::to_string(r) + " last page slot " + std::to_string(i), ++bad;
            continue;
          }
          const int first = row[pi * ps];
          if (j == 0) {
            if (first < 0 || first % ps != 0 || first / ps >= pages - 1 || (pi > 0 && first <= row[(pi - 1) * ps]))
              why = "row " + std::to_string(r) + " bad page start " + std::to_string(first), ++bad;
            else dev_pick[first / ps] = 1;
          } else if (row[i] != first + j) {
            why = "row " + std::to_string(r) + " slot " + std::to_string(i) + " not contiguous", ++bad;
          }
        }
        if (bad) break;
        // Page sets: equal, or differing only on pages that tie with the boundary score.
        if (k > 0 && host_pick != dev_pick) {
          const double kth = s[order[k - 1]], tol = 1e-5 * std::max(std::fabs(kth), 1e-30);
          for (int p = 0; p + 1 < pages; ++p)
            if (host_pick[p] != dev_pick[p] && std::fabs(s[p] - kth) > tol) {
              why = "row " + std::to_string(r) + " page " + std::to_string(p) + (dev_pick[p] ? " picked" : " missed") +
                    " score " + std::to_string(s[p]) + " boundary " + std::to_string(kth);
              ++bad;
              break;
            }
          if (!bad) ++ties;
        }
      }
  }
  report(bad == 0, name, "max_want=" + std::to_string(max_want) + " rows_with_ties=" + std::to_string(ties) + " " + why);
  return bad == 0;
}

void run_select(const SelCase& sc) {
  Cache c;
  build_cache(c, sc.t, sc.Hkv, sc.D, sc.P, sc.lens);
  const int B = c.B, Hkv = sc.Hkv, G = sc.G, Hq = Hkv * G, D = sc.D, ps = sc.ps;
  const int V = sc.per_query ? G : 1, H = Hkv * V;
  std::string name = std::string("quest_select ") + sname(sc.t) + "/q" + sname(sc.qt) + " d=" + std::to_string(D) +
                     " G=" + std::to_string(G) + " Hkv=" + std::to_string(Hkv) + " P=" + std::to_string(sc.P) +
                     " ps=" + std::to_string(ps) + (sc.per_query ? " per_query_head" : " sum") + " lens=";
  for (int b = 0; b < B; ++b) name += (b ? "," : "") + std::to_string(sc.lens[b]) + "/" + std::to_string(sc.budgets[b]);
  kvs::cuda::AttnShape shape{B, Hq, Hkv, D, 1.f};
  // Bounds per sequence, built on the device (checked by run_bounds).
  std::vector<DevBuf> bounds(B);
  std::vector<const void*> bptr(B);
  for (int b = 0; b < B; ++b) {
    const int pages = std::max(1, (sc.lens[b] + ps - 1) / ps);
    bounds[b].alloc(size_t(pages) * Hkv * 2 * D * 2);
    KVS_TEST_CK(cudaMemset(bounds[b].p, 0xFF, bounds[b].n));
    if (sc.lens[b] > 0 &&
        !status_ok(kvs::cuda::quest_update_bounds(shape, c.paged(), sc.t, b, 0, sc.lens[b], ps, bounds[b].p, nullptr), name))
      return;
    bptr[b] = bounds[b].p;
  }
  // Query, as the device sees it.
  std::vector<float> q(size_t(B) * Hq * D);
  std::vector<uint16_t> q16(q.size());
  for (size_t i = 0; i < q.size(); ++i) {
    const float x = nrand();
    q16[i] = enc(x, sc.t);
    q[i] = sc.qt == Scalar::F32 ? x : dec(q16[i], sc.t);
  }
  DevBuf dq, dbp, dlen, dbud;
  if (sc.qt == Scalar::F32) upload(dq, q);
  else upload(dq, q16);
  upload(dbp, bptr);
  upload(dlen, sc.lens);
  upload(dbud, sc.budgets);
  int max_len = 1, max_want = 1;
  for (int b = 0; b < B; ++b) {
    max_len = std::max(max_len, sc.lens[b]);
    max_want = std::max(max_want, host_want(sc.lens[b], sc.budgets[b], ps));
  }
  max_len += sc.len_extra;
  max_want += sc.want_extra;
  const int max_sel = max_want * ps;
  DevBuf oidx(size_t(B) * H * max_sel * 4), ocnt(size_t(B) * H * 4);
  DevBuf ws(kvs::cuda::quest_select_workspace_bytes(shape, max_len, ps, max_want));
  kvs::cuda::Query qq{dq.p, sc.qt};
  DevBuf staged;
  if (sc.pdl) {
    name += " pdl";
    staged.alloc(bounds[0].n);
    KVS_TEST_CK(cudaMemcpy(staged.p, bounds[0].p, bounds[0].n, cudaMemcpyDeviceToDevice));
  }
  // The summed mode runs fused (automatic cluster size, and forced to 1 and 16 CTAs) and unfused
  // (score kernel + topk_rows): each against float64, and every fused run bit for bit against the
  // unfused one.
  std::vector<int32_t> ref_idx, ref_cnt;
  const std::vector<int> modes = sc.per_query ? std::vector<int>{-1} : std::vector<int>{0, -1, 1, 16};
  for (int mode : modes) {
    kvs::cuda::detail::set_quest_cluster(mode);
    KVS_TEST_CK(cudaMemset(oidx.p, 0x7B, oidx.n));
    KVS_TEST_CK(cudaMemset(ocnt.p, 0x7B, ocnt.n));
    KVS_TEST_CK(cudaMemset(ws.p, 0x7B, ws.n));
    KVS_TEST_CK(cudaDeviceSynchronize());
    cudaStream_t st = nullptr;
    if (sc.pdl) {
      KVS_TEST_CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      LateCopy lc;
      lc.dst[0] = bounds[0].p;
      lc.src[0] = staged.p;
      lc.bytes[0] = bounds[0].n;
      KVS_TEST_CK(enqueue_late_copy(lc, st));
    }
    const auto rs = kvs::cuda::quest_select(shape, qq, sc.t, dbp.as<const void* const>(), dlen.as<int32_t>(),
                                            dbud.as<int32_t>(), max_len, ps, max_want, sc.per_query,
                                            oidx.as<int32_t>(), ocnt.as<int32_t>(), max_sel,
                                            kvs::cuda::Workspace{ws.p, ws.n}, st, sc.pdl);
    const int used = kvs::cuda::detail::quest_last_cluster();
    kvs::cuda::detail::set_quest_cluster(-1);
    if (st) {
      KVS_TEST_CK(cudaStreamSynchronize(st));
      KVS_TEST_CK(cudaStreamDestroy(st));
    }
    const std::string mname = name + (sc.per_query ? "" : mode == 0 ? " unfused" : " cluster=" + std::to_string(used) +
                                                              (mode < 0 ? " (auto)" : ""));
    if (!status_ok(rs, mname)) return;
    KVS_TEST_CK(cudaGetLastError());
    KVS_TEST_CK(cudaDeviceSynchronize());
    const auto idx = download<int32_t>(oidx.p, size_t(B) * H * max_sel);
    const auto cnt = download<int32_t>(ocnt.p, size_t(B) * H);
    if (!sc.per_query && mode != 0) {
      // Forced: fused wherever a row has pages to score (the rows always fit). Automatic: fused for
      // rows of more than 16384 candidate pages. Either way the same lists as the unfused kernels.
      const int pages = (max_len + ps - 1) / ps, scored = std::min(max_want, pages) - 1;
      const bool fused = scored > 0 && (mode > 0 || pages - 1 > 16384);
      const bool same = (used > 0) == fused && idx == ref_idx && cnt == ref_cnt;
      report(same, mname + " == unfused", "fused kernel used: " + std::to_string(used > 0));
    }
    if (!check_select(sc, c, q, B, V, max_sel, idx, cnt, mname, max_want)) return;
    if (mode == 0) ref_idx = idx, ref_cnt = cnt;
  }
  if (!sc.timing) return;
  // Informational: microseconds per quest_select (score pass, page top-k, expansion), 200 calls
  // back to back, per score tiling (tiles of 8 pages per warp; 0 = automatic).
  // The fused kernel (automatic cluster size), then the unfused kernels per score tiling.
  std::string line = "quest_select timing " + name + ":";
  for (int tiles : {-16, -8, -4, -2, -1, 0, 2, 4, 8}) {
    kvs::cuda::detail::set_quest_cluster(tiles < 0 ? (tiles == -1 ? -1 : -tiles) : 0);
    kvs::cuda::detail::set_quest_tiles_per_warp(std::max(tiles, 0));
    auto call = [&] {
      return kvs::cuda::quest_select(shape, qq, sc.t, dbp.as<const void* const>(), dlen.as<int32_t>(), dbud.as<int32_t>(),
                                     max_len, ps, max_want, sc.per_query, oidx.as<int32_t>(), ocnt.as<int32_t>(),
                                     max_sel, kvs::cuda::Workspace{ws.p, ws.n}, nullptr, false);
    };
    if (!call().ok()) continue;
    cudaEvent_t e0, e1;
    KVS_TEST_CK(cudaEventCreate(&e0));
    KVS_TEST_CK(cudaEventCreate(&e1));
    KVS_TEST_CK(cudaEventRecord(e0, nullptr));
    for (int i = 0; i < 200; ++i) (void)call();
    KVS_TEST_CK(cudaEventRecord(e1, nullptr));
    KVS_TEST_CK(cudaEventSynchronize(e1));
    float ms = 0.f;
    KVS_TEST_CK(cudaEventElapsedTime(&ms, e0, e1));
    KVS_TEST_CK(cudaEventDestroy(e0));
    KVS_TEST_CK(cudaEventDestroy(e1));
    char buf[64];
    if (tiles < 0)
      std::snprintf(buf, sizeof buf, " fused (cluster %d) %.1f us;", kvs::cuda::detail::quest_last_cluster(),
                    ms * 1e3f / 200.f);
    else
      std::snprintf(buf, sizeof buf, " tiles=%d %.1f us", tiles, ms * 1e3f / 200.f);
    line += buf;
  }
  kvs::cuda::detail::set_quest_cluster(-1);
  kvs::cuda::detail::set_quest_tiles_per_warp(0);
  std::printf("%s\n", line.c_str());
}

void run_window(int B, int H, int sinks, int window, const std::vector<int>& lens, const std::vector<int>& budgets,
                int max_sel) {
  std::string name = "window_select B=" + std::to_string(B) + " H=" + std::to_string(H) + " sinks=" +
                     std::to_string(sinks) + " window=" + std::to_string(window);
  DevBuf dl, db, oidx(size_t(B) * H * max_sel * 4), ocnt(size_t(B) * H * 4);
  upload(dl, lens);
  upload(db, budgets);
  KVS_TEST_CK(cudaMemset(oidx.p, 0x7B, oidx.n));
  KVS_TEST_CK(cudaMemset(ocnt.p, 0x7B, ocnt.n));
  if (!status_ok(kvs::cuda::window_select(B, H, dl.as<int32_t>(), db.as<int32_t>(), sinks, window, oidx.as<int32_t>(),
                                          ocnt.as<int32_t>(), max_sel, nullptr),
                 name))
    return;
  KVS_TEST_CK(cudaGetLastError());
  KVS_TEST_CK(cudaDeviceSynchronize());
  const auto idx = download<int32_t>(oidx.p, size_t(B) * H * max_sel);
  const auto cnt = download<int32_t>(ocnt.p, size_t(B) * H);
  std::string why;
  for (int b = 0; b < B && why.empty(); ++b) {
    // streaming.cpp
    const int64_t n = lens[b];
    int64_t s = std::min<int64_t>(sinks, n), w = window;
    if (window == 0) {  // sinks capped at budget / 8 (at least 1 from 2 keys), window the rest
      s = std::min<int64_t>(s, budgets[b] >= 2 ? std::max(1, budgets[b] / 8) : 0);
      w = std::max<int64_t>(1, budgets[b] - s);
    }
    std::vector<int32_t> l;
    for (int64_t t = 0; t < s; ++t) l.push_back(int32_t(t));
    for (int64_t t = std::max(s, n - w); t < n; ++t) l.push_back(int32_t(t));
    if (int(l.size()) > max_sel) l.resize(size_t(max_sel));
    for (int h = 0; h < H && why.empty(); ++h) {
      const int r = b * H + h;
      if (cnt[r] != int(l.size())) why = "row " + std::to_string(r) + " count " + std::to_string(cnt[r]);
      for (int i = 0; i < max_sel && why.empty(); ++i) {
        const int32_t e = i < int(l.size()) ? l[size_t(i)] : -1;
        if (idx[size_t(r) * max_sel + i] != e) why = "row " + std::to_string(r) + " slot " + std::to_string(i);
      }
    }
  }
  report(why.empty(), name, why);
}

void run_errors() {
  kvs::cuda::AttnShape shape{1, 8, 2, 96, 1.f};
  kvs::cuda::PagedKv kv;
  const auto s1 = kvs::cuda::quest_update_bounds(shape, kv, Scalar::BF16, 0, 0, 1, 16, nullptr, nullptr);
  report(!s1.ok(), "quest_errors head_dim 96", s1.message);
  shape.head_dim = 128;
  kvs::cuda::Query q{reinterpret_cast<const void*>(16), Scalar::F32};
  const auto s2 = kvs::cuda::quest_select(shape, q, Scalar::BF16, reinterpret_cast<const void* const*>(16),
                                          reinterpret_cast<const int32_t*>(16), reinterpret_cast<const int32_t*>(16),
                                          1000, 16, 4, false, reinterpret_cast<int32_t*>(16),
                                          reinterpret_cast<int32_t*>(16), 63, kvs::cuda::Workspace{}, nullptr);
  report(!s2.ok(), "quest_errors max_selected < max_want * page_size", s2.message);
  const auto s3 = kvs::cuda::window_select(1, 1, nullptr, nullptr, 4, 0, nullptr, nullptr, 8, nullptr);
  report(!s3.ok(), "window_errors null", s3.message);
}

}  // namespace

int run_quest_passed() { return g_pass; }

int run_quest_tests(bool small) {
  g_small = small;
  const int before = g_fail;
  const Scalar BF = Scalar::BF16, F16 = Scalar::F16, F32 = Scalar::F32;
  run_errors();
  // Bounds: dtypes, dims, page sizes, KV pages of 16 and 256 (Quest pages of 64 straddle KV pages of 16).
  for (Scalar t : {BF, F16})
    for (int D : {64, 128, 256}) run_bounds(t, D, 2, D == 128 ? 256 : 16, 16, {small ? 300 : 1500, 37});
  run_bounds(BF, 128, 3, 16, 64, {small ? 333 : 2100, 64});
  run_bounds(F16, 64, 2, 256, 64, {small ? 700 : 3000, 5});
  run_bounds(BF, 128, 1, 16, 24, {small ? 200 : 1000});  // a Quest page that is not a power of two
  // Selection: dtypes x dims x groups x modes, B = 3 of different lengths and budgets.
  const int L = small ? 1200 : 20000;
  int i = 0;
  for (Scalar t : {BF, F16})
    for (int D : {64, 128, 256})
      for (int G : {1, 4, 8})
        for (bool pq : {false, true}) {
          SelCase c;
          c.t = t;
          c.qt = (i % 3 == 2) ? t : F32;
          c.D = D;
          c.G = G;
          c.Hkv = 2;
          c.P = (i & 1) ? 256 : 16;
          c.ps = (i % 4 == 3) ? 64 : 16;
          c.per_query = pq;
          c.lens = {L + 5, L / 3 + 7, 130};
          c.budgets = {L / 20, L / 10 + 3, 40};
          c.want_extra = i % 3;
          run_select(c);
          ++i;
        }
  {
    SelCase c;  // one page only, and max_length past the longest sequence
    c.lens = {9, 16, 1};
    c.budgets = {1000, 16, 5};
    c.len_extra = 100;
    run_select(c);
    c.per_query = true;
    c.ps = 64;
    c.lens = {64, 65, 100};
    c.budgets = {128, 64, 0};
    run_select(c);
  }
  {
    SelCase c;  // an empty sequence among others
    c.lens = {0, 300, 17};
    c.budgets = {64, 64, 64};
    run_select(c);
  }
  {
    SelCase c;  // 32 query / 8 KV heads (the benchmark shape), budget 5%
    c.G = 4;
    c.Hkv = 8;
    c.P = 256;
    const int n = small ? 3000 : 131072;
    c.lens = {n};
    c.budgets = {n / 20};
    c.timing = !small;
    run_select(c);
    c.timing = false;
    c.per_query = true;
    run_select(c);
    c.per_query = false;  // as a programmatic dependent launch after a late writer of the bounds
    c.pdl = true;
    run_select(c);
    c.lens = {n, 700, 40};
    c.budgets = {n / 20, 64, 30};
    run_select(c);
  }
  if (!small) {
    SelCase c;  // rows past 16384 candidate pages: fused by default
    c.D = 64;
    c.Hkv = 1;
    c.P = 256;
    c.lens = {300000, 5000};
    c.budgets = {15000, 256};
    run_select(c);
  }
  {
    SelCase c;  // groups above 8 heads: two tiles of query vectors
    c.G = 12;
    c.Hkv = 1;
    c.per_query = true;
    c.lens = {2000, 999};
    c.budgets = {300, 128};
    run_select(c);
    c.per_query = false;
    run_select(c);
  }
  // Window.
  run_window(3, 2, 4, 0, {1000, 3, 50}, {100, 100, 2}, 104);
  run_window(2, 8, 4, 64, {1000, 60}, {0, 0}, 68);
  run_window(2, 1, 0, 0, {0, 10}, {5, 5}, 5);
  run_window(1, 2, 4, 100, {200}, {0}, 50);  // cut to max_selected
  return g_fail - before;
}
