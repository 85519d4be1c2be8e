// Device building blocks shared by the VK and KV decode kernels: dtype conversion, 16-byte
// state vectors, programmatic dependent launch, slot resolution and the per-chunk staging
// of q, k, v and gates into shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "problem.h"
#include "rounding.h"

namespace gdn::detail::cuda {

// Tokens staged in shared memory at once; longer T loops over chunks (correct, not tuned).
constexpr int kMaxChunk = 16;
// Per-token scalars in shared memory: rq*scale, rk, kq (normalized q.k), g, beta, pad.
constexpr int kTokScalars = 8;

// ---------------------------------------------------------------------------------------
// Scalars of a run-time dtype: small per-(n, t, head) inputs and outputs only.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ void store_scalar(void* base, DType dt, int64_t off, float x) {
  switch (dt) {
    case DType::kF32:
      static_cast<float*>(base)[off] = x;
      break;
    case DType::kBF16:
      static_cast<__nv_bfloat16*>(base)[off] = __float2bfloat16_rn(x);
      break;
    default:
      static_cast<__half*>(base)[off] = __float2half_rn(x);
      break;
  }
}

// A scalar loaded now and converted later: the loads of a block's prologue (gates, slot
// indices) are issued back to back and only then used, so their latencies overlap. (Converted
// inside the dtype branch right after the load, each made the thread wait for it there: the
// prologue paid the gate loads one after another, ~1.8 us at B = 1 before the state copy was
// issued.) 16-bit elements are zero-extended; bits_to_f32 / index_from_bits interpret them.
__device__ __forceinline__ uint32_t load_bits(const void* base, DType dt, int64_t off) {
  if (dt == DType::kF32 || dt == DType::kI32) return static_cast<const uint32_t*>(base)[off];
  return static_cast<const uint16_t*>(base)[off];
}
// The bf16 in the low / high half of a 32-bit word, as fp32 (exact).
__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ float bits_to_f32(uint32_t u, DType dt) {
  switch (dt) {
    case DType::kF32:
      return __uint_as_float(u);
    case DType::kBF16:
      return bf16_lo(u);
    default:
      return __half2float(__ushort_as_half(static_cast<unsigned short>(u)));
  }
}
__device__ __forceinline__ uint64_t load_index_bits(const Ptr& x, int64_t off) {
  return x.dtype == DType::kI64 ? static_cast<const uint64_t*>(x.data)[off]
                                : static_cast<const uint32_t*>(x.data)[off];
}
__device__ __forceinline__ int64_t index_from_bits(uint64_t u, DType dt) {
  return dt == DType::kI64 ? static_cast<int64_t>(u)
                           : static_cast<int64_t>(static_cast<int32_t>(static_cast<uint32_t>(u)));
}

// A state element from fp32, rounded to nearest even.
template <typename S>
__device__ __forceinline__ S from_f32(float x) {
  if constexpr (sizeof(S) == 4) {
    return x;
  } else if constexpr (std::is_same_v<S, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}

template <typename Elem>
__device__ __forceinline__ float to_f32(Elem x) {
  if constexpr (sizeof(Elem) == 4) {
    return x;
  } else if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

// ---------------------------------------------------------------------------------------
// State vectors: kVecElems elements = 16 bytes. kVec = false splits each vector into scalar
// accesses for callers whose pointers or strides are not 16-byte aligned (same element
// mapping, so the kernels above need no second body).
// ---------------------------------------------------------------------------------------
template <typename S>
constexpr int kVecElems = 16 / static_cast<int>(sizeof(S));

__device__ __forceinline__ void unpack2(uint32_t u, __nv_bfloat16*, float* out) {
  out[0] = bf16_lo(u);
  out[1] = bf16_hi(u);
}
__device__ __forceinline__ void unpack2(uint32_t u, __half*, float* out) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u));
  out[0] = f.x;
  out[1] = f.y;
}
__device__ __forceinline__ uint32_t pack2(float a, float b, __nv_bfloat16*) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack2(float a, float b, __half*) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Four consecutive elements at dst (aligned to four of them), rounded to nearest: one 8- or
// 16-byte store.
__device__ __forceinline__ void store_f32x4(void* dst, DType dt, const float (&x)[4]) {
  switch (dt) {
    case DType::kF32:
      *static_cast<float4*>(dst) = make_float4(x[0], x[1], x[2], x[3]);
      break;
    case DType::kBF16:
      *static_cast<uint2*>(dst) = make_uint2(pack2(x[0], x[1], static_cast<__nv_bfloat16*>(nullptr)),
                                             pack2(x[2], x[3], static_cast<__nv_bfloat16*>(nullptr)));
      break;
    default:
      *static_cast<uint2*>(dst) =
          make_uint2(pack2(x[0], x[1], static_cast<__half*>(nullptr)), pack2(x[2], x[3], static_cast<__half*>(nullptr)));
      break;
  }
}

template <typename S, bool kVec>
__device__ __forceinline__ void load_state_vec(const S* src, float* out) {
  constexpr int kN = kVecElems<S>;
  if constexpr (!kVec) {
#pragma unroll
    for (int c = 0; c < kN; ++c) out[c] = to_f32(src[c]);
  } else if constexpr (sizeof(S) == 4) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  } else {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    unpack2(v.x, static_cast<S*>(nullptr), out + 0);
    unpack2(v.y, static_cast<S*>(nullptr), out + 2);
    unpack2(v.z, static_cast<S*>(nullptr), out + 4);
    unpack2(v.w, static_cast<S*>(nullptr), out + 6);
  }
}

// Packed (rounded once, RNE) form of one state vector, so a token that writes both the
// intermediate cache and the pool converts only once.
template <typename S>
struct Packed {
  uint4 u;
};

