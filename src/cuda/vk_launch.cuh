// Host launchers of the VK kernels (vk.cuh, vk_chunk.cuh) for one state dtype; instantiated
// once per dtype in decode_<dtype>_vk.cu, the plan decided by decode_cuda.cu.
#pragma once

#include "vk.cuh"
#include "vk_chunk.cuh"

namespace gdn::detail::cuda {

// kSr: the kernels with the stochastic-rounding store path (vk_store_token), for 16-bit states
// given a rounding seed; every other call takes kernels without any of its code.
template <typename S, int K, bool kSr>
cudaError_t launch_vk_ks(const Problem& p, const LaunchPlan& lp, cudaStream_t stream) {
  if (lp.tile && lp.direct) {
    if (lp.rows_per_thread == 2)
      return launch_tile_kernel<decode_vk_tile_kernel<S, K, 2, true, NoFuse, kSr>>(p, lp, stream);
    return launch_tile_kernel<decode_vk_tile_kernel<S, K, 1, true, NoFuse, kSr>>(p, lp, stream);
  }
  if (lp.tile) {
    switch (lp.rows_per_thread) {
      case 4:
        return launch_tile_kernel<decode_vk_tile_kernel<S, K, 4, false, NoFuse, kSr>>(p, lp, stream);
      case 2:
        return launch_tile_kernel<decode_vk_tile_kernel<S, K, 2, false, NoFuse, kSr>>(p, lp, stream);
      default:
        return launch_tile_kernel<decode_vk_tile_kernel<S, K, 1, false, NoFuse, kSr>>(p, lp, stream);
    }
  }
  if (!lp.vec) return launch_kernel(decode_vk_kernel<S, K, 1, false, kSr>, p, lp, stream);
  switch (lp.rows_per_thread) {
    case 4:
      return launch_kernel(decode_vk_kernel<S, K, 4, true, kSr>, p, lp, stream);
    case 2:
      return launch_kernel(decode_vk_kernel<S, K, 2, true, kSr>, p, lp, stream);
    default:
      return launch_kernel(decode_vk_kernel<S, K, 1, true, kSr>, p, lp, stream);
  }
}

// At B = 1 a kernel's size is part of its time (its blocks run once each, and instruction
// fetch stalls sit on the one warp's chain): with the rounding path compiled into every bf16
// kernel as a runtime branch, bf16 B = 1 was 0.2-0.6 us slower. Kernels without it, measured on
// the H100 against that (decode, pool, docs/design.md "Where the remaining time goes"):
// Qwen3-Next bf16 T = 1 3.50 -> 3.24 us, T = 4 5.41 -> 4.79, KV T = 1 5.19 -> 4.64.
template <typename S, int K>
cudaError_t launch_vk_k(const Problem& p, const LaunchPlan& lp, cudaStream_t stream) {
  if (lp.chunked) {
    if constexpr (sizeof(S) == 2) {
      return launch_rounding<S>(p.rounding_seed, [&](auto sr) {
        return launch_tile_kernel<decode_vk_chunk_kernel<S, K, false, decltype(sr)::value>>(p, lp, stream);
      });
    } else {
      return cudaErrorInvalidConfiguration;  // the planner picks it for 16-bit states only (VK)
    }
  }
  return launch_rounding<S>(p.rounding_seed,
                            [&](auto sr) { return launch_vk_ks<S, K, decltype(sr)::value>(p, lp, stream); });
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
