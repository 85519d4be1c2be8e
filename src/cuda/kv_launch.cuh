// Host launchers of the KV kernels (kv.cuh; the chunked kernel on the KV tile, vk_chunk.cuh; VK's
// token loop on the KV tile, vk.cuh; the group kernel without the conv, group.cuh) for one state
// dtype; instantiated once per dtype in decode_<dtype>_kv.cu, the plan decided by decode_cuda.cu.
#pragma once

#include "group.cuh"
#include "kv.cuh"
#include "vk_chunk.cuh"

namespace gdn::detail::cuda {

template <typename S, int K, bool kSr>
cudaError_t launch_kv_ks(const Problem& p, const LaunchPlan& lp, cudaStream_t stream) {
  using W = KvTileWide<S, K>;
  if (lp.kv_vt) {  // VK's token loop on the transposed tile (vk.cuh; plan_kv_vt), never with rounding
    if constexpr (kSr) {
      return cudaErrorInvalidConfiguration;
    } else if (lp.direct) {
      return lp.rows_per_thread == 2 ? launch_tile_kernel<decode_kv_vt_kernel<S, K, 2, true>>(p, lp, stream)
                                     : launch_tile_kernel<decode_kv_vt_kernel<S, K, 1, true>>(p, lp, stream);
    } else {
      switch (lp.rows_per_thread) {
        case 4:
          return launch_tile_kernel<decode_kv_vt_kernel<S, K, 4>>(p, lp, stream);
        case 2:
          return launch_tile_kernel<decode_kv_vt_kernel<S, K, 2>>(p, lp, stream);
        default:
          return launch_tile_kernel<decode_kv_vt_kernel<S, K, 1>>(p, lp, stream);
      }
    }
  }
  if (lp.group) {  // the group kernel without the conv (group.cuh; plan_kv_group)
    if constexpr (K == 128) {
      FusedProblem f;
      f.step = p;
      return launch_tile_kernel<group_kernel<S, K, false, kSr, true, false>>(f, lp, stream);
    } else {
      return cudaErrorInvalidConfiguration;  // planned for K = 128 only
    }
  }
  if (lp.tile)
    return lp.kv_wide ? launch_tile_kernel<decode_kv_tile_kernel<S, K, W::NT, W::LV, NoFuse, kSr>>(p, lp, stream)
                      : launch_tile_kernel<decode_kv_tile_kernel<S, K, kKvTileThreads, 8, NoFuse, kSr>>(p, lp, stream);
  return lp.vec ? launch_kernel(decode_kv_kernel<S, K, true, kSr>, p, lp, stream)
                : launch_kernel(decode_kv_kernel<S, K, false, kSr>, p, lp, stream);
}

// kSr: launch_rounding (common.cuh).
template <typename S, int K>
cudaError_t launch_kv_k(const Problem& p, const LaunchPlan& lp, cudaStream_t stream) {
  if (lp.chunked) {  // the chunked kernel on the KV tile (vk_chunk.cuh; plan_kv_chunk)
    return launch_tile_kernel<decode_vk_chunk_kernel<S, K, true>>(p, lp, stream);
  }
  return launch_rounding<S>(p.rounding_seed,
                            [&](auto sr) { return launch_kv_ks<S, K, decltype(sr)::value>(p, lp, stream); });
}

// Host launcher for one state dtype; instantiated once per dtype in decode_<dtype>_kv.cu.
template <typename S>
cudaError_t launch_kv(const Problem& p, const LaunchPlan& lp, cudaStream_t stream) {
  switch (p.K) {
    case 64:
      return launch_kv_k<S, 64>(p, lp, stream);
    case 128:
      return launch_kv_k<S, 128>(p, lp, stream);
    default:
      return launch_kv_k<S, 256>(p, lp, stream);
  }
}

}  // namespace gdn::detail::cuda
