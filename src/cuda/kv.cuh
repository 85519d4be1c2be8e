// KV layout ([P, HV, K, V], V contiguous).
//
// A block owns VT = LV * VE consecutive value columns (LV = 8 lanes x one 16-byte vector, a
// full 128-byte line per state row; LV = 4 in the small-grid 16-bit tile variant, KvTileWide)
// and all K rows. Its kThreads/LV "k-groups" each hold RPT rows (interleaved: row = i*KG + kg,
// so a warp instruction reads 32/LV consecutive rows, LV * 16 bytes of each). Per token:
// partial dot(S[:, c], k) and dot(S[:, c], q) over the thread's rows, an xor-shuffle over the
// warp's k-groups, a cross-warp sum through
// shared memory (double-buffered by token parity: one __syncthreads per token), then the same
// rewritten update as VK: delta[c] = beta*(v[c] - g*sk[c]); o[c] = g*sq[c] + delta[c]*kq;
// S[k, c] = g*S[k, c] + delta[c]*kh[k].
#pragma once

#include "common.cuh"
#include "fused.cuh"
#include "vk_chunk.cuh"

namespace gdn::detail::cuda {

template <typename S, int K, int NTh = (sizeof(S) == 4 ? 128 : 256), int LVn = 8>
struct KvShape {
  static constexpr int VE = kVecElems<S>;
  static constexpr int LV = LVn;                     // lanes along V
  static constexpr int VT = LV * VE;                 // columns per block
  static constexpr int kThreads = NTh;
  static constexpr int NW = kThreads / 32;
  static constexpr int KGW = 32 / LV;                // k-groups per warp
  static constexpr int KG = kThreads / LV;           // k-groups per block
  static constexpr int RPT = K / KG;                 // rows per thread
  static constexpr int RED = 2 * VE + 4;             // padded partials per lane (bank spread)
  static_assert(K % KG == 0 && RPT >= 1);

  // q/k of row k at (k % KG) * RPT + k / KG: a thread's RPT rows are contiguous.
  struct Pos {
    __device__ __forceinline__ int operator()(int e) const { return (e % KG) * RPT + e / KG; }
  };

  // Shared memory floats beyond the staged tokens: the double-buffered partial sums.
  static constexpr int kRedFloats = 2 * NW * LV * RED;
};

template <int N>
__device__ __forceinline__ void load_smem_row(const float* src, float* dst) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 a = reinterpret_cast<const float4*>(src)[i];
      dst[4 * i] = a.x, dst[4 * i + 1] = a.y, dst[4 * i + 2] = a.z, dst[4 * i + 3] = a.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 a = reinterpret_cast<const float2*>(src)[i];
      dst[2 * i] = a.x, dst[2 * i + 1] = a.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = src[i];
  }
}

// Cross-thread sum of the partial dot products (shared by both KV kernels): an xor-shuffle
// over the warp's k-groups, then across warps through shared memory (double-buffered by
// token parity: one barrier per token). Every thread of the block must call it.
template <typename Sh>
__device__ __forceinline__ void kv_reduce(float* s_red, int buf, int warp, int vl, int kgw,
                                          float (&sk)[Sh::VE], float (&sq)[Sh::VE]) {
  constexpr int VE = Sh::VE, LV = Sh::LV, NW = Sh::NW, RED = Sh::RED;
#pragma unroll
  for (int off = LV; off < 32; off <<= 1) {
#pragma unroll
    for (int c = 0; c < VE; ++c) {
      sk[c] += __shfl_xor_sync(0xffffffffu, sk[c], off);
      sq[c] += __shfl_xor_sync(0xffffffffu, sq[c], off);
    }
  }
  float* red = s_red + buf * (NW * LV * RED);
  if (kgw == 0) {
    float4* dst = reinterpret_cast<float4*>(red + (warp * LV + vl) * RED);
#pragma unroll
    for (int c = 0; c < VE; c += 4) {
      dst[c / 4] = make_float4(sk[c], sk[c + 1], sk[c + 2], sk[c + 3]);
      dst[(VE + c) / 4] = make_float4(sq[c], sq[c + 1], sq[c + 2], sq[c + 3]);
    }
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < VE; ++c) sk[c] = sq[c] = 0.f;
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    const float4* src = reinterpret_cast<const float4*>(red + (w * LV + vl) * RED);
#pragma unroll
    for (int c = 0; c < VE; c += 4) {
      const float4 a = src[c / 4];
      const float4 b = src[(VE + c) / 4];
      sk[c] += a.x, sk[c + 1] += a.y, sk[c + 2] += a.z, sk[c + 3] += a.w;
      sq[c] += b.x, sq[c + 1] += b.y, sq[c + 2] += b.z, sq[c + 3] += b.w;
    }
  }
}

