// SPDX-License-Identifier: Apache-2.0
// kvsieve demo: the README's first command. Shows what the library is for, in about a minute on
// two cores: (1) how much of the attention every method keeps on a real model's trace (the
// repository's stories260K Llama trace, replayed as `kvsieve eval` does), (2) how much faster
// than `full` each decode step is at a long synthetic context (the timing code of `kvsieve bench`),
// and (3) one line per method drawn from those two measurements.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "bench.hpp"
#include "commands.hpp"
#include "common.hpp"
#include "eval.hpp"
#include "progress.hpp"

namespace kvcli {

namespace {

constexpr const char* kTraceName = "stories260k-gen-t512.safetensors";

struct DemoOptions {
  std::string out_dir = "kvsieve-demo", backend = "cpu", trace;
  double budget = 0.05;
  unsigned threads = 0;
  uint64_t seed = 1;
  int64_t context = 131072, steps = 8, warmup = 2;
  bool quick = false;
};

// --trace, else the shipped trace under the working directory, next to the executable's
// parent (a build folder inside the source tree) or in the source tree the CLI was built from.
std::string find_trace(const std::string& given) {
  if (!given.empty()) return given;
  namespace fs = std::filesystem;
  std::vector<fs::path> candidates = {fs::path("tests") / "data" / kTraceName};
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back(exe.parent_path().parent_path() / "tests" / "data" / kTraceName);
#ifdef KVS_DEMO_TRACE
  candidates.emplace_back(KVS_DEMO_TRACE);
#endif
  for (const auto& c : candidates)
    if (fs::is_regular_file(c, ec)) return c.string();
  throw CliError(std::string("demo: cannot find the real-model trace ") + kTraceName +
                 " (it ships in the repository's tests/data/); pass --trace FILE");
}

// "128K" for 131072, else the number.
std::string context_label(int64_t n) {
  if (n % 1024 == 0) return std::to_string(n / 1024) + "K";
  return std::to_string(n);
}

std::string speed_phrase(double x) {
  if (x >= 1.05) return strfmt("%.1fx faster than full", x);
  if (x > 0 && x <= 0.95) return strfmt("%.1fx slower than full", 1.0 / x);
  return "as fast as full";
}

struct SpeedRow {
  std::string method;
  double step_us = 0, full_step_us = 0, speedup = 0;
};

int run_demo(DemoOptions o) {
  if (o.quick) {
    o.context = 8192;
    o.steps = 2;
    o.warmup = 1;
  }
  if (!(o.budget > 0.0 && o.budget <= 1.0)) throw UsageError("--budget must be in (0, 1]");
  if (o.context < 64) throw UsageError("--context must be >= 64");
  if (o.steps < 1) throw UsageError("--steps must be >= 1");
  const int32_t backend = parse_backend(o.backend);
  // Accuracy and CPU timing run on the cpu backend (the demo's real-model trace has head dim 8,
  // below the GPU kernels' 64; `kvsieve eval --backend cuda` replays wider traces on the GPU);
  // --backend cuda or hybrid adds GPU timing.
  const int32_t host_backend = KVS_BACKEND_CPU;
  const std::string host_backend_name = "cpu";
  const std::string trace = find_trace(o.trace);
  std::error_code ec;
  std::filesystem::create_directories(o.out_dir, ec);
  if (ec) throw CliError("cannot create '" + o.out_dir + "': " + ec.message());
  const std::string eval_path = (std::filesystem::path(o.out_dir) / "eval.json").string();
  const std::string bench_path = (std::filesystem::path(o.out_dir) / "bench.json").string();
  const auto t0 = Clock::now();
  const unsigned threads = resolve_threads(o.threads);
  const std::string ctx = context_label(o.context);

  // 1. Accuracy on the real model's trace.
  EvalOptions e;
  e.trace = trace;
  e.backend = host_backend;
  e.methods = resolve_methods("all", host_backend);
  e.budget = o.budget;
  e.threads = o.threads;
  std::printf("kvsieve demo: every method at budget %g (exact keys per step, as a fraction of the context)\n\n",
              o.budget);
  std::printf("1. accuracy on a real model: replaying %s through %zu methods against exact float64 attention\n",
              trace.c_str(), e.methods.size());
  std::fflush(stdout);
  const EvalReport rep = run_eval(e);
  write_text_file(eval_path, eval_json(rep).dump(2) + "\n");
  std::printf("   %lld decode steps x %zu layers after a %lld-token prompt; %u q heads, %u kv heads, d %u\n",
              static_cast<long long>(rep.steps), rep.layers,
              static_cast<long long>(rep.info.prefill_len), rep.info.num_q_heads,
              rep.info.num_kv_heads, rep.info.head_dim);

  // 2. Speed at a long synthetic context: bench's code path, one data set for every method.
  BenchOptions b;
  b.backend = host_backend_name;
  b.context = o.context;
  b.q_heads = 8;
  b.kv_heads = 2;
  b.head_dim = 128;
  b.budget = o.budget;
  b.threads = o.threads;
  b.steps = o.steps;
  b.warmup = o.warmup;
  b.seed = o.seed;
  b.no_membw = true;
  const DType dtype = parse_dtype(b.dtype);
  std::printf("2. speed at a long context: one layer, %s tokens, %u q heads / %u kv heads, d %u, %s, %s backend, "
              "%u threads; median of %lld decode steps of each method, alternated with full (kvsieve bench)\n",
              ctx.c_str(), b.q_heads, b.kv_heads, b.head_dim, dtype_name(dtype), b.backend.c_str(), threads,
              static_cast<long long>(b.steps));
  std::fflush(stdout);
  std::vector<SpeedRow> speed;
  std::vector<double> all_full_us;
  {
    b.method = "full";
    validate_options(b);
    const SynthTrace data = bench_data(b, dtype, threads);
    for (const auto& m : e.methods) {
      if (m == "full") continue;
      b.method = m;
      validate_options(b);
      const BenchTiming t = bench_cpu(b, dtype, data);
      SpeedRow r{m, median(t.method_us), median(t.full_us), 0};
      r.speedup = r.step_us > 0 ? r.full_step_us / r.step_us : 0;
      all_full_us.insert(all_full_us.end(), t.full_us.begin(), t.full_us.end());
      speed.push_back(r);
    }
  }
  const double full_us = median(all_full_us);
  speed.insert(speed.begin(), SpeedRow{"full", full_us, full_us, 1.0});

  nlohmann::ordered_json bj = nlohmann::ordered_json::array();
  for (const auto& r : speed)
    bj.push_back({{"method", r.method}, {"backend", b.backend}, {"context", b.context}, {"q_heads", b.q_heads},
                  {"kv_heads", b.kv_heads}, {"head_dim", b.head_dim}, {"dtype", dtype_name(dtype)},
                  {"budget", b.budget}, {"steps", b.steps}, {"step_us", r.step_us},
                  {"full_step_us", r.full_step_us}, {"speedup_vs_full", r.speedup}});
  write_text_file(bench_path, bj.dump(2) + "\n");

  // The table: accuracy columns from step 1, speed columns from step 2.
  std::printf("\n%-12s %6s %12s %9s %14s %10s\n", "method", "kept", "mass recall", "out err",
              ("us/step " + ctx).c_str(), "vs full");
  std::printf("%s\n", std::string(68, '-').c_str());
  auto find_speed = [&](const std::string& m) -> const SpeedRow* {
    for (const auto& r : speed)
      if (r.method == m) return &r;
    return nullptr;
  };
  for (const auto& mr : rep.methods) {
    const SpeedRow* s = find_speed(mr.name);
    std::printf("%-12s %5.1f%% %12.3f %9.3f %14.1f %9.2fx\n", mr.name.c_str(), 100.0 * mr.kept_fraction,
                mr.mass_recall, mr.output_rel_err, s ? s->step_us : 0.0, s ? s->speedup : 0.0);
  }
  std::printf("\n  kept         keys attended / context, on the real trace (compare with the budget)\n"
              "  mass recall  exact softmax weight of the selected keys (1 = nothing lost), real trace\n"
              "  out err      ||o - o*|| / ||o*|| against float64 attention, real trace\n"
              "  us/step      one layer's kvs_session_decode at %s synthetic tokens; vs full = full's / this\n",
              ctx.c_str());

  // 3. One line per method, from the numbers above.
  std::printf("\n3. what to take from it (budget %g, stories260K for accuracy, %s tokens for speed):\n", o.budget,
              ctx.c_str());
  const MethodResult* best = nullptr;
  for (const auto& mr : rep.methods) {
    const SpeedRow* s = find_speed(mr.name);
    const double x = s ? s->speedup : 0.0;
    if (mr.name == "full") {
      std::printf("  %-13s the exact baseline: reads every key, %.1f us/step at %s\n", "full:", full_us,
                  ctx.c_str());
      continue;
    }
    std::printf("  %-13s %s at %s, keeps %.0f%% of the attention mass on stories260K (output error %.2f)%s\n",
                (mr.name + ":").c_str(), speed_phrase(x).c_str(), ctx.c_str(), 100.0 * mr.mass_recall,
                mr.output_rel_err, mr.name == "exact_topk" ? "; an oracle: the best selection of this size" : "");
    if (mr.name != "exact_topk" && x >= 1.05 && (!best || mr.mass_recall > best->mass_recall)) best = &mr;
  }
  if (best)
    std::printf("  => of the methods faster than full here, %s keeps the most attention mass (%.0f%%)\n",
                best->name.c_str(), 100.0 * best->mass_recall);
  else
    std::printf("  => no method beat full at %s on this machine: try a longer --context\n", ctx.c_str());

  // GPU timing: only in CUDA builds with a visible device (bench --backend cuda, method by method).
  if (backend == KVS_BACKEND_CUDA || backend == KVS_BACKEND_HYBRID) {
    const char* bn = backend == KVS_BACKEND_CUDA ? "cuda" : "hybrid";
    if (cuda_device_visible()) {
      std::printf("\n4. speed on the GPU (kvsieve bench --backend %s, one method at a time):\n", bn);
      std::fflush(stdout);
      BenchOptions g = b;
      g.backend = bn;
      for (const auto& m : resolve_methods("all", backend)) {
        if (m == "full") continue;
        g.method = m;
        run_bench(g);
      }
    } else {
      std::printf("\n4. speed on the GPU: not run (%s)\n",
#ifdef KVS_HAVE_CUDA
                  "no CUDA device is visible"
#else
                  "this kvsieve was built without CUDA"
#endif
      );
    }
  }

  std::printf("\nResults in %s and %s (%.1f s). Next: `kvsieve eval --trace %s --budgets 0.02,0.05,0.1`,\n"
              "`kvsieve bench --method quest --context 131072`; see docs/cli.md.\n",
              eval_path.c_str(), bench_path.c_str(), seconds_since(t0), trace.c_str());
  return kExitOk;
}

}  // namespace

Command add_demo_command(CLI::App& root) {
  auto o = std::make_shared<DemoOptions>();
  CLI::App* cmd = root.add_subcommand(
      "demo", "accuracy of every method on a real model's trace and speed-up at a long context (start here)");
  cmd->add_option("--out-dir", o->out_dir, "directory for eval.json and bench.json");
  cmd->add_option("--budget", o->budget, "exact keys per step, as a fraction of the context");
  cmd->add_option("--backend", o->backend,
                  "cpu or hybrid; cuda also times every method on the GPU (CUDA builds with a device)");
  cmd->add_option("--threads", o->threads, "library and reference threads (0 = all)");
  cmd->add_option("--trace", o->trace, "real-model trace for the accuracy part (default: tests/data/" +
                                           std::string(kTraceName) + ")");
  cmd->add_option("--context", o->context, "synthetic context of the speed part, in tokens");
  cmd->add_option("--steps", o->steps, "timed decode steps per method in the speed part");
  cmd->add_option("--seed", o->seed, "seed of the synthetic data of the speed part");
  cmd->add_flag("--quick", o->quick, "a small speed part (8K context, 2 steps): for tests, not for conclusions");
  return {cmd, [o] { return run_demo(*o); }};
}

}  // namespace kvcli
