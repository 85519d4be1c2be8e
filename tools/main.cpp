// gdn: command-line front end. `gdn run` simulates a serving engine's GDN decode and verifies
// it; `gdn bench` (CUDA builds) sweeps the kernels against the HBM copy ceiling.
#include <CLI/CLI.hpp>

#include "run.h"
#ifdef GDN_WITH_CUDA
#include "bench.h"
#endif

int main(int argc, char** argv) {
  CLI::App app{"gdn: Gated DeltaNet decode kernels (CPU and CUDA)"};
  app.require_subcommand(1);
  gdn::tools::add_run_command(app);
#ifdef GDN_WITH_CUDA
  add_bench_command(app);
#endif
  // Subcommands report failure by throwing CLI::RuntimeError(code); CLI11_PARSE returns it.
  CLI11_PARSE(app, argc, argv);
  return 0;
}