template <typename S>
__device__ __forceinline__ Packed<S> pack_state_vec(const float* in) {
  Packed<S> r;
  if constexpr (sizeof(S) == 4) {
    r.u = make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]),
                     __float_as_uint(in[3]));
  } else {
    r.u.x = pack2(in[0], in[1], static_cast<S*>(nullptr));
    r.u.y = pack2(in[2], in[3], static_cast<S*>(nullptr));
    r.u.z = pack2(in[4], in[5], static_cast<S*>(nullptr));
    r.u.w = pack2(in[6], in[7], static_cast<S*>(nullptr));
  }
  return r;
}

// Stochastic rounding (StepArgs::rounding_seed, src/rounding.h): the token key of the state
// after token t of head hv, from the row key that resolve_row_warp computed (WarpSlots::sr_row).
__device__ __forceinline__ uint32_t sr_key(uint64_t row_key, int64_t hv, int64_t t) {
  return sr_token_key(sr_head_key(row_key, hv), t);
}

__device__ __forceinline__ uint32_t sr_pack2(float a, float b, uint32_t ra, uint32_t rb, __nv_bfloat16*) {
  return sr_bf16_bits(a, ra) | static_cast<uint32_t>(sr_bf16_bits(b, rb)) << 16;
}
__device__ __forceinline__ uint32_t sr_pack2(float a, float b, uint32_t ra, uint32_t rb, __half*) {
  const auto rne = [](float x) { return __half_as_ushort(__float2half_rn(x)); };
  return sr_fp16_bits(a, ra, rne) | static_cast<uint32_t>(sr_fp16_bits(b, rb, rne)) << 16;
}

// pack_state_vec with stochastic rounding: in[0..7] are the elements e0..e0 + 7 of the head's
// matrix in storage order, e0 a multiple of 8 (one group of src/rounding.h). 16-bit states.
template <typename S>
__device__ __forceinline__ Packed<S> pack_state_vec_sr(const float* in, uint32_t key, int64_t e0) {
  static_assert(sizeof(S) == 2, "fp32 states are never rounded");
  const uint32_t x0 = sr_group_seed(key, e0 >> 3);
  uint32_t w[4];
  if constexpr (std::is_same_v<S, __nv_bfloat16>) {
    // One test for the vector instead of a NaN guard per element: a finite sum means eight
    // finite values, for which sr_bf16_bits is the add and the top half alone.
    float sum = in[0];
#pragma unroll
    for (int i = 1; i < 8; ++i) sum += in[i];
    if (isfinite(sum)) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w[i] = __byte_perm(__float_as_uint(in[2 * i]) + sr_group_bits(x0, 2 * i),
                           __float_as_uint(in[2 * i + 1]) + sr_group_bits(x0, 2 * i + 1), 0x7632);
      Packed<S> r;
      r.u = make_uint4(w[0], w[1], w[2], w[3]);
      return r;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = sr_pack2(in[2 * i], in[2 * i + 1], sr_group_bits(x0, 2 * i), sr_group_bits(x0, 2 * i + 1),
                    static_cast<S*>(nullptr));
  Packed<S> r;
  r.u = make_uint4(w[0], w[1], w[2], w[3]);
  return r;
}

// One state vector rounded for storage: RNE, or stochastically where the call asks for it
// (`sr`, uniform across the warp, so the branch costs one predicate when off).
template <typename S>
__device__ __forceinline__ Packed<S> round_state_vec(const float* in, bool sr, uint32_t key, int64_t e0) {
  if constexpr (sizeof(S) == 2) {
    if (sr) return pack_state_vec_sr<S>(in, key, e0);
  }
  return pack_state_vec<S>(in);
}

template <typename S, bool kVec>
__device__ __forceinline__ void store_state_vec(S* dst, const Packed<S>& v) {
  if constexpr (kVec) {
    // An explicit vector store: left to itself the compiler scalarized the KV stores (and
    // __stwb compiles to a strong SM-scope store).
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(v.u.x), "r"(v.u.y),
                 "r"(v.u.z), "r"(v.u.w)
                 : "memory");
  } else {
    const S* e = reinterpret_cast<const S*>(&v.u);
#pragma unroll
    for (int c = 0; c < kVecElems<S>; ++c) dst[c] = e[c];
  }
}

// ---------------------------------------------------------------------------------------
// Programmatic dependent launch: the launch carries the programmatic-serialization
// attribute, so this grid may start while the previous kernel in the stream is finishing;
// nothing global is read before wait(), which returns once that kernel has completed and
// its writes are visible. Without a programmatic predecessor both are no-ops.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Before pdl_wait(): start pulling this block's state rows from HBM into L2 while the previous
// kernel in the stream is still running (PDL lets this grid become resident early). A prefetch
// is only a hint and L2 is the GPU's point of coherence, so the loads after pdl_wait() still
// see every write of the previous kernel. The slot is read with ld.global.cg (no L1 line, so
// the post-wait read cannot be served stale); a stale or out-of-range slot only wastes the
// prefetch. Rows [first_row, first_row + nrows) of head hv, `row_bytes` from column col0; the
// caller guarantees 16-byte alignment (the vector path). GDN_CUDA_PREFETCH=0 disables it.
__device__ __forceinline__ int64_t ldcg_index(const Ptr& x, int64_t off) {
  return x.dtype == DType::kI64 ? static_cast<int64_t>(__ldcg(static_cast<const long long*>(x.data) + off))
                                : static_cast<int64_t>(__ldcg(static_cast<const int*>(x.data) + off));
}

