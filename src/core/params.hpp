// Method parameters: each method declares ParamSpecs (name, type, default, one-line doc); a session
// passes "key=value,key=value" text, which is validated against the specs. Every value actually used
// (defaults included) is recorded in saved tables.
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
  std::string method_;
  std::map<std::string, std::string> values_;
  std::map<std::string, std::string> types_;
};

}  // namespace kvs
