// VK layout (and, kKv, the KV layout), T = 2..16 tokens whose intermediate states are not
// stored (no intermediate cache, no per-token slots), bf16 or fp16 state (an fp32 state in the
// KV layout only: VK's token loop is faster there) with bf16 q and k: the chunked form of the
// T tokens, its products on tensor cores.
//
// Why: token by token the step needs three fp32 operations per state element and token plus
// a per-token reduction chain; without the cache that loop, not memory, bounds the call from
// T = 3 on for a bf16 state (docs/design.md, section 1). Unrolled over the tokens
// (SPEC section 2; gamma_t = g_0 * ... * g_t, G_ts = g_{s+1} * ... * g_t, G_tt = 1, S0 the state
// read, kh_t = rk_t * k_t, qh_t = rqs_t * q_t with the norms and the scale as scalars):
//
//   S_t   = gamma_t * S0 + sum_{s<=t} G_ts * d_s * kh_s^T
//   d_t   = beta_t * (v_t - gamma_t * rk_t * (S0 k_t) - sum_{s<t} G_ts rk_s rk_t (k_s.k_t) d_s)
//   o_t   = gamma_t * rqs_t * (S0 q_t) + sum_{s<=t} G_ts rk_s rqs_t (k_s.q_t) d_s
//   S_T-1 = gamma_T-1 * S0 + sum_s (G_T-1,s rk_s d_s) k_s^T
//
// so a row needs the 2T products of S0 with the raw q_t and k_t (one tensor-core product per
// tile: bf16 times bf16 is exact, the sums are fp32), a T x T triangular solve per row in fp32
// (d_t, o_t), and one rank-T update (tensor cores again: the fp32 weights split into three bf16
// terms, hi + mid + lo, which carry 24 bits; the raw k are exact), accumulated in fp32 onto
// gamma * S0 and rounded once when stored (RNE, or stochastically with a rounding seed). The
// per-token states stay implicit, which is why a call that stores them (cache, per-token
// slots) takes the token loop of vk.cuh.
//
// An fp32 state takes the same phases with S0 split into three bf16 terms where it is an
// operand (P1: S0 [q, k] as three products; the raw q and k are exact in bf16, so every
// product is exact and only the fp32 sums round, as in the token loop), P3 accumulating onto
// gamma * S0 in fp32 and storing fp32 (no rounding). The split is 4 operations per element
// against the token loop's 3 per element and token, so it pays from a few tokens on, where the
// token loop is issue-bound (docs/design.md section 4).
//
// An fp16 state is split the same way into two bf16 terms, which hold its 11 significant bits
// exactly (split2_f16), so its products are exact too; P3 accumulates onto gamma * S0 in fp32
// and rounds to fp16 once, as for bf16.
//
// Block: the tile prologue of vk.cuh (state tile of RT rows of one (n, hv) in shared memory,
// 16-byte pieces swizzled for ldmatrix), then
//   P0  (last warp, while the state tile is in flight) the Gram matrix of q and k (the raw
//       rows as A) and the T x T tables of the solve;
//   P1  warp w, for each of its 16-row m-tiles w, w + 4, ...: acc = S0 [q_0..q_T-1, k_0..k_T-1]
//       in registers;
//   P2  the same warp, each row across a quad of lanes: the solve, o_t stored, the update
//       weights in the lanes that P3's A fragments need them in;
//   P3  the same warp: the m-tile's S = gamma * S0 + W K on tensor cores, rounded back into the
//       tile;
//   P4  VK: warp w its rows from the tile to the pool with 16-byte stores; KV: the block,
//       whole rows k after a barrier.
#pragma once

#include "vk.cuh"

