// SPDX-License-Identifier: Apache-2.0
// CPU attention kernels and the session decode path against float64 references.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <set>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <thread>

#include "backends/cpu/attention.hpp"
#include "core/thread_pool.hpp"
#include "reference.hpp"

using namespace kvt;

namespace {

struct Case {
  kvs::DType dt;
  int d, G, hkv;
  int64_t n;
};

// Builds a KV layer from random rows; returns the dtype-rounded K and V ([n][hkv][d]).
std::unique_ptr<kvs::KVLayer> make_layer(const Case& c, Rng& rng, std::vector<float>& K, std::vector<float>& V) {
  auto layer = std::make_unique<kvs::KVLayer>(c.dt, c.hkv, c.d);
  K = rng.normals(size_t(c.n) * c.hkv * c.d);
  V = rng.normals(size_t(c.n) * c.hkv * c.d);
  // Append in uneven chunks to cross page boundaries in different ways.
  int64_t done = 0;
  while (done < c.n) {
    const int64_t step = std::min<int64_t>(c.n - done, rng.uniform(1, 300));
    layer->append(K.data() + done * c.hkv * c.d, V.data() + done * c.hkv * c.d, step);
    done += step;
  }
  K = rounded(K, c.dt);
  V = rounded(V, c.dt);
  return layer;
}

double tol(kvs::DType) { return 2e-5; }  // the reference uses the same rounded K/V; fp32 accumulation

}  // namespace

TEST_CASE("dense attention equals the float64 reference over dtypes, head dims, GQA ratios and lengths") {
  kvs::ThreadPool pool(2);
  Rng rng(7);
  for (kvs::DType dt : {kvs::DType::F32, kvs::DType::F16, kvs::DType::BF16})
    for (int d : {8, 12, 64, 128, 256})
      for (int G : {1, 3, 4, 7})
        for (int64_t n : {int64_t(1), int64_t(3), int64_t(255), int64_t(256), int64_t(1000)}) {
          if (d == 256 && n > 300) continue;
          Case c{dt, d, G, 2, n};
          std::vector<float> K, V;
          auto layer = make_layer(c, rng, K, V);
          const int hq = G * c.hkv;
          auto q = rng.normals(size_t(hq) * d);
          std::vector<float> o(size_t(hq) * d, -7.f), lse(size_t(hq), -7.f);
          const float scale = 1.f / std::sqrt(float(d));
          kvs::cpu::attend_dense(*layer, q.data(), G, n, scale, o.data(), lse.data(), pool);
          std::vector<int64_t> keys(static_cast<size_t>(n));
          std::iota(keys.begin(), keys.end(), 0);
          for (int h = 0; h < hq; ++h) {
            std::vector<double> ref;
            double lref;
            attention_ref(q.data(), K.data(), V.data(), h, G, c.hkv, d, keys, scale, ref, lref);
            INFO("dtype " << kvs::dtype_name(dt) << " d " << d << " G " << G << " n " << n << " head " << h);
            CHECK(rel_err(ref, o.data() + size_t(h) * d, d) < tol(dt));
            CHECK(std::abs(lse[size_t(h)] - lref) < 1e-4);
          }
        }
}

TEST_CASE("dense attention over a prefix of the keys (causal) uses exactly n_keys keys") {
  kvs::ThreadPool pool(2);
  Rng rng(11);
  Case c{kvs::DType::BF16, 64, 2, 2, 700};
  std::vector<float> K, V;
  auto layer = make_layer(c, rng, K, V);
  auto q = rng.normals(size_t(4) * 64);
  std::vector<float> o(4 * 64), lse(4);
  kvs::cpu::attend_dense(*layer, q.data(), 2, 333, 0.125f, o.data(), lse.data(), pool);
  std::vector<int64_t> keys(333);
  std::iota(keys.begin(), keys.end(), 0);
  for (int h = 0; h < 4; ++h) {
    std::vector<double> ref;
    double lref;
    attention_ref(q.data(), K.data(), V.data(), h, 2, 2, 64, keys, 0.125, ref, lref);
    CHECK(rel_err(ref, o.data() + h * 64, 64) < 2e-5);
  }
}

