// The fused layer step (gdn::fused_decode, docs/semantics.md section 6) on the tile kernels:
// the pieces that replace the q/k/v staging (the causal conv and SiLU), write the conv state,
// and apply the gated RMSNorm to the output.
//
// A block of a tile kernel owns one (row n, value head hv, tile) and needs the whole q and k
// vectors of hv's q/k head h, and v's channels of its tile. It computes those conv outputs
// itself from the conv state of the row's read slot and the new inputs, so no block waits
// for another to produce them. Two things are shared between blocks, and both are settled
// inside a thread-block cluster made of every block of one (n, h): the HV/H value heads of
// the GVA group times the tiles of each head (the host sizes the tiles so the cluster fits):
// - the conv state of the q and k channels is read by every block of the cluster and must
//   be overwritten (in place, when the write slot is the read slot) only after all of them
//   have read it: each block arrives on the cluster barrier once its conv inputs are in
//   registers, and the blocks write their share of those channels after waiting on it, at
//   the end of the kernel, where the wait costs nothing;
// - the RMSNorm's mean over V spans the tiles of one value head: each block publishes its
//   partial sums of squares per token in shared memory and reads its sibling tiles' sums
//   through distributed shared memory, all in the same order, so every tile gets the same
//   factor bit for bit.
// A padding or invalid row leaves every block of its cluster at the same early return, so
// the barriers never wait for an exited block (exited threads count as arrived).
#pragma once

#include "common.cuh"

namespace gdn::detail::cuda {

// The tile kernels' fusion policy: NoFuse is the plain decode step (kernels compile exactly
// as without it); Fuse<kNorm> the fused step, with or without the gated RMSNorm.
struct NoFuse {
  using Param = Problem;
  static constexpr bool kOn = false;
  static constexpr bool kNorm = false;
  __device__ __forceinline__ static const Problem& step(const Problem& p) { return p; }
};
template <bool kNormOn>
struct Fuse {
  using Param = FusedProblem;
  static constexpr bool kOn = true;
  static constexpr bool kNorm = kNormOn;
  __device__ __forceinline__ static const Problem& step(const FusedProblem& f) { return f.step; }
};

constexpr int kMaxConvW = 4;   // taps (check.cpp: W in 2..4)
constexpr int kMaxConvL = 16;  // conv-state columns (check.cpp: L in W - 1..16)

// ---------------------------------------------------------------------------------------
// Thread-block cluster primitives (sm_90).
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}
// Release: every memory access of this thread before it is performed before the arrival is
// seen. Every thread of the block executes it (.aligned: warp-uniform).
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// `local` (this block's shared memory) at the same offset in the block of cluster rank `rank`.
__device__ __forceinline__ float ld_cluster_f32(const float* local, unsigned rank) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
  return v;
}

// ---------------------------------------------------------------------------------------
// Shared memory of the fused step, after the staging area (host: fused_smem_floats).
// ---------------------------------------------------------------------------------------
struct FusedSmem {
  float* o = nullptr;     // [T][nc] the raw recurrence output, until the norm factor is known (norm only)
  float* zw = nullptr;    // [T][nc] norm_weight * silu(z), loaded in the prologue (norm only)
  float* part = nullptr;  // [16] this tile's sums of o^2 per token (read by sibling tiles)
  float* fac = nullptr;   // [16] rsqrt(mean(o^2) + eps) per token
  int64_t* ws = nullptr;  // [16] the conv write slot of each token (< 0: none)
};

// Floats after the staging area, with 4 of slack to align the start to 16 bytes.
__host__ __device__ constexpr int fused_smem_floats(int T, int nc, bool norm) {
  return 4 + (norm ? 2 * T * nc : 0) + 16 + 16 + 2 * 16;
}

