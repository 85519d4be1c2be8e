// VK layout ([P, HV, V, K], K contiguous): the fast path.
//
// A group of L = K/16 consecutive lanes owns one state row (one value index r); each lane
// holds 16 K-elements of it in fp32 registers for all T tokens, loaded and stored as
// 16-byte vectors interleaved across the group (vector i of lane j covers K elements
// [(i*L + j)*VE, +VE)), so one warp instruction touches whole 128-byte lines. A thread
// may own R rows with the same K-slice, so the q/k slice it reads from shared memory per
// token serves R rows. Per token and row the two reductions dot(S, k) and dot(S, q) of the
// OLD state go through one reduce-scatter over the L lanes of the row:
//   delta = beta*(v - g*sk);  o = g*sq + delta*kq;  S = g*S + delta*kh
// (exact rewrite of section 2 of the spec). No __syncthreads inside the token loop.
#pragma once

#include "common.cuh"
#include "fused.cuh"

namespace gdn::detail::cuda {

constexpr int kVkThreads = 128;
// Resident blocks per SM the register allocation must allow, i.e. the register cap per thread
// (96, 128, 168 for R = 1, 2, 4). Compile-time tuning knobs.
#ifndef GDN_VK_MIN_BLOCKS_R1
#define GDN_VK_MIN_BLOCKS_R1 5
#endif
#ifndef GDN_VK_MIN_BLOCKS_R2
#define GDN_VK_MIN_BLOCKS_R2 4
#endif
#ifndef GDN_VK_MIN_BLOCKS_R4
#define GDN_VK_MIN_BLOCKS_R4 3
#endif
template <int R>
constexpr int kVkMinBlocks =
    R == 1 ? GDN_VK_MIN_BLOCKS_R1 : R == 2 ? GDN_VK_MIN_BLOCKS_R2 : GDN_VK_MIN_BLOCKS_R4;

template <typename S, int K, int R>
struct VkShape {
  static constexpr int VE = kVecElems<S>;  // elements per 16-byte vector
  static constexpr int E = 16;             // K-elements per lane
  static constexpr int NV = E / VE;        // vectors per lane and row
  static constexpr int L = K / E;          // lanes per row
  static constexpr int G = kVkThreads / L; // row groups per block
  static constexpr int RB = G * R;         // rows per block
  static_assert(K % (E * 4) == 0 && L <= 32 && R <= L);