__device__ __forceinline__ void prefetch_state_l2(const Problem& p, int64_t n, int64_t hv, int64_t first_row,
                                                  int nrows, int64_t col0, int row_bytes, int tid, int nthreads) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (tid >= nrows) return;
  bool bad_accepted = false;
  const int64_t slot = read_slot(p, n, bad_accepted, [](const Ptr& x, int64_t off) { return ldcg_index(x, off); });
  if (bad_accepted || slot < 0 || slot >= p.P) return;
  const int es = p.state.dtype == DType::kF32 ? 4 : 2;
  const char* head = static_cast<const char*>(p.state.data) +
                     (slot * p.state.s[0] + hv * p.state.s[1] + first_row * p.state.s[2] + col0) * es;
  for (int r = tid; r < nrows; r += nthreads)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(head + r * p.state.s[2] * es), "r"(row_bytes)
                 : "memory");
#endif
}

// Kernel parameters (the ~1 KB Problem) are read through the SM's constant cache, which is
// cold for every launch; each first touch of a line stalls its thread, so a prologue that
// reads the parameters as it goes pays one miss after another. Before pdl_wait (where a block
// launched early has nothing else to do) every thread touches one 32-byte piece, so all lines
// are fetched at once. The barrier is the use that keeps the loads.
template <typename Param>
__device__ __forceinline__ void warm_params(const Param& p) {
  constexpr int kPiece = 32;
  constexpr int kPieces = static_cast<int>((sizeof(Param) + kPiece - 1) / kPiece);
  static_assert(kPieces <= 64, "one piece per thread of the smallest block (KV tile: 64)");
  const int i = threadIdx.x;
  uint32_t x = 0;
  if (i < kPieces) x = reinterpret_cast<const uint32_t*>(&p)[i * (kPiece / 4)];
  (void)__syncthreads_or(x == 0x9e3779b9u);
}

// Which (row n, value head hv, tile) a block owns. The block index fits 32 bits (a 1-D grid),
// so the divisions are 32-bit instead of the long 64-bit division routine, which sat on the
// critical path of every block at small B.
struct BlockCoords {
  int64_t n, hv;
  int tile;
};

template <typename Geo>
__device__ __forceinline__ BlockCoords block_coords(const Problem& p, const Geo& geo) {
  const uint32_t b = blockIdx.x, tiles = static_cast<uint32_t>(geo.tiles), HV = static_cast<uint32_t>(p.HV);
  const uint32_t bh = b / tiles;
  BlockCoords c;
  c.tile = static_cast<int>(b - bh * tiles);
  c.n = bh / HV;
  c.hv = bh - static_cast<uint32_t>(c.n) * HV;
  return c;
}

// ---------------------------------------------------------------------------------------
// Slot resolution, warp-cooperative: the same result as resolve_row (problem.h), but all
// index loads are issued at once (lane t loads token_slots[n, t]), so per-token mode and
// accepted-token continuation cost one memory latency instead of a chain of T.
// Every lane of the warp must call it; the result is warp-uniform except `tok`.
// ---------------------------------------------------------------------------------------
struct WarpSlots {
  int64_t read = -1;   // < 0: padding or invalid row
  int64_t write = -1;  // final-state slot (modes without token_slots)
  int64_t tok = -1;    // token_slots[n, lane] for lane < min(T, 32)
  uint64_t sr_row = 0;  // with a rounding seed: sr_row_key(seed, read)
  bool invalid = false;
};

__device__ __forceinline__ int64_t shfl64(int64_t x, int src) {
  return __shfl_sync(0xffffffffu, static_cast<long long>(x), src);
}

__device__ __forceinline__ WarpSlots resolve_row_warp(const Problem& p, int64_t n, int lane) {
  WarpSlots r;
  const bool per_token = p.token_slots.data != nullptr;
  uint64_t acc_b = 0, rs_b = 0, wsl_b = 0, tok_b = 0;  // all issued before any is used
  if (p.num_accepted.data != nullptr) acc_b = load_index_bits(p.num_accepted, n * p.num_accepted.s[0]);
  if (p.read_slots.data != nullptr) rs_b = load_index_bits(p.read_slots, n * p.read_slots.s[0]);
  if (p.write_slots.data != nullptr) wsl_b = load_index_bits(p.write_slots, n * p.write_slots.s[0]);
  if (per_token && lane < p.T)
    tok_b = load_index_bits(p.token_slots, n * p.token_slots.s[0] + lane * p.token_slots.s[1]);
  // The rounding seed with the slots: its latency overlaps theirs (loaded at the first store,
  // it cost B = 1 a round trip).
  const int64_t seed = p.rounding_seed != nullptr ? *p.rounding_seed : 0;
  const int64_t acc = index_from_bits(acc_b, p.num_accepted.dtype);
  const int64_t rs = index_from_bits(rs_b, p.read_slots.dtype);
  const int64_t wsl = index_from_bits(wsl_b, p.write_slots.dtype);
  if (per_token && lane < p.T) r.tok = index_from_bits(tok_b, p.token_slots.dtype);

  int64_t read;
  if (p.num_accepted.data != nullptr) {
    if (acc < 1 || acc > p.T) {
      r.invalid = true;
      return r;
    }
    read = acc - 1 < 32
               ? shfl64(r.tok, static_cast<int>(acc - 1))
               : load_index(p.token_slots, n * p.token_slots.s[0] + (acc - 1) * p.token_slots.s[1]);
  } else if (p.read_slots.data != nullptr) {
    read = rs;
  } else if (per_token) {
    read = shfl64(r.tok, 0);
  } else {
    read = n;
  }
  // Every slot the row names is range-checked, a padding row's too (as resolve_row).
  bool bad = read >= p.P;
  int64_t w = -1;
  if (per_token) {
    bool tok_bad = lane < p.T && r.tok >= p.P;
    for (int64_t t = 32 + lane; t < p.T; t += 32)
      tok_bad |= load_index(p.token_slots, n * p.token_slots.s[0] + t * p.token_slots.s[1]) >= p.P;
    bad |= __any_sync(0xffffffffu, tok_bad);
  } else {
    w = p.write_slots.data != nullptr ? wsl : read;
    bad |= w >= p.P;
  }
  if (bad) {
    r.invalid = true;
    return r;
  }
  if (read < 0) return r;  // padding
  r.write = w;
  r.read = read;
  if (p.rounding_seed != nullptr) r.sr_row = sr_row_key(seed, read);
  return r;
}

