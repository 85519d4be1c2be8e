// The group kernel: one block per (row n, q/k head h), no thread-block cluster, for grids that
// fill the GPU. It runs the fused step (gdn::fused_decode, docs/semantics.md section 6; kConv)
// and, for the KV layout, decode (gdn::decode, section 2; !kConv).
//
// The cluster form (fused.cuh on the tile kernels) pays the conv, the q/k norms and the
// exchange once per block of a (row, q/k head), and a block holds its SM slot through phases
// with no state bytes in flight (docs/design.md, "The fused step on an H200"). Here one block
// owns the whole GVA group of h: it convolves the 2K q/k channels and the group's v channels
// once, writes their conv state (it alone reads and writes those channels, so an in-place update
// cannot race), and then streams the group's state through a ring of NB shared-memory buffers
// of RT rows each ("stages": RT rows of one value head), the next stages landing while the
// current one computes. The conv itself runs while the first NB stages are in flight. Without
// the conv (decode) the block stages q and k of h and the group's v instead, as the tile
// kernels do (stage_issue_plan), and the rest is the same.
//
// Both state layouts (kKv). VK: a stage is RT = kGroupRows rows of one value head, each
// thread holding RR rows of a K-slice (vk_step's math). KV: a stage is the K x VT tile of VT
// columns of one value head (16 KB: VT = 64 at 16-bit states, 32 at fp32), each thread holding
// K / 16 rows of one 16-byte column vector (GroupKvShape; the KV kernels' math, kv_tokens); the
// per-token sums cross the block through kv_reduce's shared buffers. In both, a thread copies
// exactly the pieces it later reads, so a stage needs no barrier to land or to be reused (VK's
// two barriers per stage cost 3-9% of the fused step from B = 64; docs/design.md).
//
// Host: plan_fused_group and plan_kv_group (decode_cuda.cu). K = 128, 16-byte state rows; the
// fused step the conv's 16-byte path (mixed_qkv, conv state and taps of one 16-bit dtype; the
// conv state channels-contiguous or channel-major packed, fused_conv_path), decode the group's v
// heads adjacent. Other calls take the cluster form or decode's tile kernels.
//
// kHpb = 2 (the fused step, VK, 16-bit states; plan_fused_group's rule): a block takes two
// adjacent q/k heads, so one conv phase, slot chain and barrier set serve both heads' value
// heads (docs/design.md, "Two q/k heads per block").
#pragma once

#include "kv.cuh"
#include "vk.cuh"