// delta (times rk) and o of token t for VE columns: delta = beta*(v - g*sk),
// o = g*sq + delta*kq; dk = delta*rk is what the update adds per unit of k.
template <int VE>
__device__ __forceinline__ void kv_delta(const StageSmem& sm, int t, const float* vcol,
                                         const float (&sk)[VE], const float (&sq)[VE],
                                         float (&o)[VE], float (&dk)[VE], float& g) {
  const float4 sc = reinterpret_cast<const float4*>(sm.tok + t * kTokScalars)[0];
  const float rqs = sc.x, rk = sc.y, kq = sc.z;
  g = sc.w;
  const float beta = sm.tok[t * kTokScalars + 4];
#pragma unroll
  for (int c = 0; c < VE; ++c) {
    const float delta = beta * (vcol[c] - g * (sk[c] * rk));
    o[c] = g * (sq[c] * rqs) + delta * kq;
    dk[c] = delta * rk;
  }
}

// The stores of one token's updated rows held in registers (row i * KG + kg in st[i], VE columns
// from col): to the cache (inter) and to the token's write slot (wslot: warp_token_write_slot),
// either or both. Stochastic rounding: element (k, v) is e = k * V + v. Shared by the general KV
// kernel and the group kernel (group.cuh); kVec: 16-byte stores.
template <typename S, bool kVec, bool kSr, int KG, int RPT, int VE>
__device__ __forceinline__ void kv_store_rows(const Problem& p, const WarpSlots& slots, int64_t n, int64_t tt,
                                              int64_t hv, int64_t col, int64_t wslot, int kg,
                                              const float (&st)[RPT][VE]) {
  const bool to_inter = p.inter.data != nullptr;
  if (!to_inter && wslot < 0) return;
  S* const inter = static_cast<S*>(p.inter.data);
  S* const state = static_cast<S*>(p.state.data);
  const bool sr = kSr && p.rounding_seed != nullptr;
  const uint32_t key = sr ? sr_key(slots.sr_row, hv, tt) : 0u;
  // One destination at a time (cache, then pool), from one base pointer and a row step, as
  // vk_store_token does: with both interleaved each store recomputed its two 64-bit addresses
  // and reused the previous store's registers, and the warps waited there (docs/design.md, "The
  // group kernel's barriers and stores").
  const auto store_rows = [&](S* base, int64_t rs) {
    const int64_t step = KG * rs;
#pragma unroll
    for (int i = 0; i < RPT; ++i)
      store_state_vec<S, kVec>(base + i * step,
                               round_state_vec<S>(st[i], sr, key, static_cast<int64_t>(i * KG + kg) * p.V + col));
  };
  if (to_inter)
    store_rows(inter + n * p.inter.s[0] + tt * p.inter.s[1] + hv * p.inter.s[2] + kg * p.inter.s[3] + col,
               p.inter.s[3]);
  if (wslot >= 0)
    store_rows(state + wslot * p.state.s[0] + hv * p.state.s[1] + kg * p.state.s[2] + col, p.state.s[2]);
}

template <int VE>
__device__ __forceinline__ void kv_store_o(const Problem& p, int64_t n, int64_t tt, int64_t hv,
                                           int64_t col, const float (&o)[VE]) {
  const int64_t ob = n * p.o.s[0] + tt * p.o.s[1] + hv * p.o.s[2] + col;
#pragma unroll
  for (int c = 0; c < VE; ++c) store_scalar(p.o.data, p.o.dtype, ob + c, o[c]);
}

