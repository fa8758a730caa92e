// SPDX-License-Identifier: Apache-2.0
// kvsieve eval --trace T --methods a,b,... --budget B | --budgets B1,B2,...: replay a trace through
// each method (at each budget) and score it against exact float64 attention (docs/cli.md).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>

#include "commands.hpp"
#include "common.hpp"
#include "eval.hpp"

namespace kvcli {

namespace {

struct EvalCliOptions {
  std::string trace, methods = "all", backend = "cpu", json;
  std::vector<std::string> params;
  std::string stats, budgets;
  double budget = 0.05;
  unsigned threads = 0;
  int64_t steps = 0;
};

int run_eval_command(const EvalCliOptions& c) {
  if (c.steps < 0) throw UsageError("--steps must be >= 0");
  EvalOptions o;
  o.trace = c.trace;
  o.backend = parse_backend(c.backend);
  o.methods = resolve_methods(c.methods, o.backend);
  o.method_params = parse_method_params(c.params, o.methods);
  o.budget = c.budget;
  if (!c.budgets.empty()) o.budgets = parse_budget_list(c.budgets, "--budgets");
  o.threads = c.threads;
  o.max_steps = c.steps;
  if (!c.stats.empty()) o.stats = split(c.stats, ',');

  const EvalReport rep = run_eval(o);
  const auto& info = rep.info;
  // `--json -` puts the JSON document alone on stdout; the table then goes to stderr.
  const bool json_stdout = c.json == "-";
  FILE* text = json_stdout ? stderr : stdout;
  std::vector<std::string> budget_list;
  for (double b : rep.budgets) budget_list.push_back(strfmt("%g", b));
  std::fprintf(text,
               "eval %s: %lld decode steps x %zu layers after a %lld-token prompt; %u q heads, %u kv heads, "
               "d %u, %s; budget%s %s; %s backend, %u threads\n\n",
               c.trace.c_str(), static_cast<long long>(rep.steps), rep.layers,
               static_cast<long long>(info.prefill_len), info.num_q_heads, info.num_kv_heads, info.head_dim,
               dtype_name(dtype_from_scalar(info.dtype)), rep.budgets.size() > 1 ? "s" : "",
               join(budget_list, ",").c_str(), c.backend.c_str(), rep.threads);
  std::fputs(render_eval_table(rep).c_str(), text);
  for (const auto& m : rep.methods) {
    if (m.stats.empty()) continue;
    if (rep.budgets.size() > 1)
      std::fprintf(text, "%s at budget %g stats:", m.name.c_str(), m.budget);
    else
      std::fprintf(text, "%s stats:", m.name.c_str());
    for (const auto& [name, v] : m.stats) std::fprintf(text, " %s=%.4g", name.c_str(), v);
    std::fprintf(text, "\n");
  }
  if (json_stdout) {
    std::fputs((eval_json(rep).dump(2) + "\n").c_str(), stdout);
    std::fflush(stdout);
  } else if (!c.json.empty()) {
    write_text_file(c.json, eval_json(rep).dump(2) + "\n");
    std::printf("\nwrote %s\n", c.json.c_str());
  }
  return kExitOk;
}

}  // namespace

Command add_eval_command(CLI::App& root) {
  auto o = std::make_shared<EvalCliOptions>();
  CLI::App* cmd = root.add_subcommand(
      "eval", "replay a trace through methods; recall, mass recall, output/LSE error and speed vs exact");
  cmd->add_option("--trace", o->trace, "input trace (.safetensors, kvsieve-trace)")->required();
  cmd->add_option("--methods", o->methods, "comma-separated methods, or `all` (every registered one)");
  auto* budget = cmd->add_option("--budget", o->budget, "exact keys per step, as a fraction of the context, (0, 1]");
  cmd->add_option("--budgets", o->budgets,
                  "a sweep: comma-separated budgets, e.g. 0.01,0.02,0.05,0.1,0.2 (one row per method per budget)")
      ->excludes(budget);
  cmd->add_option("--params", o->params,
                  "method parameters: method:key=value,key=value,other:key=value (repeatable)");
  cmd->add_option("--backend", o->backend, "cpu, cuda or hybrid");
  cmd->add_option("--threads", o->threads, "library and reference threads (0 = all hardware threads)");
  cmd->add_option("--steps", o->steps, "replay at most this many decode steps (0 = all)");
  cmd->add_option("--json", o->json, "also write the results as JSON to this file (`-`: to stdout, the table then goes to stderr)");
  cmd->add_option("--stats", o->stats,
                  "comma-separated method statistics to print after the table (kvs_session_method_stat; "
                  "names a method does not know are skipped)");
  return {cmd, [o] { return run_eval_command(*o); }};
}

}  // namespace kvcli