  // Shared-memory position of K-element e: lane j's m-th element lives at float4 (m/4)*L + j,
  // so the per-token reads of q and k are conflict-free 16-byte loads.
  struct Pos {
    __device__ __forceinline__ int operator()(int e) const {
      const int i = e / (VE * L);
      const int j = (e / VE) % L;
      const int m = i * VE + e % VE;
      return ((m >> 2) * L + j) * 4 + (m & 3);
    }
  };
};

// ---------------------------------------------------------------------------------------
// Per-token math and stores, shared by both VK kernels. A thread holds R rows (rows
// row + r*G of its group, r < R) of its K-slice in st[r][0..16). vrow[r*G] is row r's v.
//
// Reduction: at R = 4 the 2R partial sums of a lane (dot(S, k) and dot(S, q) of the old state
// for R rows) are reduce-scattered over the L lanes of the row (VkReduce): each xor step sends half
// of a lane's values and keeps the other half, so 2R values cost 2R - 1 shuffles instead of
// 2R * log2(L). Afterwards the lanes of the lower half of the group (j < L/2) hold the
// dot(S, k) totals and compute the rows' delta, the upper half hold dot(S, q) and compute o
// (the partner lane j ^ L/2 gives them their row's delta); every lane then fetches the R deltas
// it needs for its update (R shuffles). The sums are bit-identical to an all-reduce (same
// pairs, same tree). At R <= 2 (small grids, where the chain's latency counts more than its
// instructions) the sums are all-reduced and every lane computes every row's delta; lane
// j < R keeps row j's output (vk_store_token knows both placements).
//
// Lazy decay (tile path, T > 1 without the cache or per-token slots: only the last token's
// state is stored): a thread keeps its rows as S = gam_acc * Sh with Sh in st, so each token
// but the last costs one FMA per element, Sh += (dk / gam) * k, instead of a multiply and an
// FMA (without the cache the token loop is issue-bound from T = 3 on: docs/design.md);
// the last token takes the literal step S = gam*S + dk*k, which folds the factor back. The
// tokens run in segments, a loop of lazy steps and one literal step, whose ends are found
// before they run (vk_lazy_end, block-uniform), so no loop branches per token; a segment ends
// before the decay since its start falls below kLazyMin, so dk / gam stays far from overflow.
// Four rows per thread only (kIssueBound). Same math as SPEC section 2; only the fp32 rounding
// order differs.
// ---------------------------------------------------------------------------------------
constexpr float kLazyMin = 0x1p-24f;

template <int K, int R>
struct VkReduce {
  static constexpr int L = K / 16;                       // lanes per row
  static constexpr int N = 2 * R;                        // values per lane: R sk, then R sq
  static constexpr int LOG2L = L == 4 ? 2 : L == 8 ? 3 : 4;
  static constexpr int C = N > L ? N / L : 1;            // totals held per lane afterwards
  static constexpr int H = (N / C) == 2 ? 1 : (N / C) == 4 ? 2 : 3;  // halving steps
  static constexpr int SHIFT = LOG2L - H;                // lane j holds values [C*(j>>SHIFT), +C)
  // R = 4 is picked only for grids that fill the GPU several times over, where the token loop
  // is issue-bound: the reduce-scatter (24 -> 12 shuffles per token at K = 128) trades a longer
  // per-token chain for fewer instructions. R <= 2 (small grids, latency-bound: with the
  // scatter B = 1, T = 8 was 5-8% slower) all-reduce.
  static constexpr bool kIssueBound = R == 4;
  static_assert(L == 4 || L == 8 || L == 16);
  static_assert((1 << H) * C == N && H <= LOG2L);
};

// Reduce-scatter of x over the lanes j, j ^ OFF, j ^ OFF/2, ... of a row group; CN values held.
template <int OFF, int CN, int N>
__device__ __forceinline__ void group_reduce_scatter(float (&x)[N], int j) {
  if constexpr (OFF > 0) {
    if constexpr (CN > 1) {
      const bool up = (j & OFF) != 0;
#pragma unroll
      for (int i = 0; i < CN / 2; ++i) {
        const float keep = up ? x[i + CN / 2] : x[i];
        const float send = up ? x[i] : x[i + CN / 2];
        x[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
      }
      group_reduce_scatter<OFF / 2, CN / 2, N>(x, j);
    } else {
      x[0] += __shfl_xor_sync(0xffffffffu, x[0], OFF);
      group_reduce_scatter<OFF / 2, 1, N>(x, j);
    }
  }
}

// One token for the thread's R rows; o as vk_store_token writes it. kLazy: the lazy step
// (st += (dk / gam) * k, gam_acc = gam), else the literal one (st = gam*st + dk*k, gam_acc = 1),
// which also folds the factor of earlier lazy steps. Every lane of the warp must call it.
//
// kDirectVE > 0 (the direct variant, two rows or fewer, bf16 q/k/v, tile path): q, k and v are
// read raw from the staging area (lane j's K-elements in the order of its state vectors of
// kDirectVE elements) instead of converted by stage_convert, and the token's q/k sums for the
// norms ride along the dot products' all-reduce: no conversion phase and one block barrier
// instead of two, which is what a latency-bound small grid waits for (docs/design.md).
// RS: the distance between a thread's rows (0: G, the VK kernels' interleave; 1: R consecutive
// rows, decode_kv_vt_kernel); vrow[r * RS] is row r's v.
template <int K, int R, bool kLazy, int kDirectVE = 0, typename VIn = float, int RS = 0>
__device__ __forceinline__ void vk_token(const Problem& p, float (&st)[R][16], float& gam_acc,
                                         const StageSmem& sm, int t, int j, const VIn* vrow,
                                         float (&o)[VkReduce<K, R>::C]) {
  using Rd = VkReduce<K, R>;
  constexpr int E = 16, L = Rd::L, C = Rd::C, G = RS > 0 ? RS : kVkThreads / L;
  constexpr bool kDirect = kDirectVE > 0;
  static_assert(!kDirect || (!Rd::kIssueBound && std::is_same_v<VIn, __nv_bfloat16>));
  const float4* q4 = reinterpret_cast<const float4*>(sm.q + t * K);
  const float4* k4 = reinterpret_cast<const float4*>(sm.k + t * K);
  // Direct: raw bf16 q_t, k_t (StageSmem::raw).
  const uint16_t* qr = sm.raw_part<const uint16_t>(0, K) + t * K;
  const uint16_t* kr = sm.raw_part<const uint16_t>(1, K) + t * K;
  float kv[E];
  float sk[R], sk2[R], sq[R], sq2[R];  // two chains each: half the FMA latency
  float nrm[3] = {0.f, 0.f, 0.f};      // direct: sum q^2, k^2, q k over the lane's elements
#pragma unroll
  for (int r = 0; r < R; ++r) sk[r] = sk2[r] = sq[r] = sq2[r] = 0.f;
#pragma unroll
  for (int m4 = 0; m4 < E / 4; ++m4) {
    float4 a, b;
    if constexpr (kDirect) {
      constexpr int VE = kDirectVE;
      const int e0 = ((m4 * 4) / VE) * VE * L + j * VE + (m4 * 4) % VE;
      const uint2 qa = *reinterpret_cast<const uint2*>(qr + e0);
      const uint2 ka = *reinterpret_cast<const uint2*>(kr + e0);
      a = make_float4(bf16_lo(qa.x), bf16_hi(qa.x), bf16_lo(qa.y), bf16_hi(qa.y));
      b = make_float4(bf16_lo(ka.x), bf16_hi(ka.x), bf16_lo(ka.y), bf16_hi(ka.y));
      nrm[0] = fmaf(a.x, a.x, fmaf(a.y, a.y, fmaf(a.z, a.z, fmaf(a.w, a.w, nrm[0]))));
      nrm[1] = fmaf(b.x, b.x, fmaf(b.y, b.y, fmaf(b.z, b.z, fmaf(b.w, b.w, nrm[1]))));
      nrm[2] = fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, fmaf(a.w, b.w, nrm[2]))));
    } else {
      a = q4[m4 * L + j];
      b = k4[m4 * L + j];
    }
    kv[m4 * 4 + 0] = b.x, kv[m4 * 4 + 1] = b.y, kv[m4 * 4 + 2] = b.z, kv[m4 * 4 + 3] = b.w;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float* x = &st[r][m4 * 4];
      sk[r] = fmaf(x[0], b.x, sk[r]);
      sq[r] = fmaf(x[0], a.x, sq[r]);
      sk2[r] = fmaf(x[1], b.y, sk2[r]);
      sq2[r] = fmaf(x[1], a.y, sq2[r]);
      sk[r] = fmaf(x[2], b.z, sk[r]);
      sq[r] = fmaf(x[2], a.z, sq[r]);
      sk2[r] = fmaf(x[3], b.w, sk2[r]);
      sq2[r] = fmaf(x[3], a.w, sq2[r]);
    }
  }
  float x[Rd::N];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    x[r] = sk[r] + sk2[r];
    x[R + r] = sq[r] + sq2[r];
  }

  const float4 sc = reinterpret_cast<const float4*>(sm.tok + t * kTokScalars)[0];
  float rqs = sc.x, rk = sc.y, kq = sc.z;
  const float beta = sm.tok[t * kTokScalars + 4];
  const float gam = gam_acc * sc.w;  // decay since the state in st was last exact
  if constexpr (Rd::kIssueBound) {
    const int base = C * (j >> Rd::SHIFT);
    float dl[R];  // every row's delta, on every lane
    group_reduce_scatter<L / 2, Rd::N, Rd::N>(x, j);
    float d[C];  // delta of local row base + s (meaningful on the lower half only)
#pragma unroll
    for (int s = 0; s < C; ++s) {
      const float v = to_f32(vrow[((base + s) & (R - 1)) * G]);
      d[s] = beta * (v - gam * (x[s] * rk));
    }
#pragma unroll
    for (int s = 0; s < C; ++s) {
      const float dr = __shfl_xor_sync(0xffffffffu, d[s], L / 2);  // the row's delta, from j ^ L/2
      o[s] = gam * (x[s] * rqs) + dr * kq;
    }
    const int lane0 = (threadIdx.x & 31) - j;  // the group's first lane
#pragma unroll
    for (int r = 0; r < R; ++r)
      dl[r] = __shfl_sync(0xffffffffu, d[r % C], lane0 + ((r / C) << Rd::SHIFT));
    if constexpr (kLazy) {
      const float rkg = __fdividef(rk, gam);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float c = dl[r] * rkg;
#pragma unroll
        for (int m = 0; m < E; ++m) st[r][m] = fmaf(c, kv[m], st[r][m]);
      }
      gam_acc = gam;
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float dk = dl[r] * rk;
#pragma unroll
        for (int m = 0; m < E; ++m) st[r][m] = fmaf(gam, st[r][m], dk * kv[m]);
      }
      gam_acc = 1.f;
    }
  } else {
    // All-reduce (row by row, sk and sq interleaved), then per row: delta, o, the literal update.
    static_assert(!kLazy && C == 1);
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        x[r] += __shfl_xor_sync(0xffffffffu, x[r], off);
        x[R + r] += __shfl_xor_sync(0xffffffffu, x[R + r], off);
      }
      if constexpr (kDirect) {
#pragma unroll
        for (int i = 0; i < 3; ++i) nrm[i] += __shfl_xor_sync(0xffffffffu, nrm[i], off);
      }
    }
    if constexpr (kDirect) {
      const TokScalars ts = token_scalars(p, nrm[0], nrm[1], nrm[2]);
      rqs = ts.rqs, rk = ts.rk, kq = ts.kq;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float delta = beta * (to_f32(vrow[r * G]) - gam * (x[r] * rk));
      const float orow = gam * (x[R + r] * rqs) + delta * kq;
      if (r == 0 || j == r) o[0] = orow;
      const float dk = delta * rk;
#pragma unroll
      for (int m = 0; m < E; ++m) st[r][m] = fmaf(gam, st[r][m], dk * kv[m]);
    }
  }
}

