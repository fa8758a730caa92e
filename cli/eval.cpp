// SPDX-License-Identifier: Apache-2.0
#include "eval.hpp"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <tuple>
#include <utility>

#include "progress.hpp"
#include "reference.hpp"

namespace kvcli {

namespace {

// Above this mean output error `full` is not computing dense attention: say so loudly, since every
// other row of the table is then measured against a broken yardstick.
constexpr double kFullTolerance = 1e-3;

struct Accum {
  double recall = 0, mass = 0, lse = 0, time_us = 0, kept = 0;
  int64_t recall_n = 0, head_n = 0, calls = 0;
  std::vector<double> errs;
  std::map<uint32_t, std::pair<double, int64_t>> layer_mass;  // layer -> (sum over heads and steps, count)
  std::vector<double> step_mass;  // per (step, layer): mean mass recall over the query heads
  int64_t nonfinite = 0;
  int64_t over = 0;        // selections above the budget's keys
  double max_over = 0.0;   // largest |S| / budget keys among them
  double granted = 0.0;    // sum over the selections of the budget's keys / n (beside kept)
  bool warned_selection = false;
};

struct Runner {
  std::string name;
  std::unique_ptr<Session> session;
  Accum acc;
  double budget = 0.0;  // the session's budget fraction
};

// A method whose selections hold on average fewer than this share of the budget's keys is marked.
constexpr double kUnderBudget = 0.9;

// Exact keys a budget fraction grants over n tokens (the library's rule: ceil, clamped to [1, n]).
int64_t budget_keys(double fraction, int64_t n) {
  return std::clamp<int64_t>(int64_t(std::ceil(fraction * double(n))), std::min<int64_t>(1, n), n);
}

struct LayerData {
  uint32_t layer;
  StridedArray q, k, v;
};

double mean(double sum, int64_t n) { return n > 0 ? sum / double(n) : 0.0; }

// Scores one decode call of one layer against the exact reference.
void score_step(Runner& r, const ExactAttention& ex, uint32_t layer, int64_t t,
                const std::vector<float>& o, const std::vector<float>& lse, std::vector<int32_t>& sel) {
  const int64_t hq = ex.q_heads, hkv = ex.kv_heads, d = ex.head_dim, group = hq / hkv;
  const int64_t n = ex.n;
  Accum& a = r.acc;
  double step_mass = 0.0;
  for (int64_t g = 0; g < hkv; ++g) {
    r.session->last_selection(layer, uint32_t(g), sel);
    const bool sorted_unique = std::adjacent_find(sel.begin(), sel.end(), std::greater_equal<>()) == sel.end();
    const bool in_range = sel.empty() || (*std::min_element(sel.begin(), sel.end()) >= 0 &&
                                          *std::max_element(sel.begin(), sel.end()) < n);
    if (!sorted_unique || !in_range) {
      if (!a.warned_selection) {
        std::fprintf(stderr,
                     "kvsieve: warning: %s: kvs_session_last_selection returned %s at layer %u, step "
                     "%lld (expected ascending unique indices in [0, %lld)); scoring the valid part\n",
                     r.name.c_str(), in_range ? "unsorted or repeated indices" : "indices out of range",
                     layer, static_cast<long long>(t), static_cast<long long>(n));
        a.warned_selection = true;
      }
      sel.erase(std::remove_if(sel.begin(), sel.end(), [n](int32_t j) { return j < 0 || j >= n; }), sel.end());
      std::sort(sel.begin(), sel.end());
      sel.erase(std::unique(sel.begin(), sel.end()), sel.end());
    }
    const int64_t k = int64_t(sel.size());
    const int32_t* rank = ex.ranks(g);
    int64_t hits = 0;
    for (int32_t j : sel) hits += rank[j] < k;
    a.recall += k > 0 ? double(hits) / double(k) : 0.0;
    a.kept += double(k) / double(n);
    ++a.recall_n;
    if (r.name != "full" && r.budget > 0) {
      const int64_t kb = budget_keys(r.budget, n);
      a.granted += double(kb) / double(n);
      if (k > kb) {
        ++a.over;
        a.max_over = std::max(a.max_over, double(k) / double(kb));
      }
    }

    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const double* p = ex.probs(h);
      double m = 0.0;
      for (int32_t j : sel) m += p[j];
      a.mass += m;
      step_mass += m;

      const double* ref = ex.output(h);
      double diff2 = 0.0, ref2 = 0.0;
      bool finite = std::isfinite(lse[size_t(h)]);
      for (int64_t i = 0; i < d; ++i) {
        const double x = o[size_t(h * d + i)];
        finite = finite && std::isfinite(x);
        diff2 += (x - ref[i]) * (x - ref[i]);
        ref2 += ref[i] * ref[i];
      }
      if (finite) {
        a.errs.push_back(std::sqrt(diff2) / std::max(std::sqrt(ref2), std::numeric_limits<double>::min()));
        a.lse += std::abs(double(lse[size_t(h)]) - ex.lse[size_t(h)]);
      } else {
        a.errs.push_back(std::numeric_limits<double>::infinity());
        a.lse += std::numeric_limits<double>::infinity();
        ++a.nonfinite;
      }
      ++a.head_n;
    }
  }
  auto& lm = a.layer_mass[layer];
  lm.first += step_mass;
  lm.second += hq;
  a.step_mass.push_back(step_mass / double(hq));
}

// XXH3-64 of a file's bytes (and its size), read in 4 MiB blocks.
std::pair<uint64_t, uint64_t> file_xxh3(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) throw CliError("cannot read trace '" + path + "': " + std::strerror(errno));
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> st(XXH3_createState(), &XXH3_freeState);
  if (!st || XXH3_64bits_reset(st.get()) != XXH_OK) throw CliError("xxHash: cannot allocate a hash state");
  std::vector<char> buf(size_t(4) << 20);
  uint64_t total = 0;
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), f.get())) > 0;) {
    XXH3_64bits_update(st.get(), buf.data(), n);
    total += n;
  }
  if (std::ferror(f.get())) throw CliError("cannot read trace '" + path + "': read error");
  return {XXH3_64bits_digest(st.get()), total};
}

