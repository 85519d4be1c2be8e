// The fused layer step (gdn::fused_decode, docs/semantics.md section 6) on the tile kernels:
// the pieces that replace the q/k/v staging (the causal conv and SiLU), write the conv state,
// and apply the gated RMSNorm to the output.
//
// A block of a tile kernel owns one (row n, value head hv, tile): it needs the whole q and k
// vectors of hv's q/k head h and v's channels of its tile. Every block computes the conv of all
// 2K q/k channels of its row and head itself (2K taps and windows, a few KB read from L2), and
// of its own v channels: no block waits for another before its token loop. The blocks of one
// (n, h) — the HV/H value heads of the GVA group times the tiles of each head — form a
// thread-block cluster of C blocks (the host sizes the tiles so it fits), for two reasons only:
// - the conv state of a q/k channel is read by every block of the cluster and written by one
//   (block rank r writes slice r of the 2K channels), so with an in-place update (write slot =
//   read slot) the writer must wait until every block has read it: each block arrives at the
//   cluster barrier once its inputs are in shared memory (fused_inputs_read) and waits on it
//   just before its conv-state stores, at the end, when the others have long arrived;
// - the RMSNorm's mean over V spans the tiles of one value head: each block stores its sums of
//   squares per token into every tile of its head (distributed shared memory, after that
//   wait), arrives (release) and waits (acquire) before it reads them; every tile adds the same
//   numbers in the same order, so all get the same factor bit for bit.
// The VK kernel keeps the final state in its shared tile and writes it to the pool after every
// other global store of the block (fused_store_tile): a store issued behind a burst of state
// stores waits for the burst to drain (and a release, which compiles to a GPU-scope memory
// barrier, waits for it too).
// A padding or invalid row leaves every block of its cluster at the same early return, before
// any barrier (an exited block counts as arrived).
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
constexpr int kMaxTiles = 16;  // tiles of one value head in a cluster (kMaxFusedCluster)

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
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// The cluster barrier in two halves. Every thread of every block executes each (.aligned:
// warp-uniform), alternating arrive and wait. arrive.release: the block's earlier memory
// operations are ordered before the accesses of any block after its matching wait.acquire.
__device__ __forceinline__ void cluster_arrive_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait_acquire() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// The address of this block's `local` shared memory in the block of cluster rank `rank`.
__device__ __forceinline__ unsigned remote_smem(const void* local, unsigned rank) {
  unsigned remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(local)), "r"(rank));
#endif
  return remote;
}
// Stores v at `local` (an address of this block's shared memory) in the block of cluster rank
// `rank` instead.
__device__ __forceinline__ void st_cluster_f32(float* local, unsigned rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote_smem(local, rank)), "f"(v) : "memory");
#else
  (void)rank;
  *local = v;
#endif
}

// x * sigmoid(x) by the fast exponential and division (a few ulp of fp32, far inside the
// tolerances; x < -88 gives -0, the limit): the conv's and the norm's SiLU.
__device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.f + __expf(-x)); }

// ---------------------------------------------------------------------------------------
// The block's share of the conv (host: fused_geometry) and its shared memory after the
// staging area (host: fused_smem_floats).
// ---------------------------------------------------------------------------------------
// The old conv-state columns a block keeps: the last W - 1 for the conv, and 1..L-1 for the
// conv state after token 0 (each later token needs fewer).
__host__ __device__ constexpr int conv_first_col(int L, int W) { return L - (W - 1) < 1 ? L - (W - 1) : 1; }

// Block channels: the 2K q/k channels of head h, then its nc v channels.
struct FusedShare {
  int C = 1;      // blocks in the cluster
  int S = 0;      // q/k channels whose conv state each rank writes: ceil(2K / C), whole groups of 8
  int own = 0;    // 2K + nc
  int first = 0;  // conv_first_col
  int wl = 0;     // window entries kept per channel: L - first + T
};

__host__ __device__ inline FusedShare fused_share(int K, int group, int tiles, int nc, int L, int W, int T) {
  FusedShare s;
  s.C = group * tiles;
  s.S = ((2 * K + s.C - 1) / s.C + 7) / 8 * 8;
  s.own = 2 * K + nc;
  s.first = conv_first_col(L, W);
  s.wl = L - s.first + T;
  return s;
}

