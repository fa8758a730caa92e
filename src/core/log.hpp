// SPDX-License-Identifier: Apache-2.0
// Process-wide log sink (set atomically through kvs_set_log_callback). Lines are whole.
#pragma once
#include <cstdarg>
#include <string>

namespace kvs {
enum class LogLevel : int { Debug = 0, Info = 1, Warn = 2, Error = 3, Off = 4 };
bool log_enabled(LogLevel level);
void log_line(LogLevel level, const std::string& line);
void logf(LogLevel level, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
}  // namespace kvs
