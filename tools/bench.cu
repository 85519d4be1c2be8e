// `gdn bench --device cuda`: per-call time of gdn::decode on the GPU against the device-to-device copy
// ceiling measured in the same run.
//
// Method (shared/anchors.md): each configuration is captured into a CUDA graph of C calls
// that rotate over N state sets (pool + intermediate cache), N chosen so that the bytes the
// other N-1 calls touch are at least 4x the L2: every call finds its state cold, as in
// serving, where the other layers' states evict it. The graph is replayed several times and
// the median replay time / C is the per-call time. q, k, v, gates and o are single copies
// (in serving they come hot from the previous kernel). --copy-kernel adds, per row, the time of
// a plain copy kernel that moves the same state bytes in the same graph: the floor that launch,
// latency and bandwidth leave for any kernel, measured instead of modelled.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "backends.h"
#include "bench.h"
#include "check.h"
#include "gdn/gdn.h"

#ifndef GDN_GIT_COMMIT
#define GDN_GIT_COMMIT "unknown"
#endif

namespace {

#define GDN_BENCH_CHECK(x)                                                                \
  do {                                                                                    \
    const cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess)                                                                \
      throw std::runtime_error(std::string(#x) + " failed: " + cudaGetErrorString(e_));   \
  } while (0)

struct Model {
  const char* name;
  int H, HV, K, V;
};
constexpr Model kModels[] = {{"qwen3-next", 16, 32, 128, 128}, {"qwen3.5", 16, 64, 128, 128}};

enum class Mode { kDense, kPool, kSplit };
const char* mode_name(Mode m) { return m == Mode::kDense ? "dense" : m == Mode::kPool ? "pool" : "split"; }

struct Config {
  const Model* model;
  DLDataType state;  // fp32, bf16 or fp16
  bool layout_kv;
  Mode mode;
  int T;
  int B;
  bool cache;
  bool update;
  bool fused = false;  // gdn::fused_decode (op "fused") instead of gdn::decode
  bool sr = false;     // stochastic rounding of the 16-bit state stores (rounding_seed given)
};

using gdn::tools::kConvL;  // the fused rows' conv (bench.h)
using gdn::tools::kConvW;
using gdn::tools::state_name;

// ---------------------------------------------------------------------------------------
// Random fill on the device: a counter hash to a uniform in [-amp, amp) (never all zeros;
// amp = sqrt(3) sigma gives the spec's variances).
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename T>
__global__ void fill_uniform(T* p, int64_t n, float amp, uint64_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float u = static_cast<float>(splitmix64(seed * 0x100000001b3ull + i) >> 40) * (1.f / 16777216.f);
    p[i] = static_cast<T>((2.f * u - 1.f) * amp);
  }
}

template <typename T>
void fill(void* p, int64_t n, float amp, uint64_t seed, cudaStream_t s) {
  if (n == 0) return;
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 132 * 16);
  fill_uniform<T><<<static_cast<unsigned>(blocks), 256, 0, s>>>(static_cast<T*>(p), n, amp, seed);
  GDN_BENCH_CHECK(cudaGetLastError());
}

// One device allocation carved per configuration: no cudaMalloc inside the sweep.
struct Arena {
  char* base = nullptr;
  size_t size = 0;
  size_t used = 0;
  void* take(size_t bytes) {
    const size_t off = (used + 255) / 256 * 256;
    if (off + bytes > size) throw std::runtime_error("bench arena exhausted");
    used = off + bytes;
    return base + off;
  }
  size_t left() const { return size > used ? size - used : 0; }
};

