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
// Shared memory of the fused step, after the staging area (host: fused_smem_floats). nch =
// 2K + nc channels: the q and k parts of hv's q/k head, then v channels [c0, c0 + nc) of hv.
// Everything a block needs of the conv lands here once, with every load in flight together,
// and serves both the conv outputs (prologue) and the conv-state stores (epilogue).
// ---------------------------------------------------------------------------------------
struct FusedSmem {
  unsigned char* x = nullptr;  // the new inputs, mixed_qkv's dtype, in stage_issue's raw layout
  float* cs = nullptr;    // [L - first][nch] conv-state columns first..L-1 of the read slot
  float* w = nullptr;     // [W][nch] conv taps
  float* bias = nullptr;  // [nch]
  float* o = nullptr;     // [T][nc] the raw recurrence output, until the norm factor is known (norm only)
  float* zw = nullptr;    // [T][nc] norm_weight * silu(z) (norm only)
  float* part = nullptr;  // [16] this tile's sums of o^2 per token (read by sibling tiles)
  float* fac = nullptr;   // [16] rsqrt(mean(o^2) + eps) per token
  int64_t* ws = nullptr;  // [16] the conv write slot of each token (< 0: none)
  int first = 0;          // the first conv-state column kept: 0 when L == W - 1, else 1
};

// The old conv-state columns a block needs: the last W - 1 for the conv, and 1..L-1 for the
// conv state after token 0 (each later token needs fewer).
__host__ __device__ constexpr int conv_first_col(int L, int W) { return L - (W - 1) < 1 ? L - (W - 1) : 1; }

// Floats after the staging area, each region rounded to 16 bytes, plus 4 of slack to align
// the start.
__host__ __device__ constexpr int fused_smem_floats(int T, int K, int nc, int L, int W, int x_bytes, bool norm) {
  const int nch = 2 * K + nc;
  const auto r4 = [](int f) { return (f + 3) / 4 * 4; };
  return 4 + r4((T * nch * x_bytes + 3) / 4) + r4((L - conv_first_col(L, W)) * nch) + r4(W * nch) + r4(nch) +
         (norm ? 2 * r4(T * nc) : 0) + 16 + 16 + 2 * 16;
}

__device__ __forceinline__ FusedSmem carve_fused(const FusedProblem& f, float* base, int nc, bool norm) {
  const int T = static_cast<int>(f.step.T), K = static_cast<int>(f.step.K);
  const int L = static_cast<int>(f.L), W = static_cast<int>(f.W);
  const int nch = 2 * K + nc;
  const auto r4 = [](int x) { return (x + 3) / 4 * 4; };
  base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(base) + 15) & ~uintptr_t{15});
  FusedSmem s;
  s.first = conv_first_col(L, W);
  s.x = reinterpret_cast<unsigned char*>(base);
  base += r4((T * nch * (f.x.dtype == DType::kF32 ? 4 : 2) + 3) / 4);
  s.cs = base;
  base += r4((L - s.first) * nch);
  s.w = base;
  base += r4(W * nch);
  s.bias = base;
  base += r4(nch);
  s.o = base;
  s.zw = base + (norm ? r4(T * nc) : 0);
  s.part = base + (norm ? 2 * r4(T * nc) : 0);
  s.fac = s.part + 16;
  s.ws = reinterpret_cast<int64_t*>(s.fac + 16);  // 16-byte aligned: every region is a multiple of 4 floats
  return s;
}

// Conv channel of block channel c: the q part (c < K) and k part (c < 2K) of q/k head h, else v
// channel c0 + c - 2K of head hv.
__device__ __forceinline__ int64_t conv_channel(const Problem& p, int c, int64_t h, int64_t hv, int64_t c0) {
  const int64_t K = p.K;
  return c < K ? h * K + c : c < 2 * K ? (p.H + h) * K + (c - K) : 2 * p.H * K + hv * p.V + c0 + (c - 2 * K);
}