TEST_CASE("gathered attention per KV head and per query head equals the reference; empty lists give the empty state") {
  kvs::ThreadPool pool(2);
  Rng rng(3);
  Case c{kvs::DType::F16, 64, 4, 2, 2000};
  std::vector<float> K, V;
  auto layer = make_layer(c, rng, K, V);
  const int hq = 8, d = 64;
  auto q = rng.normals(size_t(hq) * d);
  const float scale = 0.125f;
  std::vector<std::vector<int32_t>> kv_lists(2);
  for (int t = 0; t < 2000; ++t)
    if (rng.uniform(0, 9) == 0) kv_lists[0].push_back(t);
  std::shuffle(kv_lists[0].begin(), kv_lists[0].end(), rng.g);  // order must not matter
  // kv_lists[1] stays empty
  std::vector<float> o(size_t(hq) * d), lse(hq);
  kvs::cpu::attend_gather_kv(*layer, q.data(), 4, kv_lists, scale, o.data(), lse.data(), pool);
  for (int h = 0; h < hq; ++h) {
    std::vector<int64_t> keys(kv_lists[size_t(h / 4)].begin(), kv_lists[size_t(h / 4)].end());
    std::vector<double> ref;
    double lref;
    attention_ref(q.data(), K.data(), V.data(), h, 4, 2, d, keys, scale, ref, lref);
    if (keys.empty()) {
      CHECK(std::isinf(lse[size_t(h)]));
      CHECK(lse[size_t(h)] < 0);
      for (int i = 0; i < d; ++i) CHECK(o[size_t(h) * d + i] == 0.f);
    } else {
      CHECK(rel_err(ref, o.data() + size_t(h) * d, d) < 2e-5);
      CHECK(std::abs(lse[size_t(h)] - lref) < 1e-4);
    }
  }
  std::vector<std::vector<int32_t>> q_lists(hq);
  for (int h = 0; h < hq; ++h)
    for (int t = 0; t < 2000; ++t)
      if (rng.uniform(0, 20) == 0) q_lists[size_t(h)].push_back(t);
  // shape -1: every query head its own list; 0: KV head 0's four query heads share one list
  // (attended as a group, its rows read once), KV head 1's differ in one key (attended head by
  // head); 1: every list shared, KV head 1's empty.
  for (int shape = -1; shape < 2; ++shape) {
    CAPTURE(shape);
    if (shape >= 0) {
      for (int h = 1; h < 4; ++h) q_lists[size_t(h)] = q_lists[0];
      for (int h = 5; h < 8; ++h) q_lists[size_t(h)] = q_lists[4];
    }
    if (shape == 0) q_lists[6].push_back(1999);
    if (shape == 1)
      for (int h = 4; h < 8; ++h) q_lists[size_t(h)].clear();
    std::fill(o.begin(), o.end(), 7.f);
    kvs::cpu::attend_gather_q(*layer, q.data(), 4, q_lists, scale, o.data(), lse.data(), pool);
    for (int h = 0; h < hq; ++h) {
      std::vector<int64_t> keys(q_lists[size_t(h)].begin(), q_lists[size_t(h)].end());
      std::vector<double> ref;
      double lref;
      attention_ref(q.data(), K.data(), V.data(), h, 4, 2, d, keys, scale, ref, lref);
      if (keys.empty()) {
        CHECK(std::isinf(lse[size_t(h)]));
        for (int i = 0; i < d; ++i) CHECK(o[size_t(h) * d + i] == 0.f);
      } else {
        CHECK(rel_err(ref, o.data() + size_t(h) * d, d) < 2e-5);
        CHECK(std::abs(lse[size_t(h)] - lref) < 1e-4);
      }
    }
  }
}

