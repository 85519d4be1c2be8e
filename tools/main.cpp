// gdn: command-line front end. `gdn run` simulates a serving engine's GDN decode and verifies
// it; `gdn bench` times the CPU backend or the CUDA kernels against the copy bandwidth
// measured in the same run; `gdn drift` measures how far 16-bit and fp32 states drift from
// the exact trajectory over thousands of steps.
#include <CLI/CLI.hpp>

#include "bench.h"
#include "drift.h"
#include "run.h"

int main(int argc, char** argv) {
  CLI::App app{"gdn: Gated DeltaNet decode kernels (CPU and CUDA)"};
  app.require_subcommand(1);
  gdn::tools::add_run_command(app);
  gdn::tools::add_bench_command(app);
  gdn::tools::add_drift_command(app);
  // Subcommands report failure by throwing CLI::RuntimeError(code); CLI11_PARSE returns it.
  CLI11_PARSE(app, argc, argv);
  return 0;
}