struct FusedSmem {
  float* win = nullptr;   // [wl][own] each block channel's window: old columns first..L-1, x_0..x_{T-1}
  float* o = nullptr;     // [T][nc] the raw recurrence output, until the norm factor is known (norm only)
  float* zw = nullptr;    // [T][nc] norm_weight * silu(z) (norm only); with geo.norm_vec, z's raw rows
  float* wn = nullptr;    // [nc] with geo.norm_vec: norm_weight's raw elements (norm only)
  float* part = nullptr;  // [kMaxTiles][16] sums of o^2 per token, stored by each tile of the head
  float* fac = nullptr;   // [16] rsqrt(mean(o^2) + eps) per token
  int64_t* ws = nullptr;  // [16] the conv write slot of each token (< 0: none)
};

__host__ __device__ constexpr int round4(int f) { return (f + 3) / 4 * 4; }

// Floats of the window region: fp32 windows (the generic path), or the 16-byte path's raw
// 16-bit windows, taps and bias, 8 channels per 16-byte vector.
__host__ __device__ constexpr int fused_win_floats(const FusedShare& s, int W) {
  return round4(s.wl * s.own > s.own / 2 * (s.wl + W + 1) ? s.wl * s.own : s.own / 2 * (s.wl + W + 1));
}

// Floats after the staging area, each region a multiple of 16 bytes, plus 4 of slack to align
// the start.
__host__ __device__ inline int fused_smem_floats(const FusedShare& s, int T, int nc, int W, bool norm) {
  return 4 + fused_win_floats(s, W) + (norm ? 2 * round4(T * nc) + round4(nc) : 0) + kMaxTiles * 16 + 16 + 2 * 16;
}

__device__ __forceinline__ FusedSmem carve_fused(const FusedShare& s, float* base, int T, int nc, int W, bool norm) {
  base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(base) + 15) & ~uintptr_t{15});
  FusedSmem m;
  m.win = base;
  base += fused_win_floats(s, W);
  m.o = base;
  m.zw = base + (norm ? round4(T * nc) : 0);
  m.wn = base + (norm ? 2 * round4(T * nc) : 0);
  m.part = m.wn + (norm ? round4(nc) : 0);
  m.fac = m.part + kMaxTiles * 16;
  m.ws = reinterpret_cast<int64_t*>(m.fac + 16);  // 16-byte aligned: every region is a multiple of 4 floats
  return m;
}

// The conv channel of block channel c (c < 2K: q/k channel c of head h; else v channel
// c0 + c - 2K of head hv, < V); -1 past the end of v.
__device__ __forceinline__ int64_t fused_channel(const Problem& p, int c, int64_t h, int64_t hv, int64_t c0) {
  const int64_t K = p.K;
  if (c < 2 * K) return c < K ? h * K + c : (p.H + h) * K + (c - K);
  const int64_t j = c0 + (c - 2 * K);
  return j >= p.V ? -1 : 2 * p.H * K + hv * p.V + j;
}

// Whether this block writes the conv state of block channel c: its own v channels, and the q/k
// channels of its rank's slice.
__device__ __forceinline__ bool fused_writes(const FusedShare& s, int K, int c, unsigned rank) {
  return c >= 2 * K || static_cast<unsigned>(c / s.S) == rank;
}

// Where the conv output of block channel c at token t goes in the raw staging area (fp32,
// stage_issue's layout: q [T][K], k [T][K], v [T][nc]).
__device__ __forceinline__ float* fused_out(float* raw, int K, int c, int t, int nc, int T) {
  return c < K ? raw + t * K + c : c < 2 * K ? raw + T * K + t * K + (c - K) : raw + 2 * T * K + t * nc + (c - 2 * K);
}

