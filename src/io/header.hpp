// SPDX-License-Identifier: Apache-2.0
// Checked reads of a tables file's JSON header. The checksums prove that a header is the one that
// was written, not that a writer was honest: every value a loader takes from the header is read
// through this class, which checks its JSON type and its range at the C++ type it lands in before
// converting it. A float where an integer belongs (1e20), 2^32 + 8 for a uint32_t, a bool, a string
// or a missing field becomes KVS_STATUS_FORMAT_INVALID with the message
//   tables file 'PATH': header: FIELD: expected an integer in [a, b], got X
// never a conversion with undefined behaviour or a silent wrap-around. FIELD is the dotted JSON
// path ("shape.head_dim", "method.meta.layers.3.indexed_tokens").
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace kvs::io {

class HeaderReader {
 public:
  // path: the tables file (for messages); prefix: the JSON path of the objects this reader reads
  // ("" for the header itself).
  explicit HeaderReader(std::string path, std::string prefix = {})
      : path_(std::move(path)), prefix_(std::move(prefix)) {}

  // A reader for the object under `key` of this one (its messages name prefix.key.FIELD).
  HeaderReader sub(std::string_view key) const { return HeaderReader(path_, field(key)); }

  const std::string& path() const { return path_; }
  std::string field(std::string_view key) const {
    return prefix_.empty() ? std::string(key) : prefix_ + "." + std::string(key);
  }
  // "tables file 'PATH': " for messages about the file that are not about one header field.
  std::string where() const { return "tables file '" + path_ + "': "; }

  // KVS_STATUS_FORMAT_INVALID: "tables file 'PATH': header: FIELD: what".
  [[noreturn]] void fail(std::string_view key, const std::string& what) const {
    kvs::fail(KVS_STATUS_FORMAT_INVALID, where() + "header: " + field(key) + ": " + what);
  }

  // The JSON text of a value for a message (at most 64 characters).
  static std::string show(const nlohmann::json& v) {
    std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (s.size() > 64) s = s.substr(0, 61) + "...";
    return s;
  }

  // Member `key` of obj, which must be an object holding it.
  const nlohmann::json& at(const nlohmann::json& obj, std::string_view key) const {
    if (!obj.is_object())
      kvs::fail(KVS_STATUS_FORMAT_INVALID, where() + "header: " + (prefix_.empty() ? std::string("(top level)") : prefix_) +
                                               ": expected an object, got " + show(obj));
    const auto it = obj.find(key);
    if (it == obj.end()) fail(key, "missing");
    return *it;
  }
  bool has(const nlohmann::json& obj, std::string_view key) const {
    return obj.is_object() && obj.find(key) != obj.end();
  }
  const nlohmann::json& object(const nlohmann::json& obj, std::string_view key) const {
    const auto& v = at(obj, key);
    if (!v.is_object()) fail(key, "expected an object, got " + show(v));
    return v;
  }
  const nlohmann::json& array(const nlohmann::json& obj, std::string_view key) const {
    const auto& v = at(obj, key);
    if (!v.is_array()) fail(key, "expected an array, got " + show(v));
    return v;
  }

  // A JSON integer (not a float, not a bool) in [lo, hi], converted to T.
  template <class T>
  T integer(const nlohmann::json& obj, std::string_view key, T lo, T hi) const {
    return integer_value<T>(at(obj, key), key, lo, hi);
  }
  // The same, `fallback` when obj has no member `key` (fields added by later writers).
  template <class T>
  T integer_or(const nlohmann::json& obj, std::string_view key, T lo, T hi, T fallback) const {
    return has(obj, key) ? integer_value<T>(at(obj, key), key, lo, hi) : fallback;
  }
  // The value v itself (an array element, say); key names it in messages.
  template <class T>
  T integer_value(const nlohmann::json& v, std::string_view key, T lo, T hi) const {
    static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (std::cmp_greater_equal(u, lo) && std::cmp_less_equal(u, hi)) return static_cast<T>(u);
    } else if (v.is_number_integer()) {
      const int64_t s = v.get<int64_t>();
      if (std::cmp_greater_equal(s, lo) && std::cmp_less_equal(s, hi)) return static_cast<T>(s);
    }
    fail(key, "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + show(v));
  }

  // A JSON number (integer or float, not a bool), finite, in [lo, hi].
  double number(const nlohmann::json& obj, std::string_view key, double lo, double hi) const {
    const auto& v = at(obj, key);
    if (v.is_number()) {
      const double x = v.get<double>();
      if (std::isfinite(x) && x >= lo && x <= hi) return x;
    }
    fail(key, "expected a number in [" + num(lo) + ", " + num(hi) + "], got " + show(v));
  }

  bool boolean(const nlohmann::json& obj, std::string_view key) const {
    const auto& v = at(obj, key);
    if (!v.is_boolean()) fail(key, "expected true or false, got " + show(v));
    return v.get<bool>();
  }
  bool boolean_or(const nlohmann::json& obj, std::string_view key, bool fallback) const {
    return has(obj, key) ? boolean(obj, key) : fallback;
  }

  std::string string(const nlohmann::json& obj, std::string_view key) const {
    const auto& v = at(obj, key);
    if (!v.is_string()) fail(key, "expected a string, got " + show(v));
    return v.get<std::string>();
  }

 private:
  static std::string num(double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", x);
    return buf;
  }
  std::string path_, prefix_;
};

}  // namespace kvs::io
