// SPDX-License-Identifier: Apache-2.0
// Bounds of method parameters, checked when a session is created. ParamSet only checks that a
// value parses ("int": any int64); a method reads its integers through int_param, which checks the
// range at int64 before the method narrows the value to its own type, so that 4294967297 is refused
// instead of becoming 1 as an int. Parameters that size memory or time get bounds here (and, where
// the bound depends on the prompt, a clamp at build time documented in docs/methods/<m>.md).
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "core/params.hpp"

namespace kvs {

// KVS_STATUS_INVALID_ARGUMENT "method_params: METHOD KEY: expected LO..HI[ (why)], got V".
inline int64_t int_param(const ParamSet& p, const char* method, const char* key, int64_t lo, int64_t hi,
                         const char* why = nullptr) {
  const int64_t v = p.get_int(key);
  if (v < lo || v > hi)
    invalid(std::string("method_params: ") + method + " " + key + ": expected " + std::to_string(lo) + ".." +
            std::to_string(hi) + (why ? std::string(" (") + why + ")" : std::string()) + ", got " + std::to_string(v));
  return v;
}

}  // namespace kvs
