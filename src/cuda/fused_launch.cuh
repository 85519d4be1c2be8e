// Host launchers of the fused step (the cluster form: the tile kernels of vk.cuh and kv.cuh with
// Fuse<kNorm>, and for the KV layout decode_kv_vt_kernel too; the group kernel of group.cuh) for
// one state dtype and layout; instantiated in fused_<dtype>_<layout>.cu, the plan decided by
// decode_cuda.cu (plan_fused).
#pragma once

#include "group.cuh"
#include "kv.cuh"
#include "vk.cuh"

namespace gdn::detail::cuda {

// What the dispatch below does with the kernel the plan picks: launch it (FusedLaunch), or ask
// how many of its clusters the device runs at once (FusedOccupancy: the planner widens the tiles
// of a grid that would pass one wave of clusters; decode_cuda.cu, plan_fused_typed).
struct FusedLaunch {
  const FusedProblem& f;
  const LaunchPlan& lp;
  cudaStream_t stream;
  template <auto kKernel>
  cudaError_t run() const {
    return launch_tile_kernel<kKernel>(f, lp, stream);
  }
};
struct FusedOccupancy {
  const LaunchPlan& lp;
  int* clusters;
  template <auto kKernel>
  cudaError_t run() const {
    return max_active_clusters<kKernel>(lp, clusters);
  }
};

template <typename S, int K, bool kNorm, bool kSr, typename Act>
cudaError_t fused_vk_k(const LaunchPlan& lp, const Act& act) {
  using Fz = Fuse<kNorm>;
  switch (lp.rows_per_thread) {
    case 4:
      return act.template run<decode_vk_tile_kernel<S, K, 4, false, Fz, kSr>>();
    case 2:
      return act.template run<decode_vk_tile_kernel<S, K, 2, false, Fz, kSr>>();
    default:
      return act.template run<decode_vk_tile_kernel<S, K, 1, false, Fz, kSr>>();
  }
}

template <typename S, int K, bool kNorm, bool kSr, typename Act>
cudaError_t fused_kv_k(const LaunchPlan& lp, const Act& act) {
  using W = KvTileWide<S, K>;
  using Fz = Fuse<kNorm>;
  if (lp.kv_vt) {  // VK's token loop on the transposed tile (plan_fused_kv_vt)
    if constexpr (!kSr) {
      if constexpr (kv_vt_stores_direct(K, 4, sizeof(S))) {
        if (lp.rows_per_thread == 4) return act.template run<decode_kv_vt_kernel<S, K, 4, false, Fz>>();
      }
      if constexpr (kv_vt_stores_direct(K, 2, sizeof(S))) {
        if (lp.rows_per_thread == 2) return act.template run<decode_kv_vt_kernel<S, K, 2, false, Fz>>();
      }
    }
    return cudaErrorInvalidConfiguration;  // planned with stores from registers, no rounding seed
  }
  if (lp.kv_lanes16) {
    if constexpr (sizeof(S) == 4) {
      return act.template run<decode_kv_tile_kernel<S, K, kKvFusedLanes16Threads, 16, Fz, kSr>>();
    } else {
      return cudaErrorInvalidConfiguration;  // planned for fp32 states only
    }
  }
  return lp.kv_wide ? act.template run<decode_kv_tile_kernel<S, K, W::NT, W::LV, Fz, kSr>>()
                    : act.template run<decode_kv_tile_kernel<S, K, kKvTileThreads, 8, Fz, kSr>>();
}

// The kernel of the plan: by K, the rounding (kSr: launch_rounding, common.cuh, as decode) and
// the norm; the group kernel (either layout) or the layout's cluster form. Each translation unit
// (fused_<dtype>_<layout>.cu) compiles its layout's kernels only.
template <typename S, bool kKv, typename Act>
cudaError_t fused_dispatch(const FusedProblem& f, const LaunchPlan& lp, const Act& act) {
  const auto by_norm = [&](auto sr, auto norm) {
    const auto by_k = [&](auto k) {
      constexpr int K = decltype(k)::value;
      constexpr bool kNorm = decltype(norm)::value, kSr = decltype(sr)::value;
      if (lp.group) {
        if constexpr (K == 128) {
          if constexpr (kKv && sizeof(S) == 2) {
            if (lp.group4) return act.template run<group_kernel<S, K, kNorm, kSr, kKv, true, kGroupKvBlocksPerSm>>();
          }
          if constexpr (!kKv && sizeof(S) == 2) {
            if (lp.geo.hpb == 2) return act.template run<group_kernel<S, K, kNorm, kSr, kKv, true, kGroupBlocksPerSm, 2>>();
          }
          return act.template run<group_kernel<S, K, kNorm, kSr, kKv>>();
        } else {
          return cudaErrorInvalidConfiguration;  // planned for K = 128 only
        }
      }
      if constexpr (kKv) {
        return fused_kv_k<S, K, kNorm, kSr>(lp, act);
      } else {
        return fused_vk_k<S, K, kNorm, kSr>(lp, act);
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
  };
  return launch_rounding<S>(f.step.rounding_seed, [&](auto sr) {
    return f.norm_weight.data != nullptr ? by_norm(sr, std::true_type{}) : by_norm(sr, std::false_type{});
  });
}

template <typename S, bool kKv>
cudaError_t launch_fused(const FusedProblem& f, const LaunchPlan& lp, cudaStream_t stream) {
  return fused_dispatch<S, kKv>(f, lp, FusedLaunch{f, lp, stream});
}

// How many clusters of the plan's kernel the device runs at once (max_active_clusters).
template <typename S, bool kKv>
cudaError_t fused_max_clusters(const FusedProblem& f, const LaunchPlan& lp, int* clusters) {
  return fused_dispatch<S, kKv>(f, lp, FusedOccupancy{lp, clusters});
}

// Defined in their own translation units; keeps decode_cuda.cu from instantiating kernels.
#define GDN_FUSED_EXTERN(S, KV)                                                                       \
  extern template cudaError_t launch_fused<S, KV>(const FusedProblem&, const LaunchPlan&, cudaStream_t); \
  extern template cudaError_t fused_max_clusters<S, KV>(const FusedProblem&, const LaunchPlan&, int*);
GDN_FUSED_EXTERN(float, false)
GDN_FUSED_EXTERN(float, true)
GDN_FUSED_EXTERN(__nv_bfloat16, false)
GDN_FUSED_EXTERN(__nv_bfloat16, true)
GDN_FUSED_EXTERN(__half, false)
GDN_FUSED_EXTERN(__half, true)
#undef GDN_FUSED_EXTERN

}  // namespace gdn::detail::cuda
