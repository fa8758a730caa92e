// SPDX-License-Identifier: Apache-2.0
// Progress feedback on stderr, only when stderr is a terminal and only for work that has already
// taken more than a second: piped or redirected runs (CI logs, scripts) see nothing.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace kvcli {

// True when stderr is a terminal (checked once).
bool stderr_is_tty();

// A counted progress bar: "label [#####.....]  45%  123/456  eta 12s".
class Progress {
 public:
  Progress(std::string label, int64_t total);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void advance(int64_t n = 1) { update(done_ + n); }
  void update(int64_t done);
  // Erases the bar (the next output starts on a clean line).
  void finish();

 private:
  void draw(bool force);
  std::string label_;
  int64_t total_;
  int64_t done_ = 0;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

// An elapsed-time indicator for one long blocking call ("building index ... 3.2s"), drawn by a
// background thread while the object lives.
class Activity {
 public:
  explicit Activity(std::string label);
  ~Activity();
  Activity(const Activity&) = delete;
  Activity& operator=(const Activity&) = delete;

 private:
  void run();
  std::string label_;
  bool enabled_;
  bool stop_ = false;
  bool drawn_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
};

}  // namespace kvcli
