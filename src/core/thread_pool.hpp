// SPDX-License-Identifier: Apache-2.0
// A fixed pool of worker threads running index-range tasks. The calling thread takes part, so a
// pool of T threads has T-1 workers. Any number of parallel_for calls may run on one pool at once,
// from different threads or nested (a task that calls parallel_for): each caller runs its own
// job's tasks, and idle workers take tasks from the newest job that has some left, so a batch of
// sessions stepped one per task keeps every thread busy through each session's rounds.
//
// A method's step is a few rounds of a few tasks each (one per KV head, say), so what a round costs
// beyond its tasks matters as much as the tasks. Tasks are handed out and counted without a lock:
// a job lives in one of the pool's slots (the pool's memory, not the caller's), whose state word
// holds a generation and the next task, taken by compare-and-swap, so a worker looking at a slot
// whose job has ended and been replaced takes nothing from it. Waking a sleeping thread costs tens
// of microseconds on virtual machines (an inter-processor interrupt), as long as a short task: a
// worker that found nothing to do spins for a while (spin_us, below) before it sleeps, and so does
// a caller waiting for its job's last tasks, so the rounds of one step follow each other without
// wake-ups. A job wakes only as many sleeping workers as it has tasks beyond the caller's.
#pragma once
#include <algorithm>
#include <atomic>
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

  // How long a thread with nothing to do spins before it sleeps, in microseconds:
  // KVS_POOL_SPIN_US in the environment when the pool starts (0 = never spin), else the default.
  static constexpr unsigned kDefaultSpinUs = 50;
  // While some job is still open (a caller waits for its tasks), an idle worker spins up to this
  // long instead (yielding its core between looks after spin_us()): a task of that job may open a
  // nested one (a KV head's work cut into parts), and a sleeping worker takes tens of microseconds
  // to wake. Not with spin_us() = 0, nor in a pool of more threads than the machine has cores.
  static constexpr unsigned kOpenSpinUs = 1000;
  unsigned spin_us() const { return spin_us_; }

 private:
  using Fn = std::function<void(int64_t)>;
  static constexpr int kSlots = 64;                     // jobs open at once; more run on their callers alone
  static constexpr uint32_t kClosed = 0xffffffffu;      // a slot's next task while it is being set up
  static constexpr int64_t kMaxTasks = int64_t(kClosed) - 1;  // a larger n runs in rounds of this many
  struct alignas(64) Slot {
    std::atomic<uint64_t> state{0};     // generation << 32 | the next task to hand out
    std::atomic<const Fn*> fn{nullptr};
    std::atomic<int64_t> n{0};
    std::atomic<uint64_t> seq{0};       // the job's number: workers take from the newest job first
    std::atomic<int64_t> finished{0};   // tasks done
    std::atomic<bool> failed{false};    // a task threw: error holds the first exception
    std::atomic<bool> waiting{false};   // the caller sleeps on done_
    std::exception_ptr error;
  };

  // Takes the next task of slot b: true with its index and function. False when the job has none
  // left (or the slot's job changed under it).
  bool claim(int b, int64_t& i, const Fn*& fn);
  // Runs task i of s, records a first exception, counts it done (waking a sleeping caller).
  void run(Slot& s, int64_t i, const Fn* fn);
  // A worker: the newest job's next task, run; false if no job had one.
  bool run_any();
  bool has_work() const { return active_.load() != 0; }
  // Spins up to spin_us_ until done() holds (up to open_spin_us_ while a job is open, with
  // while_open); returns done().
  template <typename F>
  bool spin_until(F done, bool while_open) const;
  void worker_loop();

  std::vector<std::thread> workers_;
  Slot slots_[kSlots];
  std::atomic<uint64_t> used_{0};     // slots taken by a caller
  std::atomic<uint64_t> active_{0};   // slots whose job has tasks left to hand out
  std::atomic<uint64_t> jobs_{0};     // jobs opened so far
  std::atomic<int> sleeping_{0};      // workers waiting on cv_
  std::atomic<bool> stop_{false};
  std::mutex m_;                      // only for sleeping and waking: cv_, done_
  std::condition_variable cv_;        // workers wait for a job with tasks left
  std::condition_variable done_;      // callers wait for their job's last tasks
  unsigned spin_us_ = kDefaultSpinUs;
  unsigned open_spin_us_ = kOpenSpinUs;  // how long an idle worker waits while a job is open
};

// Where a step runs one task per KV head (8, say) on a pool of more threads (16), a head's long
// loops are cut into parts so that every thread works: parts_per_task is how many parts each of
// `tasks` concurrent tasks gets (the pool's threads per task, 1 to max_parts), parallel_ranges runs
// fn(begin, end) over [0, n) cut into that many ranges as one (nested) job. Range boundaries are
// multiples of `align`, so a kernel that works in blocks of `align` rows sees the same blocks
// whatever the cut (the results do not depend on the thread count); ranges shorter than
// `min_len` are not worth a task, and one part runs fn(0, n) on the calling thread.
inline int64_t parts_per_task(const ThreadPool& pool, int64_t tasks, int64_t max_parts = 4) {
  return std::clamp<int64_t>(int64_t(pool.size()) / std::max<int64_t>(tasks, 1), 1, std::max<int64_t>(max_parts, 1));
}
template <class F>
void parallel_ranges(ThreadPool& pool, int64_t n, int64_t parts, int64_t align, int64_t min_len, F&& fn) {
  if (n <= 0) return;
  const int64_t units = (n + align - 1) / align;  // parts <= units: every range is non-empty
  parts = std::min({parts, units, n / std::max<int64_t>(min_len, 1)});
  if (parts <= 1) {
    fn(int64_t(0), n);
    return;
  }
  pool.parallel_for(parts, [&](int64_t p) { fn(units * p / parts * align, std::min(n, units * (p + 1) / parts * align)); });
}

}  // namespace kvs
