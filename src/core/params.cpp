// SPDX-License-Identifier: Apache-2.0
#include "core/params.hpp"

#include <cerrno>
#include <cstdlib>
#include <sstream>

#include "core/error.hpp"

namespace kvs {
namespace {

std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

void check_value(const std::string& method, const ParamSpec& sp, const std::string& v) {
  const std::string type = sp.type;
  auto bad = [&](const std::string& what) {
    invalid("method_params: parameter '" + std::string(sp.name) + "' of method '" + method + "' expects " +
            what + ", got '" + v + "'");
  };
  if (type == "int") {
    char* end = nullptr;
    errno = 0;
    std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end || errno) bad("an integer");
  } else if (type == "float") {
    char* end = nullptr;
    errno = 0;
    std::strtod(v.c_str(), &end);
    if (v.empty() || *end || errno) bad("a number");
  } else if (type == "bool") {
    if (v != "true" && v != "false" && v != "1" && v != "0") bad("true or false");
  } else if (type.rfind("enum:", 0) == 0) {
    std::stringstream ss(type.substr(5));
    std::string opt;
    while (std::getline(ss, opt, '|'))
      if (opt == v) return;
    bad("one of " + type.substr(5));
  }
}

}  // namespace

ParamSet ParamSet::parse(const std::string& method, const std::vector<ParamSpec>& specs, const char* text) {
  ParamSet ps;
  ps.method_ = method;
  for (auto& s : specs) {
    ps.values_[s.name] = s.default_value;
    ps.types_[s.name] = s.type;
  }
  // NULL, "" and blanks mean "no parameters"; otherwise every comma-separated item is one
  // key=value (an empty item is a typo, e.g. "a=1,,b=2" or a trailing comma, and is refused, as is
  // a key given twice: which value was meant cannot be known).
  std::map<std::string, size_t> seen;  // key -> item number (1-based)
  if (text && !trim(text).empty()) ps.parse_items(method, specs, text, seen);
  // preset=paper: the paper values of the parameters the text left unset.
  if (auto it = ps.values_.find("preset"); it != ps.values_.end() && it->second == "paper")
    for (auto& s : specs)
      if (s.paper_value && !seen.count(s.name)) {
        check_value(method, s, s.paper_value);
        ps.values_[s.name] = s.paper_value;
      }
  return ps;
}

void ParamSet::parse_items(const std::string& method, const std::vector<ParamSpec>& specs, const char* text,
                           std::map<std::string, size_t>& seen) {
  ParamSet& ps = *this;
  const std::string all = text;
  size_t pos = 0, number = 0;
  for (;;) {
    const size_t comma = all.find(',', pos);
    std::string item = trim(all.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    ++number;
    if (item.empty())
      invalid("method_params: item " + std::to_string(number) + " of '" + all +
              "' is empty: expected key=value items separated by single commas");
    const size_t eq = item.find('=');
    if (eq == std::string::npos)
      invalid("method_params: expected key=value, got '" + item + "'");
    const std::string key = trim(item.substr(0, eq)), val = trim(item.substr(eq + 1));
    const ParamSpec* sp = nullptr;
    for (auto& s : specs)
      if (key == s.name) sp = &s;
    if (!sp) {
      std::string names;
      for (auto& s : specs) names += (names.empty() ? "" : ", ") + std::string(s.name);
      invalid("method_params: method '" + method + "' has no parameter '" + key + "' (parameters: " +
              (names.empty() ? "none" : names) + ")");
    }
    check_value(method, *sp, val);
    auto [at, fresh] = seen.emplace(key, number);
    if (!fresh)
      invalid("method_params: parameter '" + key + "' is given twice (items " + std::to_string(at->second) +
              " and " + std::to_string(number) + " of '" + all + "')");
    ps.values_[key] = val;
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
}

ParamSet ParamSet::from_json(const std::string& method, const std::vector<ParamSpec>& specs,
                             const nlohmann::json& j) {
  std::string text;
  if (j.is_object())
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!it.value().is_string()) fail(KVS_STATUS_FORMAT_INVALID, "tables header: parameter '" + it.key() + "' is not a string");
      text += (text.empty() ? "" : ",") + it.key() + "=" + it.value().get<std::string>();
    }
  return parse(method, specs, text.c_str());
}

int64_t ParamSet::get_int(const std::string& key) const { return std::strtoll(get_string(key).c_str(), nullptr, 10); }
double ParamSet::get_float(const std::string& key) const { return std::strtod(get_string(key).c_str(), nullptr); }
bool ParamSet::get_bool(const std::string& key) const {
  const auto& v = get_string(key);
  return v == "true" || v == "1";
}
const std::string& ParamSet::get_string(const std::string& key) const {
  auto it = values_.find(key);
  if (it == values_.end()) fail(KVS_STATUS_INTERNAL, "method '" + method_ + "' read undeclared parameter '" + key + "'");
  return it->second;
}

nlohmann::json ParamSet::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (auto& [k, v] : values_) j[k] = v;
  return j;
}

std::string ParamSet::to_text() const {
  std::string s;
  for (auto& [k, v] : values_) s += (s.empty() ? "" : ",") + k + "=" + v;
  return s;
}

}  // namespace kvs
