// The fused layer step (gdn::fused_decode, docs/semantics.md section 6) on the tile kernels
// (the cluster form): the pieces that replace the q/k/v staging (the causal conv and SiLU), write
// the conv state, and apply the gated RMSNorm to the output. Grids that fill the GPU (K = 128, the
// conv's 16-byte path, either state layout) take the group kernel instead (group.cuh).
//
// A block of a tile kernel owns one (row n, value head hv, tile): it needs the whole q and k
// vectors of hv's q/k head h and v's channels of its tile. The blocks of one (n, h) — the
// HV/H value heads of the GVA group times the tiles of each head — form a thread-block
// cluster of C blocks (the host sizes the tiles so it fits), and share the work:
// - the 2K conv channels of q and k are cut into C slices; block rank r computes slice r
//   (loads its conv columns, inputs and taps, the conv, SiLU) and stores the outputs into every
//   block of the cluster (distributed shared memory); each block computes its own v
//   channels. So each q/k channel is computed once per row, not once per block, and each conv
//   channel's state is read and written by the one block that owns it: an in-place update
//   (write slot = read slot) never races a read;
// - the RMSNorm's mean over V spans the tiles of one value head: each block stores its sums of
//   squares per token into every tile of its head, and every tile adds the same numbers in the
//   same order, so all get the same factor bit for bit.
// Each exchange ends at a cluster barrier (arrive.release, wait.acquire). After each barrier a
// block only touches its own shared memory, so none needs to wait for the others before it
// exits; the norm's barrier is skipped where a head is one tile (no sums cross blocks: every
// bf16 grid of more than one wave), since its release compiles to a GPU-scope memory barrier
// that waits for the block's state stores. (Transaction barriers fed by st.async, tried in
// c944157, removed that wait everywhere but left racecheck and synccheck reports that could
// not be explained; docs/design.md.) A padding or invalid row leaves every block of its
// cluster at the same early return, before any exchange.
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

// silu(x) = x / (1 + e^-x) by the SFU's exponential and reciprocal (__expf, __fdividef): at small
// B the conv items and the norm's writes are one item per thread on a lone warp's dependent chain,
// where the IEEE division and the accurate expf were ~20 of its instructions. The relative error
// stays near 1e-6 wherever the value is not negligible (SPEC section 6 allows 1e-5 at fp32); below
// x ~ -88, e^-x overflows and the result is -0, as the division gives; NaN and -inf give NaN.
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.f + __expf(-x)); }

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
// arrive.release + wait.acquire: every store of a block of the cluster before its arrival is
// visible to every block after its wait. Every thread of the block executes both (.aligned:
// warp-uniform).
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
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
// Distributed shared memory may be written only once every block of the cluster runs: each
// block arrives when it starts (fused_started) and waits before its first remote store
// (fused_wait_started), a wait that is over by the time it gets there.
__device__ __forceinline__ void fused_started() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void fused_wait_started() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
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

__device__ __forceinline__ void st_cluster_f32x4(float* local, unsigned rank, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(remote_smem(local, rank)), "f"(v.x),
               "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
#else
  (void)rank;
  *reinterpret_cast<float4*>(local) = v;
#endif
}

// ---------------------------------------------------------------------------------------
// The block's share of the conv (host: fused_geometry) and its shared memory after the
// staging area (host: fused_smem_floats).
// ---------------------------------------------------------------------------------------
// The old conv-state columns a block keeps: the last W - 1 for the conv, and 1..L-1 for the
// conv state after token 0 (each later token needs fewer).
__host__ __device__ constexpr int conv_first_col(int L, int W) { return L - (W - 1) < 1 ? L - (W - 1) : 1; }

// Block channels: S of the cluster's slice of the 2K q/k channels, then its nc v channels.
struct FusedShare {
  int group = 1;  // value heads per q/k head: HV / H
  int C = 1;      // blocks in the cluster
  int S = 0;      // q/k channels per slice: ceil(2K / C)
  int own = 0;    // S + nc
  int first = 0;  // conv_first_col
  int wl = 0;     // window entries kept per channel: L - first + T
  int cm = 0;     // the 16-byte path's channel-major variant: L (the raw columns' scratch), else 0
  // The block's own (device only; fused_share_block): its q/k head and its cluster rank.
  int64_t h = 0;
  unsigned rank = 0;
};

__host__ __device__ inline FusedShare fused_share(int K, int group, int tiles, int nc, int L, int W, int T,
                                                  bool conv_cm) {
  FusedShare s;
  s.group = group;
  s.C = group * tiles;
  s.S = (2 * K + s.C - 1) / s.C;
  s.own = s.S + nc;
  s.first = conv_first_col(L, W);
  s.wl = L - s.first + T;
  s.cm = conv_cm ? L : 0;
  return s;
}