// token_write_slot (problem.h) on a WarpSlots; warp-uniform; every lane must call it.
__device__ __forceinline__ int64_t warp_token_write_slot(const Problem& p, const WarpSlots& r,
                                                        int64_t n, int64_t t) {
  if (!p.update_state || r.read < 0) return -1;
  if (p.token_slots.data != nullptr)
    return t < 32 ? shfl64(r.tok, static_cast<int>(t))
                  : load_index(p.token_slots, n * p.token_slots.s[0] + t * p.token_slots.s[1]);
  return t == p.T - 1 ? r.write : -1;
}

// ---------------------------------------------------------------------------------------
// Gates of one (n, t, hv), section 2 of the spec, in two halves: the loads, issued early so
// that their latency overlaps the slot load and the state copy (issued after those, under a
// full memory system they returned behind the state tile and held the block's first barrier),
// and the math once they are needed. The loads keep raw bits (load_bits): converting inside
// the dtype branch right after the load made the thread wait for each load in turn there.
// ---------------------------------------------------------------------------------------
struct GateInputs {
  uint32_t x0 = 0, x1 = 0;          // raw: a, b; precomputed: g (fp32), beta
  uint32_t A_log = 0, dt_bias = 0;  // raw only
};

__device__ __forceinline__ GateInputs load_gate_inputs(const Problem& p, int64_t n, int64_t t, int64_t hv) {
  GateInputs r;
  if (p.raw_gates) {
    r.x0 = load_bits(p.a.data, p.a.dtype, n * p.a.s[0] + t * p.a.s[1] + hv * p.a.s[2]);
    r.x1 = load_bits(p.b.data, p.b.dtype, n * p.b.s[0] + t * p.b.s[1] + hv * p.b.s[2]);
    r.A_log = load_bits(p.A_log.data, DType::kF32, hv * p.A_log.s[0]);
    r.dt_bias = load_bits(p.dt_bias.data, p.dt_bias.dtype, hv * p.dt_bias.s[0]);
  } else {
    r.x0 = load_bits(p.g.data, DType::kF32, n * p.g.s[0] + t * p.g.s[1] + hv * p.g.s[2]);
    r.x1 = load_bits(p.beta.data, p.beta.dtype, n * p.beta.s[0] + t * p.beta.s[1] + hv * p.beta.s[2]);
  }
  return r;
}

__device__ __forceinline__ void gates_from_inputs(const Problem& p, const GateInputs& in, float& g,
                                                  float& beta) {
  if (p.raw_gates) {
    const float x = bits_to_f32(in.x0, p.a.dtype) + bits_to_f32(in.dt_bias, p.dt_bias.dtype);
    const float sp = x <= 20.f ? log1pf(expf(x)) : x;
    g = expf(-expf(__uint_as_float(in.A_log)) * sp);
    beta = 1.f / (1.f + expf(-bits_to_f32(in.x1, p.b.dtype)));
  } else {
    g = expf(__uint_as_float(in.x0));
    beta = bits_to_f32(in.x1, p.beta.dtype);
  }
}

// ---------------------------------------------------------------------------------------
// Staging of tokens [t0, t0 + tc) of one (n, hv) in three steps, so that no register is
// held across the long state-load latency and every input load of the chunk is in flight
// at once:
//   stage_issue:   raw q, k (the q/k head of hv) and v columns [c0, c0 + nc) copied into
//                  shared memory by cp.async (16-byte pieces when the views allow it, else
//                  element by element through registers);
//   stage_gates:   g and beta per token (threads t < tc);
//   stage_convert: after cp.async completes and a barrier, q and k converted to fp32 at
//                  positions pos(e) (each kernel picks the order its threads read), the
//                  norms, the scale and q.k folded into three scalars per token (q and k are
//                  never rescaled element-wise), v converted to fp32. The caller syncs.
// ---------------------------------------------------------------------------------------
struct Geometry {
  int tiles = 1;        // row (VK) or column (KV) tiles per (n, hv)
  int tile_rows = 0;    // VK tile path: state rows per block (a multiple of the row groups)
  int chunk = 1;        // tokens staged at once
  int raw_bytes = 0;    // bytes of the raw staging area (16-byte multiple)
  bool qkv_vec = true;  // q, k, v views allow 16-byte cp.async
  bool prefetch = true; // tile kernels: L2-prefetch the state before pdl_wait (GDN_CUDA_PREFETCH)
  bool conv_vec = false; // fused step: the conv's 16-byte path (fused.cuh, fused_conv_path)
  bool conv_cm = false;  // fused step: its channel-major variant (conv state [.., D, L], L contiguous)
  bool norm_vec = false; // fused step: the norm's inputs by 16-byte cp.async (fused_norm_vec_ok)
  int buffers = 0;       // group kernel: state stage buffers (group.cuh)
  int hpb = 1;           // group kernel, fused step: q/k heads per block (1, or 2 at VK 16-bit; plan_fused_group)
};

