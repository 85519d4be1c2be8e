// Internal: argument validation shared by can_implement, decode and the oracle.
#pragma once

#include "gdn/gdn.h"
#include "host_dtype.h"
#include "problem.h"

namespace gdn::detail {

// Checks `args` against docs/semantics.md section 4 and, on success, fills `out`.
// Reads no tensor data (slot values are checked by the backends, on the device).
Status build_problem(const DecodeArgs& args, Problem* out);

// The same for fused_decode (docs/semantics.md sections 4 and 6): the step's checks, the conv
// and norm tensors, and the memory rules over all of them.
Status build_fused_problem(const FusedDecodeArgs& args, FusedProblem* out);

}  // namespace gdn::detail
