// Host launchers of the fused step (the cluster form: the tile kernels of vk.cuh and kv.cuh with
// Fuse<kNorm>; the group kernel of fused_group.cuh) for one state dtype and layout; instantiated
// in fused_<dtype>_<layout>.cu, the plan decided by decode_cuda.cu (plan_fused).
#pragma once

#include "fused_group.cuh"
#include "kv.cuh"
#include "vk.cuh"

namespace gdn::detail::cuda {

template <typename S, int K, bool kNorm, bool kSr>
cudaError_t launch_fused_vk_k(const FusedProblem& f, const LaunchPlan& lp, cudaStream_t stream) {
  using Fz = Fuse<kNorm>;
  if (lp.group) {
    if constexpr (K == 128) {
      return launch_tile_kernel<fused_group_kernel<S, K, kNorm, kSr>>(f, lp, stream);
    } else {
      return cudaErrorInvalidConfiguration;  // planned for K = 128 only
    }
  }
  switch (lp.rows_per_thread) {
    case 4:
      return launch_tile_kernel<decode_vk_tile_kernel<S, K, 4, false, Fz, kSr>>(f, lp, stream);
    case 2:
      return launch_tile_kernel<decode_vk_tile_kernel<S, K, 2, false, Fz, kSr>>(f, lp, stream);
    default:
      return launch_tile_kernel<decode_vk_tile_kernel<S, K, 1, false, Fz, kSr>>(f, lp, stream);
  }
}

template <typename S, int K, bool kNorm, bool kSr>
cudaError_t launch_fused_kv_k(const FusedProblem& f, const LaunchPlan& lp, cudaStream_t stream) {
  using W = KvTileWide<S, K>;
  using Fz = Fuse<kNorm>;
  if (lp.kv_lanes16) {
    if constexpr (sizeof(S) == 4) {
      return launch_tile_kernel<decode_kv_tile_kernel<S, K, kKvFusedLanes16Threads, 16, Fz, kSr>>(f, lp, stream);
    } else {
      return cudaErrorInvalidConfiguration;  // planned for fp32 states only
    }
  }
  return lp.kv_wide ? launch_tile_kernel<decode_kv_tile_kernel<S, K, W::NT, W::LV, Fz, kSr>>(f, lp, stream)
                    : launch_tile_kernel<decode_kv_tile_kernel<S, K, kKvTileThreads, 8, Fz, kSr>>(f, lp, stream);
}

// kSr: launch_rounding (common.cuh), as decode.
template <typename S, bool kKv, bool kNorm, bool kSr>
cudaError_t launch_fused_sr(const FusedProblem& f, const LaunchPlan& lp, cudaStream_t stream) {
  // if constexpr: each translation unit (fused_<dtype>_<layout>.cu) compiles its layout's kernels only.
  const auto by_k = [&](auto k) {
    if constexpr (kKv) {
      return launch_fused_kv_k<S, decltype(k)::value, kNorm, kSr>(f, lp, stream);
    } else {
      return launch_fused_vk_k<S, decltype(k)::value, kNorm, kSr>(f, lp, stream);
    }
  };
  switch (f.step.K) {
    case 64:
      return by_k(std::integral_constant<int, 64>{});
    case 128:
      return by_k(std::integral_constant<int, 128>{});
    default:
      return by_k(std::integral_constant<int, 256>{});
  }
}

template <typename S, bool kKv, bool kNorm>
cudaError_t launch_fused_norm(const FusedProblem& f, const LaunchPlan& lp, cudaStream_t stream) {
  return launch_rounding<S>(f.step.rounding_seed, [&](auto sr) {
    return launch_fused_sr<S, kKv, kNorm, decltype(sr)::value>(f, lp, stream);
  });
}

template <typename S, bool kKv>
cudaError_t launch_fused(const FusedProblem& f, const LaunchPlan& lp, cudaStream_t stream) {
  return f.norm_weight.data != nullptr ? launch_fused_norm<S, kKv, true>(f, lp, stream)
                                       : launch_fused_norm<S, kKv, false>(f, lp, stream);
}

// Defined in their own translation units; keeps decode_cuda.cu from instantiating kernels.
extern template cudaError_t launch_fused<float, false>(const FusedProblem&, const LaunchPlan&, cudaStream_t);
extern template cudaError_t launch_fused<float, true>(const FusedProblem&, const LaunchPlan&, cudaStream_t);
extern template cudaError_t launch_fused<__nv_bfloat16, false>(const FusedProblem&, const LaunchPlan&, cudaStream_t);
extern template cudaError_t launch_fused<__nv_bfloat16, true>(const FusedProblem&, const LaunchPlan&, cudaStream_t);
extern template cudaError_t launch_fused<__half, false>(const FusedProblem&, const LaunchPlan&, cudaStream_t);
extern template cudaError_t launch_fused<__half, true>(const FusedProblem&, const LaunchPlan&, cudaStream_t);

}  // namespace gdn::detail::cuda