struct Device {
  int id = 0;
  std::string name;
  size_t l2 = 0;
  int sms = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Device-to-device copy ceiling: 1 GiB cudaMemcpyAsync, bytes read + written over time.
double copy_ceiling_tbs(cudaStream_t s) {
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  GDN_BENCH_CHECK(cudaMalloc(&a, bytes));
  GDN_BENCH_CHECK(cudaMalloc(&b, bytes));
  fill<float>(a, bytes / 4, 1.f, 1, s);
  cudaEvent_t e0, e1;
  GDN_BENCH_CHECK(cudaEventCreate(&e0));
  GDN_BENCH_CHECK(cudaEventCreate(&e1));
  std::vector<double> ts;
  for (int i = 0; i < 7; ++i) {
    GDN_BENCH_CHECK(cudaEventRecord(e0, s));
    GDN_BENCH_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
    GDN_BENCH_CHECK(cudaEventRecord(e1, s));
    GDN_BENCH_CHECK(cudaEventSynchronize(e1));
    float ms = 0.f;
    GDN_BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i > 0) ts.push_back(ms);
  }
  GDN_BENCH_CHECK(cudaEventDestroy(e0));
  GDN_BENCH_CHECK(cudaEventDestroy(e1));
  GDN_BENCH_CHECK(cudaFree(a));
  GDN_BENCH_CHECK(cudaFree(b));
  return 2.0 * bytes / (median(ts) * 1e-3) / 1e12;
}

// The command line is shared with the CPU bench (bench.h, bench.cpp).
using Options = gdn::tools::BenchOptions;

struct Result {
  Config c;
  double us = 0, floor_us = 0, tbs = 0;
  double copy_us = -1;  // the same-bytes copy kernel (--copy-kernel; < 0: not measured)
  std::string plan;     // the launch the CUDA backend made (gdn::detail::describe_*_cuda_plan)
};

// The tensors of one configuration: shared inputs plus N state sets (decode), or the same as
// fused-step arguments (fsets: mixed_qkv, conv weights, z and norm weight shared; each set its
// own conv pool next to its state pool).
struct Setup {
  std::vector<gdn::DecodeArgs> sets;
  std::vector<gdn::FusedDecodeArgs> fsets;
  double bytes = 0;  // floor model: valid rows' state read (+ write) (+ inter), plus inputs
  const int32_t* read_slots = nullptr;  // device, [B]; nullptr in dense mode
  int64_t slot_bytes = 0;               // state bytes of one slot (HV * rows * cols * es)
};

