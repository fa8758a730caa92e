// SPDX-License-Identifier: Apache-2.0
// The one place where C++ exceptions become C error objects.
#pragma once
#include <new>
#include <string>
#include <utility>

#include "core/error.hpp"

namespace kvs::capi {

// A static error returned when even the error object cannot be allocated; kvs_error_destroy
// recognises it and does not free it.
extern kvs_error_s g_oom_error;

inline kvs_error_t make_error(int32_t code, std::string msg, int64_t backend = 0) noexcept {
  try {
    return new kvs_error_s{code, std::move(msg), backend};
  } catch (...) {
    return &g_oom_error;
  }
}

// Runs f(); converts any exception into an error object.
template <class F>
kvs_error_t guarded(F&& f) noexcept {
  try {
    f();
    return nullptr;
  } catch (const kvs::Error& e) {
    return make_error(e.code(), e.what(), e.backend_code());
  } catch (const std::bad_alloc&) {
    return make_error(KVS_STATUS_OUT_OF_MEMORY, "out of memory");
  } catch (const std::exception& e) {
    return make_error(KVS_STATUS_INTERNAL, std::string("internal error: ") + e.what());
  } catch (...) {
    return make_error(KVS_STATUS_INTERNAL, "internal error: unknown exception");
  }
}

}  // namespace kvs::capi