// Tokens t0 .. t0 + tc - 1 of the thread's RPT rows (i * KG + kg) of VE columns from col, held
// in registers (st): partial dot products, kv_reduce, kv_delta, the update, the output and the
// stores. Shared by the general KV kernel and the group kernel (group.cuh). sm: q and k at
// Sh::Pos and the head's token scalars, chunk token t at t; vcol: v of the thread's columns, chunk
// token t at + t * vstride; o_head (kNorm): the head's raw outputs [T][V], written instead of o;
// col_ok: the columns are in range. par: kv_reduce's buffer parity, carried across calls, since no
// barrier separates one call's last token from the next call's first.
template <typename Sh, typename S, bool kVec, bool kNorm, bool kSr>
__device__ __forceinline__ void kv_tokens(const Problem& p, const WarpSlots& slots, int64_t n, int64_t t0, int tc,
                                          int64_t hv, int64_t col, bool col_ok, float (&st)[Sh::RPT][Sh::VE],
                                          const StageSmem& sm, const float* vcol, int vstride, float* o_head,
                                          float* red, int& par, int warp, int vl, int kgw, int kg) {
  constexpr int VE = Sh::VE, RPT = Sh::RPT;
  constexpr int K = RPT * Sh::KG;
  for (int t = 0; t < tc; ++t, par ^= 1) {
    const int64_t tt = t0 + t;
    float qv[RPT], kv[RPT];
    load_smem_row<RPT>(sm.q + t * K + kg * RPT, qv);
    load_smem_row<RPT>(sm.k + t * K + kg * RPT, kv);
    float sk[VE], sq[VE];
#pragma unroll
    for (int c = 0; c < VE; ++c) sk[c] = sq[c] = 0.f;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
#pragma unroll
      for (int c = 0; c < VE; ++c) {
        sk[c] = fmaf(st[i][c], kv[i], sk[c]);
        sq[c] = fmaf(st[i][c], qv[i], sq[c]);
      }
    }
    kv_reduce<Sh>(red, par, warp, vl, kgw, sk, sq);
    float o[VE], dk[VE], g;
    kv_delta<VE>(sm, t, vcol + t * vstride, sk, sq, o, dk, g);
    // k again rather than held across the reduction: holding it cost the group kernel's
    // stochastic-rounding variant 52 bytes of spills.
    load_smem_row<RPT>(sm.k + t * K + kg * RPT, kv);
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
#pragma unroll
      for (int c = 0; c < VE; ++c) st[i][c] = fmaf(g, st[i][c], dk[c] * kv[i]);
    }
    if (kg == 0 && col_ok) {
      if constexpr (kNorm) {
#pragma unroll
        for (int c = 0; c < VE; c += 4)
          *reinterpret_cast<float4*>(o_head + tt * p.V + col + c) = make_float4(o[c], o[c + 1], o[c + 2], o[c + 3]);
      } else {
        kv_store_o<VE>(p, n, tt, hv, col, o);
      }
    }
    const int64_t wslot = warp_token_write_slot(p, slots, n, tt);  // every lane
    if (col_ok) kv_store_rows<S, kVec, kSr, Sh::KG>(p, slots, n, tt, hv, col, wslot, kg, st);
  }
}

// kSr: the stochastic-rounding store path compiled in (vk_launch.cuh, launch_vk_k, says why a
// call without a rounding seed takes kernels without it).
template <typename S, int K, bool kVec, bool kSr = true>
__global__ void __launch_bounds__(KvShape<S, K>::kThreads)
    decode_kv_kernel(const __grid_constant__ Problem p, const Geometry geo) {
  using Sh = KvShape<S, K>;
  constexpr int VE = Sh::VE, LV = Sh::LV, VT = Sh::VT, NT = Sh::kThreads;
  constexpr int KGW = Sh::KGW, KG = Sh::KG, RPT = Sh::RPT;

  extern __shared__ float4 smem4[];
  float* s_red = reinterpret_cast<float*>(smem4);
  const StageSmem sm = carve_smem(s_red, Sh::kRedFloats, geo, K, VT);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid / 32;
  const int vl = lane % LV;
  const int kgw = lane / LV;
  const int kg = warp * KGW + kgw;
  const BlockCoords bc = block_coords(p, geo);
  const int tile = bc.tile;
  const int64_t hv = bc.hv, n = bc.n;
  const int64_t c0 = static_cast<int64_t>(tile) * VT;
  const int64_t col = c0 + vl * VE;  // this lane's first column
  const bool col_ok = col < p.V;     // V is a multiple of VE, so the whole vector is in range

  pdl_wait();
  pdl_launch_dependents();

  const WarpSlots slots = resolve_row_warp(p, n, lane);
  if (slots.read < 0) {
    finish_padded_row<NT>(p, slots, n, hv, tile, c0, VT);
    return;
  }

  int tc = static_cast<int>(p.T < geo.chunk ? p.T : geo.chunk);
  stage_issue<NT>(p, geo, sm, n, 0, tc, hv, c0, VT);

  const int64_t ss0 = p.state.s[0], ss1 = p.state.s[1], ss2 = p.state.s[2];
  S* const state = static_cast<S*>(p.state.data);
  float st[RPT][VE];
  {
    const S* src = state + slots.read * ss0 + hv * ss1 + col;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      if (col_ok) {
        load_state_vec<S, kVec>(src + static_cast<int64_t>(i * KG + kg) * ss2, st[i]);
      } else {
#pragma unroll
        for (int c = 0; c < VE; ++c) st[i][c] = 0.f;
      }
    }
  }

  int buf = 0;
  for (int64_t t0 = 0; t0 < p.T; t0 += geo.chunk) {
    if (t0 > 0) {
      tc = static_cast<int>(p.T - t0 < geo.chunk ? p.T - t0 : geo.chunk);
      __syncthreads();  // the previous chunk's readers are done with shared memory
      stage_issue<NT>(p, geo, sm, n, t0, tc, hv, c0, VT);
    }
    stage_gates<NT>(p, sm, n, t0, tc, hv);
    cp_async_wait_all();
    __syncthreads();
    stage_convert<K, NT>(p, geo, sm, tc, VT, typename Sh::Pos{});
    __syncthreads();

    kv_tokens<Sh, S, kVec, false, kSr>(p, slots, n, t0, tc, hv, col, col_ok, st, sm, sm.v + vl * VE, VT, nullptr,
                                       s_red, buf, warp, vl, kgw, kg);
  }
}

