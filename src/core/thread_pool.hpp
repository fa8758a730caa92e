// SPDX-License-Identifier: Apache-2.0
// A fixed pool of worker threads running index-range tasks. The calling thread takes part, so a
// pool of T threads has T-1 workers. One parallel_for at a time per pool (sessions sharing a pool
// are serialised by the pool's mutex).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvs {

class ThreadPool {
 public:
  explicit ThreadPool(unsigned threads);  // 0 = hardware concurrency
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  unsigned size() const { return unsigned(workers_.size()) + 1; }
  // Calls fn(i) for i in [0, n), spread over the threads; returns when all are done. Exceptions
  // from fn are rethrown (the first one) after every task finished.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void worker_loop();
  void run_tasks();

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one parallel_for at a time
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t next_ = 0;
  int64_t finished_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace kvs
