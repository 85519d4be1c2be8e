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

}  // namespace gdn