namespace gdn::detail::cuda {

// Tables of the solve (floats): Akk[16][16], Aqk[16][16], ga[16], gc[16], gw[16], gamma_T-1.
constexpr int kChunkTabFloats = 2 * kMaxChunk * kMaxChunk + 3 * kMaxChunk + 4;

// Shared-memory layout of the chunked kernel (byte offsets), one definition for the host
// planner (total) and the kernel (offsets). rt state rows of K elements of state_bytes each.
struct VkChunkSmem {
  int raw, tok, qk16, graw, tabs, total;
  int gs;  // row stride of Graw, floats
  static constexpr __host__ __device__ int up16(int b) { return (b + 15) / 16 * 16; }
  __host__ __device__ VkChunkSmem(int rt, int K, int T, int raw_bytes, int state_bytes) {
    gs = 2 * T + 1;
    raw = up16(rt * K * state_bytes);  // the state tile first
    tok = raw + up16(raw_bytes);  // raw: v alone (q and k land in qk16)
    qk16 = tok + up16(T * kTokScalars * 4);
    graw = qk16 + up16((2 * T + 1) * (K + kQk16Pad) * 2);
    tabs = graw + up16(2 * T * gs * 4);
    total = tabs + kChunkTabFloats * 4;
  }
};

// ldmatrix as CUTLASS writes it: volatile (kept in order with the barriers), no memory
// clobber, so the compiler may move the kernel's plain shared-memory accesses around it.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
// stmatrix (sm_90): the inverse of ldmatrix, same lane addressing and fragment layout.
__device__ __forceinline__ void stsm_x4(const void* p, const uint32_t (&r)[4]) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :
               : "r"(a), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
__device__ __forceinline__ void stsm_x4_trans(const void* p, const uint32_t (&r)[4]) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :
               : "r"(a), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
// d += a b on a 16 x 8 tile, k = 16: bf16 products (exact), fp32 sums.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (w0, w1) as three packed bf16 pairs whose sum carries 24 bits of each (the residues are exact).
__device__ __forceinline__ void split3_bf16(float w0, float w1, uint32_t& hi, uint32_t& mid,
                                            uint32_t& lo) {
  __nv_bfloat16* const tag = nullptr;
  hi = pack2(w0, w1, tag);
  const float r0 = w0 - bf16_lo(hi), r1 = w1 - bf16_hi(hi);
  mid = pack2(r0, r1, tag);
  lo = pack2(r0 - bf16_lo(mid), r1 - bf16_hi(mid), tag);
}

// An fp16 pair (u, as ldmatrix gives it) as two packed bf16 pairs whose sum is exact: hi its
// top 8 significant bits (rounded), lo the rest (at most 3 significant bits; an fp16's exponent
// range lies within bf16's, subnormals included).
__device__ __forceinline__ void split2_f16(uint32_t u, uint32_t& hi, uint32_t& lo) {
  float f[2];
  unpack2(u, static_cast<__half*>(nullptr), f);
  __nv_bfloat16* const tag = nullptr;
  hi = pack2(f[0], f[1], tag);
  lo = pack2(f[0] - bf16_lo(hi), f[1] - bf16_hi(hi), tag);
}

// P0 / P1 for one 16-row m-tile: acc[np][h] = A (16 x K) times the columns np * 16 + h * 8 +
// [0, 8) of qk16 rows as bcol maps them (P0: [q_0..q_T-1, k_0..k_T-1], zero beyond 2T; P1: q_t at
// column t and k_t at TP + t). a_frags(ks, a) gives the A
// fragments of k-step ks as NA terms whose products add: one for a bf16 tile (by ldmatrix), two
// for an fp16 tile (split2_f16), three for an fp32 tile (each element split into three bf16
// terms, 24 bits; q and k are bf16, so every product is exact and only the fp32 sums round).
// bcol(col): the qk16 row (or the zero row) that column col of the product reads.
template <int K, int NA, typename AFrags, typename BCol>
__device__ __forceinline__ void chunk_dots(float (&acc)[2][2][4], AFrags a_frags, BCol bcol, int np_count, int lane) {
#pragma unroll
  for (int np = 0; np < 2; ++np)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[np][h][i] = 0.f;
  // ldmatrix of B: lanes 0-7 columns 0-7 low k half, 8-15 columns 0-7 high half, 16-31 columns 8-15.
  const int bcl = (lane & 7) + ((lane >> 4) << 3);
  const int bk = ((lane >> 3) & 1) << 3;
#pragma unroll
  for (int ks = 0; ks < K / 16; ++ks) {
    uint32_t a[NA][4];
    a_frags(ks, a);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      if (np < np_count) {
        uint32_t b[4];
        ldsm_x4(b, bcol(np * 16 + bcl) + ks * 16 + bk);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int t = 0; t < NA; ++t) mma_bf16(acc[np][h], a[t], b[2 * h], b[2 * h + 1]);
      }
    }
  }
}