Setup make_setup(const Config& c, const Device& dev, Arena& arena, const Options& opt,
                 cudaStream_t s, uint64_t seed) {
  const Model& m = *c.model;
  const int64_t B = c.B, T = c.T, H = m.H, HV = m.HV, K = m.K, V = m.V;
  const int64_t rows = c.layout_kv ? K : V, cols = c.layout_kv ? V : K;
  const int64_t es = c.state.bits / 8;
  const DLDataType sdt = c.state;
  const DLDevice dl = gdn::cuda_device(dev.id);
  const int64_t mat = HV * rows * cols;  // elements per slot
  const int64_t pad = c.mode == Mode::kDense ? 0 : std::llround(0.2 * B);
  const int64_t valid = B - pad;
  const int64_t P = c.mode == Mode::kDense ? B : 4 * B;

  // Bytes each call must move (the floor model), and how many state sets keep it cold.
  const int64_t D = 2 * H * K + HV * V;
  const int64_t conv_elems = c.fused ? D * kConvL : 0;  // per slot
  const double state_bytes = double(valid) * (mat * es + conv_elems * 2) * (c.update ? 2 : 1);
  const double inter_bytes = c.cache ? double(valid) * T * mat * es : 0;
  // q, k, v (or mixed_qkv), z, o and the gates; the conv weights once.
  const double input_bytes = double(B) * T * (2 * H * K + 2 * HV * V) * 2 + double(B) * T * HV * 4 +
                             (c.fused ? double(B) * T * HV * V * 2 + D * kConvW * 2 : 0);
  Setup su;
  su.bytes = state_bytes + inter_bytes + input_bytes;
  su.slot_bytes = mat * es;
  const double touched = state_bytes + inter_bytes;
  const double cold = opt.l2_multiple * double(dev.l2);
  int64_t N = touched >= cold ? 1 : static_cast<int64_t>(std::ceil(cold / std::max(touched, 1.0))) + 1;
  N = std::min<int64_t>(N, 512);

  // Shared inputs.
  auto* q = arena.take(B * T * H * K * 2);
  auto* k = arena.take(B * T * H * K * 2);
  auto* v = arena.take(B * T * HV * V * 2);
  auto* a = arena.take(B * T * HV * 2);
  auto* b = arena.take(B * T * HV * 2);
  auto* A_log = arena.take(HV * 4);
  auto* dt_bias = arena.take(HV * 4);
  auto* o = arena.take(B * T * HV * V * 2);
  auto* rs = arena.take(B * 4);
  auto* ws = arena.take(B * 4);
  fill<__nv_bfloat16>(q, B * T * H * K, 1.732f, seed + 1, s);
  fill<__nv_bfloat16>(k, B * T * H * K, 1.732f, seed + 2, s);
  fill<__nv_bfloat16>(v, B * T * HV * V, 1.732f, seed + 3, s);
  fill<__nv_bfloat16>(a, B * T * HV, 1.732f, seed + 4, s);
  fill<__nv_bfloat16>(b, B * T * HV, 1.732f, seed + 5, s);
  fill<float>(dt_bias, HV, 0.1732f, seed + 6, s);
  {
    std::mt19937_64 rng(seed);
    std::vector<float> al(HV);
    std::uniform_real_distribution<float> u(1.f, 16.f);
    for (auto& x : al) x = std::log(u(rng));
    GDN_BENCH_CHECK(cudaMemcpyAsync(A_log, al.data(), HV * 4, cudaMemcpyHostToDevice, s));
    // Scattered distinct slots; the padding rows spread over the batch.
    std::vector<int32_t> perm(P);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int32_t> r(B), w(B);
    std::vector<int64_t> rowperm(B);
    std::iota(rowperm.begin(), rowperm.end(), 0);
    std::shuffle(rowperm.begin(), rowperm.end(), rng);
    for (int64_t n = 0; n < B; ++n) {
      r[n] = perm[n];
      w[n] = c.mode == Mode::kSplit ? perm[B + n] : perm[n];
    }
    for (int64_t i = 0; i < pad; ++i) r[rowperm[i]] = w[rowperm[i]] = -1;
    GDN_BENCH_CHECK(cudaMemcpyAsync(rs, r.data(), B * 4, cudaMemcpyHostToDevice, s));
    GDN_BENCH_CHECK(cudaMemcpyAsync(ws, w.data(), B * 4, cudaMemcpyHostToDevice, s));
    GDN_BENCH_CHECK(cudaStreamSynchronize(s));  // host vectors die here
  }

  const size_t set_bytes = ((P * mat * es + 255) / 256 * 256) + ((P * conv_elems * 2 + 255) / 256 * 256) +
                           (c.cache ? (B * T * mat * es + 255) / 256 * 256 : 0) + 768;
  N = std::min<int64_t>(N, static_cast<int64_t>(arena.left() / set_bytes));
  if (N < 1) throw std::runtime_error("configuration does not fit in device memory");

  gdn::DecodeArgs base;
  base.q = gdn::make_view(q, gdn::kBFloat16, dl, {B, T, H, K});
  base.k = gdn::make_view(k, gdn::kBFloat16, dl, {B, T, H, K});
  base.v = gdn::make_view(v, gdn::kBFloat16, dl, {B, T, HV, V});
  base.a = gdn::make_view(a, gdn::kBFloat16, dl, {B, T, HV});
  base.b = gdn::make_view(b, gdn::kBFloat16, dl, {B, T, HV});
  base.A_log = gdn::make_view(A_log, gdn::kFloat32, dl, {HV});
  base.dt_bias = gdn::make_view(dt_bias, gdn::kFloat32, dl, {HV});
  base.o = gdn::make_view(o, gdn::kBFloat16, dl, {B, T, HV, V});
  base.layout = c.layout_kv ? gdn::StateLayout::kKV : gdn::StateLayout::kVK;
  base.update_state = c.update;
  if (c.mode != Mode::kDense) {
    base.read_slots = gdn::make_view(rs, gdn::kInt32, dl, {B});
    su.read_slots = static_cast<const int32_t*>(rs);
  }
  if (c.mode == Mode::kSplit) base.write_slots = gdn::make_view(ws, gdn::kInt32, dl, {B});
  if (c.sr) {
    auto* seed_d = arena.take(256);
    fill<int64_t>(seed_d, 1, 1e9f, seed + 11, s);
    base.rounding_seed = gdn::make_view(seed_d, gdn::kInt64, dl, {1});
  }
  // The fused step's own inputs: mixed_qkv in place of q, k, v, the conv weights, z, the norm.
  gdn::FusedDecodeArgs fbase;
  if (c.fused) {
    auto* x = arena.take(B * T * D * 2);
    auto* cw = arena.take(D * kConvW * 2);
    auto* z = arena.take(B * T * HV * V * 2);
    auto* nw = arena.take(V * 2);
    fill<__nv_bfloat16>(x, B * T * D, 1.732f, seed + 7, s);
    fill<__nv_bfloat16>(cw, D * kConvW, 0.866f, seed + 8, s);
    fill<__nv_bfloat16>(z, B * T * HV * V, 1.732f, seed + 9, s);
    fill<__nv_bfloat16>(nw, V, 1.732f, seed + 10, s);
    static_cast<gdn::StepArgs&>(fbase) = static_cast<const gdn::StepArgs&>(base);
    fbase.mixed_qkv = gdn::make_view(x, gdn::kBFloat16, dl, {B, T, D});
    fbase.conv_weight = gdn::make_view(cw, gdn::kBFloat16, dl, {D, kConvW});
    if (opt.fused_norm) {
      fbase.z = gdn::make_view(z, gdn::kBFloat16, dl, {B, T, HV, V});
      fbase.norm_weight = gdn::make_view(nw, gdn::kBFloat16, dl, {V});
    }
  }
  for (int64_t i = 0; i < N; ++i) {
    gdn::DecodeArgs args = base;
    void* st = arena.take(P * mat * es);
    if (c.state.bits == 32) {
      fill<float>(st, P * mat, 0.1732f, seed + 100 + i, s);
    } else if (c.state.code == kDLBfloat) {
      fill<__nv_bfloat16>(st, P * mat, 0.1732f, seed + 100 + i, s);
    } else {
      fill<__half>(st, P * mat, 0.1732f, seed + 100 + i, s);
    }
    args.state = gdn::make_view(st, sdt, dl, {P, HV, rows, cols});
    if (c.cache) {
      void* in = arena.take(B * T * mat * es);
      args.inter = gdn::make_view(in, sdt, dl, {B, T, HV, rows, cols});
    }
    su.sets.push_back(args);
    if (c.fused) {
      gdn::FusedDecodeArgs f = fbase;
      static_cast<gdn::StepArgs&>(f) = static_cast<const gdn::StepArgs&>(args);
      void* cs = arena.take(P * conv_elems * 2);
      fill<__nv_bfloat16>(cs, P * conv_elems, 1.732f, seed + 300 + i, s);
      f.conv_state = gdn::tools::conv_pool_view(cs, dl, P, D, opt);
      su.fsets.push_back(f);
    }
  }
  return su;
}

