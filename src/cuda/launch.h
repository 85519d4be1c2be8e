// Per-state-dtype launchers, one translation unit each (decode_<dtype>_<layout>.cu), so the
// kernel instantiations compile in parallel; decode_cuda.cu picks one per call.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common.cuh"

namespace gdn::detail::cuda {

template <typename S>
cudaError_t launch_vk(const Problem& p, const LaunchPlan& lp, cudaStream_t stream);
template <typename S>
cudaError_t launch_kv(const Problem& p, const LaunchPlan& lp, cudaStream_t stream);

// Defined in their own translation units; keeps decode_cuda.cu from instantiating kernels.
extern template cudaError_t launch_vk<float>(const Problem&, const LaunchPlan&, cudaStream_t);
extern template cudaError_t launch_vk<__nv_bfloat16>(const Problem&, const LaunchPlan&, cudaStream_t);
extern template cudaError_t launch_vk<__half>(const Problem&, const LaunchPlan&, cudaStream_t);
extern template cudaError_t launch_kv<float>(const Problem&, const LaunchPlan&, cudaStream_t);
extern template cudaError_t launch_kv<__nv_bfloat16>(const Problem&, const LaunchPlan&, cudaStream_t);
extern template cudaError_t launch_kv<__half>(const Problem&, const LaunchPlan&, cudaStream_t);

}  // namespace gdn::detail::cuda
