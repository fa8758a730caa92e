// kvsieve bench --method M --context N ...: decode timing of a method against `full` on synthetic
// data of a given shape, alternating the two in one process, beside the machine's measured read
// bandwidth (DESIGN.md "Performance").
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "membw.hpp"
#include "progress.hpp"
#include "synth_model.hpp"

namespace kvcli {

namespace {

struct BenchOptions {
  std::string method, params, dtype = "bf16", backend = "cpu", json, stats;
  int64_t context = 32768;
  uint32_t q_heads = 32, kv_heads = 8, head_dim = 128;
  double budget = 0.05;
  unsigned threads = 0;
  int64_t steps = 20, warmup = 3;
  uint64_t seed = 1;
  double membw_mib = 0;
  bool no_membw = false;
};

int run_bench(const BenchOptions& o) {
  const int32_t backend = parse_backend(o.backend);
  if (backend == KVS_BACKEND_CUDA)
    throw CliError(
        "bench: the cuda backend needs device tensors, and this command only passes host memory "
        "(it links the C API alone, no CUDA runtime); benchmark CUDA with the drivers in bench/ "
        "(see docs/cli.md)",
        kExitUsage);
  if (!method_exists(o.method))
    throw UsageError("unknown method '" + o.method + "' (available: " + join(registered_methods(), ", ") + ")");
  if (o.context < 64) throw UsageError("--context must be >= 64");
  if (o.steps < 1) throw UsageError("--steps must be >= 1");
  if (o.warmup < 0) throw UsageError("--warmup must be >= 0");
  if (!(o.budget > 0.0 && o.budget <= 1.0)) throw UsageError("--budget must be in (0, 1]");
  if (o.membw_mib < 0) throw UsageError("--membw-mib must be >= 0");
  const DType dtype = parse_dtype(o.dtype);
  const unsigned threads = resolve_threads(o.threads);

  // Structured synthetic data (docs/synth.md), so data-dependent methods see realistic attention.
  SynthConfig cfg;
  cfg.layers = 1;
  cfg.q_heads = o.q_heads;
  cfg.kv_heads = o.kv_heads;
  cfg.head_dim = o.head_dim;
  cfg.prefill = o.context;
  cfg.decode = o.warmup + o.steps;
  cfg.dtype = dtype;
  cfg.seed = o.seed;
  cfg.segments = uint32_t(std::clamp<int64_t>((o.context - cfg.sinks) / 256, 1, 16));
  validate(cfg);
  SynthTrace data;
  {
    Activity busy("generating synthetic data");
    data = synth_generate(cfg, threads);
  }
  const StridedArray q = data.q(0), k = data.k(0), v = data.v(0);

  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = 1;
  p.num_q_heads = o.q_heads;
  p.num_kv_heads = o.kv_heads;
  p.head_dim = o.head_dim;
  p.kv_dtype = int32_t(dtype);
  p.backend = backend;
  p.num_threads = o.threads;
  p.budget = o.budget;
  kvs_session_params pf = p;
  p.method = o.method.c_str();
  p.method_params = o.params.empty() ? nullptr : o.params.c_str();
  pf.method = "full";
  Session method(p, o.method);
  Session full(pf, "full");

  const int64_t P = o.context;
  double prefill_ms = 0, index_ms = 0;
  {
    Activity busy("prefill and index build");
    auto t0 = Clock::now();
    method.prefill(0, q.rows_view(0, P), k.rows_view(0, P), v.rows_view(0, P));
    prefill_ms = seconds_since(t0) * 1e3;
    t0 = Clock::now();
    method.build_index();
    index_ms = seconds_since(t0) * 1e3;
    full.prefill(0, q.rows_view(0, P), k.rows_view(0, P), v.rows_view(0, P));
    full.build_index();
  }

  std::vector<float> out(static_cast<size_t>(o.q_heads) * o.head_dim), lse(o.q_heads);
  const Tensor o_t(out.data(), DType::F32, {int64_t(o.q_heads), int64_t(o.head_dim)});
  const Tensor lse_t(lse.data(), DType::F32, {int64_t(o.q_heads)});
  std::vector<double> method_us, full_us;
  // Per-step wall time of the method's phases (session statistics; CPU decode only): streaming
  // update, selection, exact attention.
  static const char* const kPhases[3] = {"decode_update_seconds", "decode_select_seconds", "decode_attend_seconds"};
  std::vector<double> phase_us[3];
  auto phase_totals = [&](double* out) {
    for (int p = 0; p < 3; ++p) {
      out[p] = 0;
      kvs_error_destroy(kvs_session_method_stat(method.get(), kPhases[p], &out[p]));
    }
  };
  {
    Progress bar("decoding", o.warmup + o.steps);
    for (int64_t i = 0; i < o.warmup + o.steps; ++i) {
      const int64_t t = P + i;
      const Tensor qt = q.row_view(t), kt = k.row_view(t), vt = v.row_view(t);
      // Alternate which goes first, so neither always inherits the other's cache state.
      for (int turn = 0; turn < 2; ++turn) {
        const bool m = (turn == 0) == (i % 2 == 0);
        Session& s = m ? method : full;
        double before[3], after[3];
        if (m) phase_totals(before);
        const auto t0 = Clock::now();
        s.decode(0, qt, kt, vt, o_t, &lse_t);
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (i >= o.warmup) (m ? method_us : full_us).push_back(us);
        if (m && i >= o.warmup) {
          phase_totals(after);
          for (int p = 0; p < 3; ++p) phase_us[p].push_back((after[p] - before[p]) * 1e6);
        }
      }
      bar.advance();
    }
  }
  const kvs_session_stats st = method.stats();

  double measured = 0;
  if (!o.no_membw) {
    Activity busy("measuring memory read bandwidth");
    const size_t bytes = o.membw_mib > 0 ? size_t(o.membw_mib * 1024 * 1024) : default_bandwidth_bytes();
    measured = measure_read_bandwidth(bytes, threads, 5);
  }

  const double step_us = median(method_us), full_step_us = median(full_us);
  const double es = double(dtype_size(dtype));
  const double row_bytes = double(o.kv_heads) * o.head_dim * 2.0 * es;  // one token's K and V
  const double mean_ctx = double(P + o.warmup) + double(o.steps + 1) / 2.0;
  const double full_bytes = mean_ctx * row_bytes;
  const double method_bytes = st.mean_selected_keys * row_bytes + double(st.index_bytes);
  const double achieved = full_step_us > 0 ? full_bytes / (full_step_us * 1e-6) / 1e9 : 0.0;
  const double method_gbps = step_us > 0 ? method_bytes / (step_us * 1e-6) / 1e9 : 0.0;
  const double speedup = step_us > 0 ? full_step_us / step_us : 0.0;

  std::printf("bench %s vs full: context %lld, %u q heads / %u kv heads, d %u, %s, budget %g, %s backend, "
              "%u threads, median of %lld steps after %lld warm-up\n",
              o.method.c_str(), static_cast<long long>(P), o.q_heads, o.kv_heads, o.head_dim,
              dtype_name(dtype), o.budget, o.backend.c_str(), threads, static_cast<long long>(o.steps),
              static_cast<long long>(o.warmup));
  std::printf("  prefill %.1f ms, index build %.1f ms; index %s, KV %s\n", prefill_ms, index_ms,
              human_bytes(double(st.index_bytes)).c_str(), human_bytes(double(st.kv_bytes)).c_str());
  std::printf("  full     %10.1f us/step  reads %s  -> %.1f GB/s", full_step_us,
              human_bytes(full_bytes).c_str(), achieved);
  if (measured > 0) std::printf("  (%.0f%% of the measured %.1f GB/s)", 100.0 * achieved / measured, measured);
  std::printf("\n");
  std::printf("  %-8s %10.1f us/step  reads <= %s (%.0f keys/KV head + index)  -> %.1f GB/s\n",
              o.method.c_str(), step_us, human_bytes(method_bytes).c_str(), st.mean_selected_keys, method_gbps);
  std::printf("  speedup vs full: %.2fx\n", speedup);
  const double ph[3] = {median(phase_us[0]), median(phase_us[1]), median(phase_us[2])};
  const bool have_phases = ph[0] + ph[1] + ph[2] > 0;  // CPU decode only
  if (have_phases)
    std::printf("  %s phases, median us/step: update %.1f, select %.1f, attention %.1f\n", o.method.c_str(),
                ph[0], ph[1], ph[2]);
  std::printf("  step time p50 / p99: full %.1f / %.1f us, %s %.1f / %.1f us\n", full_step_us,
              percentile(full_us, 99.0), o.method.c_str(), step_us, percentile(method_us, 99.0));
  if (!o.stats.empty()) {
    std::printf("  %s stats:", o.method.c_str());
    for (const auto& name : split(o.stats, ',')) {
      double v = 0;
      kvs_error_t e = kvs_session_method_stat(method.get(), name.c_str(), &v);
      if (e == nullptr) std::printf(" %s=%.4g", name.c_str(), v);
      else std::printf(" %s=(unknown)", name.c_str());
      kvs_error_destroy(e);
    }
    std::printf("\n");
  }

  if (!o.json.empty()) {
    const nlohmann::ordered_json j = {{"method", o.method},
                              {"backend", o.backend},
                              {"context", P},
                              {"q_heads", o.q_heads},
                              {"kv_heads", o.kv_heads},
                              {"head_dim", o.head_dim},
                              {"dtype", dtype_name(dtype)},
                              {"budget", o.budget},
                              {"steps", o.steps},
                              {"step_us", step_us},
                              {"full_step_us", full_step_us},
                              {"speedup_vs_full", speedup},
                              {"update_us", have_phases ? nlohmann::ordered_json(ph[0]) : nlohmann::ordered_json(nullptr)},
                              {"select_us", have_phases ? nlohmann::ordered_json(ph[1]) : nlohmann::ordered_json(nullptr)},
                              {"attention_us", have_phases ? nlohmann::ordered_json(ph[2]) : nlohmann::ordered_json(nullptr)},
                              {"index_build_ms", index_ms},
                              {"achieved_GBps", achieved},
                              {"measured_read_GBps", o.no_membw ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(measured)},
                              {"index_bytes", st.index_bytes},
                              {"kv_bytes", st.kv_bytes}};
    write_text_file(o.json, j.dump(2) + "\n");
    std::printf("wrote %s\n", o.json.c_str());
  }
  return kExitOk;
}

}  // namespace

Command add_bench_command(CLI::App& root) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = root.add_subcommand(
      "bench", "time decode steps of a method against full on synthetic data (CPU; CUDA: see bench/)");
  cmd->add_option("--method", o->method, "method name (see `kvsieve methods`)")->required();
  cmd->add_option("--params", o->params, "method parameters: key=value,key=value");
  cmd->add_option("--context", o->context, "prompt tokens before the timed steps");
  cmd->add_option("--q-heads", o->q_heads, "query heads");
  cmd->add_option("--kv-heads", o->kv_heads, "KV heads");
  cmd->add_option("--head-dim", o->head_dim, "head dimension");
  cmd->add_option("--dtype", o->dtype, "KV dtype: f32, f16 or bf16");
  cmd->add_option("--budget", o->budget, "exact keys per step, as a fraction of the context, (0, 1]");
  cmd->add_option("--backend", o->backend, "cpu or hybrid (cuda: use the drivers in bench/)");
  cmd->add_option("--threads", o->threads, "library threads and bandwidth-probe threads (0 = all)");
  cmd->add_option("--steps", o->steps, "timed decode steps of each session");
  cmd->add_option("--warmup", o->warmup, "untimed decode steps first");
  cmd->add_option("--seed", o->seed, "seed of the synthetic data");
  cmd->add_option("--membw-mib", o->membw_mib, "bandwidth probe buffer in MiB (0 = 4x LLC, 256 MiB..2 GiB)");
  cmd->add_flag("--no-membw", o->no_membw, "skip the bandwidth probe (measured_read_GBps: null)");
  cmd->add_option("--stats", o->stats,
                  "comma-separated method statistics to print after the run (kvs_session_method_stat; unknown names skipped)");
  cmd->add_option("--json", o->json, "also write the results as JSON to this file");
  return {cmd, [o] { return run_bench(*o); }};
}

}  // namespace kvcli