// ---------------------------------------------------------------------------------------
// Tile path (16-byte state, T <= kMaxChunk): the block's K x VT state tile (one 128-byte line
// per row) is copied into shared memory by 16-byte cp.async right after the slot is
// resolved (q, k, v copies issued before the slot load), so bytes in flight do not depend on
// registers; 64-thread blocks keep ~10 tiles per SM. Thread (k-group kg, lane column vl)
// owns rows i*KG + kg of columns [vl*VE, +VE) and only ever touches those elements in shared
// memory, so tokens need no barrier beyond the reduction's. Per token: pass 1 reads its rows
// for the partial dots; pass 2 re-reads them, updates, stores to global (cache / pool) and,
// if another token follows, writes the fp32 state back (in place for fp32; into an fp32
// work tile for 16-bit states, so the state is never rounded between tokens).
// ---------------------------------------------------------------------------------------
constexpr int kKvTileThreads = 64;
// The wide variant for grids that leave most of the GPU idle (kv_tile_wide, decode_cuda.cu):
// four rows per thread (the unroll of the row loops) instead of K / 8. fp32: four times the
// threads on the same tile (128 at K = 64). 16-bit: tiles half as wide (four lanes of 16 bytes
// along V, i.e. 64 bytes of each row: twice the blocks) with K threads.
template <typename S, int K>
struct KvTileWide {
  static constexpr int LV = sizeof(S) == 4 ? 8 : 4;
  static constexpr int NT = sizeof(S) == 4 ? (K >= 128 ? 256 : 128) : K;
};
// The fused step's fp32 fallback where a GVA group's tiles do not fit one cluster (V = 256 with
// four value heads per q/k head): 16 lanes of 16 bytes along V, tiles twice as wide as the
// narrow variant's, on 128 threads.
constexpr int kKvFusedLanes16Threads = 128;
#ifndef GDN_KV_TILE_MIN_BLOCKS
#define GDN_KV_TILE_MIN_BLOCKS 8
#endif

// Shared-memory floats of the tile path before the staging area (host and device agree).
template <typename S, int K, int NT, int LV>
__host__ __device__ constexpr int kv_tile_lead_floats(bool work) {
  using Sh = KvShape<S, K, NT, LV>;
  return Sh::kRedFloats + K * Sh::VT * static_cast<int>(sizeof(S)) / 4 +
         (work && sizeof(S) < 4 ? K * Sh::VT : 0);
}

template <typename S, int VE>
__device__ __forceinline__ void kv_tile_row(const S* tile_s, const float* work, int off,
                                            bool from_work, float (&x)[VE]) {
  if constexpr (sizeof(S) == 4) {
    load_state_vec<S, true>(tile_s + off, x);
  } else {
    if (from_work) {
#pragma unroll
      for (int c = 0; c < VE; c += 4) {
        const float4 a = *reinterpret_cast<const float4*>(work + off + c);
        x[c] = a.x, x[c + 1] = a.y, x[c + 2] = a.z, x[c + 3] = a.w;
      }
    } else {
      load_state_vec<S, true>(tile_s + off, x);
    }
  }
}