// One call of the configuration's operation on state set i.
gdn::Status run_op(const Setup& su, int64_t i, cudaStream_t s) {
  return su.fsets.empty() ? gdn::decode(su.sets[i], s) : gdn::fused_decode(su.fsets[i], s);
}

// Which kernel the call takes, from the planner itself (an in-tree tool may ask the library's
// internals: src/backends.h), so that a sweep's rows say what ran.
std::string plan_of(const Setup& su) {
  if (su.fsets.empty()) {
    gdn::detail::Problem p;
    return gdn::detail::build_problem(su.sets[0], &p).ok() ? gdn::detail::describe_cuda_plan(p) : std::string();
  }
  gdn::detail::FusedProblem f;
  return gdn::detail::build_fused_problem(su.fsets[0], &f).ok() ? gdn::detail::describe_fused_cuda_plan(f)
                                                               : std::string();
}

// Median per-call time of `calls` launches (launch(i) enqueues call i) captured into one
// CUDA graph and replayed opt.reps times after a warm-up replay.
template <typename Launch>
double time_graph(cudaStream_t s, int64_t calls, int reps, Launch launch) {
  cudaGraph_t graph;
  GDN_BENCH_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int64_t i = 0; i < calls; ++i) {
    try {
      launch(i);
    } catch (...) {
      cudaStreamEndCapture(s, &graph);
      throw;
    }
  }
  GDN_BENCH_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  GDN_BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  GDN_BENCH_CHECK(cudaEventCreate(&e0));
  GDN_BENCH_CHECK(cudaEventCreate(&e1));
  GDN_BENCH_CHECK(cudaGraphLaunch(exec, s));  // warm-up: module load, first-touch
  GDN_BENCH_CHECK(cudaStreamSynchronize(s));
  std::vector<double> per_call;
  for (int i = 0; i < reps; ++i) {
    GDN_BENCH_CHECK(cudaEventRecord(e0, s));
    GDN_BENCH_CHECK(cudaGraphLaunch(exec, s));
    GDN_BENCH_CHECK(cudaEventRecord(e1, s));
    GDN_BENCH_CHECK(cudaEventSynchronize(e1));
    float ms = 0.f;
    GDN_BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    per_call.push_back(ms * 1e3 / calls);
  }
  GDN_BENCH_CHECK(cudaEventDestroy(e0));
  GDN_BENCH_CHECK(cudaEventDestroy(e1));
  GDN_BENCH_CHECK(cudaGraphExecDestroy(exec));
  GDN_BENCH_CHECK(cudaGraphDestroy(graph));
  return median(per_call);
}

