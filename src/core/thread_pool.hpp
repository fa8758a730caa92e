// SPDX-License-Identifier: Apache-2.0
// A fixed pool of worker threads running index-range tasks. The calling thread takes part, so a
// pool of T threads has T-1 workers. Any number of parallel_for calls may run on one pool at once,
// from different threads or nested (a task that calls parallel_for): each caller runs its own
// job's tasks, and idle workers take tasks from the newest job that has some left, so a batch of
// sessions stepped one per task keeps every thread busy through each session's rounds.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
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

  // The pool of `threads` threads (0 = hardware concurrency) shared by every session of the
  // process that asks for that many: N sessions of T threads start T - 1 workers, not N * (T - 1).
  // Destroyed with the last session that holds it.
  static std::shared_ptr<ThreadPool> shared(unsigned threads);

  unsigned size() const { return unsigned(workers_.size()) + 1; }
  // Calls fn(i) for i in [0, n), spread over the threads; returns when all are done. Exceptions
  // from fn are rethrown (the first one) after every task finished. May be called from a task.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  struct Job {
    const std::function<void(int64_t)>* fn;
    int64_t n;
    int64_t next = 0;      // the next task to hand out
    int64_t finished = 0;  // tasks done
    std::exception_ptr error;
    std::condition_variable done;  // the caller waits here for the tasks other threads took
  };
  // With m_ held: the next task of j, taking j off open_ when it was its last.
  int64_t take(Job& j);
  // Runs task i of j without m_, then, with m_ held again, counts it.
  void run(Job& j, int64_t i, std::unique_lock<std::mutex>& lk);
  void worker_loop();

  std::vector<std::thread> workers_;
  std::mutex m_;
  std::condition_variable cv_;  // workers wait for a job with tasks left
  std::vector<Job*> open_;      // jobs with tasks not yet handed out, newest last
  bool stop_ = false;
};

}  // namespace kvs
