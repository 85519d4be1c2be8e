// Instantiations of the fused step for f32 state, VK layout (all K, row counts, widths, norm on/off).
#include "fused_launch.cuh"

namespace gdn::detail::cuda {
template cudaError_t launch_fused<float, false>(const FusedProblem&, const LaunchPlan&, cudaStream_t);
template cudaError_t fused_max_clusters<float, false>(const FusedProblem&, const LaunchPlan&, int*);
}  // namespace gdn::detail::cuda
