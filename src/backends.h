// Internal: the backends behind gdn::decode. Each takes a validated Problem (check.cpp)
// and never fails on its arguments; only the CUDA launch can report an error.
#pragma once

#include <string>

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

// For the tools (gdn bench): the launch the CUDA backend makes for this valid problem, as one
// line of text (kernel family, grid, block, shared memory and the family's shape fields, e.g.
// "group blocks=512 threads=128 smem=64512 hpb=2 buffers=3 tiles=2 tile_rows=64 pdl"); empty
// where the CUDA backend cannot run it or this build has none. Read from the same planner as the
// launch, on the problem's device. Informational: the text is not a stable interface.
std::string describe_cuda_plan(const Problem& p);
std::string describe_fused_cuda_plan(const FusedProblem& p);


}  // namespace gdn::detail