struct StageSmem {
  unsigned char* raw;  // [chunk][K] q, [chunk][K] k, [chunk][nc] v, input dtype
  float* q;            // [chunk][K] fp32, permuted by pos
  float* k;            // [chunk][K]
  float* v;            // [chunk][nc]
  float* tok;          // [chunk][kTokScalars]
  // VK chunked kernel only (instead of q, k): raw bf16 q and k as rows q_0..q_{tc-1},
  // k_0..k_{tc-1} (staged there directly: StagePlan::qrow), then one zero row, kQk16Pad elements
  // of padding per row so that 8 rows of 16 bytes (one ldmatrix) fall in distinct banks. Its raw
  // area holds v alone, which it reads raw (no fp32 v).
  uint16_t* qk16 = nullptr;
  int chunk = 1;  // tokens per staged chunk (geo.chunk): the rows of raw and of q, k, v, tok

  // Part 0 (q), 1 (k) or 2 (v) of the raw area, as elements of E (the input dtype, or bytes
  // with k_elems in bytes): q and k hold chunk rows of k_elems elements each.
  template <typename E>
  __device__ __forceinline__ E* raw_part(int part, int k_elems) const {
    return reinterpret_cast<E*>(raw) + part * chunk * k_elems;
  }
};
constexpr int kQk16Pad = 8;

// Carves the dynamic shared memory: `extra` leading floats (kernel-private), raw, fp32 arrays.
__device__ __forceinline__ StageSmem carve_smem(float* base, int extra, const Geometry& geo,
                                                int K, int nc) {
  StageSmem s;
  s.chunk = geo.chunk;
  s.raw = reinterpret_cast<unsigned char*>(base + extra);
  float* f = reinterpret_cast<float*>(s.raw + geo.raw_bytes);
  s.q = f;
  s.k = s.q + s.chunk * K;
  s.tok = s.k + s.chunk * K;
  s.v = s.tok + s.chunk * kTokScalars;
  return s;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
// One bulk copy global -> shared by the TMA unit (the async proxy), completing on an mbarrier:
// one instruction for a whole contiguous tile instead of a 16-byte cp.async per piece per
// thread. Bytes and both addresses are 16-byte multiples. mbar_init, bulk_load and mbar_wait
// are all called by one thread (it alone tracks the phase); a __syncthreads after the wait
// publishes the tile to the block.
// The VK tile kernels' mbarrier for bulk_load: the planner adds these bytes at the end of the
// dynamic shared memory (plan_vk_tile), and vk_tile_begin puts the barrier at the last 8-byte
// aligned word inside them (8 for the barrier, up to 8 for its alignment).
constexpr int kBulkBarBytes = 16;
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  // The init is a generic-proxy write and the copy's complete_tx an async-proxy access: without
  // this fence (the CUDA programming guide's TMA example has it) racecheck reported the two as a
  // race. Measured free at B = 1 and 4 (H200).
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, unsigned bytes, uint64_t* bar) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(d),
               "l"(gmem), "r"(bytes), "r"(b)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  unsigned done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(b), "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed cp.async groups are still pending.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void st_shared_zero16(void* smem) {
  *reinterpret_cast<uint4*>(smem) = make_uint4(0u, 0u, 0u, 0u);
}
// A tile's copy-in piece: the 16 bytes at gmem where they lie inside the state (in), else
// zeros, so that a partial tile's phases read no stale shared memory.
__device__ __forceinline__ void cp_async16_or_zero(void* smem, const void* gmem, bool in) {
  if (in) {
    cp_async16(smem, gmem);
  } else {
    st_shared_zero16(smem);
  }
}

// One-time opt-in to more than 48 KB of dynamic shared memory for kernel kKernel on the
// current device (the per-device maximum), never once per call. The cache is a static of this
// instantiation, i.e. one per kernel: keyed by the kernel's type instead, every kernel of one
// signature shared it and only the first kernel launched in a process got the opt-in.
template <auto kKernel>
cudaError_t allow_big_smem() {
  static std::atomic<int> done[64];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64 || done[dev].load(std::memory_order_acquire) != 0) return cudaSuccess;
  int optin = 0;
  err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  // The limit holds static and dynamic shared memory together: a kernel with a static
  // __shared__ variable is refused the whole opt-in (cudaErrorInvalidValue).
  cudaFuncAttributes attr{};
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, kKernel);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               optin - static_cast<int>(attr.sharedSizeBytes));
  if (err == cudaSuccess) done[dev].store(1, std::memory_order_release);
  return err;
}

__device__ __forceinline__ int dtype_bytes(DType d) { return d == DType::kF32 ? 4 : 2; }

// stage_issue in two halves: the plan (base addresses, strides and counts) depends only on the
// kernel parameters and the block's coordinates, so a kernel can compute it before pdl_wait,
// where the block waits anyway under programmatic launch; the issue loop then runs right after
// the wait. At B = 1 the plan's 64-bit index arithmetic and the q/k head's division were most of
// the ~1,500 cycles between the wait and the first copy (per-block clock stamps, docs/design.md).
struct StagePlan {
  const char *q, *k, *v;  // token t0's rows
  int64_t qt, kt, vt;     // token strides, bytes
  int64_t qe, ke, ve;     // element strides, bytes (element path)
  unsigned char *rq, *rk, *rv;
  int es, K, nc, tc;
  int qrow;  // bytes between token rows of rq and of rk (K * es; the chunked kernel's qk16 rows are padded)
  bool vec;
};

