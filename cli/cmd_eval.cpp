// SPDX-License-Identifier: Apache-2.0
// kvsieve eval --trace T --methods a,b,... --budget B | --budgets B1,B2,...: replay a trace through
// each method (at each budget) and score it against exact float64 attention (docs/cli.md).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "commands.hpp"
#include "common.hpp"
#include "eval.hpp"

namespace kvcli {

namespace {

struct EvalCliOptions {
  std::string trace, suite, half = "all", methods = "all", backend = "cpu", json, plot;
  std::vector<std::string> params;
  std::string stats, budgets;
  double budget = 0.05;
  unsigned threads = 0;
  int64_t steps = 0;
};

// --plot: two panels against the kept fraction (mass recall; output error, log scale), one line per
// method through its budgets. Drawn by Python's matplotlib, fed the eval JSON on a file.
constexpr const char* kPlotScript = R"PY(
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
out, src = sys.argv[1], sys.argv[2]
d = json.load(open(src))
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
names = []
for m in d["methods"]:
    if m["name"] not in names:
        names.append(m["name"])
for n in names:
    rows = sorted((m for m in d["methods"] if m["name"] == n), key=lambda m: m["kept_fraction"])
    x = [100.0 * m["kept_fraction"] for m in rows]
    a.plot(x, [m["mass_recall"] for m in rows], marker="o", label=n)
    b.plot(x, [m["output_rel_err"] if m["output_rel_err"] is not None else float("nan") for m in rows],
           marker="o", label=n)
for ax, yl in ((a, "mass recall"), (b, "output relative error")):
    ax.set_xscale("log")
    ax.set_xlabel("keys kept (% of the context)")
    ax.set_ylabel(yl)
    ax.grid(True, which="both", alpha=0.3)
b.set_yscale("log")
a.legend(fontsize=8)
fig.suptitle("%s: %d steps x %d layers, budgets %s" % (d["trace"].split("/")[-1], d["steps"], d["layers"],
             ",".join("%g" % x for x in d["budgets"])), fontsize=10)
fig.tight_layout()
fig.savefig(out, dpi=120)
)PY";

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

// The Python that draws --plot: $KVSIEVE_PYTHON, else python3.
std::string plot_python() {
  const char* env = std::getenv("KVSIEVE_PYTHON");
  return env && *env ? env : "python3";
}

// Runs `python - ARGS` with `script` on stdin; returns the exit status (127: could not start).
// Its output goes to stderr (stdout may carry `--json -`), or nowhere when `quiet`.
int run_python(const std::string& python, const std::string& args, const char* script, bool quiet = false) {
  const std::string cmd = shell_quote(python) + " - " + args + (quiet ? " >/dev/null 2>&1" : " >&2");
  // A Python that cannot start closes the pipe at once: the write must fail with EPIPE, not kill us
  // with SIGPIPE (ignored for the write, restored after).
  struct sigaction ign{}, old{};
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  sigaction(SIGPIPE, &ign, &old);
  FILE* p = popen(cmd.c_str(), "w");
  if (!p) {
    sigaction(SIGPIPE, &old, nullptr);
    return 127;
  }
  std::fputs(script, p);
  const int st = pclose(p);
  sigaction(SIGPIPE, &old, nullptr);
  return st >= 0 && WIFEXITED(st) ? WEXITSTATUS(st) : 127;
}

// Fails before the replay (which may take long) when the plot cannot be drawn.
void check_plot_python() {
  const std::string py = plot_python();
  const int rc = run_python(py, "", "import matplotlib\n", /*quiet=*/true);
  if (rc != 0)
    throw CliError("--plot needs Python with matplotlib: '" + py + "' " +
                   (rc == 127 ? std::string("could not be run") : "cannot import matplotlib") +
                   " (install it, e.g. `pip install matplotlib`, or set KVSIEVE_PYTHON to a Python that has "
                   "it; or drop --plot and plot the --json output yourself)");
}

void write_plot(const std::string& png, const EvalReport& rep) {
  const char* dir = std::getenv("TMPDIR");
  std::string tmp = std::string(dir && *dir ? dir : "/tmp") + "/kvsieve-eval-plot.XXXXXX";
  const int fd = mkstemp(tmp.data());
  if (fd < 0) throw CliError("--plot: cannot create a temporary file (set TMPDIR): " + std::string(std::strerror(errno)));
  close(fd);
  struct Unlink {
    std::string p;
    ~Unlink() { std::remove(p.c_str()); }
  } unlink_it{tmp};
  write_text_file(tmp, eval_json(rep).dump() + "\n");
  const int rc = run_python(plot_python(), shell_quote(png) + " " + shell_quote(tmp), kPlotScript);
  if (rc != 0) throw CliError(strfmt("--plot %s: the plotting script failed (exit %d; its message is above)", png.c_str(), rc));
}

// A suite file: one trace per line, a path relative to the file's folder (or absolute), then an
// optional half, `tuning` or `heldout` (blank lines and `#` comments skipped).
struct SuiteEntry {
  std::string path, half;
};
std::vector<SuiteEntry> read_suite(const std::string& file, const std::string& half) {
  if (half != "all" && half != "tuning" && half != "heldout")
    throw UsageError("--half: expected all, tuning or heldout, got '" + half + "'");
  std::FILE* f = std::fopen(file.c_str(), "r");
  if (!f) throw CliError("cannot read --suite '" + file + "': " + std::strerror(errno));
  const size_t slash = file.rfind('/');
  const std::string dir = slash == std::string::npos ? std::string() : file.substr(0, slash + 1);
  std::vector<SuiteEntry> out;
  char buf[4096];
  int line = 0;
  while (std::fgets(buf, sizeof buf, f)) {
    ++line;
    std::string s(buf);
    if (const size_t h = s.find('#'); h != std::string::npos) s.resize(h);
    std::vector<std::string> words;
    for (size_t i = 0; i < s.size();) {
      while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
      size_t j = i;
      while (j < s.size() && !std::isspace(static_cast<unsigned char>(s[j]))) ++j;
      if (j > i) words.push_back(s.substr(i, j - i));
      i = j;
    }
    if (words.empty()) continue;
    if (words.size() > 2 || (words.size() == 2 && words[1] != "tuning" && words[1] != "heldout")) {
      std::fclose(f);
      throw UsageError(strfmt("--suite %s line %d: expected `PATH [tuning|heldout]`", file.c_str(), line));
    }
    SuiteEntry e{words[0].front() == '/' ? words[0] : dir + words[0], words.size() == 2 ? words[1] : ""};
    if (half == "all" || e.half == half) out.push_back(std::move(e));
  }
  std::fclose(f);
  if (out.empty())
    throw UsageError("--suite " + file + ": no trace" + (half == "all" ? std::string() : " in the " + half + " half"));
  return out;
}

// --suite: eval on every trace, then per method and budget the mean over the traces and the worst.
int run_suite_command(const EvalCliOptions& c, EvalOptions o) {
  const auto entries = read_suite(c.suite, c.half);
  const bool json_stdout = c.json == "-";
  FILE* text = json_stdout ? stderr : stdout;
  std::vector<EvalReport> reps;
  for (const auto& e : entries) {
    o.trace = e.path;
    reps.push_back(run_eval(o));
    std::fprintf(text, "== %s%s: %lld steps x %zu layers\n", e.path.c_str(), e.half.empty() ? "" : (" (" + e.half + ")").c_str(),
                 static_cast<long long>(reps.back().steps), reps.back().layers);
    std::fputs(render_eval_table(reps.back()).c_str(), text);
    std::fputs("\n", text);
  }
  // Rows in the order of the first report (budget by budget, methods in --methods order).
  TextTable table({"method", "budget", "kept", "mass recall", "mass p5", "out err", "worst trace (mass recall)"},
                  {false, true, true, true, true, true, false});
  nlohmann::ordered_json summary = nlohmann::ordered_json::array();
  for (size_t i = 0; i < reps.front().methods.size(); ++i) {
    const auto& first = reps.front().methods[i];
    double kept = 0, mass = 0, p5 = 0, err = 0, worst = 2;
    bool over = false, under = false;  // over the budget on some trace; under it on some trace
    std::string worst_trace;
    for (size_t t = 0; t < reps.size(); ++t) {
      const auto& m = reps[t].methods[i];
      kept += m.kept_fraction;
      mass += m.mass_recall;
      p5 += m.mass_recall_p5;
      err += m.output_rel_err;
      over = over || m.over_budget > 0;
      under = under || m.under_budget;
      if (m.mass_recall < worst) {
        worst = m.mass_recall;
        worst_trace = entries[t].path;
      }
    }
    const double n = double(reps.size());
    table.add_row({first.name, strfmt("%.3g", first.budget),
                   strfmt("%.1f%%%s", 100.0 * kept / n, budget_mark(over, under)),
                   strfmt("%.3f", mass / n),
                   strfmt("%.3f", p5 / n), strfmt("%.2e", err / n), strfmt("%.3f %s", worst, worst_trace.c_str())});
    summary.push_back({{"name", first.name}, {"budget", first.budget}, {"kept_fraction", kept / n}, {"over_budget", over},
                       {"under_budget", under},
                       {"mass_recall", mass / n}, {"mass_recall_p5", p5 / n}, {"output_rel_err", err / n},
                       {"worst_mass_recall", worst}, {"worst_trace", worst_trace}});
  }
  std::fprintf(text, "suite %s (%s): %zu traces, mean over the traces and the worst\n\n", c.suite.c_str(),
               c.half.c_str(), reps.size());
  std::fputs(table.render().c_str(), text);
  if (!c.json.empty()) {
    nlohmann::ordered_json doc;
    doc["suite"] = c.suite;
    doc["half"] = c.half;
    doc["summary"] = std::move(summary);
    doc["traces"] = nlohmann::ordered_json::array();
    for (const auto& r : reps) doc["traces"].push_back(eval_json(r));
    if (json_stdout) {
      std::fputs((doc.dump(2) + "\n").c_str(), stdout);
      std::fflush(stdout);
    } else {
      write_text_file(c.json, doc.dump(2) + "\n");
      std::fprintf(text, "\nwrote %s\n", c.json.c_str());
    }
  }
  return kExitOk;
}

int run_eval_command(const EvalCliOptions& c) {
  if (c.steps < 0) throw UsageError("--steps must be >= 0");
  if (c.trace.empty() == c.suite.empty()) throw UsageError("give --trace FILE or --suite FILE (one of them)");
  if (!c.suite.empty() && !c.plot.empty()) throw UsageError("--plot draws one trace: it cannot be used with --suite");
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
  if (!c.plot.empty()) check_plot_python();
  if (!c.suite.empty()) return run_suite_command(c, o);

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
  if (!c.plot.empty()) {
    write_plot(c.plot, rep);
    std::fprintf(text, "wrote %s\n", c.plot.c_str());
  }
  return kExitOk;
}

}  // namespace

Command add_eval_command(CLI::App& root) {
  auto o = std::make_shared<EvalCliOptions>();
  CLI::App* cmd = root.add_subcommand(
      "eval", "replay a trace through methods; recall, mass recall, output/LSE error and speed vs exact");
  cmd->add_option("--trace", o->trace, "input trace (.safetensors, kvsieve-trace)");
  cmd->add_option("--suite", o->suite,
                  "a list of traces (one per line: PATH [tuning|heldout], relative to the list's folder); "
                  "prints each trace's table and, per method, the mean over the traces and the worst");
  cmd->add_option("--half", o->half, "with --suite: the traces to run, all, tuning or heldout (default all)");
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
  cmd->add_option("--plot", o->plot,
                  "also draw mass recall and output error against the kept fraction into this PNG "
                  "(needs Python with matplotlib: python3, or $KVSIEVE_PYTHON)");
  cmd->add_option("--stats", o->stats,
                  "comma-separated method statistics to print after the table (kvs_session_method_stat; "
                  "names a method does not know are skipped)");
  return {cmd, [o] { return run_eval_command(*o); }};
}

}  // namespace kvcli