// The block's q/k head and cluster rank, once per block before pdl_wait, where the block waits
// anyway under programmatic launch; the empty volatile asm keeps the compiler from sinking them
// past the wait. Each helper below computed both itself before, the head as hv / (HV / H), two
// 64-bit divisions (a called subroutine each): at B = 1 the prologue and epilogue are a chain of
// small loops, and every phase paid its set-up (docs/design.md, "The fused step at small B").
// hv and the group fit 32 bits (block_coords derives hv in 32 bits: the grid is under 2^31
// blocks), so one 32-bit division does.
__device__ __forceinline__ void fused_share_block(FusedShare& s, int64_t hv) {
  s.h = static_cast<int64_t>(static_cast<uint32_t>(hv) / static_cast<uint32_t>(s.group));
  s.rank = cluster_rank();
  asm volatile("" : "+l"(s.h), "+r"(s.rank));
}

struct FusedSmem {
  float* win = nullptr;   // [wl][own] each block channel's window: old columns first..L-1, x_0..x_{T-1}
  float* o = nullptr;     // [T][nc] the raw recurrence output, until the norm factor is known (norm only)
  float* zw = nullptr;    // [T][nc] norm_weight * silu(z) (norm only); with geo.norm_vec, z's raw rows
  float* wn = nullptr;    // [nc] with geo.norm_vec: norm_weight's raw elements (norm only)
  float* part = nullptr;  // [kMaxTiles][16] sums of o^2 per token, stored by each tile of the head
  int64_t* ws = nullptr;  // [16] the conv write slot of each token (< 0: none)
};

__host__ __device__ constexpr int round4(int f) { return (f + 3) / 4 * 4; }

// This thread's first index in a block loop over a few small items that starts at warp w
// (mod the block's warps) instead of warp 0. At small B each loop of the prologue and epilogue
// has a few dozen items, a lone warp's dependent chain of a few hundred cycles per step: started
// at warp 0, every loop ran on warp 0 one after another while the other warps waited at the
// next barrier (per-block clock stamps at B = 1; docs/design.md). Started on different warps,
// they run side by side.
template <int NT>
__device__ __forceinline__ int rotated_tid(int w) {
  return (static_cast<int>(threadIdx.x) + NT - (32 * w) % NT) % NT;
}

// The conv's 16-byte window area, in 16-byte pieces of 8 channels, for G groups of 8 channels:
// the window rows [wl][G], the taps [G][W], the bias [G], then (channel-major, cm = L) the raw
// columns' scratch [G][cm]. The one account of that layout: the cluster form's region
// (fused_win_floats), the group kernel's (GroupSmem) and the scratch's start
// (conv_cm_scratch) all take it from here.
__host__ __device__ constexpr int conv_win_pieces(int G, int wl, int W, int cm) { return G * (wl + W + 1 + cm); }

// Floats of the window region: fp32 windows (the generic path), or the 16-byte path's raw
// 16-bit windows, taps and bias, 8 channels per 16-byte vector (channel-major: and the raw
// columns' scratch).
__host__ __device__ constexpr int fused_win_floats(const FusedShare& s, int W) {
  const int f32 = s.wl * s.own, raw16 = conv_win_pieces(s.own, s.wl, W, s.cm) / 2;  // own / 8 groups of 4 floats
  return round4(f32 > raw16 ? f32 : raw16);
}

// Floats after the staging area, each region a multiple of 16 bytes, plus 4 of slack to align
// the start.
__host__ __device__ inline int fused_smem_floats(const FusedShare& s, int T, int nc, int W, bool norm) {
  return 4 + fused_win_floats(s, W) + (norm ? 2 * round4(T * nc) + round4(nc) : 0) + kMaxTiles * 16 + 2 * 16;
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
  m.ws = reinterpret_cast<int64_t*>(m.part + kMaxTiles * 16);  // 16-byte aligned: every region is a multiple of 4 floats
  return m;
}

// The conv channel of block channel c (c < S: q/k channel s.rank * S + c of head s.h, < 2K; else
// v channel c0 + c - S of head hv, < V); -1 past either end.
__device__ __forceinline__ int64_t fused_channel(const Problem& p, const FusedShare& s, int c, int64_t hv,
                                                 int64_t c0) {
  const int64_t K = p.K, h = s.h;
  if (c < s.S) {
    const int64_t qc = static_cast<int64_t>(s.rank) * s.S + c;
    return qc >= 2 * K ? -1 : qc < K ? h * K + qc : (p.H + h) * K + (qc - K);
  }
  const int64_t j = c0 + (c - s.S);
  return j >= p.V ? -1 : 2 * p.H * K + hv * p.V + j;
}

// The q/k channels of cluster rank r's slice: S, the last slice may be short (or empty).
__device__ __forceinline__ int fused_slice_count(const FusedShare& s, int K, int r) {
  const int first = r * s.S;
  return first >= 2 * K ? 0 : first + s.S <= 2 * K ? s.S : 2 * K - first;
}