// The norm's inputs by 16 bytes (host: fused_norm_vec_ok): z's rows [T][nc] and norm_weight's
// [nc] elements raw into fs.zw and fs.wn, issued with the conv inputs before the slot is known
// (they do not depend on it), converted where the output is written.
template <int NT>
__device__ __forceinline__ void fused_norm_issue(const FusedProblem& f, const FusedSmem& fs, int64_t n, int64_t hv,
                                                 int64_t c0, int nc, int T) {
  const int es = f.norm_weight.dtype == DType::kF32 ? 4 : 2;
  const int per = nc * es / 16;  // 16-byte pieces per row
  const char* const w = static_cast<const char*>(f.norm_weight.data) + c0 * es;
  for (int i = threadIdx.x; i < per; i += NT) cp_async16(reinterpret_cast<char*>(fs.wn) + i * 16, w + i * 16);
  if (f.z.data == nullptr) return;
  const int zs = f.z.dtype == DType::kF32 ? 4 : 2;
  const int zper = nc * zs / 16;
  const char* const z = static_cast<const char*>(f.z.data) + (n * f.z.s[0] + hv * f.z.s[2] + c0) * zs;
  for (int i = threadIdx.x; i < T * zper; i += NT) {
    const int t = i / zper, c = i % zper;
    cp_async16(reinterpret_cast<char*>(fs.zw) + (t * zper + c) * 16, z + t * f.z.s[1] * zs + c * 16);
  }
}

// Element i of a raw row in shared memory, as fp32.
__device__ __forceinline__ float smem_f32(const void* row, DType dt, int i) {
  return dt == DType::kF32 ? static_cast<const float*>(row)[i]
                           : bits_to_f32(static_cast<const uint16_t*>(row)[i], dt);
}

// zw = norm_weight * silu(z) of the block's outputs [T][nc] (columns past V clamp to V - 1),
// for layouts the 16-byte path does not take. Both loads are issued before either is used.
template <int NT>
__device__ __forceinline__ void fused_norm_gate(const FusedProblem& f, const FusedSmem& fs, int64_t n, int64_t hv,
                                                int64_t c0, int nc, int T) {
  const int64_t V = f.step.V;
  for (int e = threadIdx.x; e < T * nc; e += NT) {
    const int t = e / nc;
    const int64_t col = c0 + e % nc < V ? c0 + e % nc : V - 1;
    const uint32_t wb = load_bits(f.norm_weight.data, f.norm_weight.dtype, col * f.norm_weight.s[0]);
    const uint32_t zb = f.z.data != nullptr
                            ? load_bits(f.z.data, f.z.dtype, n * f.z.s[0] + t * f.z.s[1] + hv * f.z.s[2] + col * f.z.s[3])
                            : 0u;
    float g = 1.f;
    if (f.z.data != nullptr) {
      const float z = bits_to_f32(zb, f.z.dtype);
      g = silu(z);
    }
    fs.zw[e] = bits_to_f32(wb, f.norm_weight.dtype) * g;
  }
}

