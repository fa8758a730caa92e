// SPDX-License-Identifier: Apache-2.0
#include "core/thread_pool.hpp"

#include <pthread.h>

#include <algorithm>
#include <map>
#include <new>

namespace kvs {

namespace {
unsigned resolve(unsigned threads) { return threads ? threads : std::max(1u, std::thread::hardware_concurrency()); }
}  // namespace

ThreadPool::ThreadPool(unsigned threads) {
  threads = resolve(threads);
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

int64_t ThreadPool::take(Job& j) {
  const int64_t i = j.next++;
  if (j.next == j.n) {
    auto it = std::find(open_.rbegin(), open_.rend(), &j);  // usually the newest
    open_.erase(std::next(it).base());
  }
  return i;
}

void ThreadPool::run(Job& j, int64_t i, std::unique_lock<std::mutex>& lk) {
  lk.unlock();
  std::exception_ptr err;
  try {
    (*j.fn)(i);
  } catch (...) {
    err = std::current_exception();
  }
  lk.lock();
  if (err && !j.error) j.error = err;
  // The caller may destroy j as soon as it sees the count (it waits under m_, held here).
  if (++j.finished == j.n) j.done.notify_all();
}

void ThreadPool::worker_loop() {
  std::unique_lock<std::mutex> lk(m_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !open_.empty(); });
    if (stop_) return;
    Job& j = *open_.back();
    const int64_t i = take(j);
    run(j, i, lk);
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  Job job{&fn, n};
  std::unique_lock<std::mutex> lk(m_);
  open_.push_back(&job);
  cv_.notify_all();
  // The caller runs its own job's tasks only (never another job's: a task of a nested job must not
  // run inside one of this thread's tasks), then waits for those the workers took.
  while (job.next < job.n) {
    const int64_t i = take(job);
    run(job, i, lk);
  }
  job.done.wait(lk, [&] { return job.finished == job.n; });
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace kvs
