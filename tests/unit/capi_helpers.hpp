// SPDX-License-Identifier: Apache-2.0
// Helpers of the unit tests that go through the public C API: an owned kvs_error_t (Err), OK(expr)
// that requires success and shows the error message otherwise, and an owned session (Sess).
#pragma once
#include <doctest/doctest.h>

#include <string>

#include "kvsieve/kvsieve.h"

namespace kvt {

struct Err {
  kvs_error_t e;
  ~Err() { kvs_error_destroy(e); }
  int code() const { return kvs_error_code(e); }
  std::string msg() const { return e ? kvs_error_message(e) : ""; }
};

struct Sess {
  kvs_session_t s = nullptr;
  Sess() = default;
  Sess(const Sess&) = delete;
  Sess& operator=(const Sess&) = delete;
  ~Sess() { kvs_session_destroy(s); }
};

}  // namespace kvt

#define OK(expr)              \
  do {                        \
    kvt::Err _e{(expr)};      \
    INFO(_e.msg());           \
    REQUIRE(_e.e == nullptr); \
  } while (0)