// Elements e in [0, count) of a strided tensor (offset(e) in elements) into dst[e] as fp32,
// kBatch loads in flight per thread before the first is converted.
template <int NT, int kBatch, typename Off>
__device__ __forceinline__ void gather_f32(const void* base, DType dt, int count, Off offset, float* dst) {
  for (int e0 = threadIdx.x; e0 < count; e0 += NT * kBatch) {
    uint32_t b[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * NT;
      b[u] = e < count ? load_bits(base, dt, offset(e)) : 0u;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * NT;
      if (e < count) dst[e] = bits_to_f32(b[u], dt);
    }
  }
}

// The new inputs of the block (mixed_qkv's parts of its channels) into fs.x, by stage_issue:
// 16-byte cp.async when mixed_qkv allows it (the step's q, k, v views are mixed_qkv's parts).
// They do not depend on the slot, so the caller issues them first, in their own cp.async group.
template <int NT>
__device__ __forceinline__ void fused_stage_x(const FusedProblem& f, const Geometry& geo, const StageSmem& sm,
                                              const FusedSmem& fs, int64_t n, int64_t hv, int64_t c0, int nc, int T) {
  StageSmem xs = sm;  // sm.raw takes the conv outputs
  xs.raw = fs.x;
  stage_issue<NT>(f.step, geo, xs, n, 0, T, hv, c0, nc);
}

// The rest of the block's conv inputs, all loads in flight together: the read slot's conv
// columns, the taps and the bias into shared memory, and with the norm z. The caller then
// waits for fused_stage_x's cp.async group and syncs before fused_conv_compute.
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_conv_load(const FusedProblem& f, const FusedSmem& fs, int64_t n, int64_t hv,
                                                int64_t c0, int nc, int T, int64_t slot) {
  const Problem& p = f.step;
  const int K = static_cast<int>(p.K), L = static_cast<int>(f.L), W = static_cast<int>(f.W);
  const int64_t h = hv / (p.HV / p.H);
  const int nch = 2 * K + nc;
  // v channels past V (a partial last tile) read channel c0 of the head instead: in range, unused.
  const auto chan = [&](int c) {
    return c >= 2 * K && c0 + (c - 2 * K) >= p.V ? conv_channel(p, 2 * K, h, hv, c0) : conv_channel(p, c, h, hv, c0);
  };
  const int lc = L - fs.first;
  gather_f32<NT, 8>(f.conv_state.data, f.conv_state.dtype, lc * nch,
                    [&](int e) {
                      return slot * f.conv_state.s[0] + chan(e % nch) * f.conv_state.s[1] +
                             (fs.first + e / nch) * f.conv_state.s[2];
                    },
                    fs.cs);
  gather_f32<NT, 8>(f.conv_weight.data, f.conv_weight.dtype, W * nch,
                    [&](int e) { return chan(e % nch) * f.conv_weight.s[0] + (e / nch) * f.conv_weight.s[1]; }, fs.w);
  if (f.conv_bias.data != nullptr)
    gather_f32<NT, 4>(f.conv_bias.data, f.conv_bias.dtype, nch, [&](int e) { return chan(e) * f.conv_bias.s[0]; },
                      fs.bias);
  if constexpr (kNorm) {
    const int64_t cmax = p.V - 1;
    if (f.z.data != nullptr) {
      gather_f32<NT, 8>(f.z.data, f.z.dtype, T * nc,
                        [&](int e) {
                          const int64_t col = c0 + e % nc < cmax ? c0 + e % nc : cmax;
                          return n * f.z.s[0] + (e / nc) * f.z.s[1] + hv * f.z.s[2] + col * f.z.s[3];
                        },
                        fs.zw);
    }
  }
}

// The conv window element j of block channel c: the read slot's column j for j < L, else the
// new input of token j - L.
__device__ __forceinline__ float conv_window(const FusedProblem& f, const FusedSmem& fs, int c, int j, int K,
                                             int nc, int T) {
  const int L = static_cast<int>(f.L);
  const int nch = 2 * K + nc;
  if (j < L) return fs.cs[(j - fs.first) * nch + c];
  const int t = j - L;
  const int part = c < K ? 0 : c < 2 * K ? 1 : 2;
  const int i = part == 2 ? c - 2 * K : c - part * K;
  const int idx = part * T * K + t * (part == 2 ? nc : K) + i;  // stage_issue's raw layout
  switch (f.x.dtype) {
    case DType::kF32:
      return reinterpret_cast<const float*>(fs.x)[idx];
    case DType::kBF16:
      return bf16_lo(reinterpret_cast<const uint16_t*>(fs.x)[idx]);
    default:
      return __half2float(reinterpret_cast<const __half*>(fs.x)[idx]);
  }
}