// The block's q/k slice of conv outputs (written locally into the raw staging area) into every
// other block of the cluster, all threads sharing the stores, 16 bytes at a time where the slice
// allows it. The caller syncs the block before (the outputs are complete) and the cluster after.
template <int NT>
__device__ __forceinline__ void fused_push_slice(const Problem& p, const FusedShare& s, const StageSmem& sm,
                                                 int T) {
  if (s.C == 1) return;
  const int K = static_cast<int>(p.K);
  const unsigned rank = s.rank;
  const int first = static_cast<int>(rank) * s.S;
  const int count = fused_slice_count(s, K, static_cast<int>(rank));
  if (count <= 0) return;
  float* const raw = reinterpret_cast<float*>(sm.raw);
  // A slice never straddles the q/k boundary when S divides K (C a power of two); otherwise
  // the scalar loop below takes it element by element.
  const bool vec = count % 4 == 0 && (first < K) == (first + count - 1 < K);
  const int per = vec ? count / 4 : count;  // stores per token and rank
  const int items = T * per * (s.C - 1);
  for (int i = threadIdx.x; i < items; i += NT) {
    const int e = i % per, rest = i / per, t = rest % T, r = rest / T;
    const unsigned to = static_cast<unsigned>(r) < rank ? static_cast<unsigned>(r) : static_cast<unsigned>(r) + 1;
    if (vec) {
      const int qc = first + 4 * e;
      float* const at = raw + (qc < K ? qc : T * K + qc - K) + t * K;
      st_cluster_f32x4(at, to, *reinterpret_cast<const float4*>(at));
    } else {
      const int qc = first + e;
      float* const at = raw + (qc < K ? qc : T * K + qc - K) + t * K;
      st_cluster_f32(at, to, *at);
    }
  }
}

// The norm's inputs by 16 bytes (host: fused_norm_vec_ok): z's rows [T][nc] and norm_weight's
// [nc] elements raw into fs.zw and fs.wn, issued with the conv inputs before the slot is known
// (they do not depend on it), converted where the output is written.
template <int NT>
__device__ __forceinline__ void fused_norm_issue(const FusedProblem& f, const FusedSmem& fs, int64_t n, int64_t hv,
                                                 int64_t c0, int nc, int T) {
  const int es = dtype_bytes(f.norm_weight.dtype);
  const int per = nc * es / 16;  // 16-byte pieces per row
  const char* const w = static_cast<const char*>(f.norm_weight.data) + c0 * es;
  const int r = rotated_tid<NT>(1);  // warp 0 issues the conv inputs (fused_conv_vec_issue_inputs)
  for (int i = r; i < per; i += NT) cp_async16(reinterpret_cast<char*>(fs.wn) + i * 16, w + i * 16);
  if (f.z.data == nullptr) return;
  const int zs = dtype_bytes(f.z.dtype);
  const int zper = nc * zs / 16;
  const char* const z = static_cast<const char*>(f.z.data) + (n * f.z.s[0] + hv * f.z.s[2] + c0) * zs;
  for (int i = r; i < T * zper; i += NT) {
    const int t = i / zper, c = i % zper;
    cp_async16(reinterpret_cast<char*>(fs.zw) + (t * zper + c) * 16, z + t * f.z.s[1] * zs + c * 16);
  }
}

// Element i of a raw row in shared memory, as fp32.
__device__ __forceinline__ float smem_f32(const void* row, DType dt, int i) {
  return dt == DType::kF32 ? static_cast<const float*>(row)[i]
                           : bits_to_f32(static_cast<const uint16_t*>(row)[i], dt);
}
// Elements i..i+3 of a raw row in shared memory, as fp32; i a multiple of 4 (one 8- or 16-byte load).
__device__ __forceinline__ void smem_f32x4(const void* row, DType dt, int i, float (&x)[4]) {
  if (dt == DType::kF32) {
    const float4 v = static_cast<const float4*>(row)[i / 4];
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {
    const uint2 v = static_cast<const uint2*>(row)[i / 4];
    x[0] = bits_to_f32(v.x & 0xffffu, dt), x[1] = bits_to_f32(v.x >> 16, dt);
    x[2] = bits_to_f32(v.y & 0xffffu, dt), x[3] = bits_to_f32(v.y >> 16, dt);
  }
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
      g = silu_fast(z);
    }
    fs.zw[e] = bits_to_f32(wb, f.norm_weight.dtype) * g;
  }
}

// ---------------------------------------------------------------------------------------
// The prologue: every block channel's window (the read slot's columns first..L-1 and the T
// new inputs) into shared memory, the conv and SiLU, the outputs into the raw staging area
// (fp32, stage_issue's layout: q [T][K], k [T][K], v [T][nc]) — a q/k slice's into every block
// of the cluster. With the norm, zw = norm_weight * silu(z) of the block's outputs. All loads of
// a thread are issued before the first is used. The caller then syncs the cluster.
// ---------------------------------------------------------------------------------------
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_conv(const FusedProblem& f, const FusedShare& s, const StageSmem& sm,
                                           const FusedSmem& fs, int64_t n, int64_t hv, int64_t c0, int nc, int T,
                                           int64_t slot) {
  const Problem& p = f.step;
  const int K = static_cast<int>(p.K), L = static_cast<int>(f.L), W = static_cast<int>(f.W);
  float* const raw = reinterpret_cast<float*>(sm.raw);
  const int lc = L - s.first;
  fused_wait_started();  // the push below writes into the other blocks
  for (int c = threadIdx.x; c < s.own; c += NT) {
    const int64_t d = fused_channel(p, s, c, hv, c0);
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
    const bool qk = c < s.S;
    const int qc = static_cast<int>(s.rank) * s.S + c;  // q/k channel, when qk
    float* const dst = qk ? raw + (qc < K ? 0 : T * K) + (qc < K ? qc : qc - K)
                          : raw + 2 * T * K + (c - s.S);
    const int stride = qk ? K : nc;
    for (int t = 0; t < T; ++t) {
      float acc = bias;
#pragma unroll
      for (int k = 0; k < kMaxConvW; ++k)
        if (k < W) acc = fmaf(w[k], win[(row0 + t + k) * s.own], acc);
      dst[t * stride] = silu_fast(acc);
    }
  }
  __syncthreads();  // the slice's outputs are complete
  fused_push_slice<NT>(p, s, sm, T);
}

