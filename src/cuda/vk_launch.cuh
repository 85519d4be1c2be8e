// Host launchers of the VK kernels (vk.cuh, vk_chunk.cuh) for one state dtype; instantiated
// once per dtype in decode_<dtype>_vk.cu, the plan decided by decode_cuda.cu.
#pragma once

#include "vk.cuh"
#include "vk_chunk.cuh"

namespace gdn::detail::cuda {

template <typename S, int K>
cudaError_t launch_vk_k(const Problem& p, const LaunchPlan& lp, cudaStream_t stream) {
  if (lp.chunked) {
    if constexpr (std::is_same_v<S, __nv_bfloat16> || std::is_same_v<S, float>) {
      return launch_tile_kernel<decode_vk_chunk_kernel<S, K>>(p, lp, stream);
    } else {
      return cudaErrorInvalidConfiguration;  // the planner picks it for a bf16 or fp32 state only
    }
  }
  if (lp.tile && lp.direct) {
    return lp.rows_per_thread == 2 ? launch_tile_kernel<decode_vk_tile_kernel<S, K, 2, true>>(p, lp, stream)
                                   : launch_tile_kernel<decode_vk_tile_kernel<S, K, 1, true>>(p, lp, stream);
  }
  if (lp.tile) {
    switch (lp.rows_per_thread) {
      case 4:
        return launch_tile_kernel<decode_vk_tile_kernel<S, K, 4>>(p, lp, stream);
      case 2:
        return launch_tile_kernel<decode_vk_tile_kernel<S, K, 2>>(p, lp, stream);
      default:
        return launch_tile_kernel<decode_vk_tile_kernel<S, K, 1>>(p, lp, stream);
    }
  }
  if (!lp.vec) return launch_kernel(decode_vk_kernel<S, K, 1, false>, p, lp, stream);
  switch (lp.rows_per_thread) {
    case 4:
      return launch_kernel(decode_vk_kernel<S, K, 4, true>, p, lp, stream);
    case 2:
      return launch_kernel(decode_vk_kernel<S, K, 2, true>, p, lp, stream);
    default:
      return launch_kernel(decode_vk_kernel<S, K, 1, true>, p, lp, stream);
  }
}

// Host launcher for one state dtype; instantiated once per dtype in decode_<dtype>_vk.cu.
template <typename S>
cudaError_t launch_vk(const Problem& p, const LaunchPlan& lp, cudaStream_t stream) {
  switch (p.K) {
    case 64:
      return launch_vk_k<S, 64>(p, lp, stream);
    case 128:
      return launch_vk_k<S, 128>(p, lp, stream);
    default:
      return launch_vk_k<S, 256>(p, lp, stream);
  }
}

}  // namespace gdn::detail::cuda
