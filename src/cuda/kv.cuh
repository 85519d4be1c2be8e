// KV layout ([P, HV, K, V], V contiguous).
//
// A block owns VT = 8 * VE consecutive value columns (8 lanes x one 16-byte vector, a full
// 128-byte line per state row) and all K rows. Its kThreads/8 "k-groups" each hold RPT rows
// (interleaved: row = i*KG + kg, so a warp instruction reads 4 consecutive rows = 512
// contiguous bytes of a compact state). Per token: partial dot(S[:, c], k) and dot(S[:, c], q)
// over the thread's rows, an xor-shuffle over the warp's 4 k-groups, a cross-warp sum through
// shared memory (double-buffered by token parity: one __syncthreads per token), then the same
// rewritten update as VK: delta[c] = beta*(v[c] - g*sk[c]); o[c] = g*sq[c] + delta[c]*kq;
// S[k, c] = g*S[k, c] + delta[c]*kh[k].
#pragma once

#include "common.cuh"

namespace gdn::detail::cuda {

template <typename S, int K>
struct KvShape {
  static constexpr int VE = kVecElems<S>;
  static constexpr int LV = 8;                       // lanes along V
  static constexpr int VT = LV * VE;                 // columns per block
  static constexpr int kThreads = sizeof(S) == 4 ? 128 : 256;
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

template <typename S, int K, bool kVec>
__global__ void __launch_bounds__(KvShape<S, K>::kThreads)
    decode_kv_kernel(const __grid_constant__ Problem p, const Geometry geo) {
  using Sh = KvShape<S, K>;
  constexpr int VE = Sh::VE, LV = Sh::LV, VT = Sh::VT, NT = Sh::kThreads, NW = Sh::NW;
  constexpr int KGW = Sh::KGW, KG = Sh::KG, RPT = Sh::RPT, RED = Sh::RED;

  extern __shared__ float4 smem4[];
  float* s_red = reinterpret_cast<float*>(smem4);
  const StageSmem sm = carve_smem(s_red, Sh::kRedFloats, geo, K, VT);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid / 32;
  const int vl = lane % LV;
  const int kgw = lane / LV;
  const int kg = warp * KGW + kgw;
  int64_t bid = blockIdx.x;
  const int tile = static_cast<int>(bid % geo.tiles);
  bid /= geo.tiles;
  const int64_t hv = bid % p.HV;
  const int64_t n = bid / p.HV;
  const int64_t c0 = static_cast<int64_t>(tile) * VT;
  const int64_t col = c0 + vl * VE;  // this lane's first column
  const bool col_ok = col < p.V;     // V is a multiple of VE, so the whole vector is in range

  pdl_wait();
  pdl_launch_dependents();

  const WarpSlots slots = resolve_row_warp(p, n, lane);
  if (slots.read < 0) {
    if (slots.invalid && p.error_count != nullptr && hv == 0 && tile == 0 && tid == 0)
      atomicAdd(p.error_count, 1);
    zero_output<NT>(p, n, hv, c0, VT);
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

    for (int t = 0; t < tc; ++t, buf ^= 1) {
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

      const float4 sc = reinterpret_cast<const float4*>(sm.tok + t * kTokScalars)[0];
      const float rqs = sc.x, rk = sc.y, kq = sc.z, g = sc.w;
      const float beta = sm.tok[t * kTokScalars + 4];
      float o[VE], dk[VE];
#pragma unroll
      for (int c = 0; c < VE; ++c) {
        const float v = sm.v[t * VT + vl * VE + c];
        const float delta = beta * (v - g * (sk[c] * rk));
        o[c] = g * (sq[c] * rqs) + delta * kq;
        dk[c] = delta * rk;
      }
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
#pragma unroll
        for (int c = 0; c < VE; ++c) st[i][c] = fmaf(g, st[i][c], dk[c] * kv[i]);
      }
      if (kg == 0 && col_ok) {
        const int64_t ob = n * p.o.s[0] + tt * p.o.s[1] + hv * p.o.s[2] + col;
#pragma unroll
        for (int c = 0; c < VE; ++c) store_scalar(p.o.data, p.o.dtype, ob + c, o[c]);
      }

      const int64_t wslot = warp_token_write_slot(p, slots, n, tt);
      const bool to_inter = p.inter.data != nullptr;
      if (col_ok && (to_inter || wslot >= 0)) {
        S* const inter = static_cast<S*>(p.inter.data);
        const int64_t ib = n * p.inter.s[0] + tt * p.inter.s[1] + hv * p.inter.s[2] + col;
        const int64_t pb = wslot * ss0 + hv * ss1 + col;
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
          const int64_t row = i * KG + kg;
          const Packed<S> pk = pack_state_vec<S>(st[i]);
          if (to_inter) store_state_vec<S, kVec>(inter + ib + row * p.inter.s[3], pk);
          if (wslot >= 0) store_state_vec<S, kVec>(state + pb + row * ss2, pk);
        }
      }
    }
  }
}

template <typename S, int K>
cudaError_t launch_kv_k(const Problem& p, const LaunchPlan& lp, cudaStream_t stream) {
  return lp.vec ? launch_kernel(decode_kv_kernel<S, K, true>, p, lp, stream)
                : launch_kernel(decode_kv_kernel<S, K, false>, p, lp, stream);
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
