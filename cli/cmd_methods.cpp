// SPDX-License-Identifier: Apache-2.0
// kvsieve methods [--json]: the method registry with every parameter and its default.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"

namespace kvcli {

namespace {

struct ParamRow {
  std::string name, type, default_value, doc;
};

const char* or_empty(const char* s) { return s != nullptr ? s : ""; }

std::vector<ParamRow> method_params(const std::string& method) {
  size_t count = 0;
  check(kvs_method_param_count(method.c_str(), &count), "method '" + method + "': parameter count");
  std::vector<ParamRow> rows;
  for (size_t i = 0; i < count; ++i) {
    kvs_param_info info{};
    info.struct_size = sizeof(info);
    check(kvs_method_param(method.c_str(), i, &info),
          strfmt("method '%s': parameter %zu", method.c_str(), i));
    rows.push_back({or_empty(info.name), or_empty(info.type), or_empty(info.default_value),
                    or_empty(info.doc)});
  }
  return rows;
}

int run_methods(bool json) {
  const auto names = registered_methods();
  if (json) {
    nlohmann::json out;
    out["library_version"] = kvs_version();
    out["methods"] = nlohmann::json::array();
    for (const auto& m : names) {
      nlohmann::json jm;
      jm["name"] = m;
      jm["doc"] = or_empty(kvs_method_doc(m.c_str()));
      jm["backends"] = backends_list(kvs_method_backends(m.c_str()));
      jm["params"] = nlohmann::json::array();
      for (const auto& p : method_params(m))
        jm["params"].push_back(
            {{"name", p.name}, {"type", p.type}, {"default", p.default_value}, {"doc", p.doc}});
      out["methods"].push_back(std::move(jm));
    }
    std::printf("%s\n", out.dump(2).c_str());
    return kExitOk;
  }
  std::printf("%zu methods (library %s)\n", names.size(), kvs_version());
  for (const auto& m : names) {
    std::printf("\n%s  [%s]\n  %s\n", m.c_str(), backends_string(kvs_method_backends(m.c_str())).c_str(),
                or_empty(kvs_method_doc(m.c_str())));
    const auto params = method_params(m);
    if (params.empty()) {
      std::printf("  (no parameters)\n");
      continue;
    }
    TextTable table({"parameter", "type", "default", "description"});
    for (const auto& p : params) table.add_row({p.name, p.type, p.default_value, p.doc});
    std::fputs(table.render(2).c_str(), stdout);
  }
  std::printf("\nSet parameters with --params key=value,... (build, bench) or --params method:key=value,... (eval).\n");
  return kExitOk;
}

}  // namespace

Command add_methods_command(CLI::App& root) {
  auto json = std::make_shared<bool>(false);
  CLI::App* cmd = root.add_subcommand("methods", "list the registered methods and their parameters");
  cmd->add_flag("--json", *json, "print JSON instead of text");
  return {cmd, [json] { return run_methods(*json); }};
}

}  // namespace kvcli
