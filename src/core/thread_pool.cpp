// SPDX-License-Identifier: Apache-2.0
#include "core/thread_pool.hpp"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <new>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvs {

namespace {
unsigned resolve(unsigned threads) { return threads ? threads : std::max(1u, std::thread::hardware_concurrency()); }

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// KVS_POOL_SPIN_US: a whole number of microseconds (at most 10000), else the default.
unsigned spin_from_env(unsigned dflt) {
  const char* e = std::getenv("KVS_POOL_SPIN_US");
  if (!e || !*e) return dflt;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  return (end && *end == '\0' && v >= 0 && v <= 10000) ? unsigned(v) : dflt;
}

// Every task on this thread, the first exception rethrown after the last (as a pool's job does).
void run_serial(int64_t n, const std::function<void(int64_t)>& fn) {
  std::exception_ptr err;
  for (int64_t i = 0; i < n; ++i) {
    try {
      fn(i);
    } catch (...) {
      if (!err) err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
}
}  // namespace

ThreadPool::ThreadPool(unsigned threads) : spin_us_(spin_from_env(kDefaultSpinUs)) {
  threads = resolve(threads);
  // A pool with more threads than the machine has cores would spin on cores its working threads
  // need: then idle workers wait on open jobs no longer than on none.
  const unsigned cores = std::thread::hardware_concurrency();
  open_spin_us_ = cores == 0 || threads <= cores ? std::max(spin_us_, kOpenSpinUs) : spin_us_;
  workers_.reserve(threads - 1);
  try {
    for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  } catch (...) {
    // Could not start every thread: stop the ones that did, then report.
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> g(m_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

namespace {
// The shared pools by thread count. Never destroyed: a session may be created or outlive static
// destructors. In a child process after fork() the parent's workers do not exist: the child
// forgets the parent's pools (its sessions keep theirs, whose callers then run every task
// themselves), so its new sessions start pools of their own.
struct Registry {
  std::mutex mu;
  std::map<unsigned, std::weak_ptr<ThreadPool>> pools;
};
Registry* registry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    pthread_atfork(nullptr, nullptr, [] {
      Registry* x = registry();
      new (&x->mu) std::mutex;  // (another thread may have held it at the fork)
      new (&x->pools) std::map<unsigned, std::weak_ptr<ThreadPool>>;  // the old map leaks
    });
    return reg;
  }();
  return r;
}
}  // namespace

std::shared_ptr<ThreadPool> ThreadPool::shared(unsigned threads) {
  threads = resolve(threads);
  Registry* reg = registry();
  std::lock_guard<std::mutex> g(reg->mu);
  std::weak_ptr<ThreadPool>& w = reg->pools[threads];
  if (auto p = w.lock()) return p;
  auto p = std::make_shared<ThreadPool>(threads);
  w = p;
  return p;
}

template <typename F>
bool ThreadPool::spin_until(F done, bool while_open) const {
  if (spin_us_ == 0) return done();
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::microseconds(spin_us_);
  const auto open_until = start + std::chrono::microseconds(open_spin_us_);
  bool yielding = false;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    // Past spin_us_ a worker waiting on an open job yields between its looks, so that on a host
    // with more threads than cores (other processes, or a pool larger than the machine) the
    // threads with work get the cores; on an idle core the yield returns at once.
    if (yielding) std::this_thread::yield();
    const auto now = std::chrono::steady_clock::now();
    if (now < until) continue;
    if (!(while_open && now < open_until && used_.load() != 0)) return done();
    yielding = true;
  }
}

// Why a claim cannot take a task of the wrong job: a caller setting a slot up first stores
// (generation + 1, kClosed), then the function and n, then (generation + 1, 0), all sequentially
// consistent. A claim loads the state, then n and fn, then swaps the state it loaded for the next
// task. If it read the new job's n or fn, the closed state came before them, so the swap compares
// against a state that is no longer there and fails; if it loaded the new generation's open state,
// it reads that job's n and fn (or a later job's, and then the swap fails likewise).
bool ThreadPool::claim(int b, int64_t& i, const Fn*& fn) {
  Slot& s = slots_[b];
  uint64_t st = s.state.load();
  for (;;) {
    const uint32_t next = uint32_t(st);
    const int64_t n = s.n.load();
    const Fn* f = s.fn.load();
    if (next == kClosed || int64_t(next) >= n || !f) return false;
    if (s.state.compare_exchange_weak(st, st + 1)) {
      i = int64_t(next);
      fn = f;
      // The last task handed out: no more to take here, so idle threads stop looking. (The job
      // cannot end before this task has run, so the bit is still this job's.)
      if (i + 1 == n) active_.fetch_and(~(uint64_t(1) << b));
      return true;
    }
  }
}

void ThreadPool::run(Slot& s, int64_t i, const Fn* fn) {
  try {
    (*fn)(i);
  } catch (...) {
    bool expected = false;
    if (s.failed.compare_exchange_strong(expected, true)) s.error = std::current_exception();
  }
  // n before the count: once the count reaches it, the caller may return and the slot take another job.
  const int64_t n = s.n.load();
  if (s.finished.fetch_add(1) + 1 == n && s.waiting.load()) {
    // The caller went to sleep: it set `waiting` under m_ before it last looked at the count, so
    // taking m_ here waits until it is inside done_.wait. (If the slot has a new job by now, this
    // wakes callers for nothing; they look at their counts and sleep again.)
    { std::lock_guard<std::mutex> g(m_); }
    done_.notify_all();
  }
}

bool ThreadPool::run_any() {
  uint64_t mask = active_.load();
  while (mask) {
    int best = -1;
    uint64_t best_seq = 0;
    for (uint64_t m = mask; m; m &= m - 1) {
      const int b = __builtin_ctzll(m);
      const uint64_t q = slots_[b].seq.load();
      if (best < 0 || q > best_seq) best = b, best_seq = q;
    }
    int64_t i;
    const Fn* fn;
    if (claim(best, i, fn)) {
      run(slots_[best], i, fn);
      return true;
    }
    mask &= ~(uint64_t(1) << best);
  }
  return false;
}

void ThreadPool::worker_loop() {
  for (;;) {
    if (stop_.load()) return;
    if (run_any()) continue;
    // Nothing to take: spin a while for the next job (the next round of the step that just ran),
    // longer while a job is open (its tasks may open nested jobs: a KV head's parts), then sleep.
    if (spin_until([&] { return has_work() || stop_.load(); }, true)) continue;
    std::unique_lock<std::mutex> lk(m_);
    sleeping_.fetch_add(1);
    cv_.wait(lk, [&] { return stop_.load() || has_work(); });
    sleeping_.fetch_sub(1);
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) return run_serial(n, fn);
  if (n > kMaxTasks) {  // (rounds of kMaxTasks: the state word counts tasks in 32 bits)
    for (int64_t off = 0; off < n; off += kMaxTasks)
      parallel_for(std::min(kMaxTasks, n - off), [&](int64_t i) { fn(off + i); });
    return;
  }
  // A free slot; with every slot taken (64 jobs open at once), the caller runs the job alone.
  int b = -1;
  for (uint64_t u = used_.load();;) {
    if (~u == 0) break;
    const int f = __builtin_ctzll(~u);
    if (used_.compare_exchange_weak(u, u | (uint64_t(1) << f))) {
      b = f;
      break;
    }
  }
  if (b < 0) return run_serial(n, fn);
  Slot& s = slots_[b];
  const uint64_t bit = uint64_t(1) << b;
  const uint64_t gen = (s.state.load() >> 32) + 1;
  s.state.store(gen << 32 | kClosed);
  s.fn.store(&fn);
  s.n.store(n);
  s.finished.store(0);
  s.failed.store(false);
  s.error = nullptr;
  s.waiting.store(false);
  s.seq.store(jobs_.fetch_add(1) + 1);
  s.state.store(gen << 32);
  active_.fetch_or(bit);
  // Spinning workers see active_; wake sleeping ones for the tasks beyond the caller's (m_ taken
  // so that a worker between its last look at active_ and its wait is not missed).
  const int sleeping = sleeping_.load();
  if (sleeping > 0) {
    { std::lock_guard<std::mutex> g(m_); }
    const int64_t wake = std::min<int64_t>(n - 1, sleeping);
    if (wake >= sleeping) {
      cv_.notify_all();
    } else {
      for (int64_t w = 0; w < wake; ++w) cv_.notify_one();
    }
  }
  // The caller runs its own job's tasks only (never another job's: a task of a nested job must not
  // run inside one of this thread's tasks), then waits for those the workers took.
  int64_t i;
  const Fn* f;
  while (claim(b, i, f)) run(s, i, f);
  if (!spin_until([&] { return s.finished.load() == n; }, false)) {
    std::unique_lock<std::mutex> lk(m_);
    s.waiting.store(true);
    done_.wait(lk, [&] { return s.finished.load() == n; });
    s.waiting.store(false);
  }
  std::exception_ptr err = s.failed.load() ? s.error : nullptr;
  s.error = nullptr;
  used_.fetch_and(~bit);
  if (err) std::rethrow_exception(err);
}

}  // namespace kvs