// NT threads and LV lanes along V: kKvTileThreads and 8, or KvTileWide (same register cap).
// Fz: the fused step (fused.cuh; its parameter is a FusedProblem).
template <typename S, int K, int NT, int LVn, typename Fz = NoFuse, bool kSr = true>
__global__ void __launch_bounds__(NT, GDN_KV_TILE_MIN_BLOCKS * kKvTileThreads / NT)
    decode_kv_tile_kernel(const __grid_constant__ typename Fz::Param prm, const Geometry geo) {
  const Problem& p = Fz::step(prm);
  using Sh = KvShape<S, K, NT, LVn>;
  constexpr int VE = Sh::VE, LV = Sh::LV, VT = Sh::VT;
  constexpr int KGW = Sh::KGW, KG = Sh::KG, RPT = Sh::RPT;
  static_assert(RPT % 4 == 0);
  const int T = static_cast<int>(p.T);  // <= geo.chunk (host-checked)
  const bool work_on = sizeof(S) < 4 && T > 1;

  extern __shared__ float4 smem4[];
  float* const s_red = reinterpret_cast<float*>(smem4);
  S* const tile_s = reinterpret_cast<S*>(s_red + Sh::kRedFloats);
  float* const work = s_red + kv_tile_lead_floats<S, K, NT, LVn>(false);  // valid only if work_on
  const StageSmem sm = carve_smem(s_red, kv_tile_lead_floats<S, K, NT, LVn>(work_on), geo, K, VT);
  FusedSmem fs;
  FusedShare share;
  if constexpr (Fz::kOn) {
    share = fused_share(K, static_cast<int>(p.HV / p.H), geo.tiles, VT, static_cast<int>(prm.L),
                        static_cast<int>(prm.W), T, geo.conv_cm);
    fs = carve_fused(share, sm.v + sm.chunk * VT, T, VT, static_cast<int>(prm.W), Fz::kNorm);
  }

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid / 32;
  const int vl = lane % LV;
  const int kgw = lane / LV;
  const int kg = warp * KGW + kgw;
  const BlockCoords bc = block_coords(p, geo);
  const int tile = bc.tile;
  const int64_t hv = bc.hv, n = bc.n;
  const int64_t c0 = static_cast<int64_t>(tile) * VT;
  const int64_t col = c0 + vl * VE;
  const bool col_ok = col < p.V;

  warm_params(prm);
  if (geo.prefetch) prefetch_state_l2(p, n, hv, 0, K, c0, VT * static_cast<int>(sizeof(S)), tid, NT);
  if constexpr (Fz::kOn) {
    fused_started();
    fused_share_block(share, hv);
  }
  // The addresses that depend only on the parameters and the block: computed while the block
  // waits (stage_plan; as the VK tile prologue, vk_tile_begin).
  StagePlan plan;
  if constexpr (!Fz::kOn) {
    plan = stage_plan(p, geo, sm, n, 0, T, hv, c0, VT);
    stage_plan_pin(plan);
  }
  S* const state = static_cast<S*>(p.state.data);
  const S* head_src = state + hv * p.state.s[1] + c0;  // the tile's columns of every row k
  int64_t ss0 = p.state.s[0], ss2 = p.state.s[2];
  asm volatile("" : "+l"(head_src), "+l"(ss0), "+l"(ss2));
  pdl_wait();
  pdl_launch_dependents();

  if constexpr (!Fz::kOn) {
    stage_issue_plan<NT>(plan);
  } else {
    fused_issue_inputs<NT, Fz::kNorm>(prm, geo, share, fs, n, hv, c0, VT, T);
  }
  cp_async_commit();
  const GateInputs gates = stage_gates_load<NT>(p, n, 0, T, hv);

  const WarpSlots slots = resolve_row_warp(p, n, lane);
  if (slots.read < 0) {
    cp_async_wait_all();  // no copy may land in shared memory after the block has exited
    finish_padded_row<NT>(p, slots, n, hv, tile, c0, VT);
    return;
  }
  if constexpr (Fz::kOn) {  // the conv's state columns first: small, and needed first
    fused_issue_state<NT>(prm, geo, share, fs, slots, n, hv, c0);
    cp_async_commit();
  }

  const int64_t ss1 = p.state.s[1];
  {
    // K rows of LV pieces, as the VK tiles walk theirs (tile_piece_walk).
    static_assert(NT % LV == 0, "tile_piece_walk: a row's pieces divide the block");
    const int vin = tile_extent(p.V, c0, VT);
    tile_piece_walk<VE>(tid, NT, K, LV, head_src + slots.read * ss0, ss2, [&](int r, int c, const S* g) {
      cp_async16_or_zero(tile_s + r * VT + c * VE, g, c * VE < vin);
    });
    cp_async_commit();
  }

  stage_gates_store<NT>(p, sm, T, gates);
  if constexpr (Fz::kOn) {
    fused_prologue<NT, Fz::kNorm>(prm, geo, share, sm, fs, n, hv, c0, VT, T, slots.read);
    stage_convert_t<K, NT, float, false>(p, geo, sm, T, VT, typename Sh::Pos{});
  } else {
    cp_async_wait_group<1>();  // q, k, v landed (the state may still be in flight)
    __syncthreads();
    stage_convert<K, NT>(p, geo, sm, T, VT, typename Sh::Pos{});
  }
  cp_async_wait_group<0>();
  __syncthreads();

  S* const inter = static_cast<S*>(p.inter.data);
  for (int t = 0; t < T; ++t) {
    const bool from_work = t > 0;  // 16-bit states: fp32 copy after the first token
    const float* qrow = sm.q + t * K + kg * RPT;
    const float* krow = sm.k + t * K + kg * RPT;
    float sk[VE], sq[VE];
#pragma unroll
    for (int c = 0; c < VE; ++c) sk[c] = sq[c] = 0.f;
#pragma unroll 4
    for (int i = 0; i < RPT; i += 4) {
      float q4[4], k4[4];
      load_smem_row<4>(qrow + i, q4);
      load_smem_row<4>(krow + i, k4);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        float x[VE];
        kv_tile_row<S, VE>(tile_s, work, ((i + u) * KG + kg) * VT + vl * VE, from_work, x);
#pragma unroll
        for (int c = 0; c < VE; ++c) {
          sk[c] = fmaf(x[c], k4[u], sk[c]);
          sq[c] = fmaf(x[c], q4[u], sq[c]);
        }
      }
    }
    kv_reduce<Sh>(s_red, t & 1, warp, vl, kgw, sk, sq);
    float o[VE], dk[VE], g;
    kv_delta<VE>(sm, t, sm.v + t * VT + vl * VE, sk, sq, o, dk, g);
    if (kg == 0 && col_ok) {
      if constexpr (Fz::kNorm) {
#pragma unroll
        for (int c = 0; c < VE; ++c) fs.o[t * VT + vl * VE + c] = o[c];
      } else {
        kv_store_o<VE>(p, n, t, hv, col, o);
      }
    }

    const int64_t wslot = warp_token_write_slot(p, slots, n, t);
    const bool to_global = col_ok && (inter != nullptr || wslot >= 0);
    const bool keep = t + 1 < T;
    if (!to_global && !keep) continue;
    const int64_t ib = n * p.inter.s[0] + t * p.inter.s[1] + hv * p.inter.s[2] + col;
    const int64_t pb = wslot * ss0 + hv * ss1 + col;
    const bool sr = kSr && p.rounding_seed != nullptr && to_global;  // element (k, v): e = k * V + v
    const uint32_t key = sr ? sr_key(slots.sr_row, hv, t) : 0u;
#pragma unroll 4
    for (int i = 0; i < RPT; i += 4) {
      float k4[4];
      load_smem_row<4>(krow + i, k4);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int row = (i + u) * KG + kg;
        const int off = row * VT + vl * VE;
        float x[VE];
        kv_tile_row<S, VE>(tile_s, work, off, from_work, x);
#pragma unroll
        for (int c = 0; c < VE; ++c) x[c] = fmaf(g, x[c], dk[c] * k4[u]);
        if (to_global) {
          const Packed<S> pk = round_state_vec<S>(x, sr, key, static_cast<int64_t>(row) * p.V + col);
          if (inter != nullptr) store_state_vec<S, true>(inter + ib + row * p.inter.s[3], pk);
          if (wslot >= 0) store_state_vec<S, true>(state + pb + row * ss2, pk);
        }
        if (keep) {
          float* const dst = sizeof(S) == 4 ? reinterpret_cast<float*>(tile_s) : work;
#pragma unroll
          for (int c = 0; c < VE; c += 4)
            *reinterpret_cast<float4*>(dst + off + c) = make_float4(x[c], x[c + 1], x[c + 2], x[c + 3]);
        }
      }
    }
  }
  if constexpr (Fz::kOn)
    fused_finish<NT, Fz::kNorm>(prm, geo, share, fs, n, hv, tile, c0, VT, T);
}

}  // namespace gdn::detail::cuda
