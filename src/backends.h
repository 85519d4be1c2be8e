// Internal: the backends behind gdn::decode. Each takes a validated Problem (check.cpp)
// and never fails on its arguments; only the CUDA launch can report an error.
#pragma once

#include "gdn/gdn.h"
#include "problem.h"

namespace gdn::detail {

// Threaded CPU backend (src/cpu/decode_cpu.cpp). Runs to completion before returning.
void decode_cpu(const Problem& p);

// CUDA backend (src/cuda/). Enqueues on `stream` (cudaStream_t); no host sync, no allocation.
// Returns kCudaError with the runtime's message if a launch fails. Defined as a stub that
// returns kNotSupported in builds without CUDA (src/cuda_stub.cpp).
Status decode_cuda(const Problem& p, void* stream);

// Ok when this build has the CUDA backend; otherwise the kNotSupported status decode_cuda
// returns, so that can_implement and decode agree on CUDA tensors in a CPU-only build.
Status cuda_backend_status();

// The fused layer step (docs/semantics.md section 6), same conventions.
void fused_decode_cpu(const FusedProblem& p);
Status fused_decode_cuda(const FusedProblem& p, void* stream);
// Whether the CUDA backend can run this fused problem (a valid call it cannot run is
// kNotSupported, e.g. in a CPU-only build, or a GVA group too large for one thread-block
// cluster); can_implement and fused_decode both ask it.
Status fused_cuda_status(const FusedProblem& p);


}  // namespace gdn::detail
