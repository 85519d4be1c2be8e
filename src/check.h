// Internal: argument validation shared by can_implement, decode and the oracle.
#pragma once

#include "gdn/gdn.h"
#include "host_dtype.h"
#include "problem.h"

namespace gdn::detail {

// Checks `args` against docs/semantics.md section 4 and, on success, fills `out`.
// Reads no tensor data (slot values are checked by the backends, on the device).
Status build_problem(const DecodeArgs& args, Problem* out);

}  // namespace gdn::detail