// Reference for the floor (--copy-kernel): a plain kernel that moves exactly the state bytes a
// call must move (each valid row's slot read, and written back in place when the call updates the
// state), launched as gdn's kernels are (programmatic dependent launch) in the same graph and
// rotation. Its time is what launch, latency and bandwidth leave for any kernel of these bytes;
// nothing is computed. One warp per block and per kCopyChunkVecs 16-byte vectors (4 KB) of a
// slot, each lane's eight loads in flight at once before its stores: the fastest form measured on
// the H200 (a probe; docs/design.md, "One warp per eight rows"). The grid-stride form it replaced
// (256-thread blocks in one wave, a 64-bit division per vector) took 1.08-1.10x its time from
// B = 64 (dense fp32 Qwen3-Next B = 512: 562.5 against 511.9 us), so the "% of the copy kernel"
// figures measured with it on the H200 before this change read high there.
constexpr int kCopyVecsPerLane = 8;
constexpr int64_t kCopyChunkVecs = 32 * kCopyVecsPerLane;

__global__ void __launch_bounds__(32) state_copy_kernel(uint4* state, const int32_t* read_slots,
                                                        int64_t slot_vecs, int64_t chunks, bool write) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int64_t n = static_cast<int64_t>(blockIdx.x) / chunks;  // row n, chunk c of its slot
  const int64_t c = static_cast<int64_t>(blockIdx.x) - n * chunks;
  const int64_t slot = read_slots != nullptr ? read_slots[n] : n;
  if (slot < 0) return;
  uint4* base = state + slot * slot_vecs + c * kCopyChunkVecs + threadIdx.x;
  const int64_t left = slot_vecs - c * kCopyChunkVecs - threadIdx.x;  // vectors from this lane's first
  uint4 x[kCopyVecsPerLane];
#pragma unroll
  for (int u = 0; u < kCopyVecsPerLane; ++u)
    if (u * 32 < left) x[u] = base[u * 32];
  if (write) {
#pragma unroll
    for (int u = 0; u < kCopyVecsPerLane; ++u)
      if (u * 32 < left) base[u * 32] = x[u];
  }
}