namespace gdn::detail::cuda {

constexpr int kGroupThreads = kVkThreads;
constexpr int kGroupRR = 4;                                   // state rows per thread
constexpr int kGroupRows = kGroupRR * (kGroupThreads / 8);    // RT at K = 128: 64 rows, one pass
constexpr int kGroupMaxBuffers = 4;
constexpr int kGroupBlocksPerSm = 3;  // the register cap (__launch_bounds__): up to 168 per thread
// The fused step's 16-bit KV group kernel on grids past one wave of three blocks per SM: a second
// instantiation for four (128 registers, no spills at round-to-nearest). VK loses more to that
// cap than a fourth block buys (0.98-1.21x slower, 3e5e8ba), 16-bit KV gains (decode_cuda.cu,
// plan_fused_group).
constexpr int kGroupKvBlocksPerSm = 4;
// KV: 8 lanes of 16 bytes along V (a 128-byte line of each row per warp instruction), K / 16
// rows per thread at 128 threads.
template <typename S, int K>
using GroupKvShape = KvShape<S, K, kGroupThreads, 8>;

// Byte offsets of the block's shared memory, each region 16-byte aligned. Host and device build
// it from the same numbers (plan_fused_group, group_kernel).
struct GroupSmem {
  int buf = 0;   // [NB][RT][K] state stages, S (KV: [NB][K][RT], RT = VT columns)
  int q, k;      // [hpb][T][K] fp32 conv outputs at the layout's Pos positions (VkShape, KvShape)
  int v;         // [T][group * V] fp32
  int tok;       // [group][T][kTokScalars]
  int win;       // uint4 [wl][G8] raw windows, [G8][W] taps, [G8] bias (channel-major: [G8][L] raw columns);
                 // decode: raw q [T][K], k [T][K], v [T][group * V] (StageSmem::raw)
  int o;         // [group][T][V] fp32 raw outputs (norm only; the windows' place where they fit)
  int z;         // [group][T][V] raw z (norm with 16-byte rows and a gate)
  int wn;        // [V] raw norm_weight (norm with 16-byte rows)
  int fac;       // [group][T] the norm's factors
  int red;       // KV: kv_reduce's double-buffered partial sums (red_floats)
  int ws;        // int64 [T] conv write slots (fused step)
  int total;
  int G8;        // groups of 8 conv channels: (2 hpb K + group V) / 8
  int wl;        // window rows: old columns first..L-1, then the T inputs
  static constexpr __host__ __device__ int up16(int b) { return (b + 15) / 16 * 16; }
  // raw_bytes: decode's staging bytes (Geometry::raw_bytes); 0 for the fused step's conv windows.
  __host__ __device__ GroupSmem(int K, int V, int group, int T, int W, int L, bool cm, int rt, int nb,
                                int state_bytes, bool norm, int z_bytes, int wn_bytes, int red_floats,
                                int raw_bytes, int hpb = 1) {
    G8 = (2 * hpb * K + group * V) / 8;
    wl = L - conv_first_col(L, W) + T;
    q = up16(nb * rt * K * state_bytes);
    k = q + up16(hpb * T * K * 4);
    v = k + up16(hpb * T * K * 4);
    tok = v + up16(T * group * V * 4);
    win = tok + up16(group * T * kTokScalars * 4);
    const int win_bytes = raw_bytes > 0 ? up16(raw_bytes) : 16 * conv_win_pieces(G8, wl, W, cm ? L : 0);
    const int o_bytes = norm ? up16(group * T * V * 4) : 0;
    // The fused step's raw outputs are first written in the stages, after the stage loop's
    // barrier, when every thread has read the windows (the conv items, the conv state's stores):
    // where they fit, they take the windows' place (Qwen3-Next bf16 T = 8, Qwen3.5 T = 12: one
    // more block per SM).
    o = raw_bytes == 0 && o_bytes <= win_bytes ? win : win + win_bytes;
    z = (o == win ? win + win_bytes : o + o_bytes);
    wn = z + (norm ? up16(group * T * V * z_bytes) : 0);
    fac = wn + (norm ? up16(V * wn_bytes) : 0);
    red = fac + (norm ? up16(group * T * 4) : 0);
    ws = red + up16(red_floats * 4);
    total = ws + kMaxChunk * 8;
  }
};

// Waits until at most n (0..kGroupMaxBuffers) of this thread's committed cp.async groups are
// pending.
__device__ __forceinline__ void cp_async_wait_pending(int n) {
  static_assert(kGroupMaxBuffers == 4);
  switch (n) {
    case 0:
      cp_async_wait_group<0>();
      break;
    case 1:
      cp_async_wait_group<1>();
      break;
    case 2:
      cp_async_wait_group<2>();
      break;
    case 3:
      cp_async_wait_group<3>();
      break;
    default:
      cp_async_wait_group<4>();
      break;
  }
}

// The conv channel of the block's channel c, for its hpb q/k heads h0.. (adjacent in each part of
// mixed_qkv): q: [0, QK), k: [QK, 2 QK), v: their value heads' [2 QK, 2 QK + group V), QK = hpb K.
__device__ __forceinline__ int64_t group_channel(const Problem& p, int64_t h0, int hpb, int c) {
  const int64_t K = p.K, QK = hpb * K;
  return c < QK       ? h0 * K + c
         : c < 2 * QK ? (p.H + h0) * K + (c - QK)
                      : 2 * p.H * K + h0 * (p.HV / p.H) * p.V + (c - 2 * QK);
}

// The conv and SiLU of channels 2 * sub, +1 of 8-channel group g at token t (the inputs landed):
// q and k at their Pos positions (kPairs: an even channel and the next are adjacent there, VK;
// KV spreads them), v in order.
template <class Pos, bool kPairs, int K, int kW, int kHpb>
__device__ __forceinline__ void group_conv_item(const FusedProblem& f, const GroupSmem& lay, char* base, int g,
                                                int sub, int t, int gV) {
  const int G8 = lay.G8;
  const uint32_t* const win = reinterpret_cast<const uint32_t*>(base + lay.win);  // word (row * G8 + g) * 4 + sub
  const uint32_t* const taps = win + lay.wl * G8 * 4 + g * kW * 4 + sub * kW;
  const uint32_t* const bias =
      f.conv_bias.data != nullptr ? win + lay.wl * G8 * 4 + G8 * kW * 4 + g * 4 + sub : nullptr;
  // Every entry is in the window rows (channel-major columns were transposed there,
  // conv_cm_transpose), so no ConvPairEntry: its scratch branch stays in the code unless the
  // compiler can prove the entry index non-negative, which it cannot.
  const int row0 = static_cast<int>(f.L) - (kW - 1) - conv_first_col(static_cast<int>(f.L), kW) + t;
  const uint32_t* const x = win + (row0 * G8 + g) * 4 + sub;
  const float2 y = conv_vec_pair<kW>(taps, bias, [&](int k) { return x[k * G8 * 4]; }, f.x.dtype);
  const int c = g * 8 + 2 * sub, QK = kHpb * K;
  if (c >= 2 * QK) {
    *reinterpret_cast<float2*>(reinterpret_cast<float*>(base + lay.v) + t * gV + (c - 2 * QK)) = y;
    return;
  }
  const int cc = c < QK ? c : c - QK, qh = kHpb == 1 ? 0 : cc / K;  // q/k head qh's element e
  float* const row = reinterpret_cast<float*>(base + (c < QK ? lay.q : lay.k)) + (qh * static_cast<int>(f.step.T) + t) * K;
  const int e = cc - qh * K;
  if constexpr (kPairs) {
    *reinterpret_cast<float2*>(row + Pos{}(e)) = y;
  } else {
    row[Pos{}(e)] = y.x;
    row[Pos{}(e + 1)] = y.y;
  }
}

// Registers for three resident blocks per SM (168; shared memory allows three at 16-bit states and
// T = 1, fewer at fp32 and longer T): a cap of 128 for four was slower everywhere
// (bf16 B = 64 52.5 -> 60.8 us, fp32 83.1 -> 89.4; docs/design.md).
// kSr: the stochastic-rounding store compiled in (as decode's kernels, vk_launch.cuh). kKv: the
// KV layout (geo.tile_rows is then the stage's VT columns). kConv: the fused step; without it,
// decode (f.step alone; the KV layout, no norm), its inputs staged as the tile kernels stage them.
// kHpb: q/k heads per block (the fused step's VK three-block kernel only; plan_fused_group).
template <typename S, int K, bool kNorm, bool kSr = true, bool kKv = false, bool kConv = true,
          int kMinBlocks = kGroupBlocksPerSm, int kHpb = 1>
__global__ void __launch_bounds__(kGroupThreads, kMinBlocks)
    group_kernel(const __grid_constant__ FusedProblem f, const Geometry geo) {
  constexpr int NT = kGroupThreads, RR = kGroupRR;
  using Sh = VkShape<S, K, 1>;
  using Kv = GroupKvShape<S, K>;
  constexpr int VE = Sh::VE, NV = Sh::NV, L = Sh::L, G = Sh::G;
  static_assert(G * RR == kGroupRows || K != 128);
  static_assert(!kKv || Kv::LV * Kv::KG == NT);
  static_assert(kConv || (kKv && !kNorm), "decode's group kernel: the KV layout, no norm");
  static_assert(kHpb == 1 || (kConv && !kKv && kMinBlocks == kGroupBlocksPerSm),
                "several q/k heads per block: the fused step's VK three-block kernel");
  const Problem& p = f.step;
  const int T = static_cast<int>(p.T), V = static_cast<int>(p.V), W = static_cast<int>(f.W);
  const int Lc = static_cast<int>(f.L);
  // hpb q/k heads per block, each with qgroup value heads: the block's group value heads hv0..
  // are adjacent, and so are its q, k and v channels in mixed_qkv. A constant: a runtime count
  // cost 1-2% at T >= 4 where it was one (docs/design.md).
  constexpr int hpb = kHpb;
  const int qgroup = static_cast<int>(p.HV / p.H), group = qgroup * hpb;
  const int gV = group * V;
  const int RT = geo.tile_rows, tiles = geo.tiles, NB = geo.buffers, NS = group * tiles;
  const bool norm_vec = kNorm && geo.norm_vec;
  const int zs = dtype_bytes(f.z.dtype), wns = dtype_bytes(f.norm_weight.dtype);
  const int cm = geo.conv_cm ? Lc : 0;
  const GroupSmem lay(K, V, group, T, W, Lc, cm > 0, RT, NB, static_cast<int>(sizeof(S)), kNorm,
                      norm_vec && f.z.data != nullptr ? zs : 0, norm_vec ? wns : 0, kKv ? Kv::kRedFloats : 0,
                      kConv ? 0 : geo.raw_bytes, hpb);

  extern __shared__ float4 smem4[];
  char* const base = reinterpret_cast<char*>(smem4);
  S* const buf = reinterpret_cast<S*>(base + lay.buf);
  float* const q_s = reinterpret_cast<float*>(base + lay.q);
  float* const k_s = reinterpret_cast<float*>(base + lay.k);
  float* const v_s = reinterpret_cast<float*>(base + lay.v);
  float* const tok_s = reinterpret_cast<float*>(base + lay.tok);
  uint4* const win = reinterpret_cast<uint4*>(base + lay.win);
  float* const o_s = reinterpret_cast<float*>(base + lay.o);
  float* const fac_s = reinterpret_cast<float*>(base + lay.fac);
  int64_t* const ws_s = reinterpret_cast<int64_t*>(base + lay.ws);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31;
  const int rg = tid / L, j = tid % L;  // VK: row group and lane within the row (VkShape)
  const int vl = lane % Kv::LV, kgw = lane / Kv::LV, kg = warp * Kv::KGW + kgw;  // KV (KvShape)
  const uint32_t bx = blockIdx.x, H32 = static_cast<uint32_t>(p.H / hpb);  // blocks per row
  const int64_t n = bx / H32, h = (bx - static_cast<uint32_t>(n) * H32) * hpb;  // the first q/k head
  const int64_t hv0 = h * qgroup;
  const int G8 = lay.G8, first = conv_first_col(Lc, W), lc = Lc - first;

  // The staged tokens as the tile kernels' helpers see them (decode's raw inputs in the window
  // area); in the stages, tok: the stage's head's token scalars.
  StageSmem sm{};
  sm.raw = reinterpret_cast<unsigned char*>(win);
  sm.q = q_s;
  sm.k = k_s;
  sm.v = v_s;
  sm.tok = tok_s;
  sm.chunk = T;

  // decode: q and k of head h and the group's v (its heads adjacent: v's head stride is V, host-
  // checked), raw, into the staging area; the plan computed while the block waits (stage_plan).
  StagePlan plan;
  if constexpr (!kConv) {
    plan = stage_plan(p, geo, sm, n, 0, T, hv0, 0, gV);
    stage_plan_pin(plan);
  }
  warm_params(f);
  pdl_wait();
  pdl_launch_dependents();

  // What does not depend on the slot, first: the new conv inputs, taps and bias, the norm's rows
  // (decode: q, k and v).
  if constexpr (!kConv) {
    stage_issue_plan<NT>(plan);
  } else {
    uint4* const taps = win + lay.wl * G8;
    uint4* const bias = taps + G8 * W;
    for (int g = tid; g < G8; g += NT) {
      const int64_t d = group_channel(p, h, hpb, g * 8);
      const char* const xs = static_cast<const char*>(f.x.data) + (n * f.x.s[0] + d) * 2;
      for (int t = 0; t < T; ++t) cp_async16(win + (lc + t) * G8 + g, xs + t * f.x.s[1] * 2);
      const char* const wsrc = static_cast<const char*>(f.conv_weight.data) + d * W * 2;
      for (int k = 0; k < W; ++k) cp_async16(taps + g * W + k, wsrc + k * 16);
      if (f.conv_bias.data != nullptr) cp_async16(bias + g, static_cast<const char*>(f.conv_bias.data) + d * 2);
    }
    if constexpr (kNorm) {
      if (norm_vec) {
        const int per = V * wns / 16;
        const char* const w = static_cast<const char*>(f.norm_weight.data);
        for (int i = tid; i < per; i += NT) cp_async16(base + lay.wn + i * 16, w + i * 16);
        if (f.z.data != nullptr) {
          const int zper = V * zs / 16;  // pieces per (head, token) row
          for (int i = tid; i < group * T * zper; i += NT) {
            const int c = i % zper, ht = i / zper, t = ht % T, hi = ht / T;
            const char* const z =
                static_cast<const char*>(f.z.data) + (n * f.z.s[0] + t * f.z.s[1] + (hv0 + hi) * f.z.s[2]) * zs;
            cp_async16(base + lay.z + i * 16, z + c * 16);
          }
        }
      }
    }
  }
  cp_async_commit();
  GateInputs gin;
  const int gh = tid / T, gt = tid - gh * T;  // the (head, token) whose gates this thread loads
  if (tid < group * T) gin = load_gate_inputs(p, n, gt, hv0 + gh);

  const WarpSlots slots = resolve_row_warp(p, n, lane);
  if (slots.read < 0) {
    cp_async_wait_all();  // no copy may land in shared memory after the block has exited
    for (int i = 0; i < group; ++i) finish_padded_row<NT>(p, slots, n, hv0 + i, 0, 0, V);
    return;
  }
  // The read slot's conv columns, then the first NB state stages (empty groups past the last
  // stage keep one group per stage, so the waits below count the same everywhere).
  uint4* const scratch = conv_cm_scratch(win, G8, lay.wl, W);
  if constexpr (kConv) {
    for (int g = tid; g < G8; g += NT)
      conv_vec_issue_columns(f, win, scratch, cm, G8, g, group_channel(p, h, hpb, g * 8), slots.read, first);
    cp_async_commit();
  }
  const auto issue_stage = [&](int s) {
    if (s < NS) {
      const int hi = s / tiles;
      const int64_t r0 = static_cast<int64_t>(s - hi * tiles) * RT;  // VK: the first row; KV: column
      const S* const head = static_cast<const S*>(p.state.data) + slots.read * p.state.s[0] + (hv0 + hi) * p.state.s[1];
      S* const dst = buf + (s % NB) * RT * K;
      if constexpr (kKv) {  // this thread's own rows i * KG + kg of its column vector
#pragma unroll
        for (int i = 0; i < Kv::RPT; ++i) {
          const int r = i * Kv::KG + kg;
          cp_async16(dst + r * RT + vl * VE, head + r * p.state.s[2] + r0 + vl * VE);
        }
      } else {  // this thread's own rows rg + r * G and pieces i * L + j (the loads below)
        const S* const src = head + r0 * p.state.s[2];
#pragma unroll
        for (int r = 0; r < RR; ++r)
#pragma unroll
          for (int i = 0; i < NV; ++i) {
            const int row = rg + r * G, c = i * L + j;
            cp_async16(dst + row * K + c * VE, src + row * p.state.s[2] + c * VE);
          }
      }
    }
    cp_async_commit();
  };
  for (int s = 0; s < NB; ++s) issue_stage(s);

  if (tid < group * T) {
    float g, beta;
    gates_from_inputs(p, gin, g, beta);
    tok_s[tid * kTokScalars + 3] = g;  // tid = gh * T + gt
    tok_s[tid * kTokScalars + 4] = beta;
  }
  if (kConv && warp == 0) warp_store_write_slots(p, slots, n, ws_s);
  cp_async_wait_pending(NB);  // this thread's conv inputs and columns (decode: q, k, v) landed
  __syncthreads();
  if (kConv && cm > 0) {
    conv_cm_transpose<NT>(scratch, win, G8, Lc, first, tid);
    __syncthreads();  // the old columns' window rows
  }

  if constexpr (!kConv) {
    // decode: q, k and v to fp32 as the tile kernels convert them (q and k at KV's positions). Its
    // token scalars (head 0's) are written again, the same for every head, by the loop below.
    stage_convert<K, NT>(p, geo, sm, T, gV, typename Kv::Pos{});
  }
  for (int item = tid; kConv && item < G8 * 4 * T; item += NT) {
    const int sub = item & 3, g = (item >> 2) % G8, t = item / (4 * G8);
    using Pos = std::conditional_t<kKv, typename Kv::Pos, typename Sh::Pos>;
    switch (W) {
      case 2:
        group_conv_item<Pos, !kKv, K, 2, hpb>(f, lay, base, g, sub, t, gV);
        break;
      case 3:
        group_conv_item<Pos, !kKv, K, 3, hpb>(f, lay, base, g, sub, t, gV);
        break;
      default:
        group_conv_item<Pos, !kKv, K, 4, hpb>(f, lay, base, g, sub, t, gV);
        break;
    }
  }
  __syncthreads();  // the conv outputs (decode: q, k, v), the gates and the write slots

  // Per (q/k head, token): the q/k norms and q.k (warp qt), shared by that head's value heads.
  for (int qt = warp; qt < hpb * T; qt += NT / 32) {
    const int qh = hpb == 1 ? 0 : qt / T, t = qt - qh * T;
    float sqq = 0.f, skk = 0.f, sqk = 0.f;
    for (int e = lane; e < K; e += 32) {
      const float qf = q_s[qt * K + e], kf = k_s[qt * K + e];  // same permutation for q and k
      sqq = fmaf(qf, qf, sqq);
      skk = fmaf(kf, kf, skk);
      sqk = fmaf(qf, kf, sqk);
    }
    warp_sum_qk(sqq, skk, sqk);
    const TokScalars ts = token_scalars(p, sqq, skk, sqk);
    for (int hi = qh * qgroup + lane; hi < (qh + 1) * qgroup; hi += 32) {
      float* const tk = tok_s + (hi * T + t) * kTokScalars;
      tk[0] = ts.rqs;
      tk[1] = ts.rk;
      tk[2] = ts.kq;
    }
  }
  // The conv state after each stored token (and conv_inter). The block alone reads these
  // channels, and it has read them.
  for (int g = tid; kConv && g < G8; g += NT)
    conv_vec_store_group(f, win, cm, G8, g, group_channel(p, h, hpb, g * 8), n, first, T, ws_s);

  if constexpr (kKv) {
    // The stages: value head hi = s / tiles, columns (s % tiles) * VT on. A thread waits for its
    // own pieces only; the token scalars (written above by other warps) need one barrier.
    __syncthreads();
    float* const red = reinterpret_cast<float*>(base + lay.red);
    int par = 0;
    for (int s = 0; s < NS; ++s) {
      const int hi = s / tiles;
      const int64_t col = static_cast<int64_t>(s - hi * tiles) * RT + vl * VE;
      cp_async_wait_pending(NB - 1);
      const S* const tile = buf + (s % NB) * RT * K + vl * VE;
      float st[Kv::RPT][VE];
#pragma unroll
      for (int i = 0; i < Kv::RPT; ++i) load_state_vec<S, true>(tile + (i * Kv::KG + kg) * RT, st[i]);
      issue_stage(s + NB);
      sm.tok = tok_s + hi * T * kTokScalars;
      kv_tokens<Kv, S, true, kNorm, kSr>(p, slots, n, 0, T, hv0 + hi, col, true, st, sm, v_s + hi * V + col, gV,
                                         o_s + hi * T * V, red, par, warp, vl, kgw, kg);
    }
  } else {
    // VK: the stages: RT rows of value head hi = s / tiles, one pass of RR rows per thread. As
    // for KV, a thread copies and reads its own pieces only, so a stage needs no barrier to land
    // or to be reused; the token scalars (written above by other warps) need one.
    __syncthreads();
    for (int s = 0; s < NS; ++s) {
      const int hi = s / tiles;
      const int64_t hv = hv0 + hi;
      const int64_t row0 = static_cast<int64_t>(s - hi * tiles) * RT;
      cp_async_wait_pending(NB - 1);  // stage s landed (this thread's pieces)
      const S* const tile = buf + (s % NB) * RT * K;
      float st[RR][16];
#pragma unroll
      for (int r = 0; r < RR; ++r)
#pragma unroll
        for (int i = 0; i < NV; ++i) load_state_vec<S, true>(tile + (rg + r * G) * K + (i * L + j) * VE, &st[r][i * VE]);
      issue_stage(s + NB);

      sm.tok = tok_s + hi * T * kTokScalars;
      if constexpr (hpb > 1) {  // its q/k head's rows
        sm.q = q_s + hi / qgroup * T * K;
        sm.k = k_s + hi / qgroup * T * K;
      }
      const float* const vrow = v_s + hi * V + row0 + rg;  // token t at + t * gV
      float* const o_head = o_s + hi * T * V;
      float gam_acc = 1.f;
      for (int t = 0; t < T; ++t) {
        for (const int e = vk_lazy_end(p, sm, t, T); t < e; ++t)
          vk_step<S, K, RR, true, true, 0, float, kNorm, kSr>(p, slots, n, hv, t, row0 + rg, j, st, gam_acc, sm, t,
                                                         vrow + t * gV, o_head, 0, V);
        vk_step<S, K, RR, true, false, 0, float, kNorm, kSr>(p, slots, n, hv, t, row0 + rg, j, st, gam_acc, sm, t,
                                                        vrow + t * gV, o_head, 0, V);
      }
    }
  }

  // The gated RMSNorm: sums of o^2 per (head, token) (warp e), then o * rsqrt(mean_V(o^2) + eps)
  // * norm_weight * silu(z). (Per-warp partial sums in the stage loop and each head finished as
  // soon as its stages were done measured slower: bf16 B = 64 52.5 -> 58.5 us; docs/design.md.)
  if constexpr (kNorm) {
    __syncthreads();  // every head's raw outputs
    // With 16-byte norm rows and 4-element-aligned outputs: one warp per (head, token) row sums
    // its squares and writes its outputs, four columns per lane, with no second barrier and no
    // division per element (the loop below: ~320 instructions per warp at T = 1, 7% of the
    // kernel's, and the norm cost 10% of Qwen3-Next bf16 T = 1 B = 256's time; H200 ncu).
    const int ob = dtype_bytes(p.o.dtype);
    if (norm_vec && V % 4 == 0 && reinterpret_cast<uintptr_t>(p.o.data) % (4 * ob) == 0 && p.o.s[0] % 4 == 0 &&
        p.o.s[1] % 4 == 0 && p.o.s[2] % 4 == 0) {
      for (int e = warp; e < group * T; e += NT / 32) {  // e = head * T + t
        const int hi = e / T, t = e - hi * T;
        const float* const orow = o_s + e * V;
        float ss = 0.f;
        for (int c = lane * 4; c < V; c += 128) {
          const float4 o = *reinterpret_cast<const float4*>(orow + c);
          ss = fmaf(o.x, o.x, fmaf(o.y, o.y, fmaf(o.z, o.z, fmaf(o.w, o.w, ss))));
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        const float fac = rsqrtf(ss / static_cast<float>(V) + f.norm_eps);
        char* const out =
            static_cast<char*>(p.o.data) + (n * p.o.s[0] + t * p.o.s[1] + (hv0 + hi) * p.o.s[2]) * ob;
        for (int c = lane * 4; c < V; c += 128) {
          const float4 o = *reinterpret_cast<const float4*>(orow + c);
          float w[4], g[4] = {1.f, 1.f, 1.f, 1.f};
          smem_f32x4(base + lay.wn, f.norm_weight.dtype, c, w);
          if (f.z.data != nullptr) {
            smem_f32x4(base + lay.z, f.z.dtype, e * V + c, g);
#pragma unroll
            for (int m = 0; m < 4; ++m) g[m] = silu_fast(g[m]);
          }
          const float y[4] = {o.x * fac * (w[0] * g[0]), o.y * fac * (w[1] * g[1]), o.z * fac * (w[2] * g[2]),
                              o.w * fac * (w[3] * g[3])};
          store_f32x4(out + static_cast<int64_t>(c) * ob, p.o.dtype, y);
        }
      }
      return;
    }
    for (int e = warp; e < group * T; e += NT / 32) {  // e = head * T + t
      float ss = 0.f;
      for (int c = lane; c < V; c += 32) {
        const float o = o_s[e * V + c];
        ss = fmaf(o, o, ss);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      if (lane == 0) fac_s[e] = rsqrtf(ss / static_cast<float>(V) + f.norm_eps);
    }
    __syncthreads();
    for (int i = tid; i < group * T * V; i += NT) {
      const int c = i % V, e = i / V, t = e % T, hi = e / T;
      const int64_t hv = hv0 + hi;
      float w, gate = 1.f;
      if (norm_vec) {  // the raw rows (z: [group][T][V], as i)
        w = smem_f32(base + lay.wn, f.norm_weight.dtype, c);
        if (f.z.data != nullptr) gate = smem_f32(base + lay.z, f.z.dtype, i);
      } else {
        const DType wd = f.norm_weight.dtype, zd = f.z.dtype;
        w = bits_to_f32(load_bits(f.norm_weight.data, wd, c * f.norm_weight.s[0]), wd);
        if (f.z.data != nullptr)
          gate = bits_to_f32(load_bits(f.z.data, zd, n * f.z.s[0] + t * f.z.s[1] + hv * f.z.s[2] + c * f.z.s[3]), zd);
      }
      if (f.z.data != nullptr) gate = silu_fast(gate);
      const float o = o_s[i] * fac_s[e] * (w * gate);
      store_scalar(p.o.data, p.o.dtype, n * p.o.s[0] + t * p.o.s[1] + hv * p.o.s[2] + c, o);
    }
  }
}

}  // namespace gdn::detail::cuda
