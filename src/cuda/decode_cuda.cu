// CUDA backend entry: picks the kernel instantiation and launch geometry for one call.
// O(1) host work: no device-property queries after the first call per device, no
// allocation, no synchronization, so it can be captured into a CUDA graph.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include "backends.h"
#include "cuda/fused_launch.cuh"
#include "cuda/kv.cuh"
#include "cuda/launch.h"
#include "cuda/vk_chunk.cuh"

namespace gdn::detail {
namespace cuda {
namespace {

constexpr int kMaxDevices = 64;

// A device attribute of the current device, cached per device (the planner runs per call);
// fallback (an H100's) where it cannot be read.
template <cudaDeviceAttr kAttr>
int device_attr(int fallback) {
  static std::atomic<int> cache[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return fallback;
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    if (cudaDeviceGetAttribute(&v, kAttr, dev) != cudaSuccess || v <= 0) v = fallback;
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}
int sm_count() { return device_attr<cudaDevAttrMultiProcessorCount>(132); }
// Shared memory per SM, and what the runtime reserves of it per resident block (bytes).
int smem_per_sm() { return device_attr<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(228 * 1024); }
int smem_reserved_per_block() { return device_attr<cudaDevAttrReservedSharedMemoryPerBlock>(1024); }

// Tuning overrides, read once: GDN_CUDA_VK_ROWS (1, 2, 4: state rows per thread in VK),
// GDN_CUDA_PDL (0 disables programmatic dependent launch).
int env_int(const char* name, int fallback) {
  const char* s = std::getenv(name);
  return s != nullptr && *s != '\0' ? std::atoi(s) : fallback;
}
int vk_rows_override() {
  static const int v = env_int("GDN_CUDA_VK_ROWS", 0);
  return v;
}
bool pdl_enabled() {
  static const bool v = env_int("GDN_CUDA_PDL", 1) != 0;
  return v;
}
bool prefetch_enabled() {
  static const bool v = env_int("GDN_CUDA_PREFETCH", 1) != 0;
  return v;
}
// Shared-memory tile paths (T <= 16, 16-byte state):
//   GDN_CUDA_TILE=0           off: the register-resident general kernels everywhere;
//   GDN_CUDA_VK_TILE=<rows>   VK state rows per block (power of two; default: 32 KB of state);
//   GDN_CUDA_VK_TILE_BYTES=<bytes>  the default's per-block state bytes (32768; half of it with
//                             the cache at a 16-bit state, T > 1);
//   GDN_CUDA_VK_RR=1|2|4      VK rows in registers at once (default 4, 2 at T = 1 in a single
//                             wave; halved while the tile rows are not a multiple of G * RR);
//   GDN_CUDA_TILE_BPS=<n>     small grids: VK tiles halve while the grid still fits in n
//                             blocks per SM (default 4; below four rows per thread group at
//                             T = 1: one block per SM, VK's token loop at T > 1 without the
//                             cache: under 15/8 blocks per SM before halving);
bool tile_enabled() {
  static const bool v = env_int("GDN_CUDA_TILE", 1) != 0;
  return v;
}
int vk_tile_rows_override() {
  static const int v = env_int("GDN_CUDA_VK_TILE", 0);
  return v;
}
int vk_tile_bytes() {
  static const int v = env_int("GDN_CUDA_VK_TILE_BYTES", 32768);
  return v > 0 ? v : 32768;
}
int vk_rr_override() {
  static const int v = env_int("GDN_CUDA_VK_RR", 0);
  return v;
}
//   GDN_CUDA_VK_FINE=0        off: fp32 T = 1 grids of a few waves keep the default tiles
//                             instead of vk_fine_tile's 16 KB tiles at one row per thread;
bool vk_fine_enabled() {
  static const bool v = env_int("GDN_CUDA_VK_FINE", 1) != 0;
  return v;
}
//   GDN_CUDA_VK_CHUNK=0|1|2   T > 1 without stored intermediate states (16-bit state, or fp32 in the
//                             KV layout; bf16 q/k):
//                             0 the token loop, 2 the chunked kernel (vk_chunk.cuh) wherever it
//                             applies, 1 (default) the chunked kernel where it was measured
//                             faster (vk_chunk_pays);
int vk_chunk_mode() {
  static const int v = env_int("GDN_CUDA_VK_CHUNK", 1);
  return v;
}
//   GDN_CUDA_VK_DIRECT=0|1|2  the direct token loop (raw bf16 q/k/v read by the compute threads,
//                             no conversion phase): 0 off, 2 wherever it applies, 1 (default)
//                             where it was measured faster (vk_direct_pays);
int vk_direct_mode() {
  static const int v = env_int("GDN_CUDA_VK_DIRECT", 1);
  return v;
}
//   GDN_CUDA_KV_WIDE=0|1|2    the KV tile kernel's wide variant (KvTileWide): 0 off,
//                             2 always, 1 (default) on small grids (kv_tile_wide);
int kv_wide_mode() {
  static const int v = env_int("GDN_CUDA_KV_WIDE", 1);
  return v;
}
//   GDN_CUDA_KV_VT=0|1|2      the KV layout through VK's token loop on the transposed tile
//                             (decode_kv_vt_kernel), decode and the fused step: 0 off, 2 wherever
//                             it applies (before the other KV kernels, whatever their knobs),
//                             1 (default) where measured faster (kv_vt_pays, plan_fused_kv_vt)
//                             and no other KV kernel is forced;
int kv_vt_mode() {
  static const int v = env_int("GDN_CUDA_KV_VT", 1);
  return v;
}
// The group kernel (group.cuh), for the fused step and decode's KV layout:
//   GDN_CUDA_GROUP=0|1|2  0 never, 2 wherever it applies (the GPU tests force it), 1 (default)
//                         where measured faster (plan_fused_group, plan_kv_group).
int group_mode() {
  static const int v = env_int("GDN_CUDA_GROUP", 1);
  return v;
}
//   GDN_CUDA_GROUP_HPB=0|1|2  the fused step's VK group kernel at 16-bit states: q/k heads per
//   block; 0 (default) the measured rule (plan_fused_group), 2 wherever it applies (the GPU tests
//   force it)
int group_hpb() {
  static const int v = env_int("GDN_CUDA_GROUP_HPB", 0);
  return v;
}
int tile_blocks_per_sm() {
  static const int v = env_int("GDN_CUDA_TILE_BPS", 4);
  return v;
}

// 16-byte state vectors need every row start 16-byte aligned: the base pointer and every
// stride except the innermost a multiple of one vector. Otherwise the scalar variant runs.
bool vec_ok(const Ptr& t, int nstrides, int64_t ve) {
  if (t.data == nullptr) return true;
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int i = 0; i < nstrides; ++i)
    if (t.s[i] % ve != 0) return false;
  return true;
}

constexpr size_t kSmemBudget = 48 * 1024;  // no opt-in attribute needed, leaves room for occupancy

int dtype_bytes_host(DType d) { return d == DType::kF32 ? 4 : 2; }

// q, k, v may be staged with 16-byte cp.async: contiguous rows (innermost stride 1), every row
// start of the views 16-byte aligned.
bool qkv_vec_ok(const Problem& p) {
  const int64_t es = dtype_bytes_host(p.q.dtype);
  for (const Ptr* t : {&p.q, &p.k, &p.v}) {
    if (t->s[3] != 1 || reinterpret_cast<uintptr_t>(t->data) % 16 != 0) return false;
    for (int i = 0; i < 3; ++i)
      if (t->s[i] * es % 16 != 0) return false;
  }
  return true;
}

// The raw staging area of `tokens` tokens (StageSmem::raw: q and k of K elements and nc values
// of v per token, es bytes each), 16-byte aligned.
size_t stage_raw_bytes(int64_t tokens, int64_t K, int64_t nc, int64_t es) {
  return (static_cast<size_t>(tokens) * (2 * K + nc) * es + 15) / 16 * 16;
}

// Tokens per staged chunk and the staging bytes: as many tokens as fit the budget (<= 16).
void fit_chunk(const Problem& p, int nc, size_t fixed_bytes, LaunchPlan& lp) {
  const int64_t es = dtype_bytes_host(p.q.dtype);
  int chunk = static_cast<int>(p.T < kMaxChunk ? p.T : kMaxChunk);
  for (;; --chunk) {
    const size_t raw = stage_raw_bytes(chunk, p.K, nc, es);
    const size_t f32 = sizeof(float) * chunk * (2 * p.K + kTokScalars + nc);
    if (fixed_bytes + raw + f32 <= kSmemBudget || chunk == 1) {
      lp.geo.chunk = chunk;
      lp.geo.raw_bytes = static_cast<int>(raw);
      lp.smem = fixed_bytes + raw + f32;
      return;
    }
  }
}

LaunchPlan plan_vk(const Problem& p, bool vec) {
  LaunchPlan lp;
  const int L = static_cast<int>(p.K / 16);
  const int G = kVkThreads / L;
  int R = 1;
  if (vec) {  // the scalar (unaligned) variant exists with one row per thread only
    // More rows per thread amortize the per-token q/k reads and shrink the grid; only worth
    // it when the grid still fills the GPU several times over.
    const double resident = static_cast<double>(sm_count()) * 1024.0;
    const double threads = static_cast<double>(p.B) * p.HV * p.V * L;
    if (threads / 4 >= 4 * resident) {
      R = 4;
    } else if (threads / 2 >= 2 * resident) {
      R = 2;
    }
    const int o = vk_rows_override();
    if (o == 1 || o == 2 || o == 4) R = o;
    while (R > 1 && (R > L || G * R > p.V)) R /= 2;  // a tile never spans more than V rows
  }
  const int RB = G * R;
  lp.threads = kVkThreads;
  lp.rows_per_thread = R;
  lp.vec = vec;
  lp.geo.tiles = static_cast<int>((p.V + RB - 1) / RB);
  lp.blocks = p.B * p.HV * lp.geo.tiles;
  fit_chunk(p, RB, 0, lp);
  return lp;
}

// Staging bytes (raw + fp32) of all T tokens for nc rows/columns; sets the geometry's chunk.
// `fused`: the raw area holds the conv outputs in fp32, and the fused step's own shared memory
// (fused.cuh) follows.
size_t stage_all_tokens(const Problem& p, int nc, LaunchPlan& lp, bool fused = false) {
  const int chunk = static_cast<int>(p.T);
  const size_t raw = stage_raw_bytes(chunk, p.K, nc, fused ? 4 : dtype_bytes_host(p.q.dtype));
  const size_t f32 = sizeof(float) * chunk * (2 * p.K + kTokScalars + nc);
  lp.geo.chunk = chunk;
  lp.geo.raw_bytes = static_cast<int>(raw);
  return raw + f32;
}

// The conv's 16-byte path (fused.cuh, group.cuh): mixed_qkv, the conv state (and
// conv_inter) and the taps (and bias) of one 16-bit dtype; mixed_qkv and the bias contiguous
// along the channels and the taps row-major [D, W]; the conv state and conv_inter either
// contiguous along the channels (vLLM's [P, L, D] memory: kConvVec) or channel-major with the
// channels packed (FLA's, transformers' and SGLang's [P, D, L]: kConvCm; a group of 8 channels
// is then 8L contiguous elements); every other stride a multiple of 8 elements and every base
// 16-byte aligned; q/k slices of a multiple of 8 channels (the cluster form's C = HV/H x tiles
// blocks each take one; the group kernel's C = 1). Else the generic path (kConvScalar).
enum ConvPath : int { kConvScalar = 0, kConvVec = 1, kConvCm = 2 };

// Channel-major conv state and conv_inter, channels packed (the layout condition of kConvCm).
bool fused_conv_cm_layout(const FusedProblem& f) {
  const int64_t L = f.L;
  return f.conv_state.s[2] == 1 && f.conv_state.s[1] == L &&
         (f.conv_inter.data == nullptr || (f.conv_inter.s[3] == 1 && f.conv_inter.s[2] == L));
}

ConvPath fused_conv_path(const FusedProblem& f, int64_t C) {
  const Problem& p = f.step;
  const DType dt = f.x.dtype;
  if (dt == DType::kF32 || f.conv_state.dtype != dt || f.conv_weight.dtype != dt) return kConvScalar;
  if (f.conv_bias.data != nullptr && (f.conv_bias.dtype != dt || f.conv_bias.s[0] != 1)) return kConvScalar;
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const auto mult8 = [](int64_t x) { return x % 8 == 0; };
  if (!aligned(f.x.data) || f.x.s[2] != 1 || !mult8(f.x.s[0]) || !mult8(f.x.s[1])) return kConvScalar;
  if (!aligned(f.conv_weight.data) || f.conv_weight.s[1] != 1 || f.conv_weight.s[0] != f.W) return kConvScalar;
  if (f.conv_bias.data != nullptr && !aligned(f.conv_bias.data)) return kConvScalar;
  if ((2 * p.K) % C != 0 || !mult8(2 * p.K / C)) return kConvScalar;
  const bool inter = f.conv_inter.data != nullptr;
  if (!aligned(f.conv_state.data) || !mult8(f.conv_state.s[0])) return kConvScalar;
  if (inter && (!aligned(f.conv_inter.data) || !mult8(f.conv_inter.s[0]) || !mult8(f.conv_inter.s[1])))
    return kConvScalar;
  if (f.conv_state.s[1] == 1 && mult8(f.conv_state.s[2]) &&
      (!inter || (f.conv_inter.s[2] == 1 && mult8(f.conv_inter.s[3]))))
    return kConvVec;
  return fused_conv_cm_layout(f) ? kConvCm : kConvScalar;
}

// The fused step's shared memory beyond the staging area.
size_t fused_extra_bytes(const FusedProblem* f, int nc, int tiles) {
  if (f == nullptr) return 0;
  const int T = static_cast<int>(f->step.T);
  // The channel-major scratch wherever the layout could take it (the path is picked after the
  // tiles: fused_conv_path).
  const FusedShare s = fused_share(static_cast<int>(f->step.K), static_cast<int>(f->step.HV / f->step.H), tiles, nc,
                                   static_cast<int>(f->L), static_cast<int>(f->W), T, fused_conv_cm_layout(*f));
  return sizeof(float) * static_cast<size_t>(fused_smem_floats(s, T, nc, static_cast<int>(f->W),
                                                                 f->norm_weight.data != nullptr));
}

// The norm's 16-byte path (fused.cuh, fused_norm_issue): norm_weight and z contiguous along V,
// every base and stride 16-byte aligned, and blocks of nc whole columns (V a multiple of nc,
// nc columns a multiple of 16 bytes), so that the raw rows land by cp.async before the slot is
// known. Other layouts load them by scalar loads after it.
bool fused_norm_vec_ok(const FusedProblem& f, int nc) {
  if (f.norm_weight.data == nullptr || nc <= 0 || f.step.V % nc != 0) return false;
  // Elements per 16 bytes when x's rows qualify, else 0.
  const auto per16 = [nc](const Ptr& x, int64_t inner_stride) -> int64_t {
    const int64_t es = x.dtype == DType::kF32 ? 4 : 2;
    const bool ok = reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && inner_stride == 1 && nc * es % 16 == 0;
    return ok ? 16 / es : 0;
  };
  if (per16(f.norm_weight, f.norm_weight.s[0]) == 0) return false;
  if (f.z.data == nullptr) return true;
  const int64_t per = per16(f.z, f.z.s[3]);
  return per > 0 && f.z.s[0] % per == 0 && f.z.s[1] % per == 0 && f.z.s[2] % per == 0;
}

// Blocks per thread-block cluster the fused step may use: 8 is portable; 16 is allowed on sm_90
// with an opt-in (allow_big_cluster), given at most ~110 KB of shared memory per block so that
// two blocks fit an SM and a cluster fits one GPC.
constexpr int kMaxFusedCluster = 16;
constexpr size_t kBigClusterSmemMax = 200 * 1024;

constexpr size_t kTileSmemMax = 200 * 1024;  // under the 227 KB opt-in maximum of sm_90

// One wave of VK tile blocks: the register caps of two and four rows per thread admit four per
// SM (kVkTileMinBlocks). The rows-per-thread rule and the prefetch rule (every kernel, as
// measured) use this bound.
bool one_wave(int64_t blocks) { return blocks <= 4 * static_cast<int64_t>(sm_count()); }

// Blocks of a kernel an SM holds with `smem` bytes of dynamic shared memory each: by shared
// memory (the device's per SM, less its per-block reserve) and the launch bound `cap`.
int resident_blocks(int smem, int cap) {
  return std::min(cap, smem_per_sm() / (smem + smem_reserved_per_block()));
}
// The dynamic shared memory of a kernel that needs `total` bytes and holds at most `cap` blocks
// per SM: a grid within one wave asks for enough that an SM takes no more blocks than an even
// spread needs (ceil(blocks / SMs)). More resident blocks than that leave SMs idle (the block
// scheduler fills an SM before the next, it seems): the group kernel at B = 16 (256 blocks on
// 132 SMs) took 1.18x the time with three per SM than with two at Qwen3.5 bf16 T = 2, and capped
// to two, the cells that held three took 0.82-0.89x (H200, bench/results 2026-11-28
// group-spread). The chunked kernel takes the same rule (plan_vk_tile).
size_t spread_smem(int64_t blocks, int total, int cap) {
  const int64_t sms = sm_count(), even = (blocks + sms - 1) / sms;
  if (even >= resident_blocks(total, cap)) return static_cast<size_t>(total);
  // The least multiple of 16 bytes over smem_per_sm / (even + 1) per block, reserve included.
  const int spread = (smem_per_sm() / static_cast<int>(even + 1) - smem_reserved_per_block() + 16) / 16 * 16;
  return static_cast<size_t>(std::max(total, spread));
}

// fp32 state at T = 1 on a grid of a few waves: tiles of kVkFineTileBytes at one row per thread,
// whose 64-register cap (kVkTileMinBlocks<1>) admits eight blocks per SM: the same 128 KB in
// flight per SM as four 32 KB tiles, in pieces half the size, so blocks land, compute and
// retire at a finer grain. Measured on the H100 (Qwen3-Next, same binary, min of two runs):
// dense B = 16 26.63 -> 25.68 us, B = 32 49.26 -> 48.42, B = 64 94.20 -> 93.59, pool B = 16
// 22.06 -> 21.74; B >= 256 +0.1..+0.3% (hence the wave bound); T = 2 mixed (dense B = 16
// -2.9%, pool B = 64 +1.0%); bf16 state slower everywhere (docs/design.md section 4).
// Returns the tile rows, or 0 where the rule does not apply.
constexpr int kVkFineTileBytes = 16384;
constexpr int kVkFineMaxWaves = 8;
template <typename S>
int vk_fine_tile(const Problem& p, int64_t default_blocks, int G) {
  if (!std::is_same_v<S, float> || p.T != 1 || !vk_fine_enabled() || one_wave(default_blocks))
    return 0;
  const int rows = kVkFineTileBytes / static_cast<int>(p.K * sizeof(S));
  if (rows < G || rows > p.V) return 0;
  const int64_t blocks = p.B * p.HV * (p.V / rows);
  return blocks <= int64_t{kVkFineMaxWaves} * kVkTileMinBlocks<1> * sm_count() ? rows : 0;
}

// The chunked kernel's fixed work (product, solve and update phases) only pays where the token
// loop is issue-bound: several tokens and enough heads. The least B * HV at which it pays, per
// layout, state dtype and T (0: never), chunked / the kernel the planner takes otherwise, on one
// binary (GDN_CUDA_VK_CHUNK=2 against 0; docs/design.md section 4).
// bf16 VK and KV, fp32 KV: measured on the H200 after the KV P4 stores and the even spread
// (8551897, `gpu_check.sh chunkbench`, alternated twice, min; both models, pool, B = 1..256;
// bench/results/2026-12-02-h200-8551897-chunk-rules.json), against the KV token loop on VK's
// tile (kv-vt) where kv_vt_pays, else the tile kernels:
// - VK bf16: T = 3 0.95-0.98 from 4096 heads, 0.99-1.00 at 2048; T = 4 0.88-0.99 from 512, 1.01
//   at 512 (Qwen3.5 B = 8); T = 5..6 0.76-0.93 from 512, 1.00-1.01 at 256; T = 8 and 16 0.50-0.98
//   from 128, 1.23-1.27 at 64.
// - KV bf16: T = 2 0.92-0.95 from 2048 heads, 0.99-1.02 at 512..1024 (against kv-vt); T = 3..8
//   0.27-0.78 from 128, 1.29-1.63 at 64; T = 16 0.52-0.68 from 32, the fewest measured.
// - KV fp32: T = 2 1.07-1.11 at every B; T = 3 and 4 0.83-0.99 from 256 (against the tile kernel
//   and kv-vt), 1.11-1.16 at 128; T = 5..8 0.54-0.89 from 128, 1.31-1.45 at 64; T = 16 0.70-0.91
//   from 32.
// - VK fp32 (S0 split into three bf16 terms; H100): 1.03-1.74 at every T and B measured, so the
//   kernel has no VK fp32 form (plan_vk_tile).
// - fp16 (S0 split into two bf16 terms; 6112851, on an H200, B = 2..256, one run each,
//   bench/results/2026-11-28-h200-6112851-fp16-chunk-ab.json). VK: P1's second product makes
//   it dearer than bf16's: T <= 4 0.97-1.63 at every B; T = 5 0.92-0.98 from 512 heads; T = 6
//   0.84-0.91 from 512, 1.09-1.16 below; T = 8 0.71-0.79 from 512, 0.98-1.03 at 128..256;
//   T = 16 0.75-0.84 from 256, 0.99 at 128. KV: the thresholds bf16 had then hold (T = 3
//   0.67-0.95 from 128 heads; T = 4 0.59-0.83 from 512; T = 5..8 0.40-0.74 from 128).
// plan_kv_shared takes the chunked kernel before kv-vt where these say it pays.
int64_t chunk_min_heads(const Problem& p) {
  const int64_t t = p.T;
  const DType s = p.state.dtype;
  if (!p.layout_kv && s == DType::kF16) return t < 5 ? 0 : t < 12 ? 512 : 256;
  if (!p.layout_kv) return t < 3 ? 0 : t == 3 ? 4096 : t < 8 ? 512 : 128;  // bf16 (no fp32 form)
  if (s == DType::kF32) return t >= 9 ? 32 : t >= 5 ? 128 : t >= 3 ? 256 : 0;
  if (s == DType::kF16) return t >= 6 ? 1 : t == 5 ? 32 : t == 4 ? 64 : 128;  // 6112851's
  return t >= 9 ? 1 : t >= 3 ? 128 : 2048;
}
bool vk_chunk_pays(const Problem& p) {
  const int mode = vk_chunk_mode();
  if (mode == 2) return true;
  const int64_t min_heads = chunk_min_heads(p);
  return mode == 1 && min_heads > 0 && p.B * p.HV >= min_heads;
}

// The direct token loop trades the block's conversion phase and one barrier for per-thread
// q/k norms in every token: a latency saving where an SM holds one or two blocks, extra issue
// work that grows with the blocks per SM and the tokens. Measured on the H100 (bf16 q/k/v,
// docs/design.md section 4): Qwen3-Next B = 1 (128 blocks) T = 1 fp32 4.19 -> 3.76 us,
// bf16 3.84 -> 3.36, T = 2..6 -2..-9%, T = 8..16 -4..+4%; Qwen3.5 B = 1 (256 blocks) T = 1..2
// -9..+1%, T >= 3 fp32 without the cache +2..+10%; B = 4 (512 blocks) T = 4 fp32 +8.5%, B = 16
// T = 1 bf16 +3%. So: one block per SM at any T (the full sweeps at 7504c08, direct, and
// 6608b0b, converting from T = 6: Qwen3-Next B = 1 T = 6 -3..-6%, T = 8 and 16 with the cache
// -1..-4%, without it -2..+2%), two blocks per SM up to T = 2.
bool vk_direct_pays(const Problem& p, int64_t blocks) {
  const int mode = vk_direct_mode();
  const int64_t sms = sm_count();
  const int64_t per_sm = (blocks + sms - 1) / sms;
  return mode == 2 || (mode == 1 && (per_sm == 1 || (per_sm == 2 && p.T <= 2)));
}

// The fused step's tiles at T = 1 (plan_vk_tile): at most this many state bytes, one per value head.
constexpr int kFusedT1TileBytes = 64 * 1024;

// VK tile path: tile rows a power of two in [G * RR, V], default ~32 KB of state per block,
// halved while twice the blocks still fit in one wave of GDN_CUDA_TILE_BPS blocks per SM
// (latency: more, shorter blocks, but never a second wave: B=4 Qwen3-Next fp32 went from
// 1024 blocks in two waves, 11.3 us, to 512 in one, 9.1 us); at T = 1 see below.
// `chunk_ok` false (plan_kv_vt): the token loop even where the chunked kernel would pay.
// `f` (the fused step, else null): no chunked kernel and no direct loop (the conv outputs are
// fp32), no fine tiles, tiles large enough that a cluster of all the blocks of one (row, q/k
// head) fits (fused.cuh), and at T = 1 one tile per value head (kFusedT1TileBytes). `min_rt`
// (the fused step's widening, widen_fused_tiles): tiles of at least this many rows.
template <typename S>
bool plan_vk_tile(const Problem& p, LaunchPlan& lp, const FusedProblem* f = nullptr, int min_rt = 0,
                  bool chunk_ok = true) {
  const int L = static_cast<int>(p.K / 16);
  const int G = kVkThreads / L;
  const int V = static_cast<int>(p.V);
  const int row_bytes = static_cast<int>(p.K * sizeof(S));
  int rt = G;
  const int o = vk_tile_rows_override();
  bool fine = false;  // vk_fine_tile's tiles, one row per thread
  // The chunked form (vk_chunk.cuh): a 16-bit state, or an fp32 state in the KV layout
  // (plan_kv_chunk; VK's token loop is faster at every T, chunk_min_heads), bf16 q/k, 2 <= T,
  // only the last state stored; tiles of 16-row multiples (below).
  constexpr bool kF32 = std::is_same_v<S, float>;
  const bool stores = stores_token_states(p);
  const bool chunk_want = f == nullptr && chunk_ok && (p.layout_kv || !kF32) && vk_chunk_pays(p) && p.T >= 2 &&
                          p.q.dtype == DType::kBF16 && p.k.dtype == DType::kBF16 && !stores;
  const bool vk_tokens = !p.layout_kv && f == nullptr && p.T > 1;  // decode's VK kernels at T > 1
  if (o > 0) {
    while (rt * 2 <= o && rt * 2 <= V) rt *= 2;
  } else {
    // With the cache at T > 1, a 16-bit VK state's tiles hold half the bytes (64 rows at
    // K = 128): its per-token state stores keep twice the blocks busy. Measured on the H200
    // (GDN_CUDA_VK_TILE=64 against 128-row tiles, ef1d7dc, pool, min of two runs, both models):
    // bf16 T = 4 and 8 0.96-0.98x from B = 64 (Qwen3-Next T = 4 B = 256 354.7 -> 343.0 us),
    // T = 2 0.99x; 512-1,024 heads 0.93-1.02x.
    const int tile_bytes = vk_tokens && stores && !kF32 ? vk_tile_bytes() / 2 : vk_tile_bytes();
    while (rt * 2 <= V && rt * 2 * row_bytes <= tile_bytes) rt *= 2;
    const int64_t heads = p.B * p.HV;
    const int64_t want = static_cast<int64_t>(tile_blocks_per_sm()) * sm_count();
    // Never below two rows per thread group: at B = 1, 16-row tiles at one row per thread were
    // measured slower than 32-row tiles at two (bf16 4.06 -> 3.89 us, Qwen3.5 fp32 5.47 -> 5.26,
    // Qwen3.5 T = 4 7.14 -> 6.07; Qwen3-Next fp32 equal).
    const int min_rows = 2 * G <= V ? 2 * G : G;
    // At T = 1, below four rows per thread group only while twice the blocks still fit in one
    // block per SM: the fixed per-block work (prologue, q/k conversion) counts more than a
    // second block per SM (Qwen3-Next, us: B = 4 fp32 dense 8.07 -> 7.67, bf16 pool 5.52 ->
    // 4.72, B = 2 fp32 pool 5.04 -> 4.86; T > 1 mixed, e.g. T = 2 fp32 pool B = 4 +11%).
    // VK's token loop at T > 1 without the cache: below four rows per thread group only while
    // the grid has fewer than 15/8 blocks per SM before halving, so where the larger tiles still
    // give nearly every SM two blocks. Each block converts every token's q and k once: the
    // per-block work grows with T, and a second block per SM covers what smaller tiles would
    // overlap. Measured on the H200 (64- against 32-row tiles by GDN_CUDA_VK_TILE on one binary,
    // ef1d7dc, pool, min of two runs, T = 2..8, both states and models): 128 heads (Qwen3-Next
    // B = 4, Qwen3.5 B = 2; 256 blocks of 64 rows on 132 SMs) 0.87-0.98x (Qwen3-Next bf16 T = 4
    // 7.82 -> 6.82 us); 96 heads (192 blocks) 0.95-1.14x, bf16 slower up to T = 5; 64 heads
    // 1.00-1.33x. Not the chunked kernel (32 rows 1.02-1.04x faster at T = 8), the cache
    // (0.95-1.08x) or kv-vt (0.94-1.24x).
    const bool loop_tokens = vk_tokens && !stores && !chunk_want;
    auto halve = [&](int r) {
      const int64_t blocks = heads * (V / r);
      if (r <= 4 * G && p.T == 1) return blocks * 2 <= sm_count();
      if (r <= 4 * G && loop_tokens) return blocks * 8 < int64_t{15} * sm_count();
      return blocks * 2 <= want;
    };
    while (rt > min_rows && halve(rt)) rt /= 2;
    // An explicit rows-per-thread choice (GDN_CUDA_VK_RR) keeps the tiles above.
    const int fr = vk_rr_override() == 0 && f == nullptr ? vk_fine_tile<S>(p, heads * (V / rt), G) : 0;
    if (fr > 0) {
      rt = fr;
      fine = true;
    }
    // The fused step at T = 1: one tile per value head where it is at most 64 KB (Qwen3-Next and
    // Qwen3.5: the whole head at fp32 and bf16). The small tiles above (clusters of up to 16
    // blocks) cost the cluster barriers, the norm's exchange of sums between tiles, and at some
    // B a second wave of clusters (Qwen3.5 bf16 dense B = 4: 512 blocks in clusters of 8, 17.6 us,
    // against 10.9 at B = 3). Measured on the H100 (VK, T = 1, B = 1..8, dense, pool and split,
    // GDN_CUDA_VK_TILE=128 against the rule above, 60 cells): geomean 0.954, 32 cells faster by
    // more than 2% (Qwen3-Next bf16 dense B = 8 18.4 -> 11.7 us, Qwen3.5 bf16 B = 1 9.31 -> 8.51),
    // 9 slower (at most Qwen3.5 fp32 B = 3 +17%). At T = 4 the small tiles stay: geomean 1.06 the
    // other way.
    if (f != nullptr && p.T == 1)
      while (rt < V && 2 * rt * row_bytes <= kFusedT1TileBytes) rt *= 2;
  }
  while (rt < min_rt && rt < V) rt *= 2;
  const int group = static_cast<int>(p.HV / p.H);
  if (f != nullptr)
    while (group * (V / rt) > kMaxFusedCluster && rt < V) rt *= 2;
  bool chunked = false;
  if (chunk_want && rt % 16 == 0) {
    stage_all_tokens(p, rt, lp);
    // Its raw area holds v alone: q and k land in qk16's rows (vk_tile_begin), v is read raw.
    lp.geo.raw_bytes = static_cast<int>(stage_raw_bytes(p.T, 0, rt, 2));
    const VkChunkSmem lay(rt, static_cast<int>(p.K), static_cast<int>(p.T), lp.geo.raw_bytes,
                          static_cast<int>(sizeof(S)));
    chunked = static_cast<size_t>(lay.total) <= kTileSmemMax;
    if (chunked) lp.smem = static_cast<size_t>(lay.total);
  }
  for (; !chunked;) {
    const size_t smem = static_cast<size_t>(rt) * row_bytes + stage_all_tokens(p, rt, lp, f != nullptr) +
                        fused_extra_bytes(f, rt, V / rt) + kBulkBarBytes;  // the bulk load's mbarrier
    if (f != nullptr) {
      // The fused step: a cluster of every tile of the group, up to 16 blocks of at most
      // kBigClusterSmemMax each beyond the portable 8; else wider tiles (never narrower).
      const int64_t cluster = group * (V / rt);
      if (smem <= kTileSmemMax && (cluster <= 8 || (cluster <= kMaxFusedCluster && smem <= kBigClusterSmemMax))) {
        lp.smem = smem;
        break;
      }
      if (rt >= V) return false;
      rt *= 2;
      continue;
    }
    if (smem <= kTileSmemMax) {
      lp.smem = smem;
      break;
    }
    if (rt == G) return false;
    rt /= 2;
  }
  // Rows in registers at once (GDN_CUDA_VK_RR overrides). T > 1: four, which share the q/k
  // reads and overlap four rows' per-token reduction chains (measured against two: +1..+5
  // points of the floor without the cache, equal with it); T = 1 in a single wave: two (against
  // one, Qwen3-Next dense: bf16 B=16 16.8 -> 14.8 us, B=64 55.0 -> 52.8, fp32 B=16 28.3 -> 27.1,
  // B=1 equal).
  // At T = 1 on grids of more than one wave (four blocks per SM) four as well (same call,
  // GDN_CUDA_VK_RR=4 against 2: bf16 B = 64 -0.8..-3.9%, Qwen3-Next dense 52.5 -> 50.5 us,
  // B >= 256 -0..-1.2%, fp32 within 0.6%; on a single wave, Qwen3-Next bf16 B = 16, +4..+7%).
  // The tile rows must be a multiple of G * rr (rt is a power of two >= G): halve rr until
  // they are, so small-grid tiles fall back to 2 or 1.
  lp.geo.tile_rows = rt;
  lp.geo.tiles = V / rt;
  lp.blocks = p.B * p.HV * lp.geo.tiles;
  int rr = fine ? 1 : p.T > 1 || !one_wave(lp.blocks) ? 4 : 2;
  const int rro = vk_rr_override();
  if (rro == 1 || rro == 2 || rro == 4) rr = rro;
  while (rr > 1 && (rt % (rr * G) != 0 || rr > L)) rr /= 2;
  lp.tile = true;
  lp.chunked = chunked;
  // The chunked kernel on a grid within one wave: no SM holds more than an even spread of it,
  // where its tiles give every warp an m-tile (rt >= 64). Measured on the H200 against no spread
  // (3083bdc against main, same call; docs/design.md, "The KV chunked kernel's row stores"): 512
  // blocks of 64 or 128 rows (Qwen3-Next B = 16, Qwen3.5 B = 4; T = 3..16) 0.83-1.01x (VK alone,
  // Qwen3.5 bf16 T = 16 B = 4 19.9 -> 17.8 us); but with 32-row tiles, where two of the four
  // warps idle through P1..P3 and a fifth block per SM adds working warps, 1.03-1.07x
  // (Qwen3-Next B = 4 T = 3..8) and 1.04-1.10x at B = 1 T = 16 (one or two blocks per SM).
  if (chunked && rt >= 16 * (kVkThreads / 32))
    lp.smem = spread_smem(lp.blocks, static_cast<int>(lp.smem), kChunkMinBlocks<S>);
  lp.rows_per_thread = rr;
  lp.threads = kVkThreads;
  lp.vec = true;
  lp.direct = f == nullptr && !chunked && rr <= 2 && p.q.dtype == DType::kBF16 && p.k.dtype == DType::kBF16 &&
              p.v.dtype == DType::kBF16 && vk_direct_pays(p, lp.blocks);
  lp.cluster = f != nullptr ? group * lp.geo.tiles : 1;
  lp.geo.norm_vec = f != nullptr && fused_norm_vec_ok(*f, rt);
  return true;
}

// KV layout, T > 1 without stored intermediate states: the chunked kernel on the KV tile
// (vk_chunk.cuh with kKv: the same phases, the tile transposed) where chunk_min_heads' KV rules
// say it pays, with VK's tiles (the work and the bytes are the same), but never with a
// rounding seed (its KV form does not round stochastically).
// The KV tile's copy-in (vk_tile_begin) keeps one 16-byte piece column per thread: the block's
// threads must be a multiple of a tile row's pieces. Always so for K, V in {64, 128, 256}, whose
// tiles are powers of two; checked, not assumed.
template <typename S>
bool kv_tile_copy_fits(const LaunchPlan& lp) {
  const int pieces = lp.geo.tile_rows * static_cast<int>(sizeof(S)) / 16;
  return pieces > 0 && kVkThreads % pieces == 0;
}

template <typename S>
bool plan_kv_chunk(const Problem& p, LaunchPlan& lp) {
  // Before planning VK's tiles: most KV calls (T = 1, a rounding seed, a small grid) end here.
  if (p.T < 2 || p.rounding_seed != nullptr || !vk_chunk_pays(p)) return false;
  LaunchPlan c;
  if (!plan_vk_tile<S>(p, c) || !c.chunked || !kv_tile_copy_fits<S>(c)) return false;
  lp = c;
  return true;
}

// KV tile: the wide variant (KvTileWide: four rows per thread; fp32 four times the threads,
// 16-bit half-width tiles with K threads) where the grid of 64-thread tiles leaves SMs with
// little to do: at most one per SM (fp32) or two (16-bit). Measured on the H100 (GDN_CUDA_KV_WIDE
// =2 against 0, both models, dense and pool, T = 1, 2, 4, 8, min of two runs; docs/design.md
// section 4): fp32 at <= 132 tiles -14..-26% (Qwen3-Next B = 1 T = 1 5.25 -> 4.53 us, T = 4
// 9.26 -> 6.85), at two per SM -8..+7%, beyond +8..+110% (eight warps' per-token reduction
// through shared memory outweighs the shorter rows); bf16 at <= 132 tiles -23..-48% (Qwen3-Next
// B = 1 T = 1 6.33 -> 4.58, T = 4 14.17 -> 8.30), at two per SM -3..-15%, at four +35% at T = 1.
template <typename S>
constexpr int64_t kKvWideMaxPerSm = sizeof(S) == 4 ? 1 : 2;
template <typename S>
bool kv_tile_wide(int64_t narrow_blocks) {
  const int mode = kv_wide_mode();
  return mode == 2 || (mode == 1 && narrow_blocks <= kKvWideMaxPerSm<S> * sm_count());
}

template <typename S, int K, int NT, int LV>
bool plan_kv_tile_nt(const Problem& p, LaunchPlan& lp, const FusedProblem* f) {
  using Sh = KvShape<S, K, NT, LV>;
  const size_t lead = sizeof(float) * kv_tile_lead_floats<S, K, NT, LV>(p.T > 1);
  lp.smem = lead + stage_all_tokens(p, Sh::VT, lp, f != nullptr) +
            fused_extra_bytes(f, Sh::VT, static_cast<int>((p.V + Sh::VT - 1) / Sh::VT));
  if (lp.smem > kTileSmemMax) return false;
  lp.tile = true;
  lp.threads = NT;
  lp.vec = true;
  lp.geo.tiles = static_cast<int>((p.V + Sh::VT - 1) / Sh::VT);
  lp.blocks = p.B * p.HV * lp.geo.tiles;
  lp.cluster = f != nullptr ? static_cast<int>(p.HV / p.H) * lp.geo.tiles : 1;
  lp.geo.norm_vec = f != nullptr && fused_norm_vec_ok(*f, Sh::VT);
  return true;
}

// `f`: the fused step, whose cluster holds every tile of a GVA group: where the decode's choice
// makes the cluster too large, the narrow variant, then (fp32) tiles of 16 lanes along V.
// wide_ok = false: the narrow variant (narrow_fused_kv_tiles).
template <typename S, int K>
bool plan_kv_tile_k(const Problem& p, LaunchPlan& lp, const FusedProblem* f, bool wide_ok) {
  using Narrow = KvShape<S, K, kKvTileThreads, 8>;
  using W = KvTileWide<S, K>;
  lp.kv_wide = wide_ok && kv_tile_wide<S>(p.B * p.HV * ((p.V + Narrow::VT - 1) / Narrow::VT));
  bool ok = lp.kv_wide ? plan_kv_tile_nt<S, K, W::NT, W::LV>(p, lp, f)
                       : plan_kv_tile_nt<S, K, kKvTileThreads, 8>(p, lp, f);
  if (f == nullptr) return ok;
  const auto fits = [&] {
    return ok && lp.cluster <= kMaxFusedCluster && (lp.cluster <= 8 || lp.smem <= kBigClusterSmemMax);
  };
  if (fits()) return true;
  if (lp.kv_wide) {
    lp.kv_wide = false;
    ok = plan_kv_tile_nt<S, K, kKvTileThreads, 8>(p, lp, f);
    if (fits()) return true;
  }
  if constexpr (sizeof(S) == 4) {
    lp.kv_lanes16 = true;
    ok = plan_kv_tile_nt<S, K, kKvFusedLanes16Threads, 16>(p, lp, f);
    if (fits()) return true;
    lp.kv_lanes16 = false;
  }
  return false;
}

template <typename S>
bool plan_kv_tile(const Problem& p, LaunchPlan& lp, const FusedProblem* f = nullptr, bool wide_ok = true) {
  switch (p.K) {
    case 64:
      return plan_kv_tile_k<S, 64>(p, lp, f, wide_ok);
    case 128:
      return plan_kv_tile_k<S, 128>(p, lp, f, wide_ok);
    default:
      return plan_kv_tile_k<S, 256>(p, lp, f, wide_ok);
  }
}

// decode's KV layout on the group kernel without the conv (group.cuh): one block per (row, q/k
// head) streaming its GVA group's K x VT tiles through three 16 KB stage buffers, the rows of
// each in registers. K = 128, 16-byte state rows (the caller's `vec`), T <= kMaxChunk, the group's
// v heads adjacent (one staged row of group * V elements per token). Against the KV tile kernel
// and the chunked kernel, measured on the H200 (both models, pool, B = 1..256, T = 1, 2, 4, 8,
// cache on and off, GDN_CUDA_GROUP=2 against 0 on one binary, min of two runs; docs/design.md,
// "The group kernel for decode's KV layout"):
// - 16-bit, T = 1: 0.91-0.98 from B * H = 1024 blocks (Qwen3.5 bf16 B = 256 275.9 -> 252.2 us),
//   1.13-1.23 at 256-512: from kKvGroupT1BlocksPerSm blocks per SM.
// - 16-bit, T >= 2 with stored per-token states (the tile kernel keeps its rows in an fp32 work
//   tile in shared memory; the chunked kernel does not apply): 0.60-0.96 from 256 blocks (Qwen3-Next
//   bf16 T = 4 B = 64 167.3 -> 111.9), 0.96-1.11 at 128: from 1.5 blocks per SM. The same rule
//   where the chunked kernel does not take a 16-bit call for another reason (a rounding seed,
//   fp16 q/k).
// - Against the chunked kernel: 16-bit T = 2 0.89-0.96 from 2048 blocks, 1.00-1.07 at 1024; T = 4
//   and 8 1.3-2.6 everywhere. fp32, no stored states (the token loop at T = 2, the chunked kernel
//   at T = 4): T = 2..4 0.81-0.94 from 2048 blocks, 0.97-1.02 at 1024, T = 8 1.6-1.8; fp32 T = 1
//   and with stored states 1.04-1.3 everywhere. From kKvGroupChunkBlocksPerSm per SM at those T.
constexpr int64_t kKvGroupT1BlocksPerSm = 6;
constexpr int64_t kKvGroupChunkBlocksPerSm = 12;
bool kv_group_pays(const Problem& p, int64_t blocks, bool chunked) {
  const int64_t sms = sm_count();
  if (p.state.dtype == DType::kF32)
    return p.T >= 2 && p.T <= 4 && !stores_token_states(p) && blocks >= kKvGroupChunkBlocksPerSm * sms;
  if (p.T == 1) return blocks >= kKvGroupT1BlocksPerSm * sms;
  if (!chunked) return 2 * blocks >= 3 * sms;
  return p.T == 2 && blocks >= kKvGroupChunkBlocksPerSm * sms;
}
// The shapes the group kernel (group.cuh) takes in either use: K = 128, whole stages of rt rows
// (KV: columns) per value head, every token staged at once, and one (head, token) of the gates per
// thread (its loader).
bool group_shape_ok(const Problem& p, int rt) {
  return p.K == 128 && p.V % rt == 0 && p.T <= kMaxChunk && p.HV / p.H * p.T <= kGroupThreads;
}

// A launch of the group kernel with the shared memory of `lay`: `blocks` blocks of one (row, q/k
// head), stages of rt rows (KV: columns), `tiles` per value head, nb buffers, T tokens; false where
// the shared memory or the grid does not fit. Each planner adds its own fields.
bool group_plan(int64_t blocks, const GroupSmem& lay, int rt, int tiles, int nb, int T, LaunchPlan& out,
                int cap = kGroupBlocksPerSm) {
  if (static_cast<size_t>(lay.total) > kTileSmemMax || blocks > INT32_MAX) return false;
  LaunchPlan lp;
  lp.group = true;
  lp.tile = true;
  lp.vec = true;
  lp.threads = kGroupThreads;
  lp.rows_per_thread = kGroupRR;
  lp.blocks = blocks;
  lp.smem = spread_smem(blocks, lay.total, cap);
  lp.group4 = cap == kGroupKvBlocksPerSm;
  lp.geo.tile_rows = rt;
  lp.geo.tiles = tiles;
  lp.geo.buffers = nb;
  lp.geo.chunk = T;
  out = lp;
  return true;
}

// The group kernel's stage buffers: nb, or fewer where the grid is more than one wave of blocks
// and fewer buffers let more blocks onto an SM (the fewest removed for the most blocks). A block's
// shared memory grows with the GVA group times T (v, and the fused step's raw outputs and z, are
// [group][T][V]): the fused step at Qwen3.5 bf16 T = 8 admits one block of four warps per SM with
// three buffers. Measured on the H200 against three (two for fp32) buffers at B = 16..256: Qwen3.5
// bf16 T = 8 with one buffer (3 blocks) 0.53-0.64x the time, with two (2 blocks) 0.63-0.70x;
// Qwen3.5 fp32 T = 8 with one (2 blocks) 0.64-0.70x; Qwen3-Next fp32 T = 4 and 8 0.82-0.91x;
// 2 -> 3 blocks at Qwen3.5 T = 2 and 4 0.85-0.89x from B = 64 (bench/results 2026-11-28 group-nb).
// layout(buffers) gives the GroupSmem of that many.
template <typename Layout>
int group_buffers(int64_t blocks, int nb, Layout layout, int cap = kGroupBlocksPerSm) {
  int best = nb, resident = resident_blocks(layout(nb).total, cap);
  if (blocks <= static_cast<int64_t>(resident) * sm_count()) return nb;
  for (int b = nb - 1; b >= 1; --b) {
    const int r = resident_blocks(layout(b).total, cap);
    if (r > resident) best = b, resident = r;
  }
  return best;
}

// chunked: plan_kv_chunk takes this call.
template <typename S>
bool plan_kv_group(const Problem& p, LaunchPlan& lp, bool chunked) {
  using Kv = GroupKvShape<S, 128>;
  const int mode = group_mode();
  if (mode == 0 || !group_shape_ok(p, Kv::VT) || p.v.s[2] != p.V * p.v.s[3]) return false;
  const int64_t blocks = p.B * p.H;
  if (mode == 1 && !kv_group_pays(p, blocks, chunked)) return false;
  const int group = static_cast<int>(p.HV / p.H), V = static_cast<int>(p.V), T = static_cast<int>(p.T);
  const int tiles = V / Kv::VT;
  const int raw = static_cast<int>(stage_raw_bytes(T, 128, group * V, dtype_bytes_host(p.q.dtype)));
  const auto layout = [&](int buffers) {
    return GroupSmem(128, V, group, T, 0, 0, false, Kv::VT, buffers, static_cast<int>(sizeof(S)), false, 0, 0,
                     Kv::kRedFloats, raw);
  };
  const int nb = group_buffers(blocks, std::min(3, group * tiles), layout);
  const GroupSmem lay = layout(nb);
  if (!group_plan(blocks, lay, Kv::VT, tiles, nb, T, lp)) return false;
  lp.geo.raw_bytes = raw;
  return true;
}

// KV without a rounding seed: VK's token loop on the transposed tile (decode_kv_vt_kernel,
// vk.cuh), planned as VK plans its tile kernel (the tiles, rows in registers and the direct loop;
// never the chunked kernel), where kv_vt_pays.
// Measured on the H200 (GDN_CUDA_KV_VT=2 against 0, pool, both models, T = 1, 2, 4, 8, B = 1..512,
// with and without the cache, min of two runs, 86a1407; docs/design.md, "The KV layout through
// VK's token loop"), against the planner's KV kernels:
// - B = 1 (32 and 64 heads) without the cache: fp32 0.62-0.89x, bf16 0.61-0.91x (its small tiles:
//   tile rows of fewer than eight 16-byte pieces). With the cache, fp32 0.87-0.97x (T = 2..8).
// - fp32 T = 2 and 4 at B = 16 and 64 (512..4096 heads): 0.84-1.00x. T = 8 there: 1.02-1.04x.
// - fp32 with the cache from B = 256 (8192 heads): 0.96-0.99x, against the tile kernel.
// - bf16 T = 2 at B = 16 and 64: 0.83-0.93x.
// Slower elsewhere: against the group kernel (B >= 256 without the cache, 1.00-1.07x), at bf16
// T >= 4 from B = 16 (to 1.45x, against the chunked kernel) and at T = 1 from B = 16 (1.02-1.17x).
// VK's own kernels stay ahead by 1.04-1.52x from B = 16 (issue 18's 10% is not met).
constexpr int64_t kKvVtMaxSmallHeads = 64;
constexpr int64_t kKvVtMaxHeadsMid = 4096;
constexpr int64_t kKvVtMinHeadsCache = 8192;
bool kv_vt_pays(const Problem& p) {
  const int mode = kv_vt_mode();
  if (mode == 2) return true;
  if (mode != 1 || group_mode() == 2 || vk_chunk_mode() == 2 || kv_wide_mode() != 1 || p.T > 8) return false;
  const int64_t heads = p.B * p.HV;
  const bool stores = stores_token_states(p);
  if (p.state.dtype == DType::kBF16)
    return !stores && (heads <= kKvVtMaxSmallHeads || (p.T == 2 && heads <= kKvVtMaxHeadsMid));
  if (p.state.dtype != DType::kF32) return false;
  if (heads <= kKvVtMaxSmallHeads) return true;
  return stores ? heads >= kKvVtMinHeadsCache : (p.T == 2 || p.T == 4) && heads <= kKvVtMaxHeadsMid;
}
// VK's tile plan (with f, its fused plan) for decode_kv_vt_kernel, into c: where the copy-in fits
// the block and, if `direct`, the kernel stores the state from registers.
template <typename S>
bool plan_kv_vt_tile(const Problem& p, const FusedProblem* f, bool direct, LaunchPlan& c) {
  if (!plan_vk_tile<S>(p, c, f, 0, false) || !kv_tile_copy_fits<S>(c) ||
      (direct && !kv_vt_stores_direct(static_cast<int>(p.K), c.rows_per_thread, static_cast<int>(sizeof(S)))))
    return false;
  c.kv_vt = true;
  return true;
}
template <typename S>
bool plan_kv_vt(const Problem& p, LaunchPlan& lp) {
  if (p.rounding_seed != nullptr || !kv_vt_pays(p)) return false;
  LaunchPlan c;
  // The cache and per-token slots only where the kernel stores from registers.
  if (!plan_kv_vt_tile<S>(p, nullptr, stores_token_states(p), c)) return false;
  lp = c;
  return true;
}

// KV with 16-byte state rows: VK's token loop on the KV tile, the group kernel, the chunked
// kernel or the tile kernel.
// The chunked kernel before kv-vt: where chunk_min_heads says it pays, it was measured against
// kv-vt's cells (bf16 T = 2 from 2048 heads, fp32 T = 4 from 256).
template <typename S>
bool plan_kv_shared(const Problem& p, LaunchPlan& lp) {
  LaunchPlan chunk;
  const bool chunked = plan_kv_chunk<S>(p, chunk);
  if (!chunked && plan_kv_vt<S>(p, lp)) return true;
  if (plan_kv_group<S>(p, lp, chunked)) return true;
  if (chunked) {
    lp = chunk;
    return true;
  }
  return plan_kv_tile<S>(p, lp);
}

template <typename S, int K>
size_t kv_red_bytes() {
  return sizeof(float) * KvShape<S, K>::kRedFloats;
}

template <typename S>
LaunchPlan plan_kv(const Problem& p, bool vec) {
  LaunchPlan lp;
  using Sh = KvShape<S, 128>;  // threads, tile width and partials do not depend on K
  lp.threads = Sh::kThreads;
  lp.vec = vec;
  lp.geo.tiles = static_cast<int>((p.V + Sh::VT - 1) / Sh::VT);
  lp.blocks = p.B * p.HV * lp.geo.tiles;
  fit_chunk(p, Sh::VT, kv_red_bytes<S, 128>(), lp);
  return lp;
}

template <typename S>
LaunchPlan plan_typed(const Problem& p) {
  const int64_t ve = kVecElems<S>;
  const bool vec = vec_ok(p.state, 3, ve) && vec_ok(p.inter, 4, ve);
  LaunchPlan plan;
  bool tiled = false;
  if (vec && tile_enabled() && p.T <= kMaxChunk)
    tiled = p.layout_kv ? plan_kv_shared<S>(p, plan) : plan_vk_tile<S>(p, plan);
  if (!tiled) plan = p.layout_kv ? plan_kv<S>(p, vec) : plan_vk(p, vec);
  plan.geo.qkv_vec = qkv_vec_ok(p);
  plan.pdl = pdl_enabled();
  // Pre-wait prefetching pays only where this grid can become resident while the previous
  // kernel runs, i.e. one wave of small blocks; at large B it only adds instructions (measured:
  // -1 us at B=1, +1..4% at B >= 64; docs/design.md).
  plan.geo.prefetch = prefetch_enabled() && one_wave(plan.blocks);
  return plan;
}

template <typename S>
cudaError_t launch_typed(const Problem& p, cudaStream_t stream) {
  const LaunchPlan plan = plan_typed<S>(p);
  return p.layout_kv ? launch_kv<S>(p, plan, stream) : launch_vk<S>(p, plan, stream);
}

// describe_cuda_plan's text: the kernel family, then the launch and the family's fields.
std::string describe(const LaunchPlan& lp, bool kv) {
  std::string s = lp.group     ? std::string(lp.group4 ? "group4" : "group")
                  : lp.chunked ? std::string(kv ? "kv-chunk" : "vk-chunk")
                  : lp.kv_vt   ? std::string(lp.direct ? "kv-vt-direct" : "kv-vt")
                  : lp.tile    ? std::string(kv ? (lp.kv_wide ? "kv-tile-wide" : "kv-tile")
                                                : (lp.direct ? "vk-tile-direct" : "vk-tile"))
                               : std::string(kv ? "kv" : "vk");
  const auto add = [&](const char* name, int64_t v) { s += std::string(" ") + name + "=" + std::to_string(v); };
  add("blocks", lp.blocks);
  add("threads", lp.threads);
  add("smem", static_cast<int64_t>(lp.smem));
  if (lp.cluster > 1) add("cluster", lp.cluster);
  if (lp.cluster_cap > 0) add("cluster_cap", lp.cluster_cap);
  if (lp.group) add("hpb", lp.geo.hpb), add("buffers", lp.geo.buffers);
  add("tiles", lp.geo.tiles);
  if (lp.tile) add("tile_rows", lp.geo.tile_rows), add("chunk", lp.geo.chunk);
  add("rows_per_thread", lp.rows_per_thread);
  if (lp.pdl) s += " pdl";
  if (lp.geo.prefetch) s += " prefetch";
  return s;
}

// Checking mode: each row n counts once if a slot it writes is also written by another row.
// O(B^2 T^2) index reads; only launched when asked for.
__global__ void count_duplicate_writes(const __grid_constant__ Problem p, const Geometry) {
  pdl_wait();
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= p.B) return;
  const RowSlots rn = resolve_row(p, n);
  if (rn.read < 0) return;
  for (int64_t m = 0; m < p.B; ++m) {
    if (m == n) continue;
    const RowSlots rm = resolve_row(p, m);
    if (rm.read < 0) continue;
    for (int64_t t = 0; t < p.T; ++t) {
      const int64_t w = token_write_slot(p, rn, n, t);
      if (w < 0) continue;
      for (int64_t u = 0; u < p.T; ++u) {
        if (token_write_slot(p, rm, m, u) == w) {
          atomicAdd(p.error_count, 1);
          return;
        }
      }
    }
  }
}

// The fused step's launch (fused.cuh): the tile kernels only, with a cluster of every block of
// one (row, q/k head). Returns an empty string with the plan, or why the CUDA backend cannot run
// this (valid) fused call.
int compute_capability_major() {
  static std::atomic<int> cache[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return 0;
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    if (cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) v = -1;
    cache[dev].store(v, std::memory_order_relaxed);
  }
  (void)cudaGetLastError();
  return v;
}

// The group kernel (group.cuh): one block per (row, q/k head) streaming its GVA group's
// state through NB stage buffers (VK: kGroupRows rows; KV: the K x VT tile of VT columns, 16 KB);
// K = 128, the conv's 16-byte layout, T <= kMaxChunk. Against the cluster form, measured on the
// H100 for VK (Qwen3-Next and Qwen3.5, pool, T = 1, 2, 4, B = 4..256, one call per comparison;
// docs/design.md, before the kernel's later changes): it needed a grid of at least
// 1.5 blocks per SM (B * H = 128 blocks lost everywhere but Qwen3.5 fp32 T = 2: Qwen3.5 bf16 T = 2
// B = 8 20.8 -> 27.9 us, fp32 T = 4 B = 8 37.6 -> 40.6), and then at T <= 3 at least
// kGroupMinStateBytesPerSm of state per SM (Qwen3-Next bf16 B = 16, 16 MB: T = 1 16.3 -> 17.8,
// T = 2 18.6 -> 22.2; from 32 MB faster or level: fp32 B = 16 31.2 -> 24.2, Qwen3.5 bf16 B = 16
// 33.7 -> 29.2, Qwen3-Next bf16 B = 64 58.8 -> 52.1, B = 32 level), at T >= 4 none (Qwen3-Next bf16
// B = 16 38.5 -> 31.2). Below, the cluster form's more, smaller blocks fill the GPU sooner.
// KV, measured on the H200 (both models, pool, vLLM's conv layout, T = 1, 2, 4, B = 4..32, group
// forced against never in one call; docs/design.md): the same rule, but for 16-bit states at
// T >= 2, where the cluster form keeps its rows in an fp32 work tile, from
// kGroupKvMinStateBytesPerSm of state per SM on any grid (Qwen3-Next bf16 T = 2 B = 8, 8 MB in
// 128 blocks: 27.9 -> 17.1 us; B = 4, 4 MB: 13.1 -> 16.4, lost; Qwen3.5 bf16 T = 2 B = 4, 8 MB:
// 29.0 -> 26.3).
// Measured again on the H200 at 0ae1047 (both layouts and models, fp32 and bf16, pool, T = 1, 2,
// 4, B = 1..32, GDN_CUDA_GROUP=2 against the rule, min of two runs; bench/results 2026-11-29
// small-b-rules): the group kernel, improved since, now also pays from about one block per SM
// (7/8: 116 blocks on 132 SMs; measured at B * H = 128) where the state reaches
// kGroupMinStateBytesPerSm per SM (Qwen3.5 fp32 B = 8, 34 MB: VK T = 1 23.7 -> 19.7 us, T = 2
// 28.0 -> 21.8, T = 4 0.95x; KV 0.80, 0.92, 1.01x), and for 16-bit KV at T = 1 at any state size
// (Qwen3-Next bf16 B = 8 13.2 -> 11.5, B = 16 0.90x, Qwen3.5 B = 8 0.97x). Below one block per SM
// it loses (B = 4, 64 blocks: 1.09-1.88x but for Qwen3-Next KV bf16 T = 1, 0.94), as does 16-bit
// VK at 128 blocks (Qwen3.5 bf16 B = 8 1.07-1.17x).
// From 150 KiB per SM since 2026-11-29 (was 240; H200, fused, pool, both layouts and models, fp32
// and bf16, T = 1, 2, 4, B = 4..30 in steps of 2, the new rule against GDN_CUDA_GROUP=0 and 2 in
// one call, min of two runs; bench/results 2026-11-29 group-150k): of the 36 cells it moved, 33
// took 0.68-0.98x the time (Qwen3-Next bf16 VK T = 1 B = 24 23.2 -> 17.2 us, fp32 VK T = 2 B = 12
// 26.9 -> 18.2, Qwen3.5 bf16 VK T = 1 B = 12 23.9 -> 18.5, Qwen3-Next fp32 KV T = 1 B = 10
// 21.2 -> 16.3), past a step in the cluster form's time (likely where its grid passes one wave of
// clusters; not measured); three took 1.04-1.05x (Qwen3-Next fp32 VK T = 1 B = 10 and 12, T = 4
// B = 10).
// GDN_CUDA_GROUP (group_mode) holds it off or forces it.
// Stage buffers: three of 16 KB for 16-bit states (two: 53.0 us at bf16 B = 64, three 51.7, four
// 57.1 at two blocks per SM instead of three), two of 32 KB for fp32 (one to four within 1% at
// Qwen3-Next, three and four 4-5% slower at Qwen3.5 B = 64); KV: three of 16 KB at every dtype.
constexpr int64_t kGroupMinStateBytesPerSm = 150 * 1024;
constexpr int64_t kGroupKvMinStateBytesPerSm = 48 * 1024;
constexpr int64_t kGroupLightBlockBytes = 64 * 1024;  // plan_fused_group, past_wave

// past_wave: the caller found the cluster form's grid past the clusters the device runs at once
// (group_past_cluster_wave); the group kernel then pays where its blocks are light (a GVA group's
// state of at most kGroupLightBlockBytes) or about one per SM, whatever the rules below say.
template <typename S>
bool plan_fused_group(const FusedProblem& f, LaunchPlan& lp, bool past_wave = false) {
  const Problem& p = f.step;
  const int mode = group_mode();
  const int rt = p.layout_kv ? GroupKvShape<S, 128>::VT : kGroupRows;  // stage rows (KV: columns)
  if (mode == 0 || !group_shape_ok(p, rt)) return false;
  const ConvPath conv = fused_conv_path(f, 1);
  if (conv == kConvScalar) return false;
  const int64_t blocks = p.B * p.H;
  const int64_t state_bytes = p.B * p.HV * p.V * p.K * static_cast<int64_t>(sizeof(S));
  const int64_t sms = sm_count();
  const bool kv16 = p.layout_kv && sizeof(S) < 4;
  const bool about_one_per_sm = 8 * blocks >= 7 * sms;
  // 16-bit KV at T >= 2: by its state alone; 16-bit KV at T = 1, or 150 KiB of state per SM: from
  // about one block per SM; else from 1.5 blocks per SM at T >= 4 (the comment above).
  const bool light = state_bytes <= kGroupLightBlockBytes * blocks;  // a block's GVA group of state
  const bool pays = (past_wave && (light || about_one_per_sm)) ||
                    (kv16 && p.T >= 2 ? state_bytes >= kGroupKvMinStateBytesPerSm * sms
                     : kv16 || state_bytes >= kGroupMinStateBytesPerSm * sms
                         ? about_one_per_sm
                         : 2 * blocks >= 3 * sms && p.T >= 4);
  if (mode == 1 && !pays) return false;
  const int V = static_cast<int>(p.V), T = static_cast<int>(p.T);
  const int tiles = V / rt;
  // Two q/k heads per block (the VK kernel at 16-bit states): one conv phase, slot chain and
  // barrier set for both heads' value heads, so a block's fixed start is paid half as often. It
  // pays at a GVA group of two (Qwen3-Next; a group of one was neither timed nor tested with
  // two heads, so it keeps one), T <= 2, where two heads per block still fill 1.75 waves of
  // three blocks per SM (Qwen3-Next from B = 87 on 132 SMs: B = 96 0.92-0.96x, B = 80
  // 1.02-1.04x, B = 64 1.06-1.12x, bf16 and fp16). Measured on the H200 (fused, pool, min of two
  // runs; docs/design.md, "Two q/k heads per block"): Qwen3-Next bf16 T = 1 B = 128
  // 72.0 -> 68.7 us, B = 256 137.9 -> 127.3, B = 512 269.9 -> 242.8; T = 2 B = 256
  // 167.0 -> 144.7, B = 512 329.7 -> 273.4.
  // Lost at a group of four (Qwen3.5 1.04-1.32x from B = 64), at fp32 (1.00-1.09x) and at T = 8
  // (1.16-1.23x); mixed at T = 4 (0.92-1.04x from B = 96). KV keeps one head: its 16-bit
  // four-block kernel has no registers for two.
  // Also where two heads per block fit the grid into one wave of three blocks per SM and one
  // head does not (Qwen3-Next B = 25..49 on 132 SMs): one head leaves a second, partial wave.
  // H200, fused VK, pool, min of two runs, one head -> two (bench/results 2026-11-29
  // hpb-one-wave): bf16 T = 1 B = 32 25.5 -> 20.2 us, B = 48 30.8 -> 29.5; T = 2 B = 32
  // 32.2 -> 24.8, B = 48 37.0 -> 32.3; fp16 alike; B = 44 T = 1 0.99x. Past one wave of
  // two-head blocks (B = 52..65) two heads were level or lost at T = 1 (0.99-1.08x) and won at
  // T = 2 B = 52 and 56 (0.91-0.94x), left out of the rule.
  const int qg = static_cast<int>(p.HV / p.H);
  const int64_t wave = int64_t{kGroupBlocksPerSm} * sms;  // blocks of one wave at three per SM
  const bool two_ok = !p.layout_kv && sizeof(S) == 2 && p.H % 2 == 0 && 2 * qg * T <= kGroupThreads;
  const bool two_pays = qg == 2 && p.T <= 2 && (2 * blocks >= 7 * wave || (blocks > wave && blocks <= 2 * wave));
  const bool two = two_ok && (group_hpb() == 2 || (group_hpb() == 0 && two_pays));
  const int hpb = two ? 2 : 1;
  const int group = qg * hpb;
  const int64_t grid = blocks / hpb;
  const bool norm = f.norm_weight.data != nullptr;
  const bool norm_vec = norm && fused_norm_vec_ok(f, V);
  const int zb = norm_vec && f.z.data != nullptr ? dtype_bytes_host(f.z.dtype) : 0;
  const int wb = norm_vec ? dtype_bytes_host(f.norm_weight.dtype) : 0;
  const auto layout = [&](int buffers) {
    return GroupSmem(static_cast<int>(p.K), V, group, T, static_cast<int>(f.W), static_cast<int>(f.L), conv == kConvCm,
                     rt, buffers, static_cast<int>(sizeof(S)), norm, zb, wb,
                     p.layout_kv ? GroupKvShape<S, 128>::kRedFloats : 0, 0, hpb);
  };
  const int nb0 = std::min(sizeof(S) == 4 && !p.layout_kv ? 2 : 3, group * tiles);
  int nb = group_buffers(grid, nb0, layout), cap = kGroupBlocksPerSm;
  // 16-bit KV past one wave of three blocks per SM: the kernel compiled for four, where some
  // buffer count admits a fourth. Same-call A/B on the H200 (fused KV bf16, pool, min of two):
  // 0.83-0.94x at T = 1, 2, 4 from B = 64 (Qwen3.5 T = 4 B = 64 171.1 -> 142.7 us) but Qwen3.5
  // T = 1 1.007-1.017; unchanged at B = 16 and at T = 8, where no fourth block fits
  // (bench/results 2026-11-28 kv-group-4-ab).
  // With stochastic rounding at bf16 the four-block kernel spills 88-120 bytes (ptxas; fp16 16, the
  // three-block kernels none): from two waves of three blocks per SM the three-block kernel
  // instead (H200: 0.80-0.99x from B = 64, 1.02-1.26x at B = 32 = 1.3 waves, fp16 1.07-1.14x;
  // bench/results 2026-11-29 sr-kv-three-blocks; the rule itself 0.79-1.00x, 13cda3c-rounding-ab).
  const bool sr_bf16 = std::is_same_v<S, __nv_bfloat16> && p.rounding_seed != nullptr;
  if (p.layout_kv && sizeof(S) == 2 && grid > wave && !(sr_bf16 && grid >= 2 * wave)) {
    const int nb4 = group_buffers(grid, nb0, layout, kGroupKvBlocksPerSm);
    const GroupSmem l4 = layout(nb4);
    if (resident_blocks(l4.total, kGroupKvBlocksPerSm) >= kGroupKvBlocksPerSm) nb = nb4, cap = kGroupKvBlocksPerSm;
  }
  const GroupSmem lay = layout(nb);
  if (!group_plan(grid, lay, rt, tiles, nb, T, lp, cap)) return false;
  lp.geo.qkv_vec = false;
  lp.geo.conv_vec = true;
  lp.geo.conv_cm = conv == kConvCm;
  lp.geo.norm_vec = norm_vec;
  lp.geo.hpb = hpb;
  lp.geo.prefetch = false;  // the group kernel has no L2 prefetch
  lp.pdl = pdl_enabled();
  return true;
}

// How many clusters of the fused plan's kernel the current device runs at once
// (fused_max_clusters), or 0 where it cannot say. Cached per device, kernel, cluster size, shared
// memory and block size: the planner runs per call (an eager caller pays its host time), the
// query once per key. A fixed table of atomics, no allocation and no lock; two threads that miss
// at once both ask and store the same answer.
template <typename S>
int fused_cluster_capacity(const FusedProblem& f, const LaunchPlan& lp) {
  constexpr int kSlots = 256;
  static std::atomic<uint64_t> keys[kSlots];
  static std::atomic<int> values[kSlots];  // capacity + 1 once stored
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64 || lp.smem >= (size_t{1} << 20)) {
    (void)cudaGetLastError();
    return 0;
  }
  const Problem& p = f.step;
  const uint64_t k_code = p.K == 64 ? 0 : p.K == 128 ? 1 : 2;
  const bool sr = sizeof(S) == 2 && p.rounding_seed != nullptr;
  const uint64_t key = 1 | uint64_t(dev) << 1 | uint64_t(sizeof(S)) << 7 | uint64_t(p.layout_kv) << 10 | k_code << 11 |
                       uint64_t(lp.rows_per_thread) << 13 | uint64_t(f.norm_weight.data != nullptr) << 16 |
                       uint64_t(sr) << 17 | uint64_t(lp.cluster) << 18 | uint64_t(lp.smem) << 24 |
                       uint64_t(lp.threads) << 44;  // the KV tile variants differ in threads
  const int home = static_cast<int>((key * 0x9E3779B97F4A7C15ull) >> 56);  // 8 bits: kSlots
  const auto ask = [&] {
    int n = 0;
    const cudaError_t err = p.layout_kv ? fused_max_clusters<S, true>(f, lp, &n) : fused_max_clusters<S, false>(f, lp, &n);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky; do not leak it to the caller
      return 0;
    }
    return n;
  };
  for (int i = 0; i < kSlots; ++i) {
    const int slot = (home + i) % kSlots;
    uint64_t k = keys[slot].load(std::memory_order_acquire);
    if (k == 0) {
      const int n = ask();
      if (keys[slot].compare_exchange_strong(k, key, std::memory_order_acq_rel)) {
        values[slot].store(n + 1, std::memory_order_release);
        return n;
      }
      if (k == key) return n;  // another thread stored this key first
      continue;
    }
    if (k == key) {
      const int v = values[slot].load(std::memory_order_acquire);
      return v > 0 ? v - 1 : ask();  // stored but not yet valued: ask again
    }
  }
  return ask();  // a full table: every new key asks
}