// ---------------------------------------------------------------------------------------
// The prologue: every block channel's window (the read slot's columns first..L-1 and the T
// new inputs) into shared memory, the conv and SiLU, the outputs into the raw staging area
// (fused_out). With the norm, zw = norm_weight * silu(z) of the block's outputs. All loads of
// a thread are issued before the first is used. The caller then syncs the block.
// ---------------------------------------------------------------------------------------
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_conv(const FusedProblem& f, const FusedShare& s, const StageSmem& sm,
                                           const FusedSmem& fs, int64_t n, int64_t hv, int64_t c0, int nc, int T,
                                           int64_t slot) {
  const Problem& p = f.step;
  const int K = static_cast<int>(p.K), L = static_cast<int>(f.L), W = static_cast<int>(f.W);
  const int64_t h = hv / (p.HV / p.H);
  float* const raw = reinterpret_cast<float*>(sm.raw);
  const int lc = L - s.first;
  for (int c = threadIdx.x; c < s.own; c += NT) {
    const int64_t d = fused_channel(p, c, h, hv, c0);
    if (d < 0) continue;
    uint32_t wb[kMaxConvW], cb[kMaxConvL], xb[kMaxChunk], bb = 0;
#pragma unroll
    for (int k = 0; k < kMaxConvW; ++k)
      wb[k] = k < W ? load_bits(f.conv_weight.data, f.conv_weight.dtype, d * f.conv_weight.s[0] + k * f.conv_weight.s[1])
                    : 0u;
    if (f.conv_bias.data != nullptr) bb = load_bits(f.conv_bias.data, f.conv_bias.dtype, d * f.conv_bias.s[0]);
    const int64_t cbase = slot * f.conv_state.s[0] + d * f.conv_state.s[1];
#pragma unroll
    for (int j = 0; j < kMaxConvL; ++j)
      cb[j] = j < lc ? load_bits(f.conv_state.data, f.conv_state.dtype, cbase + (s.first + j) * f.conv_state.s[2]) : 0u;
    const int64_t xbase = n * f.x.s[0] + d * f.x.s[2];
#pragma unroll
    for (int t = 0; t < kMaxChunk; ++t) xb[t] = t < T ? load_bits(f.x.data, f.x.dtype, xbase + t * f.x.s[1]) : 0u;
    // The window, column-major over the block channels (conflict-free), for the conv below and
    // the conv-state stores at the end.
    float* const win = fs.win + c;
#pragma unroll
    for (int j = 0; j < kMaxConvL; ++j)
      if (j < lc) win[j * s.own] = bits_to_f32(cb[j], f.conv_state.dtype);
#pragma unroll
    for (int t = 0; t < kMaxChunk; ++t)
      if (t < T) win[(lc + t) * s.own] = bits_to_f32(xb[t], f.x.dtype);
    float w[kMaxConvW];
#pragma unroll
    for (int k = 0; k < kMaxConvW; ++k) w[k] = bits_to_f32(wb[k], f.conv_weight.dtype);
    const float bias = f.conv_bias.data != nullptr ? bits_to_f32(bb, f.conv_bias.dtype) : 0.f;
    // Window entry L + t - (W - 1) + k lives at row L + t - (W - 1) + k - first of win.
    const int row0 = L - (W - 1) - s.first;
    for (int t = 0; t < T; ++t) {
      float acc = bias;
#pragma unroll
      for (int k = 0; k < kMaxConvW; ++k)
        if (k < W) acc = fmaf(w[k], win[(row0 + t + k) * s.own], acc);
      *fused_out(raw, K, c, t, nc, T) = silu(acc);
    }
  }
}

// ---------------------------------------------------------------------------------------
// The 16-byte path, for the engines' layout (host: fused_conv_vec_ok): mixed_qkv, the conv
// state and the taps of one 16-bit dtype, mixed_qkv and the conv state contiguous along the
// channels (vLLM's [P, L, D] pool), taps row-major [D, W], every 16-byte piece aligned. A thread
// loads 8 consecutive block channels (2K and the v channels are multiples of 8): their
// window rows, taps and bias land in shared memory by cp.async, all in flight at once with no
// register held; the conv runs on channel pairs; the conv state is later written as 16-byte
// copies of window rows. Layout of fs.win
// with G = own / 8 groups: rows [wl][G] of raw windows, then taps [G][W], then bias [G].
// ---------------------------------------------------------------------------------------
// Issues the block's conv inputs by cp.async (in the caller's groups), in two parts: what does
// not depend on the row's slot (the new inputs, taps and bias) before the slot is known, the
// read slot's conv columns after.
template <int NT>
__device__ __forceinline__ void fused_conv_vec_issue_inputs(const FusedProblem& f, const FusedShare& s,
                                                            const FusedSmem& fs, int64_t n, int64_t hv, int64_t c0,
                                                            int T) {
  const Problem& p = f.step;
  const int W = static_cast<int>(f.W), lc = static_cast<int>(f.L) - s.first, G = s.own / 8;
  const int64_t h = hv / (p.HV / p.H);
  uint4* const win = reinterpret_cast<uint4*>(fs.win);
  uint4* const taps = win + s.wl * G;
  uint4* const bias = taps + G * W;
  for (int g = threadIdx.x; g < G; g += NT) {
    const int64_t d = fused_channel(p, g * 8, h, hv, c0);
    if (d < 0) continue;  // a whole group: tiles and heads are multiples of 8 channels
    const char* const xs = static_cast<const char*>(f.x.data) + (n * f.x.s[0] + d) * 2;
    for (int t = 0; t < T; ++t) cp_async16(win + (lc + t) * G + g, xs + t * f.x.s[1] * 2);
    const char* const ws = static_cast<const char*>(f.conv_weight.data) + d * W * 2;
    for (int k = 0; k < W; ++k) cp_async16(taps + g * W + k, ws + k * 16);
    if (f.conv_bias.data != nullptr) cp_async16(bias + g, static_cast<const char*>(f.conv_bias.data) + d * 2);
  }
}

