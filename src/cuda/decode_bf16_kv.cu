// Instantiations for bf16 state, KV layout (all K, row counts and alignment variants).
#include "kv_launch.cuh"

namespace gdn::detail::cuda {
template cudaError_t launch_kv<__nv_bfloat16>(const Problem&, const LaunchPlan&, cudaStream_t);
}  // namespace gdn::detail::cuda