// Output, intermediate cache and pool writes of token tt for the thread's R rows
// (global rows row + r*G), straight from registers; kOutOnly: the output only (a lazy token,
// whose state is neither cached nor written). wslot: warp_token_write_slot of tt.
// kOSmem (the fused step with its norm): o goes to o_s[tt][row - row0] (rt rows per token)
// instead of global memory, until the norm factor is known.
template <typename S, int K, int R, bool kVec, bool kOutOnly, bool kOSmem = false, bool kSr = true, int RS = 0>
__device__ __forceinline__ void vk_store_token(const Problem& p, int64_t wslot, uint64_t sr_row, int64_t n,
                                               int64_t hv, int64_t tt, int64_t row, int j,
                                               const float (&st)[R][16],
                                               const float (&o)[VkReduce<K, R>::C],
                                               float* o_s = nullptr, int64_t row0 = 0, int rt = 0) {
  using Rd = VkReduce<K, R>;
  constexpr int VE = kVecElems<S>, NV = 16 / VE, L = K / 16, C = Rd::C, G = RS > 0 ? RS : kVkThreads / L;
  static_assert(RS == 0 || kOutOnly, "rows at another stride than G: the output only");
  // Reduce-scatter: the upper-half lanes hold o, the first lane of each run of duplicates
  // writes it. All-reduce: lane j < R writes row j's.
  const bool writer = Rd::kIssueBound ? j >= L / 2 && (j & ((1 << Rd::SHIFT) - 1)) == 0 : j < R;
  if (writer) {
    const int r0 = Rd::kIssueBound ? C * (j >> Rd::SHIFT) - R : j;
#pragma unroll
    for (int s = 0; s < C; ++s) {
      const int64_t rv = row + (r0 + s) * G;
      if constexpr (kOSmem) {
        if (rv < p.V) o_s[tt * rt + (rv - row0)] = o[s];
      } else {
        if (rv < p.V)
          store_scalar(p.o.data, p.o.dtype, n * p.o.s[0] + tt * p.o.s[1] + hv * p.o.s[2] + rv,
                       o[s]);
      }
    }
  }

  if constexpr (kOutOnly) return;
  // Stochastic rounding: element (v, k) is e = v * K + k; this thread's vector i of row r
  // starts at k = (i * L + j) * VE.
  const bool sr = kSr && p.rounding_seed != nullptr;
  const uint32_t key = sr ? sr_key(sr_row, hv, tt) : 0u;
  // One destination at a time (cache, then pool): one base pointer live next to the R rows
  // (both at once spilled at R = 4, fp32, 128 registers).
  const auto store_rows = [&](S* base, int64_t rs) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row + r * G >= p.V) continue;
#pragma unroll
      for (int i = 0; i < NV; ++i)
        store_state_vec<S, kVec>(base + r * G * rs + i * (L * VE),
                                 round_state_vec<S>(&st[r][i * VE], sr, key,
                                                    (row + r * G) * K + (i * L + j) * VE));
    }
  };
  S* const inter = static_cast<S*>(p.inter.data);
  if (inter != nullptr)
    store_rows(inter + n * p.inter.s[0] + tt * p.inter.s[1] + hv * p.inter.s[2] +
                   row * p.inter.s[3] + j * VE,
               p.inter.s[3]);
  if (wslot >= 0)
    store_rows(static_cast<S*>(p.state.data) + wslot * p.state.s[0] + hv * p.state.s[1] +
                   row * p.state.s[2] + j * VE,
               p.state.s[2]);
}

// One token of the thread's R rows and its stores; every lane of the warp calls it.
// kLazy: a token whose state is not stored (vk_lazy_end), output only.
template <typename S, int K, int R, bool kVec, bool kLazy, int kDirectVE = 0, typename VIn = float,
          bool kOSmem = false, bool kSr = true, int RS = 0>
__device__ __forceinline__ void vk_step(const Problem& p, const WarpSlots& slots, int64_t n,
                                        int64_t hv, int64_t tt, int64_t row, int j,
                                        float (&st)[R][16], float& gam_acc, const StageSmem& sm,
                                        int t, const VIn* vrow, float* o_s = nullptr,
                                        int64_t row0 = 0, int rt = 0) {
  float o[VkReduce<K, R>::C];
  vk_token<K, R, kLazy, kDirectVE, VIn, RS>(p, st, gam_acc, sm, t, j, vrow, o);
  vk_store_token<S, K, R, kVec, kLazy, kOSmem, kSr, RS>(p, kLazy ? -1 : warp_token_write_slot(p, slots, n, tt),
                                                    slots.sr_row, n, hv, tt, row, j, st, o, o_s, row0, rt);
}

// Lazy tokens run from t up to the returned token (exclusive), which takes the literal step:
// the first token whose decay since t would fall below kLazyMin, at the latest T - 1 (the
// stored one); t itself (no lazy token) with the cache or per-token slots, where every token's
// state is stored. Block-uniform (the gates are in shared memory).
__device__ __forceinline__ int vk_lazy_end(const Problem& p, const StageSmem& sm, int t, int T) {
  if (stores_token_states(p)) return t;
  float gam = 1.f;
  for (; t < T - 1; ++t) {
    gam *= sm.tok[t * kTokScalars + 3];
    if (gam < kLazyMin) break;
  }
  return t;
}