TEST_CASE("merging the states of random disjoint splits equals attention over the whole") {
  kvs::ThreadPool pool(2);
  Rng rng(5);
  Case c{kvs::DType::F32, 32, 2, 1, 600};
  std::vector<float> K, V;
  auto layer = make_layer(c, rng, K, V);
  const int hq = 2, d = 32;
  for (int trial = 0; trial < 10; ++trial) {
    auto q = rng.normals(size_t(hq) * d, 2.f);
    std::vector<std::vector<int32_t>> a(1), b(1);
    for (int t = 0; t < 600; ++t) (rng.uniform(0, 1) ? a[0] : b[0]).push_back(t);
    if (trial == 0) {  // one side empty: merging the empty state changes nothing
      for (int32_t t : a[0]) b[0].push_back(t);
      a[0].clear();
    }
    std::vector<float> oa(hq * d), la(hq), ob(hq * d), lb(hq), ow(hq * d), lw(hq);
    kvs::cpu::attend_gather_kv(*layer, q.data(), 2, a, 0.2f, oa.data(), la.data(), pool);
    kvs::cpu::attend_gather_kv(*layer, q.data(), 2, b, 0.2f, ob.data(), lb.data(), pool);
    kvs::cpu::attend_dense(*layer, q.data(), 2, 600, 0.2f, ow.data(), lw.data(), pool);
    kvs::cpu::merge_states(oa.data(), la.data(), ob.data(), lb.data(), hq, d);
    for (int i = 0; i < hq * d; ++i) {
      CHECK(std::isfinite(oa[size_t(i)]));
      CHECK(oa[size_t(i)] == doctest::Approx(ow[size_t(i)]).epsilon(1e-4));
    }
    for (int h = 0; h < hq; ++h) CHECK(la[size_t(h)] == doctest::Approx(lw[size_t(h)]).epsilon(1e-5));
  }
  // Two empty states merge to the empty state without NaN.
  std::vector<float> o1(d, 0.f), o2(d, 0.f);
  float l1 = -INFINITY, l2 = -INFINITY;
  kvs::cpu::merge_states(o1.data(), &l1, o2.data(), &l2, 1, d);
  CHECK(std::isinf(l1));
  for (float x : o1) CHECK(x == 0.f);
}

TEST_CASE("thread pool runs every index once and propagates exceptions") {
  kvs::ThreadPool pool(3);
  std::vector<int> hits(1000, 0);
  pool.parallel_for(1000, [&](int64_t i) { hits[size_t(i)]++; });
  CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
  CHECK_THROWS(pool.parallel_for(10, [&](int64_t i) { if (i == 5) throw std::runtime_error("x"); }));
  pool.parallel_for(4, [&](int64_t i) { hits[size_t(i)]++; });  // still usable
  CHECK(hits[3] == 2);
}

TEST_CASE("thread pool: nested and concurrent parallel_for calls each run every index once") {
  for (unsigned threads : {1u, 2u, 4u}) {
    kvs::ThreadPool pool(threads);
    // Nested: 6 outer tasks, each running three rounds of 50 inner tasks (a session's step inside a
    // batch's job); the sums are exact in integers.
    std::vector<std::vector<int64_t>> sums(6, std::vector<int64_t>(3, 0));
    pool.parallel_for(6, [&](int64_t o) {
      for (int r = 0; r < 3; ++r) {
        std::vector<int64_t> part(50, 0);
        pool.parallel_for(50, [&](int64_t i) { part[size_t(i)] = (o + 1) * 1000 + r * 100 + i; });
        sums[size_t(o)][size_t(r)] = std::accumulate(part.begin(), part.end(), int64_t(0));
      }
    });
    for (int64_t o = 0; o < 6; ++o)
      for (int r = 0; r < 3; ++r) CHECK(sums[size_t(o)][size_t(r)] == 50 * ((o + 1) * 1000 + r * 100) + 49 * 50 / 2);
    // Four host threads calling at once, each many small jobs.
    std::vector<std::thread> callers;
    std::vector<int64_t> totals(4, 0);
    for (int c = 0; c < 4; ++c)
      callers.emplace_back([&, c] {
        for (int rep = 0; rep < 200; ++rep) {
          std::vector<int> hits(17, 0);
          pool.parallel_for(17, [&](int64_t i) { hits[size_t(i)] += int(i) + c; });
          totals[size_t(c)] += std::accumulate(hits.begin(), hits.end(), int64_t(0));
        }
      });
    for (auto& t : callers) t.join();
    for (int c = 0; c < 4; ++c) CHECK(totals[size_t(c)] == 200 * (16 * 17 / 2 + 17 * c));
    // An exception in a nested job reaches its caller, then the outer caller; the pool stays usable.
    CHECK_THROWS_WITH(pool.parallel_for(3, [&](int64_t o) {
      pool.parallel_for(5, [&](int64_t i) {
        if (o == 1 && i == 4) throw std::runtime_error("inner");
      });
    }), "inner");
    std::vector<int> hits(9, 0);
    pool.parallel_for(9, [&](int64_t i) { hits[size_t(i)]++; });
    CHECK(std::count(hits.begin(), hits.end(), 1) == 9);
  }
}