// ---------------------------------------------------------------------------------------
// The 16-byte path, for the engines' layout (host: fused_conv_path): mixed_qkv, the conv
// state and the taps of one 16-bit dtype, mixed_qkv and the conv state contiguous along the
// channels (vLLM's [P, L, D] pool), taps row-major [D, W], every 16-byte piece aligned. A thread
// loads 8 consecutive block channels (a slice and the v channels are multiples of 8): their
// window rows, taps and bias land in shared memory by cp.async, all in flight at once with no
// register held; the conv runs on channel pairs; the conv state is later written as 16-byte
// copies of window rows. Layout of fs.win
// with G = own / 8 groups: rows [wl][G] of raw windows, then taps [G][W], then bias [G].
// The channel-major variant (s.cm = L; FLA's, transformers' and SGLang's conv state [P, D, L],
// each channel's L columns contiguous and the channels packed): a group's conv state is then 8L
// contiguous elements, L 16-byte pieces, which land raw in a scratch [G][L] after the bias. The
// conv items read the old columns from there as element pairs (ConvPairEntry) and the new inputs
// from the window rows; the stores build each piece of 8 (channel, column) elements from both
// (conv_cm_piece). Nothing is transposed in between: at B = 1 the block's prologue is a chain,
// and a transpose with its barrier lay on it. The group kernel, whose prologue overlaps its
// first state stages, transposes (conv_cm_transpose): reading the scratch there cost it 3-6% at
// B >= 16 (docs/design.md).
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
  uint4* const win = reinterpret_cast<uint4*>(fs.win);
  uint4* const taps = win + s.wl * G;
  uint4* const bias = taps + G * W;
  for (int g = threadIdx.x; g < G; g += NT) {
    const int64_t d = fused_channel(p, s, g * 8, hv, c0);
    if (d < 0) continue;  // a whole group: slices, tiles and heads are multiples of 8 channels
    const char* const xs = static_cast<const char*>(f.x.data) + (n * f.x.s[0] + d) * 2;
    for (int t = 0; t < T; ++t) cp_async16(win + (lc + t) * G + g, xs + t * f.x.s[1] * 2);
    const char* const ws = static_cast<const char*>(f.conv_weight.data) + d * W * 2;
    for (int k = 0; k < W; ++k) cp_async16(taps + g * W + k, ws + k * 16);
    if (f.conv_bias.data != nullptr) cp_async16(bias + g, static_cast<const char*>(f.conv_bias.data) + d * 2);
  }
}

// The read slot's conv columns of the group of 8 channels from conv channel d: into the window
// rows [lc][G] (channels contiguous), or channel-major (cm = L) raw into `scratch`'s [G][L]
// pieces. Shared with the group kernel.
__device__ __forceinline__ void conv_vec_issue_columns(const FusedProblem& f, uint4* win, uint4* scratch, int cm,
                                                       int G, int g, int64_t d, int64_t slot, int first) {
  const char* const cs = static_cast<const char*>(f.conv_state.data) + slot * f.conv_state.s[0] * 2;
  if (cm > 0) {
    const char* const src = cs + d * cm * 2;  // host: conv_state.s[1] == L, s[2] == 1
    for (int v = 0; v < cm; ++v) cp_async16(scratch + g * cm + v, src + v * 16);
  } else {
    const int lc = static_cast<int>(f.L) - first;
    for (int j = 0; j < lc; ++j) cp_async16(win + j * G + g, cs + (d + (first + j) * f.conv_state.s[2]) * 2);
  }
}

// Channel-major: where the raw columns' scratch [G][L] begins in the 16-byte path's window area
// (conv_win_pieces).
template <class P>
__device__ __forceinline__ P* conv_cm_scratch(P* win, int G, int wl, int W) {
  return win + conv_win_pieces(G, wl, W, 0);
}