// The fused step's tiles at T > 1 (VK; T = 1 takes one tile per head, plan_vk_tile): decode's
// tiles, small at small B for latency, make grids that pass one wave of clusters by a little and
// then take two (H100, docs/design.md "The fused step at small and mid B": Qwen3.5 bf16 T = 4
// B = 2, 512 blocks in clusters of 16, 21.5 us, against 16.9 with one tile per head and 15.0 at
// B = 3 with 384 blocks in clusters of 8). So where the grid's clusters are more than the device
// runs at once but at most twice that, the tiles widen until they fit (or are a whole head);
// grids of several waves keep decode's tiles.
template <typename S>
void widen_fused_tiles(const FusedProblem& f, LaunchPlan& lp) {
  const Problem& p = f.step;
  if (p.layout_kv || p.T == 1 || vk_tile_rows_override() > 0) return;
  while (lp.geo.tile_rows < p.V && lp.cluster > 1) {
    const int64_t cap = fused_cluster_capacity<S>(f, lp);
    const int64_t clusters = lp.blocks / lp.cluster;
    if (cap <= 0 || clusters <= cap || clusters > 2 * cap) return;
    LaunchPlan wider;
    if (!plan_vk_tile<S>(p, wider, &f, 2 * lp.geo.tile_rows) || wider.geo.tile_rows <= lp.geo.tile_rows) return;
    lp = wider;
  }
}