// The three-term A fragments of an fp32 tile's m-tile for chunk_dots. a_pair(h, k): the
// elements (k, k + 1) of the lane's row g + 8 h of the m-tile (the mma A-fragment layout: lane
// (g, t4) holds columns 2 t4, 2 t4 + 1 and 8 + 2 t4, 9 + 2 t4 of each k-step); ChunkTile's
// swizzle spreads a warp's loads over distinct banks (fp32 tiles are KV only: two scalars from
// rows k and k + 1).
template <typename APair>
__device__ __forceinline__ void chunk_split_frags(APair a_pair, int ks, int lane, uint32_t (&a)[3][4]) {
  const int k0 = ks * 16 + 2 * (lane & 3);
  const float2 x[4] = {a_pair(0, k0), a_pair(1, k0), a_pair(0, k0 + 8), a_pair(1, k0 + 8)};
#pragma unroll
  for (int i = 0; i < 4; ++i) split3_bf16(x[i].x, x[i].y, a[0][i], a[1][i], a[2][i]);
}

// The m-tile's rows [0, nrows) of acc into dst (row stride ds floats), columns < T2.
__device__ __forceinline__ void chunk_store_acc(const float (&acc)[2][2][4], float* dst, int ds,
                                                int nrows, int T2, int np_count, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int np = 0; np < 2; ++np)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = np * 16 + h * 8 + 2 * t4;
      if (np >= np_count || col >= T2) continue;  // T2 even: col + 1 < T2 too
      if (g < nrows) {
        dst[g * ds + col] = acc[np][h][0];
        dst[g * ds + col + 1] = acc[np][h][1];
      }
      if (g + 8 < nrows) {
        dst[(g + 8) * ds + col] = acc[np][h][2];
        dst[(g + 8) * ds + col + 1] = acc[np][h][3];
      }
    }
}

// 16-bit: five resident blocks (96 registers; one 8-byte spill since P1..P3 moved into
// registers): shared memory admits them up to T = 10 at K = 128 (42.0 KiB at T = 8: no X, q and
// k staged into qk16, v raw). Measured on the H200 (ec9e84c against 511d0b7, which had four at
// T = 6..8): T = 6..8 from B = 64 0.87-0.91x. Beyond T = 10, four (T = 16: 52.8 KiB, 0.81-0.84x
// against 511d0b7's three). fp32: the tile alone is 32 KB at the default 64 rows of K = 128:
// four at most.
template <typename S>
constexpr int kChunkMinBlocks = std::is_same_v<S, float> ? 4 : 5;

