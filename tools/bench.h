// `gdn bench` (CUDA builds only): sweeps the CUDA kernels against the HBM copy ceiling.
#pragma once

#include <CLI/CLI.hpp>

void add_bench_command(CLI::App& app);
