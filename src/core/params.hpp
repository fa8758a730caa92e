// SPDX-License-Identifier: Apache-2.0
// Method parameters: each method declares ParamSpecs (name, type, default, one-line doc); a session
// passes "key=value,key=value" text, which is validated against the specs. Every value actually used
// (defaults included) is recorded in saved tables.
//
// Presets: a method that declares an enum parameter named "preset" with a value "paper" gives some
// parameters a paper_value; preset=paper then sets each of them to its paper_value unless the text
// sets it explicitly (explicit values win). The recorded values are the resolved ones, so a saved
// session reloads with the same settings.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvs {

struct ParamSpec {
  const char* name;
  const char* type;  // "int", "float", "bool", "string", "enum:a|b|c"
  const char* default_value;
  const char* doc;
  const char* paper_value = nullptr;  // the value under preset=paper (nullptr: the default)
};

class ParamSet {
 public:
  // Parses and validates "key=value,key=value" text against specs (NULL or blank: every default);
  // unknown keys, bad values and keys given twice throw naming the key, empty items naming their
  // position.
  static ParamSet parse(const std::string& method, const std::vector<ParamSpec>& specs, const char* text);
  static ParamSet from_json(const std::string& method, const std::vector<ParamSpec>& specs,
                            const nlohmann::json& j);

  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  const std::string& get_string(const std::string& key) const;

  nlohmann::json to_json() const;  // all values as strings
  std::string to_text() const;

 private:
  void parse_items(const std::string& method, const std::vector<ParamSpec>& specs, const char* text,
                   std::map<std::string, size_t>& seen);
  std::string method_;
  std::map<std::string, std::string> values_;
  std::map<std::string, std::string> types_;
};

}  // namespace kvs