// Channel-major, group kernel: the landed raw columns (group g's 8L elements in `scratch`, channel
// i's column c at element i * L + c) into window rows 0..lc-1 (entries first..L-1), a row piece
// per item, all threads from `tid0`, so that its conv items read whole window rows. (The cluster
// form reads the scratch directly instead, ConvPairEntry: measured, docs/design.md.) The caller
// syncs before (the pieces landed) and after.
template <int NT>
__device__ __forceinline__ void conv_cm_transpose(const uint4* scratch, uint4* win, int G, int L, int first, int tid0) {
  const int lc = L - first;
  for (int item = tid0; item < G * lc; item += NT) {
    const int g = item % G, j = item / G;
    const uint16_t* const src = reinterpret_cast<const uint16_t*>(scratch + g * L) + first + j;
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = uint32_t{src[2 * i * L]} | uint32_t{src[(2 * i + 1) * L]} << 16;
    win[j * G + g] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <int NT>
__device__ __forceinline__ void fused_conv_vec_issue_state(const FusedProblem& f, const FusedShare& s,
                                                           const FusedSmem& fs, int64_t hv, int64_t c0,
                                                           int64_t slot) {
  const Problem& p = f.step;
  const int G = s.own / 8;
  uint4* const win = reinterpret_cast<uint4*>(fs.win);
  uint4* const scratch = conv_cm_scratch(win, G, s.wl, static_cast<int>(f.W));
  for (int g = rotated_tid<NT>(2); g < G; g += NT) {  // beside warp 0's gates and warp 3's write slots
    const int64_t d = fused_channel(p, s, g * 8, hv, c0);
    if (d >= 0) conv_vec_issue_columns(f, win, scratch, s.cm, G, g, d, slot, s.first);
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

// The conv and SiLU of one channel pair of a 16-byte path's raw windows, once the inputs landed:
// `taps` the pair's 2 * kW taps (kW words), `bias` its bias word (null: none), `entry(k)` the
// pair's word of window entry L - (W - 1) + t + k (ConvPairEntry; the group kernel's rows alone,
// group_conv_item). Shared by the cluster form and the group kernel (group.cuh).
template <int kW, class Entry>
__device__ __forceinline__ float2 conv_vec_pair(const uint32_t* taps, const uint32_t* bias, Entry entry, DType dt) {
  float tw[2 * kW];  // tap k of channel i at [i * kW + k]
#pragma unroll
  for (int k = 0; k < kW; ++k) unpack2(taps[k], dt, tw + 2 * k);
  float acc[2] = {0.f, 0.f};
  if (bias != nullptr) unpack2(*bias, dt, acc);
#pragma unroll
  for (int k = 0; k < kW; ++k) {
    float xv[2];
    unpack2(entry(k), dt, xv);
#pragma unroll
    for (int i = 0; i < 2; ++i) acc[i] = fmaf(tw[i * kW + k], xv[i], acc[i]);
  }
  return make_float2(silu_fast(acc[0]), silu_fast(acc[1]));
}

// The word of channels 2 * sub, +1 of group g at window entry e0 + k, for conv_vec_pair: `win`
// the raw window rows [wl][G] (entry e at row e - first), `scratch` the channel-major raw
// columns [G][L] (cm = L: entries < L come from there; else 0).
struct ConvPairEntry {
  const uint32_t* win;
  const uint16_t* old;  // channel 2 * sub's L columns in the scratch (cm only)
  int row_words, e0, first, cm;
  __device__ __forceinline__ ConvPairEntry(const uint4* w, const uint4* scratch, int G, int g, int sub, int e0_,
                                           int first_, int cm_)
      : win(reinterpret_cast<const uint32_t*>(w) + g * 4 + sub),
        old(reinterpret_cast<const uint16_t*>(scratch + g * cm_) + 2 * sub * cm_),
        row_words(G * 4), e0(e0_), first(first_), cm(cm_) {}
  __device__ __forceinline__ uint32_t operator()(int k) const {
    const int e = e0 + k;
    if (e < cm) return uint32_t{old[e]} | uint32_t{old[cm + e]} << 16;
    return win[(e - first) * row_words];
  }
};

// Channel-major: the next 16-byte piece of group g's conv state after token t (8 elements of its
// 8L, from channel i, column j on: window entry t + 1 + j; i and j advance past them), from the
// scratch's old columns (entries < L) and the window rows, or from the window rows alone where
// `scratch` is null (the group kernel, which transposed the old columns there).
__device__ __forceinline__ uint4 conv_cm_piece(const uint4* win, const uint4* scratch, int G, int g, int L, int first,
                                               int t, int& i, int& j) {
  const uint16_t* const old = scratch != nullptr ? reinterpret_cast<const uint16_t*>(scratch + g * L) : nullptr;
  const uint16_t* const rows = reinterpret_cast<const uint16_t*>(win + g);  // channel i of row r: [r * G * 8 + i]
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int en = t + 1 + j;
    const uint32_t h = old != nullptr && en < L ? old[i * L + en] : rows[(en - first) * G * 8 + i];
    w[e / 2] = e % 2 == 0 ? h : w[e / 2] | h << 16;
    if (++j == L) {
      j = 0;
      ++i;
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Channel-major: piece v (16 bytes) of conv channel d's group after token t, into the conv
// state's write slot `wslot` (< 0: none) and into conv_inter (where given). The channels are
// packed (host: fused_conv_cm_layout), so the group's 8L elements start at channel d * L.
__device__ __forceinline__ void conv_cm_put(const FusedProblem& f, int64_t wslot, int64_t n, int t, int64_t d, int v,
                                            uint4 piece) {
  const Packed<__half> pv{piece};
  if (wslot >= 0)
    store_state_vec<__half, true>(reinterpret_cast<__half*>(static_cast<char*>(f.conv_state.data) +
                                                            (wslot * f.conv_state.s[0] + d * f.L) * 2 + v * 16),
                                  pv);
  if (f.conv_inter.data != nullptr)
    store_state_vec<__half, true>(
        reinterpret_cast<__half*>(static_cast<char*>(f.conv_inter.data) +
                                  (n * f.conv_inter.s[0] + t * f.conv_inter.s[1] + d * f.L) * 2 + v * 16),
        pv);
}

// Channel-major: the conv state after each stored token (and conv_inter, channel-major too) as
// items (t, g, v) of one 16-byte piece over all threads from tid0; `channel(g)`: group g's first
// conv channel (< 0: none). `ws`: each token's conv write slot (< 0: none). The cluster form's,
// after its slice push; the group kernel stores a group per thread (conv_vec_store_group).
template <int NT, class Channel>
__device__ __forceinline__ void conv_cm_store(const FusedProblem& f, const uint4* win, const uint4* scratch, int G,
                                              int first, int64_t n, int T, const int64_t* ws, int tid0,
                                              Channel channel) {
  const int L = static_cast<int>(f.L);
  const bool inter = f.conv_inter.data != nullptr;
  for (int item = tid0; item < T * G * L; item += NT) {
    const int v = item % L, g = item / L % G, t = item / (L * G);
    const int64_t wslot = ws[t];
    if (wslot < 0 && !inter) continue;
    const int64_t d = channel(g);
    if (d < 0) continue;
    int i = 8 * v / L, j = 8 * v - i * L;
    conv_cm_put(f, wslot, n, t, d, v, conv_cm_piece(win, scratch, G, g, L, first, t, i, j));
  }
}

// The conv and SiLU of channels 2 * sub, +1 of group g (8 channels) at token t, into the raw
// staging area of this block. (A thread per pair, not per group: the SiLU's exp and division
// dominate, and at T = 1 a group per thread left one warp computing while the block waited for
// it.)
template <int kW>
__device__ __forceinline__ void fused_conv_vec_item(const FusedProblem& f, const FusedShare& s, const StageSmem& sm,
                                                    const FusedSmem& fs, int g, int sub, int t, int nc, int T) {
  const int K = static_cast<int>(f.step.K), G = s.own / 8;
  const uint32_t* const win = reinterpret_cast<const uint32_t*>(fs.win);  // word (row * G + g) * 4 + sub
  // The group's taps are its 8 rows of [D, W], 8 * kW elements: the pair's 2 * kW start at
  // word sub * kW of the group's kW words.
  const uint32_t* const taps = win + s.wl * G * 4 + g * kW * 4 + sub * kW;
  const uint32_t* const bias =
      f.conv_bias.data != nullptr ? win + s.wl * G * 4 + G * kW * 4 + g * 4 + sub : nullptr;
  const uint4* const rows = reinterpret_cast<const uint4*>(fs.win);
  const ConvPairEntry entry(rows, conv_cm_scratch(rows, G, s.wl, kW), G, g, sub,
                            static_cast<int>(f.L) - (kW - 1) + t, s.first, s.cm);
  const float2 y = conv_vec_pair<kW>(taps, bias, entry, f.x.dtype);
  const int c = g * 8 + 2 * sub;
  const int qc = static_cast<int>(s.rank) * s.S + c;
  float* const raw = reinterpret_cast<float*>(sm.raw);
  float* const dst = c < s.S ? raw + (qc < K ? qc : T * K + qc - K) + t * K : raw + 2 * T * K + t * nc + (c - s.S);
  *reinterpret_cast<float2*>(dst) = y;
}

// The conv state after each stored token (and conv_inter) of one group of 8 channels starting at
// conv channel d: 16-byte copies of its window rows (`win`: rows of G groups; column j after token
// t is window entry t + 1 + j, row t + 1 + j - first; the conv state and mixed_qkv share the
// dtype), or channel-major (cm = L; conv_inter too, host: fused_conv_path) L pieces of 8
// (channel, column) elements (conv_cm_piece: the group kernel transposed the old columns into the
// window rows). `ws`: each token's conv write slot (< 0: none). Shared with the group kernel; the
// cluster form's channel-major stores are conv_cm_store's, after its slice push.
__device__ __forceinline__ void conv_vec_store_group(const FusedProblem& f, const uint4* win, int cm, int G, int g,
                                                     int64_t d, int64_t n, int first, int T, const int64_t* ws) {
  const int L = static_cast<int>(f.L);
  const bool inter = f.conv_inter.data != nullptr;
  for (int t = 0; t < T; ++t) {
    const int64_t wslot = ws[t];
    if (wslot < 0 && !inter) continue;
    if (cm > 0) {
      int i = 0, j = 0;
      for (int v = 0; v < L; ++v)
        conv_cm_put(f, wslot, n, t, d, v, conv_cm_piece(win, nullptr, G, g, L, first, t, i, j));
      continue;
    }
    char* const cs = static_cast<char*>(f.conv_state.data) + (wslot * f.conv_state.s[0] + d) * 2;
    char* const ci = static_cast<char*>(f.conv_inter.data) + (n * f.conv_inter.s[0] + t * f.conv_inter.s[1] + d) * 2;
    for (int j = 0; j < L; ++j) {
      const Packed<__half> v{win[(t + 1 + j - first) * G + g]};
      if (wslot >= 0) store_state_vec<__half, true>(reinterpret_cast<__half*>(cs + j * f.conv_state.s[2] * 2), v);
      if (inter) store_state_vec<__half, true>(reinterpret_cast<__half*>(ci + j * f.conv_inter.s[3] * 2), v);
    }
  }
}

// The block's groups, from the last warp (fused_conv_vec: beside the conv items, from warp 0).
template <int NT>
__device__ __forceinline__ void fused_conv_vec_store(const FusedProblem& f, const FusedShare& s, const FusedSmem& fs,
                                                     int64_t n, int64_t hv, int64_t c0, int T) {
  const Problem& p = f.step;
  const int G = s.own / 8;
  for (int g = rotated_tid<NT>(NT / 32 - 1); g < G; g += NT) {
    const int64_t d = fused_channel(p, s, g * 8, hv, c0);
    if (d >= 0) conv_vec_store_group(f, reinterpret_cast<const uint4*>(fs.win), 0, G, g, d, n, s.first, T, fs.ws);
  }
}

// One item per (channel pair, token), over all threads. The caller has waited for its own
// cp.async group; the barrier here makes every thread's landed inputs visible to all.
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_conv_vec(const FusedProblem& f, const FusedShare& s, const StageSmem& sm,
                                               const FusedSmem& fs, int64_t n, int64_t hv, int64_t c0, int nc, int T) {
  const Problem& p = f.step;
  const int G = s.own / 8;
  __syncthreads();  // the windows and fs.ws
  // The conv state after each token, as soon as the windows landed: the block alone reads and
  // writes these channels, and its read of them is over. So the stores are in flight during the
  // token loop instead of following it. (Channel-major: after the conv items, below.)
  if (s.cm == 0) fused_conv_vec_store<NT>(f, s, fs, n, hv, c0, T);
  fused_wait_started();  // the push below writes into the other blocks
  for (int item = threadIdx.x; item < G * 4 * T; item += NT) {
    const int sub = item % 4, g = item / 4 % G, t = item / (4 * G);
    if (fused_channel(p, s, g * 8, hv, c0) < 0) continue;
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
  __syncthreads();  // the slice's outputs are complete
  fused_push_slice<NT>(p, s, sm, T);
  if (s.cm > 0) {
    const uint4* const win = reinterpret_cast<const uint4*>(fs.win);
    conv_cm_store<NT>(f, win, conv_cm_scratch(win, G, s.wl, static_cast<int>(f.W)), G, s.first, n, T, fs.ws,
                      threadIdx.x, [&](int g) { return fused_channel(p, s, g * 8, hv, c0); });
  }
}

// ---------------------------------------------------------------------------------------
// The fused step's part of the tile kernels' prologue, in their order: fused_started before
// pdl_wait; fused_issue_inputs before the row's slot is known and fused_issue_state after it
// (one cp.async group each, committed by the caller, empty where nothing goes that way);
// fused_prologue once the gates are staged: q, k and v in the raw staging area, fp32, as
// stage_issue's layout, for stage_convert_t.
// ---------------------------------------------------------------------------------------
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_issue_inputs(const FusedProblem& f, const Geometry& geo, const FusedShare& s,
                                                   const FusedSmem& fs, int64_t n, int64_t hv, int64_t c0, int nc,
                                                   int T) {
  if (geo.conv_vec) fused_conv_vec_issue_inputs<NT>(f, s, fs, n, hv, c0, T);
  if constexpr (kNorm)
    if (geo.norm_vec) fused_norm_issue<NT>(f, fs, n, hv, c0, nc, T);
}

// Each token's conv write slot (< 0: none) into ws[0, T), by one whole warp (the caller picks it;
// warp_token_write_slot shuffles within the warp). Shared with the group kernel.
__device__ __forceinline__ void warp_store_write_slots(const Problem& p, const WarpSlots& slots, int64_t n,
                                                       int64_t* ws) {
  for (int t = 0; t < static_cast<int>(p.T); ++t) {
    const int64_t w = warp_token_write_slot(p, slots, n, t);
    if ((threadIdx.x & 31) == 0) ws[t] = w;
  }
}

// Also each token's conv write slot into fs.ws, by the last warp (every warp resolved the row's
// slots), for the conv-state stores after the next block barrier.
template <int NT>
__device__ __forceinline__ void fused_issue_state(const FusedProblem& f, const Geometry& geo, const FusedShare& s,
                                                  const FusedSmem& fs, const WarpSlots& slots, int64_t n, int64_t hv,
                                                  int64_t c0) {
  if (geo.conv_vec) fused_conv_vec_issue_state<NT>(f, s, fs, hv, c0, slots.read);
  if (static_cast<int>(threadIdx.x) / 32 == NT / 32 - 1) warp_store_write_slots(f.step, slots, n, fs.ws);
}

// The caller has committed the groups above and then the state tile's.
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_prologue(const FusedProblem& f, const Geometry& geo, const FusedShare& s,
                                               const StageSmem& sm, const FusedSmem& fs, int64_t n, int64_t hv,
                                               int64_t c0, int nc, int T, int64_t slot) {
  // The norm's gate by scalar loads (other layouts) while the conv inputs land.
  if constexpr (kNorm)
    if (!geo.norm_vec) fused_norm_gate<NT>(f, fs, n, hv, c0, nc, T);
  if (geo.conv_vec) {
    cp_async_wait_group<1>();  // this thread's conv inputs landed (the state may still be in flight)
    fused_conv_vec<NT, kNorm>(f, s, sm, fs, n, hv, c0, nc, T);
  } else {
    fused_conv<NT, kNorm>(f, s, sm, fs, n, hv, c0, nc, T, slot);
  }
  cluster_sync();  // every slice's q/k outputs are in every block of the cluster
}

// ---------------------------------------------------------------------------------------
// The epilogue: on the generic path, the conv state after each stored token (and conv_inter)
// for the block's own channels, from the windows — column j after token t is window entry
// t + 1 + j (the 16-byte path stored it after its conv, fused_conv_vec); then with
// the norm, the tiles' sums of squares exchanged and o = o * rsqrt(mean_V(o^2) + eps) *
// norm_weight * silu(z) written. `tile`: this block's tile of its value head (the cluster holds
// HV/H heads x geo.tiles blocks, head-major).
// ---------------------------------------------------------------------------------------
template <int NT, bool kNorm>
__device__ __forceinline__ void fused_finish(const FusedProblem& f, const Geometry& geo, const FusedShare& s,
                                             const FusedSmem& fs, int64_t n, int64_t hv, int tile, int64_t c0,
                                             int nc, int T) {
  const Problem& p = f.step;
  const int L = static_cast<int>(f.L), tiles = geo.tiles;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const unsigned rank = s.rank;
  // norm_weight * silu(z) of output item i (token i / nc, column c0 + i % nc).
  [[maybe_unused]] const auto gate = [&](int i) {
    if (!geo.norm_vec) return fs.zw[i];  // (fused_norm_gate)
    float g = 1.f;                       // raw rows (fused_norm_issue); host: V is a multiple of nc
    if (f.z.data != nullptr) g = silu_fast(smem_f32(fs.zw, f.z.dtype, i));
    return smem_f32(fs.wn, f.norm_weight.dtype, i % nc) * g;
  };
  // The norm's writes start at warp 1 (warp 0 sums token 0's squares), and a thread's first
  // item's gate is computed now: it does not need the sums, and at small B (an item per thread)
  // it is then off the chain that follows the sums' barrier.
  [[maybe_unused]] const int i0 = rotated_tid<NT>(1);
  [[maybe_unused]] float gate0 = 0.f;
  if constexpr (kNorm) {
    if (i0 < T * nc) gate0 = gate(i0);
    __syncthreads();  // the token loop's outputs (fs.o) are complete
    // This tile's sums of squares, one warp per token in a fixed order, stored into every tile
    // of the head (the cluster is head-major: the head's tile 0 has rank rank - tile).
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
  }

  if (!geo.conv_vec) {  // (the 16-byte path stored its conv state in fused_conv_vec)
    const bool inter = f.conv_inter.data != nullptr;
    for (int c = threadIdx.x; c < s.own; c += NT) {
      const int64_t d = fused_channel(p, s, c, hv, c0);
      if (d < 0) continue;
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
    // Every tile's sums are in every tile of the head: a cluster barrier (uniform over the
    // cluster, and a block barrier too) where they cross blocks, else the block's own.
    if (tiles > 1)
      cluster_sync();
    else
      __syncthreads();
    for (int i = i0; i < T * nc; i += NT) {
      const int t = i / nc, c = i % nc;
      if (c0 + c >= p.V) continue;
      // The factor, per item rather than once per token behind one more barrier: every tile adds
      // the same sums in the same order, so all get the same bits.
      float ss = 0.f;
      for (int j = 0; j < tiles; ++j) ss += fs.part[j * 16 + t];
      const float fac = rsqrtf(ss / static_cast<float>(p.V) + f.norm_eps);
      const float zw = i == i0 ? gate0 : gate(i);
      store_scalar(p.o.data, p.o.dtype, n * p.o.s[0] + t * p.o.s[1] + hv * p.o.s[2] + c0 + c, fs.o[i] * fac * zw);
    }
  }
}

}  // namespace gdn::detail::cuda
