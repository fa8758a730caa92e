// SPDX-License-Identifier: Apache-2.0
// kvsieve inspect FILE [--json]: verify a tables file and describe it (kvs_tables_describe).
//
// The description's schema belongs to the library (docs/formats.md); this printer is generic on
// purpose: scalars as "key: value", objects as indented blocks, arrays of objects (the section
// directory) as tables, so a new field shows up without a CLI change.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"

namespace kvcli {

namespace {

using ojson = nlohmann::ordered_json;

constexpr size_t kMaxTableRows = 64;

struct InspectOptions {
  std::string file;
  bool json = false;
};

bool is_corruption(int32_t code) {
  switch (code) {
    case KVS_STATUS_FORMAT_MAGIC:
    case KVS_STATUS_FORMAT_VERSION:
    case KVS_STATUS_FORMAT_TRUNCATED:
    case KVS_STATUS_FORMAT_CHECKSUM:
    case KVS_STATUS_FORMAT_INVALID:
      return true;
    default:
      return false;
  }
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_size_key(const std::string& key) {
  return ends_with(key, "bytes") || ends_with(key, "_size") || key == "size" ||
         key.find("bytes_") != std::string::npos;
}

// `in_bytes`: the value sits in an object of sizes (e.g. "bytes_by_tag").
std::string scalar_text(const std::string& key, const ojson& v, bool in_bytes = false) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "yes" : "no";
  if (v.is_null()) return "-";
  if (key == "backend" && v.is_number_integer()) return backend_name(v.get<int32_t>());
  std::string text = v.dump();
  // Sizes read better with a unit beside them.
  if (v.is_number_integer() && (in_bytes || is_size_key(key)) && v.get<double>() >= 1024.0)
    text += " (" + human_bytes(v.get<double>()) + ")";
  return text;
}

bool all_scalars(const ojson& a) {
  for (const auto& x : a)
    if (x.is_structured()) return false;
  return true;
}

void print_value(const std::string& key, const ojson& v, int indent, bool in_bytes = false);

void print_table(const std::string& key, const ojson& arr, int indent) {
  std::vector<std::string> cols;
  for (const auto& row : arr)
    for (const auto& [k, _] : row.items())
      if (std::find(cols.begin(), cols.end(), k) == cols.end()) cols.push_back(k);
  std::printf("%*s%s (%zu):\n", indent, "", key.c_str(), arr.size());
  cols.insert(cols.begin(), "#");
  std::vector<bool> numeric;
  for (const auto& c : cols) {
    bool num = true;
    for (const auto& row : arr)
      if (c != "#" && row.contains(c) && !row[c].is_number()) num = false;
    numeric.push_back(num);
  }
  TextTable table(cols, numeric);
  size_t shown = 0;
  for (const auto& row : arr) {
    if (shown++ == kMaxTableRows) break;
    std::vector<std::string> cells;
    for (const auto& c : cols) {
      if (c == "#") {
        cells.push_back(std::to_string(shown - 1));
      } else if (!row.contains(c)) {
        cells.emplace_back("");
      } else if (row[c].is_structured()) {
        cells.push_back(row[c].dump());
      } else {
        cells.push_back(row[c].is_number() ? row[c].dump() : scalar_text(c, row[c]));
      }
    }
    table.add_row(std::move(cells));
  }
  std::fputs(table.render(indent + 2).c_str(), stdout);
  if (arr.size() > kMaxTableRows)
    std::printf("%*s... %zu more (use --json for all)\n", indent + 2, "", arr.size() - kMaxTableRows);
}

void print_value(const std::string& key, const ojson& v, int indent, bool in_bytes) {
  if (v.is_object()) {
    std::printf("%*s%s:\n", indent, "", key.c_str());
    if (v.empty()) std::printf("%*s(none)\n", indent + 2, "");
    for (const auto& [k, x] : v.items()) print_value(k, x, indent + 2, is_size_key(key));
  } else if (v.is_array()) {
    if (v.empty()) {
      std::printf("%*s%s: (none)\n", indent, "", key.c_str());
    } else if (all_scalars(v)) {
      std::vector<std::string> items;
      for (const auto& x : v) items.push_back(scalar_text("", x));
      std::printf("%*s%s: %s\n", indent, "", key.c_str(), join(items, ", ").c_str());
    } else {
      bool objects = true;
      for (const auto& x : v) objects = objects && x.is_object();
      if (objects) {
        print_table(key, v, indent);
      } else {
        std::printf("%*s%s:\n", indent, "", key.c_str());
        for (size_t i = 0; i < v.size(); ++i) print_value("[" + std::to_string(i) + "]", v[i], indent + 2);
      }
    }
  } else {
    std::printf("%*s%s: %s\n", indent, "", key.c_str(), scalar_text(key, v, in_bytes).c_str());
  }
}

int run_inspect(const InspectOptions& o) {
  char* raw = nullptr;
  const Status st = take_status(kvs_tables_describe(o.file.c_str(), &raw));
  LibString owned(raw);

  ojson doc;
  bool parsed = false;
  if (raw != nullptr) {
    try {
      doc = ojson::parse(raw);
      parsed = true;
    } catch (const std::exception& e) {
      throw CliError(strfmt("the library's description of '%s' is not valid JSON: %s", o.file.c_str(), e.what()));
    }
  }
  const bool json_says_bad = parsed && doc.is_object() && doc.contains("ok") && doc["ok"].is_boolean() &&
                             !doc["ok"].get<bool>();

  if (parsed) {
    if (o.json) {
      std::printf("%s\n", doc.dump(2).c_str());
    } else {
      std::printf("%s: %s\n", o.file.c_str(), (st.ok() && !json_says_bad) ? "ok" : "FAILED VERIFICATION");
      if (doc.is_object()) {
        for (const auto& [k, v] : doc.items()) {
          // "ok" is the status line above; an absent error needs no line of its own.
          if (k == "ok" || (k == "error" && v.is_null()) || (k == "error_code" && v == 0)) continue;
          print_value(k, v, 2);
        }
      } else {
        print_value("description", doc, 2);
      }
    }
  }

  if (!st.ok()) {
    const std::string msg = strfmt("%s [%s]", st.message.c_str(), status_name(st.code));
    if (is_corruption(st.code)) throw CliError(msg, kExitCorrupt);
    throw CliError(msg);
  }
  if (json_says_bad) {
    std::string why = doc.contains("error") ? scalar_text("error", doc["error"]) : "no reason given";
    throw CliError(strfmt("'%s' failed verification: %s", o.file.c_str(), why.c_str()), kExitCorrupt);
  }
  if (!parsed) throw CliError("the library returned no description of '" + o.file + "'");
  return kExitOk;
}

}  // namespace

Command add_inspect_command(CLI::App& root) {
  auto o = std::make_shared<InspectOptions>();
  CLI::App* cmd = root.add_subcommand(
      "inspect", "verify a tables file (checksums, sizes) and describe it; exit 3 if corrupt");
  cmd->add_option("file", o->file, "tables file written by `kvsieve build` or kvs_session_save")->required();
  cmd->add_flag("--json", o->json, "print the library's JSON description");
  return {cmd, [o] { return run_inspect(*o); }};
}

}  // namespace kvcli
