// Instantiations for f16 state, VK layout (all K, row counts and alignment variants).
#include "vk_launch.cuh"

namespace gdn::detail::cuda {
template cudaError_t launch_vk<__half>(const Problem&, const LaunchPlan&, cudaStream_t);
}  // namespace gdn::detail::cuda