// The parameters a session resolved (defaults filled in, values normalised), as the library writes
// them into a tables file: saved to a temporary file, described, deleted.
nlohmann::ordered_json resolved_params(const Session& s) {
  const char* dir = std::getenv("TMPDIR");
  std::string path = std::string(dir && *dir ? dir : "/tmp") + "/kvsieve-eval-params.XXXXXX";
  const int fd = mkstemp(path.data());
  if (fd < 0) throw CliError("cannot create a temporary file in '" + std::string(dir && *dir ? dir : "/tmp") +
                             "' (set TMPDIR): " + std::strerror(errno));
  close(fd);
  struct Unlink {
    std::string p;
    ~Unlink() { std::remove(p.c_str()); }
  } unlink_it{path};
  s.save(path, KVS_SAVE_TABLES);
  char* raw = nullptr;
  const Status st = take_status(kvs_tables_describe(path.c_str(), &raw));
  const LibString text(raw);
  if (!st.ok()) throw CliError(s.label() + ": reading back its parameters: " + st.message);
  const auto doc = nlohmann::ordered_json::parse(text ? text.get() : "null", nullptr, false);
  const auto* p = &doc;
  for (const char* key : {"header", "method", "params"}) {
    if (!p->is_object() || !p->contains(key)) return nlohmann::ordered_json::object();
    p = &(*p)[key];
  }
  return *p;
}

}  // namespace

std::vector<double> parse_budget_list(const std::string& list, const char* option) {
  std::vector<double> out;
  const auto items = split(list, ',');
  if (items.empty()) throw UsageError(std::string(option) + " is empty (expected e.g. 0.01,0.05,0.1)");
  for (const auto& item : items) {
    char* end = nullptr;
    errno = 0;
    const double b = std::strtod(item.c_str(), &end);
    if (end == item.c_str() || *end != '\0' || errno == ERANGE)
      throw UsageError(std::string(option) + ": '" + item + "' is not a number");
    if (!(b > 0.0 && b <= 1.0))
      throw UsageError(std::string(option) + ": " + item + " is outside (0, 1]");
    if (std::find(out.begin(), out.end(), b) != out.end())
      throw UsageError(std::string(option) + ": " + item + " is given twice");
    out.push_back(b);
  }
  return out;
}