TEST_CASE("thread pool: jobs nested deeper than its 64 slots, exceptions through them, the spin setting") {
  for (const char* spin : {"0", "50"}) {
    setenv("KVS_POOL_SPIN_US", spin, 1);
    kvs::ThreadPool pool(4);
    CHECK(pool.spin_us() == unsigned(std::atoi(spin)));
    // 80 levels of nested jobs, each open while the next runs: the deepest ones find no free slot
    // and run on their callers alone, and every index still runs once.
    std::vector<std::atomic<int>> hits(80 * 3);
    std::function<void(int)> level = [&](int depth) {
      pool.parallel_for(3, [&, depth](int64_t i) {
        hits[size_t(depth * 3 + i)]++;
        if (i == 0 && depth + 1 < 80) level(depth + 1);
        if (i == 2 && depth == 79) throw std::runtime_error("deepest");
      });
    };
    CHECK_THROWS_WITH(level(0), "deepest");
    CHECK(std::all_of(hits.begin(), hits.end(), [](const std::atomic<int>& h) { return h.load() == 1; }));
    std::vector<int> again(1000, 0);  // every slot free again
    pool.parallel_for(1000, [&](int64_t i) { again[size_t(i)]++; });
    CHECK(std::count(again.begin(), again.end(), 1) == 1000);
  }
  for (const char* bad : {"-1", "20000", "fast", "5x"}) {  // not a whole number in 0..10000: the default
    setenv("KVS_POOL_SPIN_US", bad, 1);
    CHECK(kvs::ThreadPool(2).spin_us() == kvs::ThreadPool::kDefaultSpinUs);
  }
  unsetenv("KVS_POOL_SPIN_US");
  CHECK(kvs::ThreadPool(2).spin_us() == kvs::ThreadPool::kDefaultSpinUs);
}

TEST_CASE("thread pool: parts_per_task and parallel_ranges cut [0, n) into aligned ranges that cover it once") {
  kvs::ThreadPool p16(16), p2(2), p1(1);
  CHECK(kvs::parts_per_task(p16, 8) == 2);
  CHECK(kvs::parts_per_task(p16, 2) == 4);      // capped at max_parts
  CHECK(kvs::parts_per_task(p16, 2, 8) == 8);
  CHECK(kvs::parts_per_task(p16, 32) == 1);
  CHECK(kvs::parts_per_task(p2, 0) == 2);       // no tasks counts as one
  CHECK(kvs::parts_per_task(p1, 8) == 1);
  struct Case {
    int64_t n, parts, align, min_len, want;  // want: the number of ranges
  };
  for (const Case c : {Case{1000, 4, 64, 1, 4}, Case{1000, 4, 64, 300, 3}, Case{1000, 4, 64, 1000, 1}, Case{100, 4, 64, 1, 2},
                       Case{64, 4, 64, 1, 1}, Case{1, 3, 1, 1, 1}, Case{8192, 3, 64, 512, 3}, Case{0, 4, 64, 1, 0}}) {
    CAPTURE(c.n);
    CAPTURE(c.parts);
    CAPTURE(c.min_len);
    std::mutex mu;
    std::vector<std::pair<int64_t, int64_t>> got;
    std::vector<std::thread::id> who;
    kvs::parallel_ranges(p16, c.n, c.parts, c.align, c.min_len, [&](int64_t b, int64_t e) {
      std::lock_guard<std::mutex> g(mu);
      got.emplace_back(b, e);
      who.push_back(std::this_thread::get_id());
    });
    std::sort(got.begin(), got.end());
    CHECK(int64_t(got.size()) == c.want);
    int64_t at = 0;
    for (const auto& [b, e] : got) {
      CHECK(b == at);                         // contiguous, in order, no overlap
      CHECK(e > b);
      CHECK((b % c.align == 0));              // starts on the alignment
      if (got.size() > 1) CHECK(e - b >= std::min<int64_t>(c.min_len, c.n));
      at = e;
    }
    CHECK(at == c.n);                         // covers [0, n)
    if (c.want == 1) CHECK(who[0] == std::this_thread::get_id());  // one part: on the caller
  }
}