__device__ __forceinline__ FusedSmem carve_fused(float* base, int T, int nc, bool norm) {
  base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(base) + 15) & ~uintptr_t{15});
  FusedSmem s;
  s.o = base;
  s.zw = base + (norm ? T * nc : 0);
  s.part = base + (norm ? 2 * T * nc : 0);
  s.fac = s.part + 16;
  s.ws = reinterpret_cast<int64_t*>(s.fac + 16);  // 16-byte aligned: 2 * T * nc + 32 floats in
  return s;
}

// Conv channel of part 0 (q), 1 (k) or 2 (v) element i of head h (q, k) or hv (v).
__device__ __forceinline__ int64_t conv_channel(const Problem& p, int part, int64_t head, int64_t i) {
  return part == 0 ? head * p.K + i : part == 1 ? (p.H + head) * p.K + i : 2 * p.H * p.K + head * p.V + i;
}

// ---------------------------------------------------------------------------------------
// The conv staging: for the block's channels (the q and k parts of hv's q/k head, and v
// channels [c0, c0 + nc) of hv) and every token t:
//   y[t] = silu(bias + sum_w weight[d, w] * window[t + w]),  window = the last W - 1 columns
//   of the read slot's conv state, then the T new inputs,
// written as fp32 into the raw staging area in the order stage_issue gives raw inputs (so
// stage_convert_t<float> takes it from there). With the norm, zw = norm_weight * silu(z) of
// the block's output elements too. All loads of a channel are issued before any is used.
// ---------------------------------------------------------------------------------------
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_conv_stage(const FusedProblem& f, const StageSmem& sm, const FusedSmem& fs,
                                                 int64_t n, int64_t hv, int64_t c0, int nc, int T, int64_t slot) {
  const Problem& p = f.step;
  const int K = static_cast<int>(p.K);
  const int W = static_cast<int>(f.W);
  const int64_t h = hv / (p.HV / p.H);
  float* const raw = reinterpret_cast<float*>(sm.raw);
  const int nch = 2 * K + nc;
  for (int c = threadIdx.x; c < nch; c += NT) {
    const int part = c < K ? 0 : c < 2 * K ? 1 : 2;
    const int i = part == 2 ? c - 2 * K : c - part * K;
    const int64_t d = part == 2 ? conv_channel(p, 2, hv, c0 + i) : conv_channel(p, part, h, i);
    if (part == 2 && c0 + i >= p.V) continue;
    // Reversed taps wr[k] = weight[d, W-1-k]; window e[2 - j] = old column L-1-j, e[3 + t] = x_t.
    uint32_t wb[kMaxConvW], eb[kMaxConvW - 1 + kMaxChunk], bb = 0;
#pragma unroll
    for (int k = 0; k < kMaxConvW; ++k)
      wb[k] = k < W ? load_bits(f.conv_weight.data, f.conv_weight.dtype,
                                d * f.conv_weight.s[0] + (W - 1 - k) * f.conv_weight.s[1])
                    : 0u;
    if (f.conv_bias.data != nullptr) bb = load_bits(f.conv_bias.data, f.conv_bias.dtype, d * f.conv_bias.s[0]);
#pragma unroll
    for (int j = 0; j < kMaxConvW - 1; ++j)
      eb[2 - j] = j < W - 1 ? load_bits(f.conv_state.data, f.conv_state.dtype,
                                        slot * f.conv_state.s[0] + d * f.conv_state.s[1] +
                                            (f.L - 1 - j) * f.conv_state.s[2])
                            : 0u;
#pragma unroll
    for (int t = 0; t < kMaxChunk; ++t)
      eb[3 + t] = t < T ? load_bits(f.x.data, f.x.dtype, n * f.x.s[0] + t * f.x.s[1] + d * f.x.s[2]) : 0u;
    float wr[kMaxConvW];
#pragma unroll
    for (int k = 0; k < kMaxConvW; ++k) wr[k] = k < W ? bits_to_f32(wb[k], f.conv_weight.dtype) : 0.f;
    const float bias = f.conv_bias.data != nullptr ? bits_to_f32(bb, f.conv_bias.dtype) : 0.f;
    float e[kMaxConvW - 1 + kMaxChunk];
#pragma unroll
    for (int j = 0; j < kMaxConvW - 1; ++j) e[j] = bits_to_f32(eb[j], f.conv_state.dtype);
#pragma unroll
    for (int t = 0; t < kMaxChunk; ++t) e[3 + t] = bits_to_f32(eb[3 + t], f.x.dtype);
    float* const dst = raw + part * T * K + i;  // StageSmem::raw_part(part, K) as fp32
    const int stride = part == 2 ? nc : K;
#pragma unroll
    for (int t = 0; t < kMaxChunk; ++t) {
      if (t >= T) break;
      float acc = bias;
#pragma unroll
      for (int k = 0; k < kMaxConvW; ++k) acc = fmaf(wr[k], e[3 + t - k], acc);  // wr[k] = 0 beyond W
      dst[t * stride] = acc / (1.f + expf(-acc));
    }
  }
  if constexpr (kNorm) {
    for (int i = threadIdx.x; i < T * nc; i += NT) {
      const int t = i / nc, c = i % nc;
      if (c0 + c >= p.V) continue;
      const float w = bits_to_f32(load_bits(f.norm_weight.data, f.norm_weight.dtype, (c0 + c) * f.norm_weight.s[0]),
                                  f.norm_weight.dtype);
      float g = 1.f;
      if (f.z.data != nullptr) {
        const float z = bits_to_f32(load_bits(f.z.data, f.z.dtype,
                                              n * f.z.s[0] + t * f.z.s[1] + hv * f.z.s[2] + (c0 + c) * f.z.s[3]),
                                    f.z.dtype);
        g = z / (1.f + expf(-z));
      }
      fs.zw[i] = w * g;
    }
  }
}

