// SPDX-License-Identifier: Apache-2.0
// kvsieve: the operator's command line over the public C API (docs/cli.md).
#include <kvsieve/kvsieve.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "commands.hpp"
#include "common.hpp"

namespace {

void log_to_stderr(int32_t level, const char* line, void* /*user_data*/) {
  static const char* names[] = {"debug", "info", "warning", "error"};
  const char* name = level >= 0 && level <= 3 ? names[level] : "log";
  std::fprintf(stderr, "kvsieve: %s: %s\n", name, line);
}

int fail(const std::string& msg, int code) {
  std::fprintf(stderr, "kvsieve: error: %s\n", msg.c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvcli;
  const std::string version = std::string("kvsieve ") + kvs_version() + " (C API header " +
                              std::to_string(KVS_VERSION_MAJOR) + "." +
                              std::to_string(KVS_VERSION_MINOR) + "." +
                              std::to_string(KVS_VERSION_PATCH) + ", ABI " +
                              std::to_string(kvs_abi_version()) + ")";

  CLI::App app{"kvsieve: sparse-attention decoding over a KV cache.\n"
               "Build, inspect, evaluate and benchmark method index tables. Start with `kvsieve demo`.",
               "kvsieve"};
  app.option_defaults()->always_capture_default();
  app.set_version_flag("--version", version);
  app.require_subcommand(1);
  app.footer("Run `kvsieve <command> --help` for a command's options; docs/cli.md has the details.");
  int verbosity = 0;
  app.add_flag("-v,--verbose", verbosity, "library log lines on stderr (-v info, -vv debug)");

  const std::vector<Command> commands = {
      add_demo_command(app),  add_methods_command(app), add_synth_command(app),
      add_build_command(app), add_inspect_command(app), add_eval_command(app),
      add_bench_command(app),
  };

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string where = "kvsieve";
    for (const auto* sub : app.get_subcommands()) where += " " + sub->get_name();
    return fail(std::string(e.what()) + " (see `" + where + " --help`)", kExitUsage);
  }

  if (verbosity > 0) {
    kvs_set_log_callback(&log_to_stderr, nullptr, verbosity >= 2 ? KVS_LOG_DEBUG : KVS_LOG_INFO);
  }

  try {
    check(kvs_abi_check(KVS_ABI_VERSION),
          "this kvsieve was built against another ABI of libkvsieve than the one loaded");
    for (const auto& cmd : commands)
      if (cmd.app->parsed()) return cmd.run();
    return fail("no command given (see `kvsieve --help`)", kExitUsage);
  } catch (const CliError& e) {
    return fail(e.what(), e.code());
  } catch (const CLI::ParseError& e) {  // validation done after parsing, in a command
    return fail(e.what(), kExitUsage);
  } catch (const std::bad_alloc&) {
    return fail("out of memory", kExitError);
  } catch (const std::exception& e) {
    return fail(std::string("unexpected: ") + e.what(), kExitError);
  }
}
