// SPDX-License-Identifier: Apache-2.0
// kvsieve synth --out FILE [...]: writes a synthetic kvsieve-trace (docs/synth.md).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>

#include "commands.hpp"
#include "common.hpp"
#include "progress.hpp"
#include "synth_model.hpp"

namespace kvcli {

namespace {

struct SynthOptions {
  SynthConfig cfg;
  std::string dtype = "f32";
  std::string present;
  std::string out;
  unsigned threads = 0;
  bool stats = false;
  bool quiet = false;
};

int run_synth(SynthOptions& o) {
  o.cfg.dtype = parse_dtype(o.dtype);
  if (!o.present.empty()) o.cfg.present = parse_index_list(o.present, "--present");
  validate(o.cfg);
  const unsigned threads = resolve_threads(o.threads);

  const auto t0 = Clock::now();
  SynthTrace tr;
  {
    Activity busy("synthesizing");
    tr = synth_generate(o.cfg, threads);
  }
  {
    Activity busy("writing " + o.out);
    synth_write(tr, o.out);
  }
  const auto& c = o.cfg;
  if (!o.quiet) {
    std::vector<std::string> layers;
    for (const auto& sl : tr.layers) layers.push_back(std::to_string(sl.layer));
    std::printf("wrote %s: layers %s of %u, %lld tokens (%lld prompt + %lld decode), %u q heads, "
                "%u kv heads, d %u, %s, %s, seed %llu (%.1f s)\n",
                o.out.c_str(), join(layers, ",").c_str(), c.layers,
                static_cast<long long>(c.total()), static_cast<long long>(c.prefill),
                static_cast<long long>(c.decode), c.q_heads, c.kv_heads, c.head_dim,
                dtype_name(c.dtype), human_bytes(double(tr.bytes())).c_str(),
                static_cast<unsigned long long>(c.seed), seconds_since(t0));
  }
  if (o.stats) {
    SynthStats st;
    {
      Activity busy("computing attention statistics");
      st = synth_stats(tr, 16, threads);
    }
    std::printf("exact attention mass, mean over %lld sampled steps x layers x query heads:\n"
                "  sinks %.3f  needles %.3f  last 64 tokens %.3f  top 1%% keys %.3f  top 5%% keys %.3f  "
                "max weight %.3f\n  background logit std %.2f\n",
                static_cast<long long>(st.steps), st.sink_mass, st.needle_mass, st.recent_mass,
                st.top1_mass, st.top5_mass, st.max_prob, st.background_logit_std);
  }
  return kExitOk;
}

}  // namespace

Command add_synth_command(CLI::App& root) {
  auto o = std::make_shared<SynthOptions>();
  CLI::App* cmd = root.add_subcommand(
      "synth", "write a synthetic Q/K/V trace with sinks, RoPE, topics, needles and recency");
  cmd->add_option("--out", o->out, "output trace file (.safetensors)")->required();
  add_synth_shape_options(cmd, o->cfg, o->dtype);
  cmd->add_option("--present", o->present,
                  "comma-separated layers to write (default: all); the others are absent");
  cmd->add_option("--threads", o->threads, "generator threads (0 = all; the output does not depend on it)");
  cmd->add_flag("--stats", o->stats, "print the exact attention mass on sinks, needles, recent keys, top keys");
  cmd->add_flag("-q,--quiet", o->quiet, "print nothing on success");
  add_synth_model_options(cmd, o->cfg);
  return {cmd, [o] { return run_synth(*o); }};
}

}  // namespace kvcli
