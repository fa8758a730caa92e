// SPDX-License-Identifier: Apache-2.0
#include "core/log.hpp"

#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>

#include "kvsieve/kvsieve.h"

namespace kvs {
namespace {
struct Sink {
  kvs_log_fn fn;
  void* user;
  int min_level;
};
// The sink is replaced as a whole (fn + user_data + level), so a reader never sees a torn pair.
std::shared_ptr<const Sink>& sink_slot() {
  static std::shared_ptr<const Sink> s = std::make_shared<Sink>(Sink{nullptr, nullptr, int(LogLevel::Warn)});
  return s;
}
std::shared_ptr<const Sink> current() { return std::atomic_load(&sink_slot()); }
const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::Debug: return "debug";
    case LogLevel::Info: return "info";
    case LogLevel::Warn: return "warning";
    case LogLevel::Error: return "error";
    default: return "";
  }
}
}  // namespace

bool log_enabled(LogLevel level) { return int(level) >= current()->min_level && level != LogLevel::Off; }

void log_line(LogLevel level, const std::string& line) {
  auto s = current();
  if (int(level) < s->min_level || level == LogLevel::Off) return;
  if (s->fn) {
    s->fn(int32_t(level), line.c_str(), s->user);
  } else {
    static std::mutex m;
    std::lock_guard<std::mutex> g(m);
    std::fprintf(stderr, "kvsieve %s: %s\n", level_name(level), line.c_str());
  }
}

void logf(LogLevel level, const char* fmt, ...) {
  if (!log_enabled(level)) return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  log_line(level, buf);
}

}  // namespace kvs

extern "C" KVS_API void kvs_set_log_callback(kvs_log_fn fn, void* user_data, int32_t min_level) {
  try {
    int lvl = min_level < 0 ? 0 : (min_level > 4 ? 4 : min_level);
    auto s = std::make_shared<const kvs::Sink>(kvs::Sink{fn, fn ? user_data : nullptr, fn ? lvl : int(kvs::LogLevel::Warn)});
    std::atomic_store(&kvs::sink_slot(), std::shared_ptr<const kvs::Sink>(s));
  } catch (...) {
    // Allocation failure: keep the previous sink.
  }
}