// The fused KV cluster form at 16-bit states: the wide tiles (kv_tile_wide) are half as wide, so a
// cluster holds twice the blocks (Qwen3.5: four value heads of four tiles, sixteen, past the
// portable eight). Where the grid has more such clusters than the device runs at once, the narrow
// tiles instead. Measured on the H200 (fused, pool, min of two runs; bench/results 2026-11-29
// small-b-rules): Qwen3.5 bf16 B = 2, 32 clusters of 16, T = 1 18.6 -> 12.1 us, T = 2 22.8 ->
// 16.1, T = 4 31.4 -> 23.8; B = 1 (16 clusters, which fit) keeps the wide tiles (narrow 1.06-1.15x).
// Clusters of eight keep them too: Qwen3-Next bf16 B = 4, 64 clusters of 8 past the capacity,
// lost with the narrow tiles (T = 2 1.07x, T = 4 1.17x).
template <typename S>
void narrow_fused_kv_tiles(const FusedProblem& f, LaunchPlan& lp) {
  const Problem& p = f.step;
  if (!p.layout_kv || sizeof(S) != 2 || !lp.kv_wide || lp.cluster <= 8 || kv_wide_mode() == 2) return;
  const int64_t cap = fused_cluster_capacity<S>(f, lp);
  if (cap <= 0 || lp.blocks / lp.cluster <= cap) return;
  LaunchPlan narrow;
  if (plan_kv_tile<S>(p, narrow, &f, false) && narrow.cluster < lp.cluster) lp = narrow;
}

