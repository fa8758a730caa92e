// SPDX-License-Identifier: Apache-2.0
// The subcommands of `kvsieve`, one file each (cmd_<name>.cpp). Each adds itself to the root
// CLI11 app and returns the function main() runs when it was the one parsed.
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace kvcli {

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;  // returns the exit code; may throw CliError
};

Command add_methods_command(CLI::App& root);
Command add_synth_command(CLI::App& root);
Command add_build_command(CLI::App& root);
Command add_inspect_command(CLI::App& root);
Command add_eval_command(CLI::App& root);
Command add_bench_command(CLI::App& root);
Command add_demo_command(CLI::App& root);

}  // namespace kvcli
