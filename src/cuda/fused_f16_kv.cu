// Instantiations of the fused step for f16 state, KV layout (all K, row counts, widths, norm on/off).
#include "fused_launch.cuh"

namespace gdn::detail::cuda {
template cudaError_t launch_fused<__half, true>(const FusedProblem&, const LaunchPlan&, cudaStream_t);
template cudaError_t fused_max_clusters<__half, true>(const FusedProblem&, const LaunchPlan&, int*);
}  // namespace gdn::detail::cuda