// The group kernel where the cluster form's grid (as widened or narrowed above) has more clusters
// than the device runs at once and the group grid fits one wave, if its blocks are light or about
// one per SM (plan_fused_group, past_wave). Past its capacity the cluster form's time steps
// up by about a whole wave, while the group kernel's blocks start one by one; but a few heavy
// group blocks (Qwen3.5 fp32: four heads, 256 KiB) take longer than that second wave.
// The planner cannot see how many rows are padding: a grid of padding rows' clusters exits at
// once, so the cluster form passes its capacity later than its grid says. The rule takes the
// full batch's side: measured on the H200 (fused, B = 1..32, T = 1, 2, 4, min of two runs;
// docs/design.md, "The bulk tile load landed, and dense rows at small B") dense Qwen3-Next KV
// bf16 B = 4 T = 1 16.0 -> 11.4 us, B = 6 T = 2 28.8 -> 14.5, KV fp32 B = 8 T = 1 22.2 -> 14.8,
// Qwen3.5 VK bf16 B = 8 T = 1 22.9 -> 15.8; with 20% padding rows the same cells take 0.80-1.34x.
template <typename S>
bool group_past_cluster_wave(const FusedProblem& f, LaunchPlan& lp) {
  const Problem& p = f.step;
  if (group_mode() != 1 || lp.cluster <= 1 || p.B * p.H > int64_t{kGroupBlocksPerSm} * sm_count()) return false;
  const int cap = fused_cluster_capacity<S>(f, lp);
  // plan_fused_group leaves lp as it is where it declines, and replaces it where it plans; either
  // plan's text reports the capacity weighed.
  const bool group = cap > 0 && lp.blocks / lp.cluster > cap && plan_fused_group<S>(f, lp, true);
  lp.cluster_cap = cap;
  return group;
}