// ---------------------------------------------------------------------------------------
// General path: the state rows of a thread live in registers for all tokens; T of any
// length (chunks of staged tokens), scalar variant for unaligned state or cache. kSr as in
// decode_vk_tile_kernel.
// ---------------------------------------------------------------------------------------
template <typename S, int K, int R, bool kVec, bool kSr = true>
__global__ void __launch_bounds__(kVkThreads, kVkMinBlocks<R>)
    decode_vk_kernel(const __grid_constant__ Problem p, const Geometry geo) {
  using Sh = VkShape<S, K, R>;
  constexpr int VE = Sh::VE, E = Sh::E, NV = Sh::NV, L = Sh::L, G = Sh::G, RB = Sh::RB;

  extern __shared__ float4 smem4[];
  const StageSmem sm = carve_smem(reinterpret_cast<float*>(smem4), 0, geo, K, RB);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int group = tid / L;
  const int j = tid % L;
  const BlockCoords bc = block_coords(p, geo);
  const int tile = bc.tile;
  const int64_t hv = bc.hv, n = bc.n;
  const int64_t row0 = static_cast<int64_t>(tile) * RB;

  pdl_wait();
  pdl_launch_dependents();

  const WarpSlots slots = resolve_row_warp(p, n, lane);
  if (slots.read < 0) {
    finish_padded_row<kVkThreads>(p, slots, n, hv, tile, row0, RB);
    return;
  }

  int tc = static_cast<int>(p.T < geo.chunk ? p.T : geo.chunk);
  stage_issue<kVkThreads>(p, geo, sm, n, 0, tc, hv, row0, RB);

  // The state loads are the long pole: in flight together with the staging copies.
  float st[R][E];
  {
    const S* src = static_cast<const S*>(p.state.data) + slots.read * p.state.s[0] +
                   hv * p.state.s[1] + (row0 + group) * p.state.s[2] + j * VE;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r * G + group < p.V) {
#pragma unroll
        for (int i = 0; i < NV; ++i)
          load_state_vec<S, kVec>(src + r * G * p.state.s[2] + i * (L * VE), &st[r][i * VE]);
      } else {
#pragma unroll
        for (int m = 0; m < E; ++m) st[r][m] = 0.f;
      }
    }
  }

  float gam_acc = 1.f;  // literal steps only: stays 1
  for (int64_t t0 = 0; t0 < p.T; t0 += geo.chunk) {
    if (t0 > 0) {
      tc = static_cast<int>(p.T - t0 < geo.chunk ? p.T - t0 : geo.chunk);
      __syncthreads();  // the previous chunk's readers are done with shared memory
      stage_issue<kVkThreads>(p, geo, sm, n, t0, tc, hv, row0, RB);
    }
    stage_gates<kVkThreads>(p, sm, n, t0, tc, hv);
    cp_async_wait_all();
    __syncthreads();
    stage_convert<K, kVkThreads>(p, geo, sm, tc, RB, typename Sh::Pos{});
    __syncthreads();

    for (int t = 0; t < tc; ++t)
      vk_step<S, K, R, kVec, false, 0, float, false, kSr>(p, slots, n, hv, t0 + t, row0 + group, j, st, gam_acc,
                                                          sm, t, sm.v + t * RB + group);
  }
}

// ---------------------------------------------------------------------------------------
// Tile path (16-byte state, T <= kMaxChunk): bytes in flight decoupled from registers.
// A block owns geo.tile_rows state rows of one (n, hv). After pdl_wait it issues the
// cp.async copies of q, k, v (they do not depend on the slot), resolves the slot, then
// copies its whole state tile into shared memory with 16-byte cp.async (coalesced: the
// threads walk each row's 16-byte pieces in order), so the tile is in flight at once with
// few registers; the gates and the q/k norms are computed while it lands. Then each thread
// walks its rows RR at a time: rows from shared memory into registers (same K-slice mapping
// as the general path, conflict-free 16-byte reads), all T tokens, stores from registers.
// ---------------------------------------------------------------------------------------
// Resident blocks per SM the register cap must allow (128 registers per thread; 5 spills
// 12 bytes at fp32 K=128): 4 blocks x 32 KB tiles = 128 KB of state in flight per SM.
// RR = 1 (64 registers): 8 blocks x 16 KB tiles, the fp32 T = 1 rule vk_fine_tile (decode_cuda.cu).
#ifndef GDN_VK_TILE_MIN_BLOCKS_RR1
#define GDN_VK_TILE_MIN_BLOCKS_RR1 8
#endif
#ifndef GDN_VK_TILE_MIN_BLOCKS_RR2
#define GDN_VK_TILE_MIN_BLOCKS_RR2 4
#endif
// RR = 4: four rows' reduction chains overlap per token (ILP for T > 1 without the cache),
// at the same 4 blocks/SM (128-register cap).
#ifndef GDN_VK_TILE_MIN_BLOCKS_RR4
#define GDN_VK_TILE_MIN_BLOCKS_RR4 4
#endif
template <int RR>
constexpr int kVkTileMinBlocks = RR == 1   ? GDN_VK_TILE_MIN_BLOCKS_RR1
                                 : RR == 2 ? GDN_VK_TILE_MIN_BLOCKS_RR2
                                           : GDN_VK_TILE_MIN_BLOCKS_RR4;

// The chunked kernel's state tile in shared memory (vk_chunk.cuh): rows v = row0 + r of K
// elements k, in the layout the state has, 16-byte pieces of VE elements swizzled so that an
// ldmatrix (eight rows of one piece) and the mma fragment loads hit distinct banks.
// VK: RT rows r of K elements, piece c of row r at r * K + (c ^ (r & 7)) * VE.
// KV (kKv): its transpose, K rows k of RT elements, piece c of row k at k * RT + (c ^ (k & m))
// * VE, m = min(RT / VE, 8) - 1 (RT a power of two >= 16).
template <typename S, int K, bool kKv>
struct ChunkTile {
  static constexpr int VE = kVecElems<S>;
  S* base;
  int rt, m;
  __device__ ChunkTile(S* b, int RT) : base(b), rt(RT), m((RT / VE < 8 ? RT / VE : 8) - 1) {}
  // KV: where element (v = row0 + r, k) sits in its row k, which depends on k only through
  // k & 7: loops over k with a fixed k & 7 compute it once.
  __device__ __forceinline__ int kv_col(int r, int k7) const { return (((r / VE) ^ (k7 & m)) * VE) + r % VE; }
  // Element (v = row0 + r, k).
  __device__ __forceinline__ S* elem(int r, int k) const {
    if constexpr (kKv) {
      return base + k * rt + kv_col(r, k & 7);
    } else {
      return base + r * K + ((((k / VE) ^ (r & 7)) * VE) + k % VE);
    }
  }
};

// The KV state's tile for the VK token loop (decode_kv_vt_kernel): K rows k of RT elements, as
// the state has them, 16-byte pieces of VE elements swizzled by k / VE over min(RT / VE, 8)
// pieces. A thread of the token loop reads, for each of its K-elements (i * L + j) * VE + e, its
// RR consecutive columns in one access. The L lanes j of a warp read rows k whose k / VE differ
// in their low three bits (the lane j), and with eight pieces or more rows k are multiples of
// 128 bytes: without the XOR every lane would hit the same banks; with it the lanes of a column
// land in distinct pieces (a warp's access spanning more than one piece, e.g. bf16 RR = 4, can
// still meet two-way conflicts). With fewer pieces (small tiles at small B) 8 / pieces lanes
// share one.
template <typename S>
struct KvVtTile {
  static constexpr int VE = kVecElems<S>;
  S* base;
  int rt;
  unsigned mask;  // the swizzle's span in pieces, less one
  __device__ KvVtTile(S* b, int RT) : base(b), rt(RT), mask(static_cast<unsigned>((RT / VE < 8 ? RT / VE : 8) - 1)) {}
  // Element (column row0 + r, k = kp * VE + e), e < VE: the swizzle depends on kp alone (for a
  // thread of the token loop, on its lane j alone), which the compiler sees only in this form.
  __device__ __forceinline__ S* elem(unsigned r, unsigned kp, unsigned e) const {
    return base + (kp * VE + e) * rt + (((r / VE) ^ (kp & mask)) * VE + r % VE);
  }
  // Piece c (elements [c * VE, +VE) of the tile's columns) of row k.
  __device__ __forceinline__ S* piece(int c, int k) const {
    return elem(static_cast<unsigned>(c) * VE, static_cast<unsigned>(k) / VE, static_cast<unsigned>(k) % VE);
  }
};