__device__ __forceinline__ StagePlan stage_plan(const Problem& p, const Geometry& geo, const StageSmem& sm,
                                                int64_t n, int64_t t0, int tc, int64_t hv, int64_t c0, int nc) {
  StagePlan sp;
  const int64_t h = hv / (p.HV / p.H);
  sp.es = dtype_bytes(p.q.dtype);
  sp.K = static_cast<int>(p.K);
  sp.nc = nc;
  sp.tc = tc;
  sp.vec = geo.qkv_vec;
  const int es = sp.es;
  sp.q = static_cast<const char*>(p.q.data) + (n * p.q.s[0] + t0 * p.q.s[1] + h * p.q.s[2]) * es;
  sp.k = static_cast<const char*>(p.k.data) + (n * p.k.s[0] + t0 * p.k.s[1] + h * p.k.s[2]) * es;
  sp.v = static_cast<const char*>(p.v.data) + (n * p.v.s[0] + t0 * p.v.s[1] + hv * p.v.s[2] + c0 * p.v.s[3]) * es;
  sp.qt = p.q.s[1] * es;
  sp.kt = p.k.s[1] * es;
  sp.vt = p.v.s[1] * es;
  sp.qe = p.q.s[3] * es;
  sp.ke = p.k.s[3] * es;
  sp.ve = p.v.s[3] * es;
  sp.qrow = sp.K * es;
  sp.rq = sm.raw_part<unsigned char>(0, sp.K * es);
  sp.rk = sm.raw_part<unsigned char>(1, sp.K * es);
  sp.rv = sm.raw_part<unsigned char>(2, sp.K * es);
  return sp;
}

// Keeps a plan's values computed where this is called (before pdl_wait): the empty volatile asm
// consumes and redefines them, so the compiler can neither sink their arithmetic past the wait
// nor recompute it there.
__device__ __forceinline__ void stage_plan_pin(StagePlan& sp) {
  asm volatile("" : "+l"(sp.q), "+l"(sp.k), "+l"(sp.v), "+l"(sp.qt), "+l"(sp.kt), "+l"(sp.vt));
  asm volatile("" : "+l"(sp.rq), "+l"(sp.rk), "+l"(sp.rv));
}

template <int kThreads>
__device__ __forceinline__ void stage_issue_plan(const StagePlan& sp) {
  const int es = sp.es, K = sp.K, tc = sp.tc, nc = sp.nc;
  if (sp.vec) {
    const int cq = K * es / 16, cv = nc * es / 16;  // 16-byte pieces per row
    const int nq = tc * cq, total = 2 * nq + tc * cv;
    for (int i = threadIdx.x; i < total; i += kThreads) {
      if (i < nq) {
        const int t = i / cq, c = i % cq;
        cp_async16(sp.rq + t * sp.qrow + c * 16, sp.q + t * sp.qt + c * 16);
      } else if (i < 2 * nq) {
        const int t = (i - nq) / cq, c = (i - nq) % cq;
        cp_async16(sp.rk + t * sp.qrow + c * 16, sp.k + t * sp.kt + c * 16);
      } else {
        const int t = (i - 2 * nq) / cv, c = (i - 2 * nq) % cv;
        cp_async16(sp.rv + (t * nc) * es + c * 16, sp.v + t * sp.vt + c * 16);
      }
    }
  } else {
    // Unaligned or element-strided views: element copies (2 or 4 bytes), several in flight
    // per thread. The innermost strides (bytes) are whatever the caller's views have.
    const int nq = tc * K, total = 2 * nq + tc * nc;
#pragma unroll 4
    for (int i = threadIdx.x; i < total; i += kThreads) {
      const char* src;
      unsigned char* dst;
      if (i < nq) {
        src = sp.q + (i / K) * sp.qt + (i % K) * sp.qe;
        dst = sp.rq + (i / K) * sp.qrow + (i % K) * es;
      } else if (i < 2 * nq) {
        src = sp.k + ((i - nq) / K) * sp.kt + ((i - nq) % K) * sp.ke;
        dst = sp.rk + ((i - nq) / K) * sp.qrow + ((i - nq) % K) * es;
      } else {
        src = sp.v + ((i - 2 * nq) / nc) * sp.vt + ((i - 2 * nq) % nc) * sp.ve;
        dst = sp.rv + (i - 2 * nq) * es;
      }
      if (es == 4) {
        *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
      } else {
        *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src);
      }
    }
  }
}

template <int kThreads>
__device__ __forceinline__ void stage_issue(const Problem& p, const Geometry& geo, const StageSmem& sm, int64_t n,
                                            int64_t t0, int tc, int64_t hv, int64_t c0, int nc) {
  stage_issue_plan<kThreads>(stage_plan(p, geo, sm, n, t0, tc, hv, c0, nc));
}

// Thread t < tc loads token t0 + t's gate inputs (one token per thread: chunks are at most
// kMaxChunk tokens); stage_gates_store turns them into g and beta in shared memory.
template <int kThreads>
__device__ __forceinline__ GateInputs stage_gates_load(const Problem& p, int64_t n, int64_t t0,
                                                       int tc, int64_t hv) {
  static_assert(kThreads >= kMaxChunk, "one token per thread");
  GateInputs r;
  if (static_cast<int>(threadIdx.x) < tc) r = load_gate_inputs(p, n, t0 + threadIdx.x, hv);
  return r;
}

template <int kThreads>
__device__ __forceinline__ void stage_gates_store(const Problem& p, const StageSmem& sm, int tc,
                                                  const GateInputs& in) {
  const int t = threadIdx.x;
  if (t < tc) {
    float g, beta;
    gates_from_inputs(p, in, g, beta);
    sm.tok[t * kTokScalars + 3] = g;
    sm.tok[t * kTokScalars + 4] = beta;
  }
}

template <int kThreads>
__device__ __forceinline__ void stage_gates(const Problem& p, const StageSmem& sm, int64_t n,
                                            int64_t t0, int tc, int64_t hv) {
  stage_gates_store<kThreads>(p, sm, tc, stage_gates_load<kThreads>(p, n, t0, tc, hv));
}

