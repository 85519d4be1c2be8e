// Public entry points: validate once, then hand the flat Problem to the tensors' backend.
#include "backends.h"
#include "check.h"

namespace gdn {

Status can_implement(const DecodeArgs& args) {
  detail::Problem p;
  Status s = detail::build_problem(args, &p);
  if (s.ok() && args.state.device.device_type == kDLCUDA) return detail::cuda_backend_status();
  return s;
}

Status decode(const DecodeArgs& args, void* stream) {
  detail::Problem p;
  Status s = detail::build_problem(args, &p);
  if (!s.ok()) return s;
  if (p.B == 0) return s;  // an empty batch is a valid no-op
  if (args.state.device.device_type == kDLCUDA) return detail::decode_cuda(p, stream);
  detail::decode_cpu(p);
  return s;
}

Status can_implement(const FusedDecodeArgs& args) {
  detail::FusedProblem p;
  Status s = detail::build_fused_problem(args, &p);
  if (s.ok() && args.state.device.device_type == kDLCUDA) return detail::fused_cuda_status(p);
  return s;
}

Status fused_decode(const FusedDecodeArgs& args, void* stream) {
  detail::FusedProblem p;
  Status s = detail::build_fused_problem(args, &p);
  if (!s.ok()) return s;
  if (args.state.device.device_type == kDLCUDA) {
    if (s = detail::fused_cuda_status(p); !s.ok()) return s;
    return p.step.B == 0 ? s : detail::fused_decode_cuda(p, stream);
  }
  if (p.step.B > 0) detail::fused_decode_cpu(p);
  return s;
}

}  // namespace gdn