// How many of a tile's RT rows (VK) or columns (KV) from row0 lie inside the head's V, as an int
// (the walks' per-piece checks in 32 bits).
__device__ __forceinline__ int tile_extent(int64_t V, int64_t row0, int RT) {
  return static_cast<int>(V - row0 < RT ? V - row0 : RT);
}

// The 16-byte pieces (r, c), r < rows, c < pr, of a tile moved by nthreads threads (this one
// tid), pr dividing nthreads: the thread keeps one piece column c = tid % pr and steps over the
// rows r = tid / pr, + nthreads / pr, .., and f(r, c, g) gets the piece's global address g =
// g0 + r * gs + c * VE as a running pointer. So the division, whatever depends on the column
// alone and the 64-bit address arithmetic leave the loop: the walk as `i = tid .. rows * pr`
// with r = i / pr took ~33 instructions per piece (SASS of the chunked kernel's copy-in, bf16
// K = 128), the running form ~13 with its zero fill. Every tile copy and store pass walks its
// pieces this way.
template <int VE, typename G, typename F>
__device__ __forceinline__ void tile_piece_walk(int tid, int nthreads, int rows, int pr, G* g0, int64_t gs, F f) {
  const int c = tid % pr, rstep = nthreads / pr;
  int r = tid / pr;
  G* g = g0 + r * gs + c * VE;
  const int64_t gstep = rstep * gs;
  for (; r < rows; r += rstep, g += gstep) f(r, c, g);
}

// A KV tile to the pool: K rows k (row k at dst + k * ks) of RT / VE pieces, which divide the
// block (kv_tile_copy_fits, decode_cuda.cu), the pieces past the head's V (c * VE >= vin) left
// alone. piece(c, k) is piece c of row k in shared memory (KvVtTile::piece, ChunkTile::elem):
// the kv-vt kernel's final store and the KV chunked kernel's P4, walked as the copy-in.
template <int VE, typename S, typename Piece>
__device__ __forceinline__ void kv_tile_store(int tid, int K, int RT, int vin, S* dst, int64_t ks, Piece piece) {
  tile_piece_walk<VE>(tid, kVkThreads, K, RT / VE, dst, ks, [&](int k, int c, S* g) {
    if (c * VE < vin) store_state_vec<S, true>(g, *reinterpret_cast<const Packed<S>*>(piece(c, k)));
  });
}

// The tile kernels' prologue (VK tile and chunked kernels): returns false when the block's row
// is padding or invalid (its outputs are zeroed; nothing else to do). Afterwards the state tile
// (RT rows of head hv from row0), the converted inputs and the gates are in shared memory and
// visible to every thread. kChunked, the chunked kernel's layout: ChunkTile's swizzled pieces,
// and q, k stay raw bf16 rows (StageSmem::qk16) instead of fp32. kKv: the state is in the KV
// layout ([P, HV, K, V]) and so is the tile (ChunkTile; KvVtTile outside the chunked kernel).
// while_state_lands() runs after the inputs are converted and before the wait for the state
// tile (work that needs only the inputs hides under the state's latency). kDirect: no
// conversion (the direct token loop reads the raw inputs), one barrier after everything landed.
struct NoWork {
  __device__ void operator()() const {}
};
// Fz (fused.cuh): with the fused step, the conv computes q, k and v (fused_conv; the cluster
// shares the q/k slices) instead of the staging copies; `fs` is its shared memory, `share` its
// part of the conv.
template <typename S, int K, bool kChunked, typename Work = NoWork, bool kDirect = false, typename Fz = NoFuse,
          bool kKv = false>