// A token's q/k scalars from sum(q^2), sum(k^2) and sum(q k) of the raw inputs (spec section
// 2): rq * scale and rk (the L2 norms' reciprocals, 1 without use_qk_l2norm) and the normalized,
// scaled q.k, so that q and k are never rescaled element-wise.
struct TokScalars {
  float rqs, rk, kq;
};
__device__ __forceinline__ TokScalars token_scalars(const Problem& p, float sqq, float skk, float sqk) {
  const float rq = p.use_qk_l2norm ? rsqrtf(sqq + 1e-6f) : 1.f;
  const float rk = p.use_qk_l2norm ? rsqrtf(skk + 1e-6f) : 1.f;
  const float rqs = rq * p.scale;
  return {rqs, rk, sqk * rqs * rk};
}

// Sums of q^2, k^2 and q k over the 32 lanes of a warp, on every lane.
__device__ __forceinline__ void warp_sum_qk(float& sqq, float& skk, float& sqk) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    sqq += __shfl_xor_sync(0xffffffffu, sqq, off);
    skk += __shfl_xor_sync(0xffffffffu, skk, off);
    sqk += __shfl_xor_sync(0xffffffffu, sqk, off);
  }
}

template <int K, int kThreads, typename QK, bool kQk16, typename Pos>
__device__ __forceinline__ void stage_convert_t(const Problem& p, const Geometry& geo,
                                                const StageSmem& sm, int tc, int nc, Pos pos) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kPerLane = K / 32;
  const int lane = threadIdx.x & 31;
  // kQk16: q and k were staged straight into qk16's padded rows, and the chunked kernel reads v
  // raw (as bf16) where it needs it.
  constexpr int QS = kQk16 ? K + kQk16Pad : K;  // row stride of rq and rk, elements
  const QK* rq = kQk16 ? reinterpret_cast<const QK*>(sm.qk16) : sm.raw_part<const QK>(0, K);
  const QK* rk = kQk16 ? rq + tc * QS : sm.raw_part<const QK>(1, K);
  for (int t = threadIdx.x / 32; t < tc; t += kWarps) {
    float sqq = 0.f, skk = 0.f, sqk = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = i * 32 + lane;
      const float qf = to_f32(rq[t * QS + e]);
      const float kf = to_f32(rk[t * QS + e]);
      if constexpr (!kQk16) {
        sm.q[t * K + pos(e)] = qf;
        sm.k[t * K + pos(e)] = kf;
      }
      sqq = fmaf(qf, qf, sqq);
      skk = fmaf(kf, kf, skk);
      sqk = fmaf(qf, kf, sqk);
    }
    warp_sum_qk(sqq, skk, sqk);
    if (lane == 0) {
      const TokScalars ts = token_scalars(p, sqq, skk, sqk);
      sm.tok[t * kTokScalars + 0] = ts.rqs;
      sm.tok[t * kTokScalars + 1] = ts.rk;
      sm.tok[t * kTokScalars + 2] = ts.kq;
    }
  }
  if constexpr (kQk16) {
    static_assert(sizeof(QK) == 2);
    for (int i = threadIdx.x; i < K; i += kThreads) sm.qk16[2 * tc * (K + kQk16Pad) + i] = 0;
  } else {
    const QK* rv = sm.raw_part<const QK>(2, K);
    for (int i = threadIdx.x; i < tc * nc; i += kThreads) sm.v[i] = to_f32(rv[i]);
  }
}

// kQk16 (the VK chunked kernel; bf16 q and k, host-checked): q and k are already in sm.qk16's
// rows (staged there) and v stays raw; only the per-token scalars and qk16's zero row are written.
template <int K, int kThreads, bool kQk16 = false, typename Pos>
__device__ __forceinline__ void stage_convert(const Problem& p, const Geometry& geo,
                                              const StageSmem& sm, int tc, int nc, Pos pos) {
  if constexpr (kQk16) {
    stage_convert_t<K, kThreads, __nv_bfloat16, true>(p, geo, sm, tc, nc, pos);
  } else {
    switch (p.q.dtype) {
      case DType::kF32:
        stage_convert_t<K, kThreads, float, false>(p, geo, sm, tc, nc, pos);
        break;
      case DType::kBF16:
        stage_convert_t<K, kThreads, __nv_bfloat16, false>(p, geo, sm, tc, nc, pos);
        break;
      default:
        stage_convert_t<K, kThreads, __half, false>(p, geo, sm, tc, nc, pos);
        break;
    }
  }
}

// Output rows [c0, c0 + nc) of every token written as exact zeros (padding / invalid rows).
template <int kThreads>
__device__ __forceinline__ void zero_output(const Problem& p, int64_t n, int64_t hv, int64_t c0,
                                            int nc) {
  for (int64_t i = threadIdx.x; i < p.T * nc; i += kThreads) {
    const int64_t t = i / nc;
    const int64_t c = c0 + i % nc;
    if (c < p.V)
      store_scalar(p.o.data, p.o.dtype, n * p.o.s[0] + t * p.o.s[1] + hv * p.o.s[2] + c, 0.f);
  }
}

// A padding or invalid row (slots.read < 0) of this block: outputs [c0, c0 + nc) of every
// token become exact zeros, and an invalid row is counted once, by thread 0 of the block that
// owns head 0, tile 0.
template <int kThreads>
__device__ __forceinline__ void finish_padded_row(const Problem& p, const WarpSlots& slots, int64_t n,
                                                  int64_t hv, int tile, int64_t c0, int nc) {
  if (slots.invalid && p.error_count != nullptr && hv == 0 && tile == 0 && threadIdx.x == 0)
    atomicAdd(p.error_count, 1);
  zero_output<kThreads>(p, n, hv, c0, nc);
}

