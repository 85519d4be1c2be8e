// `gdn drift`: the state-precision study (see drift.cpp).
#pragma once

#include <CLI/CLI.hpp>

namespace gdn::tools {

void add_drift_command(CLI::App& app);

}  // namespace gdn::tools
