// SPDX-License-Identifier: Apache-2.0
// Errors inside the library are C++ exceptions of type kvs::Error; the C API layer (src/capi)
// catches everything and turns it into an owned kvs_error_s. Nothing throws across the C ABI.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "kvsieve/kvsieve.h"

struct kvs_error_s {
  int32_t code;
  std::string message;
  int64_t backend_code;
};

namespace kvs {

class Error : public std::runtime_error {
 public:
  Error(kvs_status code, std::string msg, int64_t backend_code = 0)
      : std::runtime_error(std::move(msg)), code_(code), backend_code_(backend_code) {}
  kvs_status code() const noexcept { return code_; }
  int64_t backend_code() const noexcept { return backend_code_; }

 private:
  kvs_status code_;
  int64_t backend_code_;
};

[[noreturn]] inline void fail(kvs_status code, std::string msg, int64_t backend_code = 0) {
  throw Error(code, std::move(msg), backend_code);
}
[[noreturn]] inline void invalid(std::string msg) {
  throw Error(KVS_STATUS_INVALID_ARGUMENT, std::move(msg));
}

}  // namespace kvs