// The fused step's KV layout through VK's token loop (decode_kv_vt_kernel with Fuse): VK's
// fused tile plan (its clusters, tiles and rows per thread), where the kernel stores the state
// from registers (the tile pass would follow fused_finish's cluster barrier) and without a
// rounding seed. Measured on the H200 (86a1407, forced against never, as kv_vt_pays), against
// the fused step's KV kernels: fp32 at B = 1 (32 and 64 heads) without the cache, T = 2..8,
// 0.74-0.96x; everywhere else slower: T = 1 and the cache at B = 1 0.98-1.22x, from B = 16
// 0.93-1.66x against the group kernel, about what the KV tile kernel's cluster form cost against
// it (fp32 T = 4 B = 256: 1.44x, 1.45x at 73b8773): the cluster form's cost, not the tile's.
template <typename S>
bool plan_fused_kv_vt(const FusedProblem& f, LaunchPlan& lp) {
  const Problem& p = f.step;
  if (!p.layout_kv || p.rounding_seed != nullptr || !kv_vt_pays(p)) return false;
  if (kv_vt_mode() != 2 && (p.state.dtype != DType::kF32 || p.B * p.HV > kKvVtMaxSmallHeads || p.T < 2 ||
                            stores_token_states(p)))
    return false;
  LaunchPlan c;
  if (!plan_kv_vt_tile<S>(p, &f, true, c) || c.cluster > kMaxFusedCluster ||
      (c.cluster > 8 && c.smem > kBigClusterSmemMax))
    return false;
  lp = c;
  return true;
}

