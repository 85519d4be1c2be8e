// Builds without a CUDA compiler: CUDA tensors are a valid request this build cannot serve.
#include "backends.h"

namespace gdn::detail {

Status cuda_backend_status() {
  return Status(StatusCode::kNotSupported,
                "tensors are on a CUDA device, but this build of gdn has no CUDA backend "
                "(configure with a CUDA compiler and GDN_ENABLE_CUDA=ON)");
}

Status decode_cuda(const Problem&, void*) { return cuda_backend_status(); }
Status fused_cuda_status(const FusedProblem&) { return cuda_backend_status(); }
Status fused_decode_cuda(const FusedProblem&, void*) { return cuda_backend_status(); }
std::string describe_cuda_plan(const Problem&) { return {}; }
std::string describe_fused_cuda_plan(const FusedProblem&) { return {}; }

}  // namespace gdn::detail

namespace gdn {
bool cuda_available() { return false; }
}  // namespace gdn
