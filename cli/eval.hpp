// SPDX-License-Identifier: Apache-2.0
// Trace replay against a float64 reference (docs/cli.md, "kvsieve eval"), shared by `eval` and `demo`.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common.hpp"

namespace kvcli {

struct EvalOptions {
  std::string trace;
  std::vector<std::string> methods;                 // registry names, in report order
  std::map<std::string, std::string> method_params;  // method -> "key=value,..."
  double budget = 0.05;
  std::vector<double> budgets;  // a sweep, one row per method per budget; empty = {budget}
  int32_t backend = KVS_BACKEND_CPU;
  unsigned threads = 0;  // library and reference threads; 0 = all
  int64_t max_steps = 0;  // 0 = every decode step of the trace
  std::vector<std::string> stats;  // method statistics to read after the replay (kvs_session_method_stat)
};

struct MethodResult {
  std::string name;
  double budget = 0;
  double recall_at_k = 0;         // mean over steps, layers, KV heads
  double mass_recall = 0;         // mean over steps, layers, query heads
  double mass_recall_p5 = 0;      // 5th percentile over (step, layer) of the mean over query heads
  std::vector<std::pair<uint32_t, double>> layer_mass_recall;  // per layer: mean over steps and heads
  double output_rel_err = 0;      // mean over steps, layers, query heads
  double output_rel_err_p95 = 0;  // 95th percentile of the same samples
  double lse_abs_err = 0;         // mean over steps, layers, query heads
  double step_us = 0;             // mean time of one kvs_session_decode call (one layer, one token)
  double full_step_us = 0;        // the same for `full`, measured in the same run
  double kept_fraction = 0;       // mean |S| / (t + 1) over steps, layers, KV heads
  // Selections (one per step, layer and KV head) with more keys than the budget grants,
  // ceil(budget * (t + 1)) (full excepted: it attends everything by definition), and the largest
  // |S| / budget keys among them.
  int64_t over_budget = 0, selections = 0;
  double max_over_ratio = 0;
  bool under_budget = false;  // kept fraction under 0.9 x the budget's, on average
  nlohmann::ordered_json params;  // the parameters the session resolved (defaults included)
  int64_t nonfinite = 0;          // outputs with NaN/inf (counted as error inf)
  std::vector<std::pair<std::string, double>> stats;  // the requested statistics the method knows
};

struct EvalReport {
  std::string trace;
  uint64_t trace_bytes = 0;
  uint64_t trace_xxh3 = 0;  // XXH3-64 of the trace file's bytes
  std::vector<double> budgets;
  int32_t backend = KVS_BACKEND_CPU;
  unsigned threads = 0;  // resolved (never 0)
  int64_t steps = 0;  // decode steps replayed per layer
  size_t layers = 0;  // present layers replayed
  kvs_trace_info info{};  // the trace's shape (info.source is not kept)
  std::vector<MethodResult> methods;  // budget by budget, methods in --methods order within each
};

// Resolves a --methods list: "all" (alone or as an item) expands to every registered method that
// supports `backend`; unknown names fail with a UsageError listing the available ones.
std::vector<std::string> resolve_methods(const std::string& list, int32_t backend);

// Parses "--params method:key=value,key=value,other:key=value" (items without "method:" continue
// the previous method). Every method named must be in `methods`.
// Parses a --budgets list ("0.01,0.02,0.05"): each in (0, 1], no repeats; throws UsageError naming
// the option.
std::vector<double> parse_budget_list(const std::string& list, const char* option);

std::map<std::string, std::string> parse_method_params(const std::vector<std::string>& specs,
                                                       const std::vector<std::string>& methods);

EvalReport run_eval(const EvalOptions& opts);

// The mark after a kept fraction: " !" over the budget (some selection), " ~" under 0.9 x it (on
// average), else "".
const char* budget_mark(bool over, bool under);
std::string render_eval_table(const EvalReport& r);
// The JSON document of docs/cli.md ("kvsieve eval", JSON output).
nlohmann::ordered_json eval_json(const EvalReport& r);

}  // namespace kvcli