void launch_state_copy(const Setup& su, const gdn::DecodeArgs& args, int64_t B, bool write, cudaStream_t s) {
  const int64_t slot_vecs = su.slot_bytes / 16;
  const int64_t chunks = (slot_vecs + kCopyChunkVecs - 1) / kCopyChunkVecs;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(B * chunks));
  cfg.blockDim = dim3(32);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  GDN_BENCH_CHECK(cudaLaunchKernelEx(&cfg, state_copy_kernel, static_cast<uint4*>(args.state.data),
                                     su.read_slots, slot_vecs, chunks, write));
}

Result run_config(const Config& c, const Device& dev, Arena& arena, const Options& opt,
                  cudaStream_t s, double copy_tbs, uint64_t seed) {
  arena.used = 0;
  Setup su = make_setup(c, dev, arena, opt, s, seed);
  const int64_t N = static_cast<int64_t>(su.sets.size());
  Result r;
  r.c = c;
  r.floor_us = su.bytes / (copy_tbs * 1e12) * 1e6;

  // One eager call first: argument errors and faults surface here, not inside capture.
  const char* what = c.fused ? "gdn::fused_decode" : "gdn::decode";
  const gdn::Status st = run_op(su, 0, s);
  if (!st.ok()) throw std::runtime_error(std::string(what) + ": " + st.message());
  GDN_BENCH_CHECK(cudaStreamSynchronize(s));
  r.plan = plan_of(su);

  const int64_t calls = std::max<int64_t>(N, r.floor_us > 2000 ? 3 : opt.calls);
  r.us = time_graph(s, calls, opt.reps, [&](int64_t i) {
    const gdn::Status e = run_op(su, i % N, s);
    if (!e.ok()) throw std::runtime_error(std::string(what) + " under capture: " + e.message());
  });
  r.tbs = su.bytes / (r.us * 1e-6) / 1e12;
  // The copy kernel moves the recurrent state bytes only: no reference for the intermediate
  // cache, nor for the fused step (its rows compare against the decode rows instead).
  if (opt.copy_kernel && !c.cache && !c.fused)
    r.copy_us = time_graph(s, calls, opt.reps, [&](int64_t i) {
      launch_state_copy(su, su.sets[i % N], c.B, c.update, s);
    });
  return r;
}

// Host overhead and eager latency of a T=1, B=1 qwen3-next fp32 dense call.
void eager_latency(const Device& dev, Arena& arena, const Options& opt, cudaStream_t s,
                   double& eager_us, double& host_us) {
  arena.used = 0;
  Config c{&kModels[0], gdn::kFloat32, false, Mode::kDense, 1, 1, false, true};
  Options o = opt;
  o.l2_multiple = 0;  // one state set: this measures launch cost, not bandwidth
  Setup su = make_setup(c, dev, arena, o, s, 7);
  constexpr int kCalls = 200;
  for (int i = 0; i < 20; ++i) (void)gdn::decode(su.sets[0], s);
  GDN_BENCH_CHECK(cudaStreamSynchronize(s));
  const auto h0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kCalls; ++i) (void)gdn::decode(su.sets[0], s);
  const auto h1 = std::chrono::steady_clock::now();
  GDN_BENCH_CHECK(cudaStreamSynchronize(s));
  host_us = std::chrono::duration<double, std::micro>(h1 - h0).count() / kCalls;
  cudaEvent_t e0, e1;
  GDN_BENCH_CHECK(cudaEventCreate(&e0));
  GDN_BENCH_CHECK(cudaEventCreate(&e1));
  GDN_BENCH_CHECK(cudaEventRecord(e0, s));
  for (int i = 0; i < kCalls; ++i) (void)gdn::decode(su.sets[0], s);
  GDN_BENCH_CHECK(cudaEventRecord(e1, s));
  GDN_BENCH_CHECK(cudaEventSynchronize(e1));
  float ms = 0.f;
  GDN_BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  eager_us = ms * 1e3 / kCalls;
  GDN_BENCH_CHECK(cudaEventDestroy(e0));
  GDN_BENCH_CHECK(cudaEventDestroy(e1));
}