__device__ __forceinline__ bool vk_tile_begin(const typename Fz::Param& prm, const Geometry& geo,
                                              const StageSmem& sm, S* tile_s, const BlockCoords& bc,
                                              int64_t row0, int RT, WarpSlots& slots,
                                              Work while_state_lands = {}, const FusedSmem* fs = nullptr,
                                              FusedShare* share = nullptr) {
  static_assert(!Fz::kOn || (!kChunked && !kDirect), "the fused step stages fp32 conv outputs");
  const Problem& p = Fz::step(prm);
  constexpr int VE = kVecElems<S>;
  constexpr int PR = K / VE;  // 16-byte pieces per state row
  static_assert(!kChunked || PR >= 8);
  const int tid = threadIdx.x;
  const int64_t n = bc.n, hv = bc.hv;
  const int T = static_cast<int>(p.T);  // <= geo.chunk (host-checked)
  warm_params(prm);
  if (geo.prefetch) {
    const int rows = tile_extent(p.V, row0, RT);
    if constexpr (kKv) {  // K rows of the tile's columns
      prefetch_state_l2(p, n, hv, 0, K, row0, rows * static_cast<int>(sizeof(S)), tid, kVkThreads);
    } else {
      prefetch_state_l2(p, n, hv, row0, rows, 0, K * static_cast<int>(sizeof(S)), tid, kVkThreads);
    }
  }
  if constexpr (Fz::kOn) {
    fused_started();
    fused_share_block(*share, hv);
  }
  // The addresses that depend only on the parameters and the block: computed while the block
  // waits (stage_plan).
  StagePlan plan;
  if constexpr (!Fz::kOn) {
    plan = stage_plan(p, geo, sm, n, 0, T, hv, row0, RT);
    if constexpr (kChunked) {  // q and k straight into qk16's padded rows; v alone in the raw area
      plan.qrow = (K + kQk16Pad) * 2;
      plan.rq = reinterpret_cast<unsigned char*>(sm.qk16);
      plan.rk = plan.rq + T * plan.qrow;
      plan.rv = sm.raw;
    }
    stage_plan_pin(plan);
  }
  // KV: the tile's columns row0.. of every row k (p.state.s[2] is then the k stride).
  const S* head_src = static_cast<const S*>(p.state.data) + hv * p.state.s[1] + (kKv ? row0 : row0 * p.state.s[2]);
  int64_t ss0 = p.state.s[0], ss2 = p.state.s[2];
  // Where the tile's rows are contiguous and inside the head, one bulk copy by the TMA unit loads
  // it (the smem tile is unswizzled outside the chunked kernel). Same-binary A/B on the H200
  // against the 16-byte cp.async loop (decode VK, pool, T = 1..8, B = 1..256): 0.89-1.08x,
  // geometric mean 0.97, most at B = 1, T = 2 and fp32 T >= 4 (docs/design.md, "The bulk tile
  // load landed"). The mbarrier lives in the kBulkBarBytes the planner adds at the end of the
  // dynamic shared memory: a static __shared__ variable instead moved the dynamic area and made
  // the whole kernel ~4% slower.
  unsigned dyn_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_bytes));
  uint64_t* const bulk_bar =
      reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(tile_s) + ((dyn_bytes - static_cast<unsigned>(sizeof(uint64_t))) & ~7u));
  const bool bulk = !kKv && !kChunked && ss2 == K && row0 + RT <= p.V;
  if (bulk && tid == 0) mbar_init(bulk_bar);
  asm volatile("" : "+l"(head_src), "+l"(ss0), "+l"(ss2));
  pdl_wait();
  pdl_launch_dependents();

  // Inputs first: they do not depend on the slot, so their latency overlaps the slot load.
  // (The fused step's conv computes q, k and v instead.)
  if constexpr (!Fz::kOn) {
    stage_issue_plan<kVkThreads>(plan);
  } else {
    fused_issue_inputs<kVkThreads, Fz::kNorm>(prm, geo, *share, *fs, n, hv, row0, RT, T);
  }
  cp_async_commit();
  const GateInputs gates = stage_gates_load<kVkThreads>(p, n, 0, T, hv);

  slots = resolve_row_warp(p, n, tid & 31);
  if (slots.read < 0) {
    cp_async_wait_all();  // no copy may land in shared memory after the block has exited
    finish_padded_row<kVkThreads>(p, slots, n, hv, bc.tile, row0, RT);
    return false;
  }
  if constexpr (Fz::kOn) {  // the conv's state columns first: small, and needed first
    fused_issue_state<kVkThreads>(prm, geo, *share, *fs, slots, n, hv, row0);
    cp_async_commit();
  }

  if constexpr (kKv) {
    const ChunkTile<S, K, true> tile(tile_s, RT);
    const KvVtTile<S> vt(tile_s, RT);
    // K rows k of RT / VE pieces, which divide the block (kv_tile_copy_fits, decode_cuda.cu).
    const int vin = tile_extent(p.V, row0, RT);
    tile_piece_walk<VE>(tid, kVkThreads, K, RT / VE, head_src + slots.read * ss0, ss2, [&](int k, int c, const S* g) {
      cp_async16_or_zero(kChunked ? tile.elem(c * VE, k) : vt.piece(c, k), g, c * VE < vin);
    });
    cp_async_commit();
  } else if (bulk) {
    if (tid == 0)
      bulk_load(tile_s, head_src + slots.read * ss0, static_cast<unsigned>(RT * K * sizeof(S)), bulk_bar);
    cp_async_commit();  // an empty group: the callers' group counts stay as they are
  } else {
    // RT rows of PR pieces.
    static_assert(kVkThreads % PR == 0, "tile_piece_walk: a row's pieces divide the block");
    const int vin = tile_extent(p.V, row0, RT);
    tile_piece_walk<VE>(tid, kVkThreads, RT, PR, head_src + slots.read * ss0, ss2, [&](int r, int c, const S* g) {
      cp_async16_or_zero(tile_s + r * K + (kChunked ? c ^ (r & 7) : c) * VE, g, r < vin);
    });
    cp_async_commit();
  }

  stage_gates_store<kVkThreads>(p, sm, T, gates);
  if constexpr (Fz::kOn) {
    fused_prologue<kVkThreads, Fz::kNorm>(prm, geo, *share, sm, *fs, n, hv, row0, RT, T, slots.read);
    stage_convert_t<K, kVkThreads, float, false>(p, geo, sm, T, RT, typename VkShape<S, K, 1>::Pos{});
  } else if constexpr (!kDirect) {  // direct: the compute threads read the raw inputs
    cp_async_wait_group<1>();  // q, k, v landed (the state may still be in flight)
    __syncthreads();
    stage_convert<K, kVkThreads, kChunked>(p, geo, sm, T, RT, typename VkShape<S, K, 1>::Pos{});
    while_state_lands();
  }
  cp_async_wait_group<0>();
  if (bulk && tid == 0) mbar_wait(bulk_bar, 0);
  __syncthreads();  // (converted) inputs, gates and the state tile visible to every thread
  return true;
}

// The tokens' v rows [t][RT] in the staging area: raw bf16 for the direct token loop
// (StageSmem::raw), else the converted fp32 rows.
template <int K, bool kDirect>
__device__ __forceinline__ auto staged_v_rows(const StageSmem& sm) {
  if constexpr (kDirect) {
    return sm.raw_part<const __nv_bfloat16>(2, K);
  } else {
    return static_cast<const float*>(sm.v);
  }
}

// The fused step's parts of shared memory (Fz::kOn), past the staging area, for the kernels of
// VK's token loop (decode_vk_tile_kernel, decode_kv_vt_kernel); nothing without it.
template <typename Fz>
__device__ __forceinline__ void carve_vk_fused(const typename Fz::Param& prm, const Geometry& geo, const StageSmem& sm,
                                               int K, int RT, FusedSmem& fs, FusedShare& share) {
  if constexpr (Fz::kOn) {
    const Problem& p = Fz::step(prm);
    share = fused_share(K, static_cast<int>(p.HV / p.H), geo.tiles, RT, static_cast<int>(prm.L),
                        static_cast<int>(prm.W), static_cast<int>(p.T), geo.conv_cm);
    fs = carve_fused(share, sm.v + sm.chunk * RT, static_cast<int>(p.T), RT, static_cast<int>(prm.W), Fz::kNorm);
  }
}

