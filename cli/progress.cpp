// SPDX-License-Identifier: Apache-2.0
#include "progress.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace kvcli {

namespace {
constexpr auto kDelay = std::chrono::seconds(1);           // show nothing for short work
constexpr auto kInterval = std::chrono::milliseconds(100);  // redraw at most 10 times a second

void clear_line() {
  std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
}
}  // namespace

bool stderr_is_tty() {
  static const bool tty = isatty(STDERR_FILENO) != 0;
  return tty;
}

Progress::Progress(std::string label, int64_t total)
    : label_(std::move(label)),
      total_(std::max<int64_t>(total, 1)),
      enabled_(stderr_is_tty()),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

Progress::~Progress() { finish(); }

void Progress::update(int64_t done) {
  done_ = std::min(done, total_);
  if (enabled_) draw(false);
}

void Progress::draw(bool force) {
  const auto now = std::chrono::steady_clock::now();
  if (!force && (now - start_ < kDelay || now - last_draw_ < kInterval)) return;
  last_draw_ = now;
  const double frac = double(done_) / double(total_);
  constexpr int kWidth = 30;
  const int filled = int(frac * kWidth);
  std::string bar(size_t(filled), '#');
  bar.append(size_t(kWidth - filled), '.');
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  char eta[32] = "";
  if (done_ > 0 && done_ < total_) {
    std::snprintf(eta, sizeof eta, "  eta %.0fs", elapsed * double(total_ - done_) / double(done_));
  }
  std::fprintf(stderr, "\r\033[K%s [%s] %3.0f%%  %lld/%lld%s", label_.c_str(), bar.c_str(),
               frac * 100.0, static_cast<long long>(done_), static_cast<long long>(total_), eta);
  std::fflush(stderr);
  drawn_ = true;
}

void Progress::finish() {
  if (drawn_) clear_line();
  drawn_ = false;
  enabled_ = false;
}

Activity::Activity(std::string label) : label_(std::move(label)), enabled_(stderr_is_tty()) {
  if (enabled_) thread_ = std::thread([this] { run(); });
}

Activity::~Activity() {
  if (!enabled_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  if (drawn_) clear_line();
}

void Activity::run() {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  if (cv_.wait_for(lock, kDelay, [this] { return stop_; })) return;
  while (!stop_) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "\r\033[K%s ... %.1fs", label_.c_str(), elapsed);
    std::fflush(stderr);
    drawn_ = true;
    cv_.wait_for(lock, std::chrono::milliseconds(200), [this] { return stop_; });
  }
}

}  // namespace kvcli
