// SPDX-License-Identifier: Apache-2.0
#include "core/thread_pool.hpp"

namespace kvs {

ThreadPool::ThreadPool(unsigned threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
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

void ThreadPool::run_tasks() {
  for (;;) {
    int64_t i;
    const std::function<void(int64_t)>* fn;
    {
      std::lock_guard<std::mutex> g(m_);
      if (next_ >= n_) return;
      i = next_++;
      fn = fn_;
    }
    try {
      (*fn)(i);
    } catch (...) {
      std::lock_guard<std::mutex> g(m_);
      if (!error_) error_ = std::current_exception();
    }
    std::lock_guard<std::mutex> g(m_);
    if (++finished_ == n_) done_cv_.notify_all();
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(m_);
      cv_.wait(lk, [&] { return stop_ || (generation_ != seen && next_ < n_); });
      if (stop_) return;
      seen = generation_;
    }
    run_tasks();
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> run(run_mutex_);
  {
    std::lock_guard<std::mutex> g(m_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    finished_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  cv_.notify_all();
  run_tasks();
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(m_);
    done_cv_.wait(lk, [&] { return finished_ == n_; });
    err = error_;
    fn_ = nullptr;
    n_ = 0;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace kvs