TEST_CASE("thread pool: sessions asking for the same thread count share one pool") {
  auto a = kvs::ThreadPool::shared(3), b = kvs::ThreadPool::shared(3), c = kvs::ThreadPool::shared(2);
  CHECK(a.get() == b.get());
  CHECK(a.get() != c.get());
  CHECK(a->size() == 3);
  CHECK(c->size() == 2);
  CHECK(kvs::ThreadPool::shared(0)->size() == std::max(1u, std::thread::hardware_concurrency()));
  a.reset();
  b.reset();  // the last holder: destroyed; the next call starts a new one
  auto d = kvs::ThreadPool::shared(3);
  CHECK(d->size() == 3);
}

TEST_CASE("thread pool: a child process after fork() gets pools of its own, with running workers") {
  auto parent = kvs::ThreadPool::shared(3);
  parent->parallel_for(8, [](int64_t) {});
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {  // the child: no doctest macros, the exit status says it
    auto child = kvs::ThreadPool::shared(3);
    std::mutex m;
    std::set<std::thread::id> ids;
    child->parallel_for(12, [&](int64_t) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      std::lock_guard<std::mutex> g(m);
      ids.insert(std::this_thread::get_id());
    });
    _exit(child.get() != parent.get() && ids.size() > 1 ? 0 : 1);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("attention scoring: score_rows and score_contig equal float64 dot products over dtypes, head dims and group sizes") {
  Rng rng(5);
  for (kvs::DType dt : {kvs::DType::F32, kvs::DType::F16, kvs::DType::BF16})
    for (int d : {12, 64, 128})
      for (int G : {1, 3, 4})
        for (int64_t n : {int64_t(1), int64_t(63), int64_t(200)}) {
          Case c{dt, d, G, 1, n};
          std::vector<float> K, V;
          auto layer = make_layer(c, rng, K, V);
          auto q = rng.normals(size_t(G) * d);
          // Rows in a shuffled order (gathered), and one page's rows contiguously.
          std::vector<int32_t> order(static_cast<size_t>(n));
          std::iota(order.begin(), order.end(), 0);
          std::shuffle(order.begin(), order.end(), rng.g);
          std::vector<const std::byte*> rows(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) rows[size_t(i)] = layer->k_row(0, order[size_t(i)]);
          std::vector<float> out(size_t(G) * n, NAN), outc(size_t(G) * n, NAN);
          const float scale = 0.3f;
          kvs::cpu::score_rows(dt, d, G, q.data(), scale, rows.data(), n, out.data());
          const int64_t nc = std::min<int64_t>(n, kvs::kPageTokens);
          kvs::cpu::score_contig(dt, d, G, q.data(), scale, layer->k_row(0, 0), nc, outc.data());
          for (int g = 0; g < G; ++g)
            for (int64_t i = 0; i < n; ++i) {
              auto ref = [&](int32_t t) {
                double a = 0, m = 0;
                for (int x = 0; x < d; ++x) {
                  a += double(q[size_t(g) * d + x]) * K[size_t(t) * d + x];
                  m += std::abs(double(q[size_t(g) * d + x]) * K[size_t(t) * d + x]);
                }
                return std::make_pair(scale * a, scale * m);
              };
              INFO("dtype " << kvs::dtype_name(dt) << " d " << d << " G " << G << " n " << n << " g " << g << " i " << i);
              const auto [r, mag] = ref(order[size_t(i)]);
              CHECK(std::abs(out[size_t(g) * n + i] - r) <= 1e-5 * mag + 1e-6);
              if (i < nc) {
                const auto [rc, magc] = ref(int32_t(i));
                CHECK(std::abs(outc[size_t(g) * nc + i] - rc) <= 1e-5 * magc + 1e-6);
              }
            }
        }
}

TEST_CASE("attention values: accumulate_rows adds float64 weighted sums of gathered V rows; max_of skips NaN; softmax_rows") {
  Rng rng(11);
  for (kvs::DType dt : {kvs::DType::F32, kvs::DType::F16, kvs::DType::BF16})
    for (int d : {12, 64, 128})
      for (int G : {1, 3, 4, 9})
        for (int64_t n : {int64_t(1), int64_t(63), int64_t(64), int64_t(200)}) {
          Case c{dt, d, G, 1, n};
          std::vector<float> K, V;
          auto layer = make_layer(c, rng, K, V);
          std::vector<int32_t> order(static_cast<size_t>(n));
          std::iota(order.begin(), order.end(), 0);
          std::shuffle(order.begin(), order.end(), rng.g);
          std::vector<const std::byte*> rows(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) rows[size_t(i)] = layer->v_row(0, order[size_t(i)]);
          // Weights with a row stride larger than n, and a nonzero starting output (it accumulates).
          const int64_t ldw = n + 5;
          auto w = rng.normals(size_t(G) * ldw);
          auto o = rng.normals(size_t(G) * d);
          const auto o0 = o;
          kvs::cpu::accumulate_rows(dt, d, G, w.data(), ldw, rows.data(), n, o.data());
          for (int g = 0; g < G; ++g)
            for (int x = 0; x < d; ++x) {
              double r = o0[size_t(g) * d + x], mag = std::abs(r);
              for (int64_t i = 0; i < n; ++i) {
                const double t = double(w[size_t(g) * ldw + i]) * V[size_t(order[size_t(i)]) * d + x];
                r += t;
                mag += std::abs(t);
              }
              INFO("dtype " << kvs::dtype_name(dt) << " d " << d << " G " << G << " n " << n << " g " << g << " x " << x);
              CHECK(std::abs(o[size_t(g) * d + x] - r) <= 1e-5 * mag + 1e-6);
            }
        }
  for (int64_t n : {0, 1, 7, 8, 9, 100}) {
    auto x = rng.normals(size_t(n));
    if (n > 2) x[1] = NAN;
    float ref = -INFINITY;
    for (float v : x)
      if (v > ref) ref = v;
    CHECK(kvs::cpu::max_of(x.data(), n) == ref);
  }
  // argmax: the first maximum (ties from a few distinct values, the maximum anywhere: first,
  // last, in the vector body or the tail), NaNs skipped, 0 for nothing.
  CHECK(kvs::cpu::argmax(nullptr, 0) == 0);
  for (int rep = 0; rep < 200; ++rep) {
    const int64_t n = rng.uniform(1, 70);
    auto x = rng.normals(size_t(n));
    const int levels = 1 + rep % 4;  // 1: every value tied
    for (auto& v : x) v = std::floor(v * float(levels) / 2.f);
    if (rep % 5 == 0 && n > 3) x[size_t(rep % n)] = NAN;
    double best = -INFINITY;  // the largest value that is not NaN, then its first position
    for (float v : x)
      if (!std::isnan(v)) best = std::max(best, double(v));
    int64_t ref = 0;
    while (ref < n && double(x[size_t(ref)]) != best) ++ref;
    INFO("n " << n << " rep " << rep);
    CHECK(kvs::cpu::argmax(x.data(), n) == ref);
  }
  {
    std::vector<float> x(9, NAN);
    CHECK(kvs::cpu::argmax(x.data(), 9) == 0);
    x[8] = -INFINITY;
    CHECK(kvs::cpu::argmax(x.data(), 9) == 8);
  }
  // softmax_rows: rows of a strided matrix to softmax weights, and their LSE.
  for (int64_t n : {1, 5, 64, 300}) {
    const int G = 3;
    const int64_t ld = n + 3;
    auto x = rng.normals(size_t(G) * ld);
    for (auto& v : x) v *= 6.f;
    const auto x0 = x;
    std::vector<float> lse(G);
    kvs::cpu::softmax_rows(x.data(), G, n, ld, lse.data());
    for (int g = 0; g < G; ++g) {
      double mx = -1e300, z = 0;
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, double(x0[size_t(g * ld + i)]));
      for (int64_t i = 0; i < n; ++i) z += std::exp(double(x0[size_t(g * ld + i)]) - mx);
      const double l = mx + std::log(z);
      CHECK(std::abs(lse[size_t(g)] - l) < 1e-5 * std::max(1.0, std::abs(l)));
      for (int64_t i = 0; i < n; ++i) CHECK(std::abs(x[size_t(g * ld + i)] - std::exp(double(x0[size_t(g * ld + i)]) - l)) < 1e-6);
      for (int64_t i = n; i < ld; ++i) CHECK(x[size_t(g * ld + i)] == x0[size_t(g * ld + i)]);  // beyond n: untouched
    }
  }
}