template <typename S>
std::string plan_fused_typed(const FusedProblem& f, LaunchPlan& lp) {
  const Problem& p = f.step;
  if (!vec_ok(p.state, 3, kVecElems<S>) || !vec_ok(p.inter, 4, kVecElems<S>))
    return "fused_decode on CUDA needs 16-byte aligned state and inter rows (data pointers and every "
           "stride but the innermost a multiple of 16 bytes); decode takes unaligned pools";
  // The cluster form's limits hold for every call, also where the group kernel runs instead, so
  // that whether a shape is supported does not depend on B.
  const bool ok = p.layout_kv ? plan_kv_tile<S>(p, lp, &f) : plan_vk_tile<S>(p, lp, &f);
  if (!ok || lp.cluster > kMaxFusedCluster || (lp.cluster > 8 && lp.smem > kBigClusterSmemMax))
    return "fused_decode on CUDA needs every block of one row and q/k head (HV/H = " + std::to_string(p.HV / p.H) +
           " value heads times their tiles) in one thread-block cluster of at most " +
           std::to_string(kMaxFusedCluster) + " blocks; this shape does not fit";
  if (!plan_fused_kv_vt<S>(f, lp)) {
    if (plan_fused_group<S>(f, lp)) return {};
    widen_fused_tiles<S>(f, lp);
    narrow_fused_kv_tiles<S>(f, lp);
    if (group_past_cluster_wave<S>(f, lp)) return {};
  }
  if (lp.blocks > INT32_MAX)
    return "fused_decode on CUDA: B * HV * tiles = " + std::to_string(lp.blocks) + " blocks exceeds the grid limit";
  lp.geo.qkv_vec = false;  // the conv loads the new inputs itself (stage_issue never runs)
  const ConvPath conv = fused_conv_path(f, p.HV / p.H * lp.geo.tiles);
  lp.geo.conv_vec = conv != kConvScalar;
  lp.geo.conv_cm = conv == kConvCm;
  lp.pdl = pdl_enabled();
  lp.geo.prefetch = prefetch_enabled() && one_wave(lp.blocks);
  return {};
}

