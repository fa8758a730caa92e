// SPDX-License-Identifier: Apache-2.0
// kvsieve build --trace T --method M --out FILE: prefill a trace's prompt, build the method's
// index, save the tables (optionally with the KV cache).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>

#include "commands.hpp"
#include "common.hpp"
#include "progress.hpp"

namespace kvcli {

namespace {

struct BuildOptions {
  std::string trace, method = "full", params, backend = "cpu", out;
  double budget = 0.05;
  unsigned threads = 0;
  bool include_kv = false;
  bool quiet = false;
};

int run_build(const BuildOptions& o) {
  if (!(o.budget > 0.0 && o.budget <= 1.0)) throw UsageError("--budget must be in (0, 1]");
  const int32_t backend = parse_backend(o.backend);
  if (!method_exists(o.method))
    throw UsageError("unknown method '" + o.method + "' (available: " + join(registered_methods(), ", ") + ")");

  Trace trace(o.trace);
  const auto& info = trace.info();
  kvs_session_params p = session_params_for(info);
  p.method = o.method.c_str();
  p.method_params = o.params.empty() ? nullptr : o.params.c_str();
  p.budget = o.budget;
  p.backend = backend;
  p.num_threads = o.threads;
  Session session(p, o.method);

  const int64_t P = info.prefill_len;
  const auto t0 = Clock::now();
  {
    Progress bar("prefill", int64_t(trace.present_layers().size()));
    for (uint32_t layer : trace.present_layers()) {
      const auto q = trace.tensor(layer, "q"), k = trace.tensor(layer, "k"), v = trace.tensor(layer, "v");
      session.prefill(layer, q.rows_view(0, P), k.rows_view(0, P), v.rows_view(0, P));
      bar.advance();
    }
  }
  const double prefill_s = seconds_since(t0);
  const auto t1 = Clock::now();
  {
    Activity busy("building the " + o.method + " index");
    session.build_index();
  }
  const double index_s = seconds_since(t1);
  const auto t2 = Clock::now();
  {
    Activity busy("saving " + o.out);
    session.save(o.out, o.include_kv ? KVS_SAVE_INCLUDE_KV : KVS_SAVE_TABLES);
  }
  const double save_s = seconds_since(t2);

  if (!o.quiet) {
    const kvs_session_stats st = session.stats();
    std::printf("built %s over %zu of %u layers (%lld prompt tokens each): prefill %.2f s, index %.2f s, "
                "save %.2f s\n",
                o.method.c_str(), trace.present_layers().size(), info.num_layers,
                static_cast<long long>(P), prefill_s, index_s, save_s);
    std::printf("index %s, KV %s (%s) -> %s\n", human_bytes(double(st.index_bytes)).c_str(),
                human_bytes(double(st.kv_bytes)).c_str(), o.include_kv ? "included" : "not included",
                o.out.c_str());
  }
  return kExitOk;
}

}  // namespace

Command add_build_command(CLI::App& root) {
  auto o = std::make_shared<BuildOptions>();
  CLI::App* cmd = root.add_subcommand(
      "build", "prefill a trace's prompt, build a method's index and save its tables");
  cmd->add_option("--trace", o->trace, "input trace (.safetensors, kvsieve-trace)")->required();
  cmd->add_option("--method", o->method, "method name (see `kvsieve methods`)");
  cmd->add_option("--params", o->params, "method parameters: key=value,key=value");
  cmd->add_option("--budget", o->budget, "exact keys per step, as a fraction of the context, (0, 1]");
  cmd->add_option("--backend", o->backend, "cpu, cuda or hybrid");
  cmd->add_option("--threads", o->threads, "library worker threads (0 = all hardware threads)");
  cmd->add_flag("--include-kv", o->include_kv, "store the KV cache in the file too");
  cmd->add_option("--out", o->out, "output tables file")->required();
  cmd->add_flag("-q,--quiet", o->quiet, "print nothing on success");
  return {cmd, [o] { return run_build(*o); }};
}

}  // namespace kvcli