std::vector<std::string> resolve_methods(const std::string& list, int32_t backend) {
  const auto registered = registered_methods();
  std::vector<std::string> out, unknown;
  auto add = [&](const std::string& m) {
    if (std::find(out.begin(), out.end(), m) == out.end()) out.push_back(m);
  };
  const auto items = split(list, ',');
  if (items.empty()) throw UsageError("--methods is empty");
  for (const auto& item : items) {
    if (item == "all") {
      for (const auto& m : registered) {
        if (kvs_method_backends(m.c_str()) & (1u << backend))
          add(m);
        else
          std::fprintf(stderr, "kvsieve: note: skipping %s (no %s backend)\n", m.c_str(), backend_name(backend));
      }
    } else if (std::find(registered.begin(), registered.end(), item) != registered.end()) {
      add(item);
    } else {
      unknown.push_back(item);
    }
  }
  if (!unknown.empty())
    throw UsageError(std::string(unknown.size() == 1 ? "unknown method " : "unknown methods ") +
                     join(unknown, ", ") + " (available: " + join(registered, ", ") + ")");
  if (out.empty()) throw UsageError(std::string("no method supports the ") + backend_name(backend) + " backend");
  return out;
}

std::map<std::string, std::string> parse_method_params(const std::vector<std::string>& specs,
                                                       const std::vector<std::string>& methods) {
  std::map<std::string, std::string> out;
  for (const auto& spec : specs) {
    std::string current;
    for (const auto& item : split(spec, ',')) {
      const size_t colon = item.find(':'), eq = item.find('=');
      std::string kv = item;
      if (colon != std::string::npos && (eq == std::string::npos || colon < eq)) {
        current = item.substr(0, colon);
        kv = item.substr(colon + 1);
        if (std::find(methods.begin(), methods.end(), current) == methods.end())
          throw UsageError("--params names method '" + current + "', which is not being evaluated (" +
                           join(methods, ", ") + ")");
      }
      if (current.empty())
        throw UsageError("--params: '" + item + "' does not name a method (expected method:key=value)");
      if (kv.find('=') == std::string::npos || kv.front() == '=')
        throw UsageError("--params: '" + item + "' is not key=value");
      auto& dst = out[current];
      if (!dst.empty()) dst += ',';
      dst += kv;
    }
  }
  return out;
}