// The conv state after each stored token (and conv_inter), for `count` channels starting at
// the block's share: channel index c in [0, 2K) names the q/k part of head h, c >= 2K the v
// channel c0 + c - 2K of head hv. Every value is loaded before any is stored, so a write slot
// that is also the read slot (in place, or a per-token slot) never feeds a later read.
// fs.ws holds the tokens' write slots.
template <int NT>
__device__ __forceinline__ void fused_conv_store(const FusedProblem& f, const FusedSmem& fs, int64_t n, int64_t hv,
                                                 int64_t c0, int c_first, int c_last, int T, int64_t read_slot) {
  const Problem& p = f.step;
  const int K = static_cast<int>(p.K);
  const int L = static_cast<int>(f.L);
  const int64_t h = hv / (p.HV / p.H);
  const bool inter = f.conv_inter.data != nullptr;
  for (int c = c_first + static_cast<int>(threadIdx.x); c < c_last; c += NT) {
    const int part = c < K ? 0 : c < 2 * K ? 1 : 2;
    const int i = part == 2 ? c - 2 * K : c - part * K;
    if (part == 2 && c0 + i >= p.V) continue;
    const int64_t d = part == 2 ? conv_channel(p, 2, hv, c0 + i) : conv_channel(p, part, h, i);
    // ext[j]: old columns 0..L-1, then x_0..x_{T-1}, all loaded before the first store (a small
    // thread-local array: rolled loops keep this cold path short to compile and to fetch).
    float ext[kMaxConvL + kMaxChunk];
    for (int j = 0; j < L; ++j)
      ext[j] = bits_to_f32(load_bits(f.conv_state.data, f.conv_state.dtype,
                                     read_slot * f.conv_state.s[0] + d * f.conv_state.s[1] + j * f.conv_state.s[2]),
                           f.conv_state.dtype);
    for (int t = 0; t < T; ++t)
      ext[L + t] = bits_to_f32(load_bits(f.x.data, f.x.dtype, n * f.x.s[0] + t * f.x.s[1] + d * f.x.s[2]), f.x.dtype);
    // Column j after token t is window element t + 1 + j.
    for (int t = 0; t < T; ++t) {
      const int64_t ws = fs.ws[t];
      if (ws < 0 && !inter) continue;
      for (int j = 0; j < L; ++j) {
        const float x = ext[t + 1 + j];
        if (ws >= 0)
          store_scalar(f.conv_state.data, f.conv_state.dtype,
                       ws * f.conv_state.s[0] + d * f.conv_state.s[1] + j * f.conv_state.s[2], x);
        if (inter)
          store_scalar(f.conv_inter.data, f.conv_inter.dtype,
                       n * f.conv_inter.s[0] + t * f.conv_inter.s[1] + d * f.conv_inter.s[2] + j * f.conv_inter.s[3],
                       x);
      }
    }
  }
}

