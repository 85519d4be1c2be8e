// The float64 oracle: docs/semantics.md sections 2-3 followed literally, element by element,
// reading the same strided views as gdn::decode. For tests and `gdn run` verification only;
// slow by design and never on a user's hot path (CUTLASS keeps its oracles apart the same way).
#pragma once

#include "gdn/gdn.h"

namespace gdn::reference {

// Same contract as gdn::decode for host (kDLCPU) tensors: validates with gdn::can_implement,
// then computes every row in float64 and stores o, inter and the state in their own dtypes
// (round-to-nearest-even for bf16/fp16), adds bad rows to error_count, and with
// check_duplicate_writes counts rows whose written slots another row also writes.
// Single-threaded; the state is rounded to its dtype only where it is stored. With
// rounding_seed and a bf16/fp16 state, each state and inter store rounds the float64 value to
// fp32 (RNE) and then stochastically with src/rounding.h's bits for (the seed's value, the row's
// read slot, the head, the token, the element's index in the head's matrix), as the backends.
Status decode(const DecodeArgs& args);

// decode with a float64 state (and inter, and optionally o) that is never rounded: the exact
// trajectory that `gdn drift` measures fp32 / bf16 / fp16 states against, step after step.
// gdn::decode accepts no float64, so the call is validated as decode validates the same views
// typed fp32; their byte ranges are then half the real ones, so keep the float64 tensors in
// buffers of their own.
Status decode_exact(const DecodeArgs& args);

// Same contract as gdn::fused_decode for host tensors (docs/semantics.md section 6), computed
// in float64: the conv window, SiLU, the recurrence and the gated RMSNorm, with o, inter, the
// state, conv_inter and the conv state stored in their own dtypes only where they are stored.
Status fused_decode(const FusedDecodeArgs& args);

}  // namespace gdn::reference