template <int NT>
__device__ __forceinline__ void fused_conv_vec_issue_state(const FusedProblem& f, const FusedShare& s,
                                                           const FusedSmem& fs, int64_t hv, int64_t c0,
                                                           int64_t slot) {
  const Problem& p = f.step;
  const int lc = static_cast<int>(f.L) - s.first, G = s.own / 8;
  const int64_t h = hv / (p.HV / p.H);
  uint4* const win = reinterpret_cast<uint4*>(fs.win);
  for (int g = threadIdx.x; g < G; g += NT) {
    const int64_t d = fused_channel(p, g * 8, h, hv, c0);
    if (d < 0) continue;
    const char* const cs = static_cast<const char*>(f.conv_state.data) + (slot * f.conv_state.s[0] + d) * 2;
    for (int j = 0; j < lc; ++j) cp_async16(win + j * G + g, cs + (s.first + j) * f.conv_state.s[2] * 2);
  }
}

// The two channels of the 32-bit word w, as fp32.
__device__ __forceinline__ void unpack2(uint32_t w, DType dt, float* out) {
  if (dt == DType::kBF16) {
    out[0] = bf16_lo(w);
    out[1] = bf16_hi(w);
  } else {
    const float2 f2 = __half22float2(*reinterpret_cast<const __half2*>(&w));
    out[0] = f2.x;
    out[1] = f2.y;
  }
}

// The conv and SiLU of channels 2 * sub, +1 of group g (8 channels) at token t, into the raw
// staging area of this block, once the inputs landed. (A thread per pair, not per group: the
// SiLU's exp and division dominate, and at T = 1 a group per thread left one warp computing
// while the block waited for it.)
template <int kW>
__device__ __forceinline__ void fused_conv_vec_item(const FusedProblem& f, const FusedShare& s, const StageSmem& sm,
                                                    const FusedSmem& fs, int g, int sub, int t, int nc, int T) {
  const int K = static_cast<int>(f.step.K), G = s.own / 8;
  const DType dt = f.x.dtype;
  const uint32_t* const win = reinterpret_cast<const uint32_t*>(fs.win);  // word (row * G + g) * 4 + sub
  // The group's taps are its 8 rows of [D, W], 8 * kW elements: the pair's 2 * kW start at
  // word sub * kW of the group's kW words.
  const uint32_t* const taps = win + s.wl * G * 4 + g * kW * 4 + sub * kW;
  float tw[2 * kW];  // tap k of channel i at [i * kW + k]
#pragma unroll
  for (int k = 0; k < kW; ++k) unpack2(taps[k], dt, tw + 2 * k);
  float acc[2] = {0.f, 0.f};
  if (f.conv_bias.data != nullptr) unpack2((win + s.wl * G * 4 + G * kW * 4)[g * 4 + sub], dt, acc);
  const int row0 = static_cast<int>(f.L) - (kW - 1) - s.first + t;
#pragma unroll
  for (int k = 0; k < kW; ++k) {
    float x[2];
    unpack2(win[((row0 + k) * G + g) * 4 + sub], dt, x);
#pragma unroll
    for (int i = 0; i < 2; ++i) acc[i] = fmaf(tw[i * kW + k], x[i], acc[i]);
  }
  float* const dst = fused_out(reinterpret_cast<float*>(sm.raw), K, g * 8 + 2 * sub, t, nc, T);
  *reinterpret_cast<float2*>(dst) = make_float2(silu(acc[0]), silu(acc[1]));
}

