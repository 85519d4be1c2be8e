// `gdn run`: the main job (see run.cpp).
#pragma once

#include <CLI/CLI.hpp>

namespace gdn::tools {

void add_run_command(CLI::App& app);

}  // namespace gdn::tools