// The end of a fused block: waits on the cluster barrier (every block has its conv inputs),
// stores its share of the conv state, and with the norm, exchanges the tiles' sums of squares
// and writes o = o * rsqrt(mean_V(o^2) + eps) * norm_weight * silu(z). `tiles`: tiles per
// value head (the cluster holds HV/H heads x tiles blocks, head-major); `tile`: this block's.
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_finish(const FusedProblem& f, const FusedSmem& fs, const WarpSlots& slots,
                                             int64_t n, int64_t hv, int tile, int tiles, int64_t c0, int nc, int T) {
  const Problem& p = f.step;
  const int K = static_cast<int>(p.K);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (warp == 0)
    for (int t = 0; t < T; ++t) {
      const int64_t ws = warp_token_write_slot(p, slots, n, t);
      if (lane == 0) fs.ws[t] = ws;
    }
  if constexpr (kNorm) {
    // Sums of squares of this tile's outputs, one warp per token, in a fixed order.
    for (int t = warp; t < T; t += NT / 32) {
      float ss = 0.f;
      for (int c = lane; c < nc; c += 32) {
        const float o = fs.o[t * nc + c];
        ss = fmaf(o, o, ss);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      if (lane == 0) fs.part[t] = ss;
    }
  }
  __syncthreads();  // fs.ws, fs.part and fs.o complete
  cluster_wait();   // every block of the cluster has read its conv inputs (arrived in the prologue)

  // This block's share of the conv state: its own v channels, and a slice of the q/k channels
  // of head h by its rank in the cluster.
  const unsigned rank = cluster_rank();
  const int csize = static_cast<int>(p.HV / p.H) * tiles;
  const int per = (2 * K + csize - 1) / csize;
  const int qk_first = static_cast<int>(rank) * per, qk_last = qk_first + per < 2 * K ? qk_first + per : 2 * K;
  fused_conv_store<NT>(f, fs, n, hv, c0, qk_first, qk_last, T, slots.read);
  fused_conv_store<NT>(f, fs, n, hv, c0, 2 * K, 2 * K + nc, T, slots.read);

  if constexpr (kNorm) {
    cluster_arrive();  // this tile's sums are published
    cluster_wait();
    if (static_cast<int>(threadIdx.x) < T) {
      const int t = threadIdx.x;
      const unsigned head0 = rank - static_cast<unsigned>(tile);  // rank of this head's tile 0
      float ss = 0.f;
      for (int j = 0; j < tiles; ++j)
        ss += j == tile ? fs.part[t] : ld_cluster_f32(&fs.part[t], head0 + static_cast<unsigned>(j));
      fs.fac[t] = rsqrtf(ss / static_cast<float>(p.V) + f.norm_eps);
    }
    cluster_arrive();  // done reading the siblings' sums
    __syncthreads();   // fs.fac
    for (int i = threadIdx.x; i < T * nc; i += NT) {
      const int t = i / nc, c = i % nc;
      if (c0 + c < p.V)
        store_scalar(p.o.data, p.o.dtype, n * p.o.s[0] + t * p.o.s[1] + hv * p.o.s[2] + c0 + c,
                     fs.o[i] * fs.fac[t] * fs.zw[i]);
    }
    cluster_wait();  // no sibling still reads this block's sums when it exits
  }
}

}  // namespace gdn::detail::cuda