// fn(StateType<S>{}) with S the state's element type: fp32, bf16 or fp16 (validated before).
template <typename S>
struct StateType {
  using type = S;
};
template <typename Fn>
auto with_state_type(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      return fn(StateType<float>{});
    case DType::kBF16:
      return fn(StateType<__nv_bfloat16>{});
    default:
      return fn(StateType<__half>{});
  }
}

std::string plan_fused(const FusedProblem& f, LaunchPlan& lp) {
  if (compute_capability_major() < 9)
    return "fused_decode on CUDA needs thread-block clusters (sm_90 or newer), device has compute capability " +
           std::to_string(compute_capability_major()) + ".x";
  return with_state_type(f.step.state.dtype,
                         [&](auto s) { return plan_fused_typed<typename decltype(s)::type>(f, lp); });
}

}  // namespace
}  // namespace cuda

Status cuda_backend_status() { return Status::Ok(); }

Status fused_cuda_status(const FusedProblem& f) {
  cuda::LaunchPlan lp;
  const std::string why = cuda::plan_fused(f, lp);
  return why.empty() ? Status::Ok() : Status(StatusCode::kNotSupported, why);
}

namespace {

// Launches on the tensors' device, as a device guard would, and leaves the caller's current
// device as it was (the Python binding and multi-GPU engines rely on both).
struct DeviceGuard {
  int dev = 0, prev = -1;
  cudaError_t err = cudaSuccess;
  explicit DeviceGuard(int device) : dev(device) {
    err = cudaGetDevice(&prev);
    if (err == cudaSuccess && prev != dev) err = cudaSetDevice(dev);
    if (err != cudaSuccess) (void)cudaGetLastError();
  }
  ~DeviceGuard() {
    if (prev >= 0 && prev != dev) cudaSetDevice(prev);
  }
  Status status() const {
    return err == cudaSuccess ? Status::Ok()
                              : Status(StatusCode::kCudaError, std::string("cannot select CUDA device ") +
                                                                   std::to_string(dev) + ": " + cudaGetErrorString(err));
  }
};

// Checking mode: counts rows writing a slot another row writes (after the step's kernel).
cudaError_t launch_duplicate_count(const Problem& p, cudaStream_t stream) {
  if (!p.check_duplicate_writes || p.error_count == nullptr || !p.update_state) return cudaSuccess;
  cuda::LaunchPlan lp;
  lp.threads = 128;
  lp.blocks = (p.B + lp.threads - 1) / lp.threads;
  lp.pdl = false;
  return cuda::launch_kernel(cuda::count_duplicate_writes, p, lp, stream);
}

Status launch_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();  // a failed launch is not sticky; do not leak it to the caller
  return Status(StatusCode::kCudaError, std::string("gdn CUDA ") + what + " kernel launch failed: " +
                                            cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

}  // namespace

Status fused_decode_cuda(const FusedProblem& f, void* stream_ptr) {
  using namespace cuda;
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const DeviceGuard guard(f.step.device_id);
  if (Status s = guard.status(); !s.ok()) return s;
  LaunchPlan lp;
  if (const std::string why = plan_fused(f, lp); !why.empty()) return Status(StatusCode::kNotSupported, why);
  cudaError_t err = with_state_type(f.step.state.dtype, [&](auto s) {
    using S = typename decltype(s)::type;
    return f.step.layout_kv ? launch_fused<S, true>(f, lp, stream) : launch_fused<S, false>(f, lp, stream);
  });
  if (err == cudaSuccess) err = launch_duplicate_count(f.step, stream);
  return launch_status(err, "fused decode");
}

std::string describe_cuda_plan(const Problem& p) {
  using namespace cuda;
  const DeviceGuard guard(p.device_id);
  if (!guard.status().ok()) return {};
  return with_state_type(p.state.dtype,
                         [&](auto s) { return describe(plan_typed<typename decltype(s)::type>(p), p.layout_kv); });
}

std::string describe_fused_cuda_plan(const FusedProblem& f) {
  using namespace cuda;
  const DeviceGuard guard(f.step.device_id);
  if (!guard.status().ok()) return {};
  LaunchPlan lp;
  return plan_fused(f, lp).empty() ? describe(lp, f.step.layout_kv) : std::string();
}

Status decode_cuda(const Problem& p, void* stream_ptr) {
  using namespace cuda;
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const DeviceGuard guard(p.device_id);
  if (Status s = guard.status(); !s.ok()) return s;
  cudaError_t err = with_state_type(p.state.dtype,
                                    [&](auto s) { return launch_typed<typename decltype(s)::type>(p, stream); });
  if (err == cudaSuccess) err = launch_duplicate_count(p, stream);
  return launch_status(err, "decode");
}

}  // namespace gdn::detail

namespace gdn {

bool cuda_available() {
  static const bool available = [] {
    int n = 0;
    const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
    (void)cudaGetLastError();
    return ok;
  }();
  return available;
}

}  // namespace gdn