// kDirect: the direct variant of vk_token (bf16 q, k, v, host-checked; RR <= 2). Fz: the
// fused step (fused.cuh; its parameter is a FusedProblem). kSr: the stochastic-rounding store
// path compiled in (vk_launch.cuh, launch_vk_k, says why a call without a rounding seed takes
// kernels without it).
template <typename S, int K, int RR, bool kDirect = false, typename Fz = NoFuse, bool kSr = true>
__global__ void __launch_bounds__(kVkThreads, kVkTileMinBlocks<RR>)
    decode_vk_tile_kernel(const __grid_constant__ typename Fz::Param prm, const Geometry geo) {
  static_assert(RR == 1 || RR == 2 || RR == 4);
  static_assert(RR <= K / 16, "VkShape: at most L rows per thread");
  static_assert(!kDirect || RR <= 2);
  using Sh = VkShape<S, K, 1>;
  constexpr int VE = Sh::VE, E = Sh::E, NV = Sh::NV, L = Sh::L, G = Sh::G;
  const Problem& p = Fz::step(prm);
  const int RT = geo.tile_rows;

  extern __shared__ float4 smem4[];
  S* const tile_s = reinterpret_cast<S*>(smem4);
  const StageSmem sm = carve_smem(reinterpret_cast<float*>(smem4),
                                  RT * K * static_cast<int>(sizeof(S)) / 4, geo, K, RT);
  FusedSmem fs;
  FusedShare share;
  carve_vk_fused<Fz>(prm, geo, sm, K, RT, fs, share);

  const int tid = threadIdx.x;
  const int group = tid / L;
  const int j = tid % L;
  const BlockCoords bc = block_coords(p, geo);
  const int tile = bc.tile;
  const int64_t hv = bc.hv, n = bc.n;
  const int64_t row0 = static_cast<int64_t>(tile) * RT;
  const int T = static_cast<int>(p.T);  // <= geo.chunk (host-checked)

  WarpSlots slots;
  if (!vk_tile_begin<S, K, false, NoWork, kDirect, Fz>(prm, geo, sm, tile_s, bc, row0, RT, slots, NoWork{}, &fs,
                                                       &share))
    return;
  const auto* const vbase = staged_v_rows<K, kDirect>(sm);

  for (int i = 0; i < RT / G; i += RR) {  // RT is a multiple of G * RR
    const int lr = i * G + group;        // local row of r = 0
    float st[RR][E];
#pragma unroll
    for (int r = 0; r < RR; ++r) {
#pragma unroll
      for (int v = 0; v < NV; ++v)
        load_state_vec<S, true>(tile_s + (lr + r * G) * K + (v * L + j) * VE, &st[r][v * VE]);
    }
    float gam_acc = 1.f;
    for (int t = 0; t < T; ++t) {
      // Lazy decay at four rows per thread only: at smaller grids the second loop body cost
      // more in instruction fetch than it saved (B = 1, T = 1: +0.27 us).
      if constexpr (VkReduce<K, RR>::kIssueBound) {
        for (const int e = vk_lazy_end(p, sm, t, T); t < e; ++t)
          vk_step<S, K, RR, true, true, 0, float, Fz::kNorm, kSr>(p, slots, n, hv, t, row0 + lr, j, st, gam_acc,
                                                             sm, t, vbase + t * RT + lr, fs.o, row0, RT);
      }
      vk_step<S, K, RR, true, false, kDirect ? VE : 0, std::remove_cv_t<std::remove_pointer_t<decltype(vbase)>>,
              Fz::kNorm, kSr>(p, slots, n, hv, t, row0 + lr, j, st, gam_acc, sm, t, vbase + t * RT + lr, fs.o, row0,
                              RT);
    }
  }
  if constexpr (Fz::kOn)
    fused_finish<kVkThreads, Fz::kNorm>(prm, geo, share, fs, n, hv, tile, row0, RT, T);
}

// N consecutive state elements in shared memory (N * sizeof(S) bytes, aligned to that), as fp32,
// in one access.
template <typename S, int N>
struct alignas(N * sizeof(S)) StateCols {
  S e[N];
};
template <typename S, int N>
__device__ __forceinline__ void load_cols(const S* src, float (&out)[N]) {
  if constexpr (sizeof(S) == 2 && N % 2 == 0) {  // two per 32-bit word, as load_state_vec unpacks
    const StateCols<uint32_t, N / 2> w = *reinterpret_cast<const StateCols<uint32_t, N / 2>*>(src);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) unpack2(w.e[i], static_cast<S*>(nullptr), out + 2 * i);
  } else {
    const StateCols<S, N> c = *reinterpret_cast<const StateCols<S, N>*>(src);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_f32(c.e[i]);
  }
}
template <typename S, int N>
__device__ __forceinline__ void store_cols(S* dst, const float (&in)[N]) {
  StateCols<S, N> c;
#pragma unroll
  for (int i = 0; i < N; ++i) c.e[i] = from_f32<S>(in[i]);
  *reinterpret_cast<StateCols<S, N>*>(dst) = c;
}

// Whether decode_kv_vt_kernel stores the state straight from registers (head dim K, rr rows per
// thread, elem_bytes per state element): where a warp's store instruction covers whole 32-byte
// sectors of each row k it touches, its 32 / L groups holding 32 / L * rr consecutive columns (at
// K = 128: fp32 rr >= 2, 16-bit rr = 4). Else through the tile. plan_kv_vt admits the cache and
// per-token slots only where it does.
__host__ __device__ constexpr bool kv_vt_stores_direct(int K, int rr, int elem_bytes) {
  return 32 / (K / 16) * rr * elem_bytes >= 32;
}