std::vector<Config> make_sweep(const Options& opt) {
  auto pick = [](const std::string& sel, const char* name) { return sel == "all" || sel == name; };
  std::vector<int> Ts = opt.T, Bs = opt.B;
  if (Ts.empty()) Ts = opt.quick ? std::vector<int>{1, 2, 4, 8} : std::vector<int>{1, 2, 3, 4, 6, 8, 16};
  if (Bs.empty()) Bs = opt.quick ? std::vector<int>{1, 16, 64, 512} : std::vector<int>{1, 4, 16, 64, 256, 512};
  std::vector<Mode> modes;
  for (Mode m : {Mode::kDense, Mode::kPool, Mode::kSplit})
    if (pick(opt.mode, mode_name(m)) && !(opt.quick && opt.mode == "all" && m == Mode::kSplit))
      modes.push_back(m);
  std::vector<Config> out;
  for (bool fused : {false, true}) {
  if (!pick(opt.op, fused ? "fused" : "decode")) continue;
  for (const Model& m : kModels) {
    if (!pick(opt.model, m.name)) continue;
    for (DLDataType sd : {gdn::kFloat32, gdn::kBFloat16, gdn::kFloat16}) {
      // fp16 states only when named: "all" keeps the sweep to the states engines hold.
      if (sd.code == kDLFloat && sd.bits == 16 ? opt.state != "fp16" : !pick(opt.state, state_name(sd))) continue;
      for (bool kv : {false, true}) {
        // default: VK everywhere, KV on a subset (dense, T in {1, 4}, cache off, update on).
        const bool subset = kv && opt.layout == "default";
        if (opt.layout == "vk" && kv) continue;
        if (opt.layout == "kv" && !kv) continue;
        for (Mode mode : modes) {
          if (subset && mode != Mode::kDense) continue;
          for (int T : Ts) {
            if (subset && T != 1 && T != 4) continue;
            for (int B : Bs) {
              for (bool cache : {false, true}) {
                for (bool update : {true, false}) {
                  if (T == 1 && (cache || !update)) continue;  // cache/update sweep only for T > 1
                  if (!pick(opt.cache, cache ? "on" : "off")) continue;
                  if (!pick(opt.update, update ? "on" : "off")) continue;
                  if (opt.quick && T > 1 && !(cache && update)) continue;
                  if (subset && (cache || !update)) continue;
                  for (bool sr : {false, true}) {
                    if (!pick(opt.rounding, sr ? "stochastic" : "nearest") || (sr && sd.bits == 32)) continue;
                    out.push_back(Config{&m, sd, kv, mode, T, B, cache, update, fused, sr});
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  }
  return out;
}

std::string today() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", std::gmtime(&t));
  return buf;
}

int bench_main(const Options& opt) {
  Device dev;
  GDN_BENCH_CHECK(cudaGetDevice(&dev.id));
  cudaDeviceProp prop;
  GDN_BENCH_CHECK(cudaGetDeviceProperties(&prop, dev.id));
  dev.name = prop.name;
  dev.l2 = prop.l2CacheSize;
  dev.sms = prop.multiProcessorCount;
  cudaStream_t s;
  GDN_BENCH_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  const double copy_tbs = copy_ceiling_tbs(s);
  Arena arena;
  {
    size_t free_b = 0, total_b = 0;
    GDN_BENCH_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const size_t keep = size_t(2) << 30;
    arena.size = free_b > 2 * keep ? free_b - keep : free_b / 2;
    GDN_BENCH_CHECK(cudaMalloc(reinterpret_cast<void**>(&arena.base), arena.size));
  }
  double eager_us = 0, host_us = 0;
  eager_latency(dev, arena, opt, s, eager_us, host_us);

  std::printf("device %s, %d SMs, L2 %.0f MiB; copy ceiling %.3f TB/s\n", dev.name.c_str(), dev.sms,
              dev.l2 / 1048576.0, copy_tbs);
  std::printf("eager T=1 B=1 qwen3-next fp32: %.2f us per call on the GPU, %.2f us host time per call\n",
              eager_us, host_us);
  std::printf("%-6s %-10s %-7s %-3s %-5s %3s %4s %-5s %-6s %10s %7s %6s %10s%s\n", "op", "model", "state",
              "lay", "mode", "T", "B", "cache", "update", "us", "TB/s", "%ceil", "floor_us",
              opt.copy_kernel ? "    copy_us" : "");

  const std::vector<Config> sweep = make_sweep(opt);
  std::vector<Result> results;
  int failures = 0;
  for (size_t i = 0; i < sweep.size(); ++i) {
    const Config& c = sweep[i];
    std::fprintf(stderr, "\r[bench %zu/%zu] %s %s %s %s T=%d B=%d          ", i + 1, sweep.size(),
                 c.model->name, state_name(c.state), c.layout_kv ? "KV" : "VK",
                 mode_name(c.mode), c.T, c.B);
    std::fflush(stderr);
    try {
      const Result r = run_config(c, dev, arena, opt, s, copy_tbs, 1000 + i);
      results.push_back(r);
      std::printf("%-6s %-10s %-7s %-3s %-5s %3d %4d %-5s %-6s %10.2f %7.3f %5.1f%% %10.2f",
                  c.fused ? "fused" : "decode", c.model->name,
                  (std::string(state_name(c.state)) + (c.sr ? "+sr" : "")).c_str(), c.layout_kv ? "KV" : "VK",
                  mode_name(c.mode), c.T, c.B, c.cache ? "on" : "off", c.update ? "on" : "off", r.us,
                  r.tbs, 100.0 * r.tbs / copy_tbs, r.floor_us);
      if (r.copy_us >= 0) std::printf(" %10.2f", r.copy_us);
      std::printf("\n");
      std::fflush(stdout);
    } catch (const std::exception& e) {
      ++failures;
      std::fprintf(stderr, "\n[bench] %s %s T=%d B=%d: %s\n", c.model->name,
                   state_name(c.state), c.T, c.B, e.what());
      (void)cudaGetLastError();
      if (cudaStreamSynchronize(s) != cudaSuccess) break;  // a sticky error ends the sweep
    }
  }
  std::fprintf(stderr, "\n");

  if (!opt.json.empty()) {
    nlohmann::json j;
    j["device"] = dev.name;
    j["commit"] = GDN_GIT_COMMIT;
    j["date"] = today();
    j["copy_TBs"] = copy_tbs;
    j["l2_bytes"] = dev.l2;
    j["eager_us"] = eager_us;
    j["host_us"] = host_us;
    nlohmann::json rows = nlohmann::json::array();
    for (const Result& r : results) {
      const Config& c = r.c;
      rows.push_back({{"op", c.fused ? "fused" : "decode"},
                      {"model", c.model->name},
                      {"state", state_name(c.state)},
                      {"layout", c.layout_kv ? "KV" : "VK"},
                      {"mode", mode_name(c.mode)},
                      {"T", c.T},
                      {"B", c.B},
                      {"H", c.model->H},
                      {"HV", c.model->HV},
                      {"K", c.model->K},
                      {"V", c.model->V},
                      {"cache", c.cache},
                      {"update", c.update},
                      {"rounding", c.sr ? "stochastic" : "nearest"},
                      {"us", r.us},
                      {"TBs", r.tbs},
                      {"floor_us", r.floor_us},
                      {"plan", r.plan}});
      if (c.fused) {
        rows.back()["norm"] = opt.fused_norm;
        rows.back()["conv_layout"] = opt.conv_layout;
      }
      if (r.copy_us >= 0) rows.back()["copy_us"] = r.copy_us;
    }
    j["rows"] = rows;
    std::ofstream f(opt.json);
    f << j.dump(1) << "\n";
    if (!f) throw std::runtime_error("cannot write " + opt.json);
  }
  GDN_BENCH_CHECK(cudaFree(arena.base));
  GDN_BENCH_CHECK(cudaStreamDestroy(s));
  return failures == 0 ? 0 : 1;
}

}  // namespace

namespace gdn::tools {

int cuda_bench_main(const BenchOptions& opt) { return bench_main(opt); }

}  // namespace gdn::tools