// One item per (channel pair, token), over all threads. The caller has waited for its own
// cp.async group; the barrier here makes every thread's landed inputs visible to all.
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_conv_vec(const FusedProblem& f, const FusedShare& s, const StageSmem& sm,
                                               const FusedSmem& fs, int64_t hv, int64_t c0, int nc, int T) {
  const Problem& p = f.step;
  const int64_t h = hv / (p.HV / p.H);
  const int G = s.own / 8;
  __syncthreads();
  for (int item = threadIdx.x; item < G * 4 * T; item += NT) {
    const int sub = item % 4, g = item / 4 % G, t = item / (4 * G);
    if (fused_channel(p, g * 8, h, hv, c0) < 0) continue;
    switch (f.W) {
      case 2:
        fused_conv_vec_item<2>(f, s, sm, fs, g, sub, t, nc, T);
        break;
      case 3:
        fused_conv_vec_item<3>(f, s, sm, fs, g, sub, t, nc, T);
        break;
      default:
        fused_conv_vec_item<4>(f, s, sm, fs, g, sub, t, nc, T);
        break;
    }
  }
}

// The conv state after each stored token (and conv_inter) for the thread's groups that this
// block writes (fused_writes): 16-byte copies of window rows (the conv state and mixed_qkv
// share the dtype).
template <int NT>
__device__ __forceinline__ void fused_conv_vec_store(const FusedProblem& f, const FusedShare& s, const FusedSmem& fs,
                                                     int64_t n, int64_t hv, int64_t c0, int T) {
  const Problem& p = f.step;
  const int L = static_cast<int>(f.L), G = s.own / 8;
  const int64_t h = hv / (p.HV / p.H);
  const unsigned rank = cluster_rank();
  const uint4* const win = reinterpret_cast<const uint4*>(fs.win);
  const bool inter = f.conv_inter.data != nullptr;
  for (int g = threadIdx.x; g < G; g += NT) {
    const int64_t d = fused_channel(p, g * 8, h, hv, c0);
    if (d < 0 || !fused_writes(s, static_cast<int>(p.K), g * 8, rank)) continue;
    for (int t = 0; t < T; ++t) {
      const int64_t ws = fs.ws[t];
      if (ws < 0 && !inter) continue;
      char* const cs = static_cast<char*>(f.conv_state.data) + (ws * f.conv_state.s[0] + d) * 2;
      char* const ci = static_cast<char*>(f.conv_inter.data) + (n * f.conv_inter.s[0] + t * f.conv_inter.s[1] + d) * 2;
      for (int j = 0; j < L; ++j) {
        const Packed<__half> v{win[(t + 1 + j - s.first) * G + g]};
        if (ws >= 0) store_state_vec<__half, true>(reinterpret_cast<__half*>(cs + j * f.conv_state.s[2] * 2), v);
        if (inter) store_state_vec<__half, true>(reinterpret_cast<__half*>(ci + j * f.conv_inter.s[3] * 2), v);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// The fused step's part of the tile kernels' prologue, in their order: fused_issue_inputs
// before the row's slot is known and fused_issue_state after it (one cp.async group each,
// committed by the caller, empty where nothing goes that way); fused_prologue once the gates
// are staged: q, k and v in the raw staging area, fp32, as stage_issue's layout, for
// stage_convert_t; fused_inputs_read once every input of the block has landed.
// ---------------------------------------------------------------------------------------
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_issue_inputs(const FusedProblem& f, const Geometry& geo, const FusedShare& s,
                                                   const FusedSmem& fs, int64_t n, int64_t hv, int64_t c0, int nc,
                                                   int T) {
  if (geo.conv_vec && !(geo.exp & 8)) fused_conv_vec_issue_inputs<NT>(f, s, fs, n, hv, c0, T);
  if constexpr (kNorm)
    if (geo.norm_vec) fused_norm_issue<NT>(f, fs, n, hv, c0, nc, T);
}

template <int NT>
__device__ __forceinline__ void fused_issue_state(const FusedProblem& f, const Geometry& geo, const FusedShare& s,
                                                  const FusedSmem& fs, int64_t hv, int64_t c0, int64_t slot) {
  if (geo.conv_vec && !(geo.exp & 8)) fused_conv_vec_issue_state<NT>(f, s, fs, hv, c0, slot);
}

// The caller has committed the groups above and then the state tile's.
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_prologue(const FusedProblem& f, const Geometry& geo, const FusedShare& s,
                                               const StageSmem& sm, const FusedSmem& fs, int64_t n, int64_t hv,
                                               int64_t c0, int nc, int T, int64_t slot) {
  // The norm's gate by scalar loads (other layouts) while the conv inputs land.
  if constexpr (kNorm)
    if (!geo.norm_vec) fused_norm_gate<NT>(f, fs, n, hv, c0, nc, T);
  if (geo.exp & 2) {
  } else if (geo.conv_vec) {
    cp_async_wait_group<1>();  // this thread's conv inputs landed (the state may still be in flight)
    fused_conv_vec<NT, kNorm>(f, s, sm, fs, hv, c0, nc, T);
  } else {
    fused_conv<NT, kNorm>(f, s, sm, fs, n, hv, c0, nc, T, slot);
  }
  __syncthreads();  // the conv outputs are complete
}

// The block has read every conv-state column it will read (each thread's loads landed): the
// arrival that lets the cluster's conv-state writers go on (fused_finish_begin waits for it).
// Called by every thread after the prologue's last wait, when no store of the block is
// outstanding, so the release costs no wait for the memory system.
__device__ __forceinline__ void fused_inputs_read(const FusedShare& s, const Geometry& geo) {
  if (s.C > 1) {
    if (geo.exp & 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
    } else {
      cluster_arrive_release();
    }
  }
}

// ---------------------------------------------------------------------------------------
// The epilogue, in the order the kernels call it: fused_finish_begin: the conv write slots; the wait for every
// block of the cluster to have read its inputs (fused_inputs_read), after which this block may
// overwrite its conv-state slice and store into the others' shared memory; with the norm, this
// tile's sums of squares per token into every tile of its head and the arrival (release) that
// publishes them. fused_finish_end: the conv state after each stored token (and conv_inter)
// for the channels this block writes, from the windows — column j after token t is window
// entry t + 1 + j; with the norm, the wait (acquire) for the other tiles' sums and
// o = o * rsqrt(mean_V(o^2) + eps) * norm_weight * silu(z) written. `tile`: this block's tile
// of its value head (the cluster holds HV/H heads x geo.tiles blocks, head-major). Then the VK
// kernel's fused_store_tile.
// ---------------------------------------------------------------------------------------
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_finish_begin(const FusedProblem& f, const Geometry& geo, const FusedShare& s,
                                                   const FusedSmem& fs, const WarpSlots& slots, int64_t n, int tile,
                                                   int nc, int T) {
  const Problem& p = f.step;
  const int tiles = geo.tiles;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  __syncthreads();  // the token loop's outputs (fs.o) are complete
  if (warp == 0)
    for (int t = 0; t < T; ++t) {
      const int64_t ws = warp_token_write_slot(p, slots, n, t);
      if (lane == 0) fs.ws[t] = ws;
    }
  if (s.C > 1) cluster_wait_acquire();  // every block of the cluster has read its conv inputs
  if constexpr (kNorm) {
    // This tile's sums of squares, one warp per token in a fixed order, stored into every tile
    // of the head (the cluster is head-major: the head's tile 0 has rank rank - tile).
    const unsigned rank = cluster_rank();
    for (int t = warp; t < T; t += NT / 32) {
      float ss = 0.f;
      for (int c = lane; c < nc; c += 32) {
        const float o = fs.o[t * nc + c];
        ss = fmaf(o, o, ss);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      if (lane == tile)
        fs.part[tile * 16 + t] = ss;
      else if (lane < tiles)
        st_cluster_f32(&fs.part[tile * 16 + t], rank - tile + lane, ss);
    }
    if (tiles > 1) {
      if (geo.exp & 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
      } else {
        cluster_arrive_release();  // uniform over the cluster
      }
    }
  }
  __syncthreads();  // fs.ws, this tile's own sums
}

template <int NT, bool kNorm>
__device__ __forceinline__ void fused_finish_end(const FusedProblem& f, const Geometry& geo, const FusedShare& s,
                                                 const FusedSmem& fs, int64_t n, int64_t hv, int64_t c0, int nc,
                                                 int T) {
  const Problem& p = f.step;
  const int L = static_cast<int>(f.L), tiles = geo.tiles;
  if (geo.exp & 4) {
  } else if (geo.conv_vec) {
    fused_conv_vec_store<NT>(f, s, fs, n, hv, c0, T);
  } else {
    const int64_t h = hv / (p.HV / p.H);
    const unsigned rank = cluster_rank();
    const bool inter = f.conv_inter.data != nullptr;
    for (int c = threadIdx.x; c < s.own; c += NT) {
      const int64_t d = fused_channel(p, c, h, hv, c0);
      if (d < 0 || !fused_writes(s, static_cast<int>(p.K), c, rank)) continue;
      const float* const win = fs.win + c;
      for (int t = 0; t < T; ++t) {
        const int64_t ws = fs.ws[t];
        if (ws < 0 && !inter) continue;
        for (int j = 0; j < L; ++j) {
          const float x = win[(t + 1 + j - s.first) * s.own];  // window entry t + 1 + j
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

  if constexpr (kNorm) {
    if (tiles > 1) cluster_wait_acquire();  // every tile's sums are in every tile of the head
    if (static_cast<int>(threadIdx.x) < T) {
      const int t = threadIdx.x;
      float ss = 0.f;
      for (int j = 0; j < tiles; ++j) ss += fs.part[j * 16 + t];
      fs.fac[t] = rsqrtf(ss / static_cast<float>(p.V) + f.norm_eps);
    }
    __syncthreads();  // fs.fac
    for (int i = threadIdx.x; i < T * nc; i += NT) {
      const int t = i / nc, c = i % nc;
      if (c0 + c >= p.V) continue;
      float zw;
      if (geo.norm_vec) {  // raw rows (fused_norm_issue); host: V is a multiple of nc
        float g = 1.f;
        if (f.z.data != nullptr) {
          const float z = smem_f32(fs.zw, f.z.dtype, i);
          g = silu(z);
        }
        zw = smem_f32(fs.wn, f.norm_weight.dtype, c) * g;
      } else {
        zw = fs.zw[i];
      }
      store_scalar(p.o.data, p.o.dtype, n * p.o.s[0] + t * p.o.s[1] + hv * p.o.s[2] + c0 + c, fs.o[i] * fs.fac[t] * zw);
    }
  }
}

// The kernel's final state, kept in its shared tile (rows of smem_row elements, the block's
// part of the matrix of head hv from element `first` of a row of the pool's matrix: the VK
// kernel's rows row0.. with first = row0 * state.s[2], the KV kernel's columns c0.. with
// first = c0), to the pool slot of the row's last token, 16 bytes a thread at a time: the
// block's last global stores. `pieces`: 16-byte pieces per tile row inside the matrix.
template <typename S, int NT>
__device__ __forceinline__ void fused_store_tile(const Problem& p, const WarpSlots& slots, int64_t n, int64_t hv,
                                                 int64_t first, int rows, int pieces, int smem_row, const S* tile_s) {
  constexpr int VE = kVecElems<S>;
  const int64_t wslot = warp_token_write_slot(p, slots, n, p.T - 1);
  if (wslot < 0) return;
  S* const dst = static_cast<S*>(p.state.data) + wslot * p.state.s[0] + hv * p.state.s[1] + first;
  for (int i = threadIdx.x; i < rows * pieces; i += NT) {
    const int r = i / pieces, c = i - r * pieces;
    const Packed<S> v{*reinterpret_cast<const uint4*>(tile_s + r * smem_row + c * VE)};
    store_state_vec<S, true>(dst + r * p.state.s[2] + c * VE, v);
  }
}

}  // namespace gdn::detail::cuda