EvalReport run_eval(const EvalOptions& opts) {
  const std::vector<double> budgets = opts.budgets.empty() ? std::vector<double>{opts.budget} : opts.budgets;
  for (double b : budgets)
    if (!(b > 0.0 && b <= 1.0)) throw UsageError(strfmt("--budget must be in (0, 1] (got %g)", b));
  if (opts.methods.empty()) throw UsageError("no method to evaluate");
  Trace trace(opts.trace);
  const kvs_trace_info& info = trace.info();
  const int64_t P = info.prefill_len, T = info.total_len;
  if (T <= P)
    throw CliError(strfmt("trace '%s' has no decode step (prefill_len %lld = total_len %lld)",
                          opts.trace.c_str(), static_cast<long long>(P), static_cast<long long>(T)));
  if (P < 1) throw CliError("trace '" + opts.trace + "' has an empty prompt (prefill_len 0)");
  const int64_t steps = opts.max_steps > 0 ? std::min(opts.max_steps, T - P) : T - P;
  const unsigned threads = resolve_threads(opts.threads);
  const double scale = trace.softmax_scale();

  std::vector<LayerData> layers;
  for (uint32_t l : trace.present_layers())
    layers.push_back({l, trace.tensor(l, "q"), trace.tensor(l, "k"), trace.tensor(l, "v")});

  EvalReport rep;
  rep.trace = opts.trace;
  std::tie(rep.trace_xxh3, rep.trace_bytes) = file_xxh3(opts.trace);
  rep.budgets = budgets;
  rep.backend = opts.backend;
  rep.threads = threads;
  rep.steps = steps;
  rep.layers = layers.size();
  rep.info = info;
  rep.info.source = nullptr;

  const int64_t hq = info.num_q_heads, d = info.head_dim;
  std::vector<float> o(static_cast<size_t>(hq * d)), lse(static_cast<size_t>(hq));
  const Tensor o_t(o.data(), DType::F32, {hq, d});
  const Tensor lse_t(lse.data(), DType::F32, {hq});
  std::vector<int32_t> sel;
  sel.reserve(size_t(T));
  ExactAttention ex;

  for (const double budget : budgets) {
    const std::string tag = budgets.size() > 1 ? strfmt("budget %g: ", budget) : std::string();
    // `full` runs first and always (reported only when asked for): its step time is the yardstick
    // of the speed column, its error the check of the yardstick of every other column. Sessions live
    // for one budget at a time, so a sweep needs no more memory than one budget.
    std::vector<Runner> runners;
    runners.push_back(Runner{"full", nullptr, {}});
    for (const auto& m : opts.methods)
      if (m != "full") runners.push_back(Runner{m, nullptr, {}});

    {
      Progress bar(tag + "prefill + index", int64_t(runners.size() * (layers.size() + 1)));
      for (auto& r : runners) {
        kvs_session_params p = session_params_for(info);
        p.method = r.name.c_str();
        const auto it = opts.method_params.find(r.name);
        p.method_params = it != opts.method_params.end() ? it->second.c_str() : nullptr;
        p.budget = budget;
        p.backend = opts.backend;
        p.num_threads = opts.threads;
        r.session = std::make_unique<Session>(p, r.name);
        r.budget = budget;
        for (const auto& L : layers) {
          r.session->prefill(L.layer, L.q.rows_view(0, P), L.k.rows_view(0, P), L.v.rows_view(0, P));
          bar.advance();
        }
        r.session->build_index();
        bar.advance();
      }
    }

    for (auto& r : runners) r.acc.errs.reserve(size_t(steps) * layers.size() * size_t(hq));
    {
      Progress bar(tag + "replaying", steps * int64_t(layers.size()));
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t t = P + s;
        for (const auto& L : layers) {
          exact_attention(L.q, L.k, L.v, t, scale, /*want_ranks=*/true, threads, ex);
          const Tensor qt = L.q.row_view(t), kt = L.k.row_view(t), vt = L.v.row_view(t);
          for (auto& r : runners) {
            const auto t0 = Clock::now();
            r.session->decode(L.layer, qt, kt, vt, o_t, &lse_t);
            r.acc.time_us += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
            ++r.acc.calls;
            score_step(r, ex, L.layer, t, o, lse, sel);
          }
          bar.advance();
        }
      }
    }

    const double full_us = mean(runners.front().acc.time_us, runners.front().acc.calls);
    const double full_err = mean(std::accumulate(runners.front().acc.errs.begin(), runners.front().acc.errs.end(), 0.0),
                                 int64_t(runners.front().acc.errs.size()));
    if (!(full_err <= kFullTolerance))
      std::fprintf(stderr,
                   "kvsieve: warning: `full` differs from the float64 reference by %.3g on average "
                   "(expected below %.0e): dense attention in the library (or the trace reading) is wrong, "
                   "so every error below is suspect\n",
                   full_err, kFullTolerance);
    for (const auto& m : opts.methods) {
      const auto it = std::find_if(runners.begin(), runners.end(), [&](const Runner& r) { return r.name == m; });
      const Accum& a = it->acc;
      MethodResult res;
      res.name = m;
      res.budget = budget;
      res.recall_at_k = mean(a.recall, a.recall_n);
      res.mass_recall = mean(a.mass, a.head_n);
      res.mass_recall_p5 = percentile(a.step_mass, 5.0);
      for (const auto& [l, sm] : a.layer_mass) res.layer_mass_recall.emplace_back(l, mean(sm.first, sm.second));
      double err_sum = 0.0;
      for (double e : a.errs) err_sum += e;
      res.output_rel_err = mean(err_sum, int64_t(a.errs.size()));
      res.output_rel_err_p95 = percentile(a.errs, 95.0);
      res.lse_abs_err = mean(a.lse, a.head_n);
      res.step_us = mean(a.time_us, a.calls);
      res.full_step_us = full_us;
      res.kept_fraction = mean(a.kept, a.recall_n);
      res.nonfinite = a.nonfinite;
      res.over_budget = a.over;
      res.selections = a.recall_n;
      res.max_over_ratio = a.max_over;
      // Under: on average fewer than 0.9 x the keys the budget grants (the selections' mean).
      const double granted = mean(a.granted, a.recall_n);
      res.under_budget = granted > 0 && res.kept_fraction < kUnderBudget * granted;
      if (res.under_budget)
        std::fprintf(stderr,
                     "kvsieve: warning: %s attends %.2f%% of the keys on average, under %.1f x the %.2f%% the budget "
                     "%g grants; its row is marked '~' (under_budget in the JSON): it is cheaper, and less "
                     "accurate, than a row that keeps to the budget\n",
                     m.c_str(), 100.0 * res.kept_fraction, kUnderBudget, 100.0 * granted, budget);
      if (a.over > 0)
        std::fprintf(stderr,
                     "kvsieve: warning: %s attends more keys than the budget %g grants in %lld of %lld "
                     "selections (up to %.2fx the budget's keys); its row is marked '!' (over_budget in the "
                     "JSON) and is not comparable with rows that keep to the budget\n",
                     m.c_str(), budget, static_cast<long long>(a.over), static_cast<long long>(a.recall_n),
                     a.max_over);
      res.params = resolved_params(*it->session);
      for (const auto& name : opts.stats) {
        double v = 0;
        kvs_error_t e = kvs_session_method_stat(it->session->get(), name.c_str(), &v);
        if (e == nullptr) res.stats.emplace_back(name, v);
        kvs_error_destroy(e);
      }
      if (a.nonfinite > 0)
        std::fprintf(stderr, "kvsieve: warning: %s returned %lld non-finite outputs (counted as infinite error)\n",
                     m.c_str(), static_cast<long long>(a.nonfinite));
      rep.methods.push_back(std::move(res));
    }
  }
  return rep;
}