// y[t] = silu(bias + sum_w weight[d, w] * window[L + t - (W - 1) + w]) for the block's channels,
// as fp32 in the raw staging area (for stage_convert_t<float>); with the norm, zw = norm_weight
// * silu(z). After fused_conv_load's data is visible.
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_conv_compute(const FusedProblem& f, const StageSmem& sm, const FusedSmem& fs,
                                                   int64_t c0, int nc, int T) {
  const Problem& p = f.step;
  const int K = static_cast<int>(p.K), L = static_cast<int>(f.L), W = static_cast<int>(f.W);
  const int nch = 2 * K + nc;
  float* const raw = reinterpret_cast<float*>(sm.raw);
  const bool has_bias = f.conv_bias.data != nullptr;
  for (int c = threadIdx.x; c < nch; c += NT) {
    const int part = c < K ? 0 : c < 2 * K ? 1 : 2;
    const int i = part == 2 ? c - 2 * K : c - part * K;
    float* const dst = raw + part * T * K + i;  // StageSmem::raw_part(part, K) as fp32
    const int stride = part == 2 ? nc : K;
    const float b = has_bias ? fs.bias[c] : 0.f;
    for (int t = 0; t < T; ++t) {
      float acc = b;
      for (int k = 0; k < W; ++k) acc = fmaf(fs.w[k * nch + c], conv_window(f, fs, c, L + t - (W - 1) + k, K, nc, T), acc);
      dst[t * stride] = acc / (1.f + expf(-acc));
    }
  }
  if constexpr (kNorm) {
    for (int e = threadIdx.x; e < T * nc; e += NT) {
      const int64_t col = c0 + e % nc < p.V ? c0 + e % nc : p.V - 1;
      const float w = bits_to_f32(load_bits(f.norm_weight.data, f.norm_weight.dtype, col * f.norm_weight.s[0]),
                                  f.norm_weight.dtype);
      float g = 1.f;
      if (f.z.data != nullptr) {
        const float z = fs.zw[e];
        g = z / (1.f + expf(-z));
      }
      fs.zw[e] = w * g;
    }
  }
}

// The conv state after each stored token (and conv_inter) for block channels [c_first, c_last),
// from shared memory: column j after token t is window element t + 1 + j. fs.ws holds the
// tokens' write slots.
template <int NT>
__device__ __forceinline__ void fused_conv_store(const FusedProblem& f, const FusedSmem& fs, int64_t n, int64_t hv,
                                                 int64_t c0, int nc, int c_first, int c_last, int T) {
  const Problem& p = f.step;
  const int K = static_cast<int>(p.K);
  const int L = static_cast<int>(f.L);
  const int64_t h = hv / (p.HV / p.H);
  const bool inter = f.conv_inter.data != nullptr;
  for (int c = c_first + static_cast<int>(threadIdx.x); c < c_last; c += NT) {
    if (c >= 2 * K && c0 + (c - 2 * K) >= p.V) continue;
    const int64_t d = conv_channel(p, c, h, hv, c0);
    for (int t = 0; t < T; ++t) {
      const int64_t ws = fs.ws[t];
      if (ws < 0 && !inter) continue;
      for (int j = 0; j < L; ++j) {
        const float x = conv_window(f, fs, c, t + 1 + j, K, nc, T);
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
  __syncthreads();  // the token loop's outputs (fs.o) are complete
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
  fused_conv_store<NT>(f, fs, n, hv, c0, nc, qk_first, qk_last, T);
  fused_conv_store<NT>(f, fs, n, hv, c0, nc, 2 * K, 2 * K + nc, T);

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