// ---------------------------------------------------------------------------------------
// The KV layout through the VK token loop (plan_kv_vt, decode_cuda.cu): KV and VK hold the
// same matrix, and in shared memory the transpose is a layout. A block owns RT columns v (VK's
// rows) of one (n, hv): vk_tile_begin copies them, K rows k of RT elements, into a KvVtTile
// (16-byte pieces, swizzled); each thread reads its RR consecutive columns' K-slices out of it
// (one RR * sizeof(S)-byte read per k) and runs decode_vk_tile_kernel's token loop on them
// unchanged (lazy decay, reduce-scatter, direct variant). Where a warp's store covers whole
// sectors of each row k (kStoreDirect) the state goes straight from registers to the write slot,
// and the intermediate cache and per-token slots with it; else the final state goes back into
// the tile and the block stores whole 128-byte lines of each row k after a barrier. The KV tile
// kernel's token instead reduces over k across warps through shared memory, one barrier per
// token (kv.cuh). No stochastic rounding; the planner checks that and the stores. Against VK's
// kernel it costs the tile's copy-in by 16-byte cp.async (VK's is one bulk copy) and the stores'
// address arithmetic (at 16 bits also twice VK's store instructions): 1.04-1.40x the time of
// VK's tile kernel at fp32, 1.15-1.43x at bf16 (H200, docs/design.md), so the planner takes it
// only where the other KV kernels are slower still (kv_vt_pays).
// ---------------------------------------------------------------------------------------
// Fz: the fused step (fused.cuh), as decode_vk_tile_kernel's; only where the state is stored
// from registers (the tile pass would need the block after fused_finish's cluster barrier).
template <typename S, int K, int RR, bool kDirect = false, typename Fz = NoFuse>
__global__ void __launch_bounds__(kVkThreads, kVkTileMinBlocks<RR>)
    decode_kv_vt_kernel(const __grid_constant__ typename Fz::Param prm, const Geometry geo) {
  static_assert(RR == 1 || RR == 2 || RR == 4);
  static_assert(RR <= K / 16, "VkShape: at most L rows per thread");
  static_assert(!kDirect || RR <= 2);
  static_assert(!Fz::kOn || (!kDirect && kv_vt_stores_direct(K, RR, sizeof(S))),
                "the fused step: stores from registers");
  using Sh = VkShape<S, K, 1>;
  constexpr int VE = Sh::VE, E = Sh::E, NV = Sh::NV, L = Sh::L, G = Sh::G;
  const Problem& p = Fz::step(prm);
  const int RT = geo.tile_rows;

  extern __shared__ float4 smem4[];
  S* const tile_s = reinterpret_cast<S*>(smem4);
  const StageSmem sm = carve_smem(reinterpret_cast<float*>(smem4),
                                  RT * K * static_cast<int>(sizeof(S)) / 4, geo, K, RT);
  FusedSmem fs;
  FusedShare share;
  carve_vk_fused<Fz>(prm, geo, sm, K, RT, fs, share);
  const int tid = threadIdx.x;
  const int group = tid / L;
  const int j = tid % L;
  const BlockCoords bc = block_coords(p, geo);
  const int64_t hv = bc.hv, n = bc.n;
  const int64_t row0 = static_cast<int64_t>(bc.tile) * RT;
  const int T = static_cast<int>(p.T);

  WarpSlots slots;
  if (!vk_tile_begin<S, K, false, NoWork, kDirect, Fz, true>(prm, geo, sm, tile_s, bc, row0, RT, slots, NoWork{}, &fs,
                                                             &share))
    return;
  const auto* const vbase = staged_v_rows<K, kDirect>(sm);
  using VIn = std::remove_cv_t<std::remove_pointer_t<decltype(vbase)>>;
  const int64_t wslot = warp_token_write_slot(p, slots, n, T - 1);  // uniform: one row per block
  // The final state straight from registers, as decode_vk_tile_kernel stores it; else the final
  // state back into the tile, then whole lines of each row k after a barrier.
  constexpr bool kStoreDirect = kv_vt_stores_direct(K, RR, static_cast<int>(sizeof(S)));

  // A thread's RR rows are RR consecutive columns lr.., so that one shared-memory access along v
  // (RR * sizeof(S) bytes: 16 at fp32 RR = 4) moves element k of all of them: as many accesses
  // as decode_vk_tile_kernel's 16-byte ones at fp32 RR = 4 (RS = 1 in the token loop).
  for (int i = 0; i < RT / (G * RR); ++i) {
    const int lr = (i * G + group) * RR;
    float st[RR][E];
    // The thread's RR columns of every row k it holds: those of K-element (v * L + j) * VE + e
    // to first(v) + e * step. A running pointer over the VE rows k: computed per store, the
    // 64-bit address took an IMAD.WIDE, LEAs and a shift each (SASS: 188 -> ~105 instructions per
    // store of the state).
    const auto store_st_cols = [&](auto first, int64_t step) {
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        S* q = first(v);
#pragma unroll
        for (int e = 0; e < VE; ++e, q += step) {
          float x[RR];
#pragma unroll
          for (int r = 0; r < RR; ++r) x[r] = st[r][v * VE + e];
          store_cols<S, RR>(q, x);
        }
      }
    };
    // To base + k * ks (KV: rows k, v contiguous).
    const auto store_state_cols = [&](S* base, int64_t ks) {
      store_st_cols([&](int v) { return base + static_cast<int64_t>((v * L + j) * VE) * ks; }, ks);
    };
    // The tile's row length passes through an empty asm before the loads and again after the
    // tokens, so the store-back computes its addresses anew: without the two, the addresses of
    // the loads held their registers across the token loop (ptxas, K = 128, RR = 4: 168 bytes of
    // spills at fp32, 56 at bf16 in the scalar form; none with them, as decode_vk_tile_kernel).
    int rt_ld = RT;
    asm volatile("" : "+r"(rt_ld));
    const KvVtTile<S> tl(tile_s, rt_ld);
#pragma unroll
    for (int v = 0; v < NV; ++v) {
#pragma unroll
      for (int e = 0; e < VE; ++e) {
        float x[RR];
        load_cols<S, RR>(tl.elem(lr, v * L + j, e), x);
#pragma unroll
        for (int r = 0; r < RR; ++r) st[r][v * VE + e] = x[r];
      }
    }
    float gam_acc = 1.f;
    for (int t = 0; t < T; ++t) {
      if constexpr (VkReduce<K, RR>::kIssueBound) {
        for (const int e = vk_lazy_end(p, sm, t, T); t < e; ++t)
          vk_step<S, K, RR, true, true, 0, float, Fz::kNorm, false, 1>(p, slots, n, hv, t, row0 + lr, j, st, gam_acc,
                                                                      sm, t, vbase + t * RT + lr, fs.o, row0, RT);
      }
      // The literal step with the output only (with the fused step's norm, into fs.o); the state
      // goes out below, by columns.
      float o[VkReduce<K, RR>::C];
      vk_token<K, RR, false, kDirect ? VE : 0, VIn, 1>(p, st, gam_acc, sm, t, j, vbase + t * RT + lr, o);
      vk_store_token<S, K, RR, true, true, Fz::kNorm, false, 1>(p, -1, 0, n, hv, t, row0 + lr, j, st, o, fs.o, row0,
                                                                RT);
      if constexpr (kStoreDirect) {
        // The intermediate cache and the per-token slots (plan_kv_vt: the direct store only); then
        // every token is literal (vk_lazy_end). The last token's slot is the final store below.
        if (stores_token_states(p)) {
          if (p.inter.data != nullptr)
            store_state_cols(static_cast<S*>(p.inter.data) + n * p.inter.s[0] + t * p.inter.s[1] +
                                 hv * p.inter.s[2] + row0 + lr,
                             p.inter.s[3]);
          const int64_t ws = warp_token_write_slot(p, slots, n, t);
          if (t < T - 1 && ws >= 0)
            store_state_cols(static_cast<S*>(p.state.data) + ws * p.state.s[0] + hv * p.state.s[1] + row0 + lr,
                             p.state.s[2]);
        }
      }
    }
    if constexpr (kStoreDirect) {
      if (wslot >= 0)
        store_state_cols(static_cast<S*>(p.state.data) + wslot * p.state.s[0] + hv * p.state.s[1] + row0 + lr,
                         p.state.s[2]);
    } else if (wslot >= 0) {
      int rt_st = RT;
      asm volatile("" : "+r"(rt_st) : "f"(st[0][0]));
      const KvVtTile<S> ts(tile_s, rt_st);
      store_st_cols([&](int v) { return ts.elem(lr, v * L + j, 0); }, rt_st);
    }
  }
  if constexpr (Fz::kOn) {  // (kStoreDirect: the static_assert above)
    fused_finish<kVkThreads, Fz::kNorm>(prm, geo, share, fs, n, hv, bc.tile, row0, RT, T);
    return;
  }
  if (kStoreDirect || wslot < 0) return;
  __syncthreads();  // every column's final state in the tile
  const KvVtTile<S> tile(tile_s, RT);
  S* const dst = static_cast<S*>(p.state.data) + wslot * p.state.s[0] + hv * p.state.s[1] + row0;
  kv_tile_store<VE>(tid, K, RT, tile_extent(p.V, row0, RT), dst, p.state.s[2],
                    [&](int c, int k) { return tile.piece(c, k); });
}

}  // namespace gdn::detail::cuda