const char* budget_mark(bool over, bool under) { return over ? " !" : under ? " ~" : ""; }

std::string render_eval_table(const EvalReport& r) {
  TextTable table({"method", "budget", "kept", "recall@k", "mass recall", "mass p5", "worst layer", "out err",
                   "out err p95", "lse err", "step us", "speed vs full"},
                  {false, true, true, true, true, true, false, true, true, true, true, true});
  for (const auto& m : r.methods) {
    std::string worst = "-";
    if (!m.layer_mass_recall.empty()) {
      const auto w = std::min_element(m.layer_mass_recall.begin(), m.layer_mass_recall.end(),
                                      [](const auto& a, const auto& b) { return a.second < b.second; });
      worst = strfmt("L%u %.3f", w->first, w->second);
    }
    table.add_row({m.name, strfmt("%.3g", m.budget),
                   strfmt("%.1f%%%s", 100.0 * m.kept_fraction, budget_mark(m.over_budget > 0, m.under_budget)),
                   strfmt("%.3f", m.recall_at_k), strfmt("%.3f", m.mass_recall), strfmt("%.3f", m.mass_recall_p5),
                   worst,
                   strfmt("%.2e", m.output_rel_err), strfmt("%.2e", m.output_rel_err_p95),
                   strfmt("%.2e", m.lse_abs_err), strfmt("%.1f", m.step_us),
                   m.step_us > 0 ? strfmt("%.2fx", m.full_step_us / m.step_us) : std::string("-")});
  }
  return table.render();
}

// {"<layer>": mean mass recall} for a method's row.
nlohmann::ordered_json layer_mass_json(const MethodResult& m) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const auto& [l, v] : m.layer_mass_recall) out[std::to_string(l)] = v;
  return out;
}

nlohmann::ordered_json eval_json(const EvalReport& r) {
  nlohmann::ordered_json methods = nlohmann::ordered_json::array();
  for (const auto& m : r.methods) {
    methods.push_back({{"name", m.name},
                       {"budget", m.budget},
                       {"kept_fraction", m.kept_fraction},
                       {"over_budget", m.over_budget > 0},
                       {"over_budget_selections", m.over_budget},
                       {"selections", m.selections},
                       {"max_over_budget_ratio", m.max_over_ratio},
                       {"under_budget", m.under_budget},
                       {"params", m.params},
                       {"recall_at_k", m.recall_at_k},
                       {"mass_recall", m.mass_recall},
                       {"mass_recall_p5", m.mass_recall_p5},
                       {"layer_mass_recall", layer_mass_json(m)},
                       {"output_rel_err", m.output_rel_err},
                       {"output_rel_err_p95", m.output_rel_err_p95},
                       {"lse_abs_err", m.lse_abs_err},
                       {"step_us", m.step_us},
                       {"full_step_us", m.full_step_us},
                       {"nonfinite_outputs", m.nonfinite}});
    if (!m.stats.empty()) {
      nlohmann::ordered_json st = nlohmann::ordered_json::object();
      for (const auto& [name, v] : m.stats) st[name] = v;
      methods.back()["stats"] = std::move(st);
    }
  }
  nlohmann::ordered_json out;
  out["trace"] = r.trace;
  out["trace_bytes"] = r.trace_bytes;
  out["trace_xxh3_64"] = strfmt("%016llx", static_cast<unsigned long long>(r.trace_xxh3));
  out["version"] = kvs_version();
  out["backend"] = backend_name(r.backend);
  out["threads"] = r.threads;
  out["budgets"] = r.budgets;
  out["steps"] = r.steps;
  out["layers"] = r.layers;
  out["methods"] = std::move(methods);
  return out;
}

}  // namespace kvcli