// kKv: the state in the KV layout ([P, HV, K, V]); the tile keeps it (ChunkTile), ldmatrix.trans
// and per-element fragment accesses read it as the VK rows the phases work on, and P4 stores
// its rows k. No stochastic rounding (the planner keeps a rounding seed on the token loop).
// kSr: the stochastic-rounding store (16-bit VK with a rounding seed); the kernel without it has
// none of its code (as the token loop's kernels, vk_launch.cuh: its runtime branch alone cost the
// kernel ~10% at T = 4).
template <typename S, int K, bool kKv = false, bool kSr = false>
__global__ void __launch_bounds__(kVkThreads, kChunkMinBlocks<S>)
    decode_vk_chunk_kernel(const __grid_constant__ Problem p, const Geometry geo) {
  constexpr bool kF32 = std::is_same_v<S, float>;
  constexpr bool kF16 = std::is_same_v<S, __half>;
  // VK's fp32 token loop is faster at every T measured (chunk_min_heads, decode_cuda.cu).
  static_assert(!kF32 || kKv, "an fp32 state takes the chunked kernel in the KV layout only");
  static_assert(!kSr || (!kF32 && !kKv), "stochastic rounding in the chunked kernel: 16-bit VK only");
  constexpr int QKS = K + kQk16Pad;
  constexpr int VE = kVecElems<S>;
  constexpr int CH = K / VE;  // 16-byte pieces per state row
  constexpr int kWarps = kVkThreads / 32;
  const int RT = geo.tile_rows;  // a multiple of 16 (host-checked)
  const int T = static_cast<int>(p.T);
  const int T2 = 2 * T;
  const VkChunkSmem lay(RT, K, T, geo.raw_bytes, static_cast<int>(sizeof(S)));

  extern __shared__ float4 smem4[];
  unsigned char* const base = reinterpret_cast<unsigned char*>(smem4);
  S* const tile_s = reinterpret_cast<S*>(base);
  StageSmem sm;
  sm.chunk = geo.chunk;
  sm.raw = base + lay.raw;
  sm.q = sm.k = nullptr;  // not staged: the products use the raw bits (qk16)
  sm.tok = reinterpret_cast<float*>(base + lay.tok);
  sm.v = nullptr;  // v stays raw (bf16, as q and k: host-checked) in the raw area: vraw
  sm.qk16 = reinterpret_cast<uint16_t*>(base + lay.qk16);
  float* const graw = reinterpret_cast<float*>(base + lay.graw);
  float* const Akk = reinterpret_cast<float*>(base + lay.tabs);
  float* const Aqk = Akk + kMaxChunk * kMaxChunk;
  float* const ga = Aqk + kMaxChunk * kMaxChunk;
  float* const gc = ga + kMaxChunk;
  float* const gw = gc + kMaxChunk;
  float* const gT = gw + kMaxChunk;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const BlockCoords bc = block_coords(p, geo);
  const int64_t hv = bc.hv, n = bc.n;
  const int64_t row0 = static_cast<int64_t>(bc.tile) * RT;

  const uint16_t* const qk = sm.qk16;
  const uint16_t* const zrow = qk + T2 * QKS;
  const int mts = RT / 16;
  const int np_count = (T2 + 15) / 16;
  const int g = lane >> 2, t4 = lane & 3;
  const int arow = (lane & 7) + (((lane >> 3) & 1) << 3);  // ldmatrix of A: row in the m-tile
  const int ahalf = lane >> 4;                              // low or high 8 of the 16 k (or columns)
  const float* const tok = sm.tok;

  // The Gram matrix of the raw q and k rows (on tensor cores, the rows as A) and the T x T
  // tables of the solve need only the inputs: the last warp computes them while the state
  // tile is still in flight, off the block's critical path (after P1 they held the barrier).
  const auto gram_col = [&](int col) { return col < T2 ? qk + col * QKS : zrow; };
  const auto gram_and_tables = [&]() {
    __syncthreads();  // qk16 and the per-token scalars written by every thread
    if (warp != kWarps - 1) return;
    float acc[2][2][4];
    for (int gt = 0; gt < np_count; ++gt) {
      const int i = gt * 16 + arow;
      const uint16_t* const ap = (i < T2 ? qk + i * QKS : zrow) + (ahalf << 3);
      chunk_dots<K, 1>(
          acc, [&](int ks, uint32_t(&a)[1][4]) { ldsm_x4(a[0], ap + ks * 16); }, gram_col, np_count, lane);
      chunk_store_acc(acc, graw + gt * 16 * lay.gs, lay.gs, T2 - gt * 16, T2, np_count, lane);
    }
    __syncwarp();
    // The decay products directly (never as ratios of cumulative products, which underflow),
    // times the norms; rows t, columns s.
    for (int idx = lane; idx < T * T; idx += 32) {
      const int t = idx / T, s = idx - t * T;
      if (s > t) continue;
      float G = 1.f;
      for (int i = s + 1; i <= t; ++i) G *= tok[i * kTokScalars + 3];
      const float rks = G * tok[s * kTokScalars + 1];
      Aqk[t * kMaxChunk + s] = rks * tok[t * kTokScalars + 0] * graw[t * lay.gs + T + s];
      if (s < t)
        Akk[t * kMaxChunk + s] = rks * tok[t * kTokScalars + 1] * graw[(T + t) * lay.gs + T + s];
    }
    if (lane < T) {
      float gam = 1.f, tail = 1.f;
      for (int i = 0; i <= lane; ++i) gam *= tok[i * kTokScalars + 3];
      for (int i = lane + 1; i < T; ++i) tail *= tok[i * kTokScalars + 3];
      ga[lane] = gam * tok[lane * kTokScalars + 1];
      gc[lane] = gam * tok[lane * kTokScalars + 0];
      gw[lane] = tail * tok[lane * kTokScalars + 1];
      if (lane == T - 1) gT[0] = gam;
    }
  };
  WarpSlots slots;
  if (!vk_tile_begin<S, K, true, decltype(gram_and_tables), false, NoFuse, kKv>(p, geo, sm, tile_s, bc, row0, RT,
                                                                               slots, gram_and_tables))
    return;
  const ChunkTile<S, K, kKv> tile(tile_s, RT);
  // A 16-bit tile's A blocks of m-tile mt: a_blocks(mt)(ks), the lane's ldmatrix address for
  // k-step ks, read by P1 and read and written back by P3. VK: row 16 mt + arow through the
  // swizzle. KV (.trans): lanes 8 m .. 8 m + 7 address rows k = 16 ks + 8 (m >> 1) + i of the
  // columns v = 16 mt + 8 (m & 1) .. + 7, whose transposes are the fragment's a[m]
  // ((16 ks + 8 (m >> 1) + i) & 7 == i, so the column does not depend on ks).
  const auto a_blocks = [&](int mt) {
    S* base;
    int sw = 0;
    if constexpr (kKv) {
      const int m = lane >> 3, i = lane & 7;
      base = tile_s + (((m >> 1) << 3) + i) * RT + tile.kv_col(mt * 16 + ((m & 1) << 3), i);
    } else {
      const int r = mt * 16 + arow;
      base = tile_s + r * K;
      sw = r & 7;
    }
    return [=](int ks) { return kKv ? base + ks * 16 * RT : base + (((ks * 2 + ahalf) ^ sw) << 3); };
  };

  // P1..P3 per m-tile, each warp's m-tiles in its own registers. P1's accumulators hold, in lane
  // (g, t4), rows g and g + 8 of the m-tile and columns 8 h + 2 t4, + 1 of each 16-column block:
  // with q_t in column t and k_t in column TP + t (TP = 8 up to T = 8, else 16; P1 reads the
  // qk16 rows through p1_col), the lane holds S0 q_t and S0 k_t of its own tokens
  // t_j = 8 (j >> 1) + 2 t4 + (j & 1), and those are the columns of P3's A fragment too. P2
  // solves each row across its quad (the four lanes of rows g and g + 8): at token t the owner
  // lane computes d_t and broadcasts it by shuffle, and every lane folds it into its tokens' sums.
  // The operations and their order are the thread-per-row solve's, so are the results; no
  // staging buffer between the phases and no block barrier.
  const int64_t wslot = p.update_state ? slots.write : -1;  // block-uniform
  // P3: S = gamma_T-1 * S0 + W K per m-tile, in place in the tile. A = the weights (16 rows x
  // 16 tokens, zero beyond T) as three bf16 terms; B = k rows by ldmatrix.trans (tokens beyond
  // T read the zero row); C starts as gamma * S0.
  const float gam_end = gT[0];
  // Stochastic rounding of the final state (the state after token T - 1), when asked for
  // (16-bit states only: an fp32 state is stored as computed).
  constexpr bool sr = kSr;  // the launcher picks kSr only with a rounding seed
  const uint32_t key = sr ? sr_key(slots.sr_row, hv, p.T - 1) : 0u;
  uint32_t ja0, jc0, ja1, jc1;  // the LCG jumps to this lane's elements 2 * t4, 2 * t4 + 1
  sr_lcg_jump(2 * t4, ja0, jc0);
  sr_lcg_jump(2 * t4 + 1, ja1, jc1);
  // ldmatrix.trans of B: the lane's row is token arow (the A-row pattern), columns + 8 * ahalf.
  const uint16_t* const bp = (arow < T ? qk + (T + arow) * QKS : zrow) + (ahalf << 3);
  const int64_t obase = n * p.o.s[0] + hv * p.o.s[2] + row0;
  const int vin = tile_extent(p.V, row0, RT);  // the tile's rows within V
  const __nv_bfloat16* const vraw = reinterpret_cast<const __nv_bfloat16*>(sm.raw);  // [T][RT]
  const auto phases = [&](auto tp) {
    constexpr int TP = decltype(tp)::value;
    constexpr int NJ = TP / 4;  // tokens per lane
    const auto p1_col = [&](int col) {
      const int t = col < TP ? col : col - TP;
      return t < T ? qk + (col < TP ? t : T + t) * QKS : zrow;
    };
    int tj[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) tj[j] = 8 * (j >> 1) + 2 * t4 + (j & 1);
    for (int mt = warp; mt < mts; mt += kWarps) {
      float acc[2][2][4];
      if constexpr (kF32) {
        // KV (fp32 is KV only): the lane's k are 2 t4 and 2 t4 + 1 modulo 8, four fixed places
        // within a row k.
        const int r = mt * 16 + g;
        const int c00 = tile.kv_col(r, 2 * t4), c01 = tile.kv_col(r, 2 * t4 + 1);
        const int c10 = tile.kv_col(r + 8, 2 * t4), c11 = tile.kv_col(r + 8, 2 * t4 + 1);
        const auto a_pair = [&](int h, int k) {
          const float* const row = tile_s + k * RT;
          return h == 0 ? make_float2(row[c00], row[RT + c01]) : make_float2(row[c10], row[RT + c11]);
        };
        chunk_dots<K, 3>(
            acc, [&](int ks, uint32_t(&a)[3][4]) { chunk_split_frags(a_pair, ks, lane, a); }, p1_col, TP / 8, lane);
      } else {
        const auto a_at = a_blocks(mt);
        const auto load = [&](int ks, uint32_t(&x)[4]) {
          if constexpr (kKv) {
            ldsm_x4_trans(x, a_at(ks));
          } else {
            ldsm_x4(x, a_at(ks));
          }
        };
        if constexpr (kF16) {
          chunk_dots<K, 2>(
              acc,
              [&](int ks, uint32_t(&a)[2][4]) {
                uint32_t x[4];
                load(ks, x);
#pragma unroll
                for (int i = 0; i < 4; ++i) split2_f16(x[i], a[0][i], a[1][i]);
              },
              p1_col, TP / 8, lane);
        } else {
          chunk_dots<K, 1>(
              acc, [&](int ks, uint32_t(&a)[1][4]) { load(ks, a[0]); }, p1_col, TP / 8, lane);
        }
      }

      // P2.
      float x[2][NJ], o[2][NJ], d[2][NJ];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = mt * 16 + g + 8 * e;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const float c = acc[j >> 2][(j >> 1) & 1][2 * e + (j & 1)];
          const float a = acc[TP / 16 + (j >> 2)][(TP / 8 + (j >> 1)) & 1][2 * e + (j & 1)];
          const bool in = tj[j] < T;
          x[e][j] = in ? fmaf(-ga[tj[j]], a, __bfloat162float(vraw[tj[j] * RT + r])) : 0.f;
          o[e][j] = in ? gc[tj[j]] * c : 0.f;
          d[e][j] = 0.f;
        }
      }
#pragma unroll
      for (int t = 0; t < TP; ++t) {
        if (t >= T) break;
        const int jo = ((t >> 3) << 1) | (t & 1), owner = (t & 7) >> 1;
        const float bt = tok[t * kTokScalars + 4];
        float dt[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) dt[e] = __shfl_sync(0xffffffffu, bt * x[e][jo], (lane & ~3) | owner);
        if (t4 == owner) d[0][jo] = dt[0], d[1][jo] = dt[1];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          if (tj[j] >= T || tj[j] < t) continue;
          if (tj[j] > t) {
            const float akk = Akk[tj[j] * kMaxChunk + t];
            x[0][j] = fmaf(-akk, dt[0], x[0][j]);
            x[1][j] = fmaf(-akk, dt[1], x[1][j]);
          }
          const float aqk = Aqk[tj[j] * kMaxChunk + t];
          o[0][j] = fmaf(aqk, dt[0], o[0][j]);
          o[1][j] = fmaf(aqk, dt[1], o[1][j]);
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = mt * 16 + g + 8 * e;
        if (r < vin) {
#pragma unroll
          for (int j = 0; j < NJ; ++j)
            if (tj[j] < T) store_scalar(p.o.data, p.o.dtype, obase + tj[j] * p.o.s[1] + r, o[e][j]);
        }
      }
      if (wslot < 0) continue;

      // P3: the weights G_T-1,s rk_s d_s of the lane's tokens are its A fragments' elements.
      float w[2][NJ];
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int j = 0; j < NJ; ++j) w[e][j] = tj[j] < T ? gw[tj[j]] * d[e][j] : 0.f;
      uint32_t ah[4] = {}, am[4] = {}, al[4] = {};
      split3_bf16(w[0][0], w[0][1], ah[0], am[0], al[0]);
      split3_bf16(w[1][0], w[1][1], ah[1], am[1], al[1]);
      if constexpr (NJ == 4) {
        split3_bf16(w[0][2], w[0][3], ah[2], am[2], al[2]);
        split3_bf16(w[1][2], w[1][3], ah[3], am[3], al[3]);
      }
      const int rg = mt * 16 + g;
      if constexpr (kF32) {
        // fp32 (KV only): the C fragment (rows rg, rg + 8; columns 2 t4, 2 t4 + 1 of n-tile nt)
        // sits in rows k = 8 nt + 2 t4 and k + 1 of the tile, at the lane's four fixed places
        // (k mod 8 as in P1); the sums replace it as computed.
        constexpr int NG = 8;
        const int c00 = tile.kv_col(rg, 2 * t4), c01 = tile.kv_col(rg, 2 * t4 + 1);
        const int c10 = tile.kv_col(rg + 8, 2 * t4), c11 = tile.kv_col(rg + 8, 2 * t4 + 1);
#pragma unroll
        for (int n0 = 0; n0 < K / 8; n0 += NG) {
          float2 u0[NG], u1[NG];
#pragma unroll
          for (int i = 0; i < NG; ++i) {
            const float* const row = tile_s + (8 * (n0 + i) + 2 * t4) * RT;
            u0[i] = make_float2(row[c00], row[RT + c01]);
            u1[i] = make_float2(row[c10], row[RT + c11]);
          }
#pragma unroll
          for (int i = 0; i < NG; i += 2) {
            uint32_t b[4];
            ldsm_x4_trans(b, bp + (n0 + i) * 8);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float acc[4] = {gam_end * u0[i + h].x, gam_end * u0[i + h].y, gam_end * u1[i + h].x,
                              gam_end * u1[i + h].y};
              mma_bf16(acc, ah, b[2 * h], b[2 * h + 1]);
              mma_bf16(acc, am, b[2 * h], b[2 * h + 1]);
              mma_bf16(acc, al, b[2 * h], b[2 * h + 1]);
              u0[i + h] = make_float2(acc[0], acc[1]);
              u1[i + h] = make_float2(acc[2], acc[3]);
            }
          }
#pragma unroll
          for (int i = 0; i < NG; ++i) {
            float* const row = tile_s + (8 * (n0 + i) + 2 * t4) * RT;
            row[c00] = u0[i].x, row[RT + c01] = u0[i].y;
            row[c10] = u1[i].x, row[RT + c11] = u1[i].y;
          }
        }
      } else {
        // The C fragments of n-tiles i, i + 1 (rows rg, rg + 8; k = 8 i + 2 t4, + 1 and 8 (i + 1) + ..)
        // are, as bf16 pairs, the A fragment of the 16 x 16 block (m-tile, k = 8 i ..): one ldmatrix
        // reads them and one stmatrix writes them back, at P1's addresses (.trans for the KV tile),
        // instead of four 4-byte accesses (VK) or eight 2-byte ones (KV) each way.
        // Groups of 8 n-tiles (8 columns each): all loads of a group first, then its products,
        // then its stores, so that no load waits behind the previous n-tile's store (the
        // swizzled addresses are not provably distinct). Measured equal to the interleaved loop
        // (docs/design.md section 4): the per-block chain lies elsewhere.
        constexpr int NG = 8;
        const auto a_at = a_blocks(mt);  // P1's addresses
#pragma unroll
        for (int n0 = 0; n0 < K / 8; n0 += NG) {
          uint32_t u[NG][2];
#pragma unroll
          for (int i = 0; i < NG; i += 2) {
            uint32_t x[4];
            if constexpr (kKv) {
              ldsm_x4_trans(x, a_at((n0 + i) / 2));
            } else {
              ldsm_x4(x, a_at((n0 + i) / 2));
            }
            u[i][0] = x[0], u[i][1] = x[1], u[i + 1][0] = x[2], u[i + 1][1] = x[3];
          }
#pragma unroll
          for (int i = 0; i < NG; i += 2) {
            uint32_t b[4];
            ldsm_x4_trans(b, bp + (n0 + i) * 8);
            // Stochastic rounding: the lanes of a quad (same rows) share the hashes of the four
            // groups of 8 elements they store here (n-tiles i, i + 1; rows rg, rg + 8): lane t4
            // computes group (h = t4 & 1, row half t4 >> 1) and the quad reads them by shuffle
            // (each lane computing all four cost the chunked kernel +30% at T = 4).
            uint32_t gseed = 0;
            if (sr) gseed = sr_group_seed(key, (((row0 + rg) * K + (n0 + i + (t4 & 1)) * 8) >> 3) + (t4 >> 1) * K);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float s0[2], s1[2];
              unpack2(u[i + h][0], static_cast<S*>(nullptr), s0);
              unpack2(u[i + h][1], static_cast<S*>(nullptr), s1);
              float acc[4] = {gam_end * s0[0], gam_end * s0[1], gam_end * s1[0], gam_end * s1[1]};
              mma_bf16(acc, ah, b[2 * h], b[2 * h + 1]);
              mma_bf16(acc, am, b[2 * h], b[2 * h + 1]);
              mma_bf16(acc, al, b[2 * h], b[2 * h + 1]);
              if (sr) {  // element (v, k): e = v * K + k; this lane's pair is 2 * t4, 2 * t4 + 1 of its group
                const int quad = lane & ~3;
                const uint32_t x0 = __shfl_sync(0xffffffffu, gseed, quad | h);
                const uint32_t x1 = __shfl_sync(0xffffffffu, gseed, quad | 2 | h);
                u[i + h][0] =
                    sr_pack2(acc[0], acc[1], (x0 * ja0 + jc0) >> 16, (x0 * ja1 + jc1) >> 16, static_cast<S*>(nullptr));
                u[i + h][1] =
                    sr_pack2(acc[2], acc[3], (x1 * ja0 + jc0) >> 16, (x1 * ja1 + jc1) >> 16, static_cast<S*>(nullptr));
              } else {
                u[i + h][0] = pack2(acc[0], acc[1], static_cast<S*>(nullptr));
                u[i + h][1] = pack2(acc[2], acc[3], static_cast<S*>(nullptr));
              }
            }
          }
#pragma unroll
          for (int i = 0; i < NG; i += 2) {
            const uint32_t x[4] = {u[i][0], u[i][1], u[i + 1][0], u[i + 1][1]};
            if constexpr (kKv) {
              stsm_x4_trans(a_at((n0 + i) / 2), x);
            } else {
              stsm_x4(a_at((n0 + i) / 2), x);
            }
          }
        }
      }
    }
  };
  if (T <= 8) {
    phases(std::integral_constant<int, 8>{});
  } else {
    phases(std::integral_constant<int, 16>{});
  }
  if (wslot < 0) return;

  // P4: the tile to the pool, 16-byte pieces in order (coalesced). VK: each warp its own rows
  // (its m-tiles, which P3 wrote). KV: whole rows k of RT columns by the block, after a barrier
  // (as the copy-in; the m-tiles of a row k are every warp's): a warp's 16 columns of each row
  // were 32 bytes of 16 rows per store at bf16, and their tile reads two-way bank conflicts.
  S* const dst = static_cast<S*>(p.state.data) + wslot * p.state.s[0] + hv * p.state.s[1] +
                 (kKv ? row0 : row0 * p.state.s[2]);
  const int64_t ss2 = p.state.s[2];
  if constexpr (kKv) {
    __syncthreads();
    kv_tile_store<VE>(tid, K, RT, vin, dst, ss2, [&](int c, int k) { return tile.elem(c * VE, k); });
  } else {
    __syncwarp();
    static_assert(32 % CH == 0, "P4: a warp's lanes keep one piece column each");
    for (int mt = warp; mt < mts; mt += kWarps) {
      tile_piece_walk<VE>(lane, 32, 16, CH, dst + mt * 16 * ss2, ss2, [&](int r, int c, S* g) {
        if (mt * 16 + r < vin)
          store_state_vec<S, true>(g, *reinterpret_cast<const Packed<S>*>(tile.elem(mt * 16 + r, c * VE)));
      });
    }
  }
}

}  // namespace gdn::detail::cuda