// Launch geometry decided on the host (decode_cuda.cu) and handed to the per-dtype launchers.
struct LaunchPlan {
  int64_t blocks = 0;
  int threads = 0;
  size_t smem = 0;          // dynamic shared memory bytes
  int rows_per_thread = 1;  // VK only: state rows per thread (1, 2 or 4); tile path: rows
                            // in registers at once (1, 2 or 4)
  bool tile = false;        // shared-memory tile path (16-byte state, all tokens staged)
  bool chunked = false;     // VK: the chunked tile kernel (vk_chunk.cuh) instead of the token loop
  bool direct = false;      // VK tile, rows in registers <= 2: raw bf16 q/k/v, no conversion phase
  bool kv_wide = false;     // KV tile: the wide variant (KvTileWide, kv_tile_wide)
  bool kv_lanes16 = false;  // KV tile, fused step, fp32: 16 lanes along V (plan_kv_tile_k)
  bool kv_vt = false;       // KV: the VK token loop on the transposed tile (decode_kv_vt_kernel)
  bool vec = true;          // 16-byte state accesses allowed
  bool pdl = true;          // programmatic dependent launch attribute
  int cluster = 1;          // fused step: blocks per thread-block cluster (fused.cuh)
  bool group = false;       // the group kernel (group.cuh): the fused step's instead of a cluster,
                            // decode's KV instead of a tile kernel
  bool group4 = false;      // the group kernel's instantiation for four blocks per SM (16-bit KV)
  int cluster_cap = 0;      // fused step: clusters the device runs at once of the cluster form the
                            // planner weighed (0: not asked); reported by describe_cuda_plan
  Geometry geo;
};

}  // namespace gdn::detail::cuda

namespace gdn::detail::cuda {

// The launch configuration of a plan: `grid` blocks of lp.threads threads with lp.smem bytes of
// dynamic shared memory each, the thread-block cluster dimension where lp.cluster > 1 and, with
// `pdl`, the programmatic-stream-serialization attribute. `attr` holds the attributes cfg points
// to. Shared by the launch and the occupancy query, which must describe the same kernel launch.
inline cudaLaunchConfig_t launch_config(const LaunchPlan& lp, int64_t grid, bool pdl, cudaStream_t stream,
                                        cudaLaunchAttribute (&attr)[2]) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(static_cast<unsigned>(lp.threads));
  cfg.dynamicSmemBytes = lp.smem;
  cfg.stream = stream;
  unsigned na = 0;
  if (pdl) {
    attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[na].val.programmaticStreamSerializationAllowed = 1;
    ++na;
  }
  if (lp.cluster > 1) {
    attr[na].id = cudaLaunchAttributeClusterDimension;
    attr[na].val.clusterDim.x = static_cast<unsigned>(lp.cluster);
    attr[na].val.clusterDim.y = 1;
    attr[na].val.clusterDim.z = 1;
    ++na;
  }
  cfg.attrs = attr;
  cfg.numAttrs = na;
  return cfg;
}

// Launches a decode kernel (signature (Problem, Geometry)) with the plan's geometry and,
// when enabled, the programmatic-stream-serialization attribute (captured into CUDA graphs
// as a programmatic edge).
// Param: Problem, or FusedProblem for the fused step, whose launches also carry the
// thread-block cluster dimension.
template <typename Kernel, typename Param>
cudaError_t launch_kernel(Kernel kernel, const Param& p, const LaunchPlan& lp,
                          cudaStream_t stream) {
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(lp, lp.blocks, lp.pdl, stream, attr);
  return cudaLaunchKernelEx(&cfg, kernel, p, lp.geo);
}

// Clusters of more than 8 blocks (the portable size) need an opt-in, once per kernel and device.
template <auto kKernel>
cudaError_t allow_big_cluster() {
  static std::atomic<int> done[64];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64 || done[dev].load(std::memory_order_acquire) != 0) return cudaSuccess;
  err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (err == cudaSuccess) done[dev].store(1, std::memory_order_release);
  return err;
}

// The opt-ins a tile kernel's plan needs, once per kernel and device: more than 48 KB of
// dynamic shared memory (the tile kernels stage the state there), and clusters of more than 8
// blocks.
template <auto kKernel>
cudaError_t allow_tile_plan(const LaunchPlan& lp) {
  const cudaError_t err = allow_big_smem<kKernel>();
  return err == cudaSuccess && lp.cluster > 8 ? allow_big_cluster<kKernel>() : err;
}

template <auto kKernel, typename Param>
cudaError_t launch_tile_kernel(const Param& p, const LaunchPlan& lp, cudaStream_t stream) {
  const cudaError_t err = allow_tile_plan<kKernel>(lp);
  return err != cudaSuccess ? err : launch_kernel(kKernel, p, lp, stream);
}

// How many clusters of lp.cluster blocks of kKernel (as the launch configures them) the device
// runs at once: cudaOccupancyMaxActiveClusters, after the same opt-ins as the launch (they
// change the answer). A host query, no device work; the planner caches it (decode_cuda.cu,
// fused_cluster_capacity), and asks only for plans of clusters (lp.cluster > 1).
template <auto kKernel>
cudaError_t max_active_clusters(const LaunchPlan& lp, int* clusters) {
  const cudaError_t err = allow_tile_plan<kKernel>(lp);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(lp, lp.cluster, false, nullptr, attr);
  return cudaOccupancyMaxActiveClusters(clusters, kKernel, &cfg);
}

// The kernels' kSr parameter: a 16-bit state with a rounding seed takes the kernels with the
// stochastic-rounding store (launch(std::true_type)), every other call kernels without any of
// its code (launch(std::false_type)): at B = 1 a kernel's size is part of its time (measured:
// vk_launch.cuh, launch_vk_k).
template <typename S, typename Launch>
cudaError_t launch_rounding(const int64_t* seed, Launch&& launch) {
  if constexpr (sizeof(S) == 2) {
    if (seed != nullptr) return launch(std::true_type{});
  }
  return launch(std::false_type{});
}

}  // namespace gdn::detail::cuda
