// `gdn bench --device cpu`: per-call time of gdn::decode (and, with --op fused | all,
// gdn::fused_decode) on the CPU backend against the machine's copy bandwidth measured in the
// same run, over the same OpenMP threads.
//
// Method. The copy bandwidth is a memcpy of a buffer many times the last-level cache, split
// over the threads (each copies its own contiguous share, first-touched by itself), bytes
// read + written over the median time. Each configuration then rotates over N state sets
// (pools, and intermediate caches when on), N chosen so that the bytes the other N - 1 calls
// touch are at least --llc-multiple times the last-level cache: every call finds its state
// cold, as in serving, where the other layers' states evict it. q, k, v, gates and o are one
// copy (hot, as they come from the previous layer). Rows report state GB/s: state bytes read
// + written (valid rows only; + the intermediate cache) over the median per-call time, and
// that as a percentage of the copy bandwidth (the floor is those bytes at the copy rate).
// --rounding stochastic times 16-bit states with a rounding_seed (stochastic rounding of every
// state store; the seed is the same every call, which does not change the time). The fused rows
// take the CUDA bench's conv (W = 4 taps, a bf16 conv pool of L = 3 columns in vLLM's [P, L, D]
// memory, rotated with the state pools; mixed_qkv in place of q, k, v) and the gated RMSNorm
// (unless --fused-norm false); their state bytes count the conv pool's too.
#include <sys/resource.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "cpu/step_cpu.h"
#include "gdn/gdn.h"
#include "host_dtype.h"

#ifndef GDN_GIT_COMMIT
#define GDN_GIT_COMMIT "unknown"
#endif

namespace gdn::tools {
namespace {

struct Model {
  const char* name;
  int H, HV, K, V;
};
constexpr Model kModels[] = {{"qwen3-next", 16, 32, 128, 128}, {"qwen3.5", 16, 64, 128, 128}};

enum class Mode { kDense, kPool, kSplit };
const char* mode_name(Mode m) { return m == Mode::kDense ? "dense" : m == Mode::kPool ? "pool" : "split"; }

constexpr DLDataType kStates[] = {kFloat32, kBFloat16, kFloat16};
using gdn::tools::state_name;

struct Config {
  const Model* model;
  DLDataType state;
  bool layout_kv;
  Mode mode;
  int T;
  int B;
  bool cache;
  bool update;
  bool stochastic;  // rounding_seed given (16-bit states only)
  bool fused;       // gdn::fused_decode (op "fused") instead of gdn::decode
};

struct Result {
  Config c;
  int64_t valid = 0;  // rows that are not padding
  int sets = 0;       // state sets rotated over
  double us = 0, gbs = 0, floor_us = 0;
  // CPU time of the process per call over wall time x threads, in the median repetition:
  // near 1 when the threads had the cores to themselves (a shared machine shows less).
  double busy = 0;
};

#ifdef _OPENMP
int max_threads() { return omp_get_max_threads(); }
int thread_num() { return omp_get_thread_num(); }
#else
int max_threads() { return 1; }
int thread_num() { return 0; }
#endif

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// CPU time of the process (every thread), seconds.
double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// Page-aligned host memory, released on scope exit.
struct Buffer {
  std::unique_ptr<char, decltype(&std::free)> p{nullptr, &std::free};
  size_t bytes = 0;
  explicit Buffer(size_t n) : bytes(n) {
    const size_t rounded = (std::max<size_t>(n, 1) + 4095) / 4096 * 4096;
    p.reset(static_cast<char*>(std::aligned_alloc(4096, rounded)));
    if (!p) throw std::runtime_error("out of host memory (" + std::to_string(n >> 20) + " MiB)");
  }
  char* get() const { return p.get(); }
};

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [-amp, amp) (amp = sqrt(3) sigma gives the spec's variances), in parallel so that
// each page is first touched by the threads that will use it.
void fill(void* p, DLDataType t, int64_t n, float amp, uint64_t seed) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float u = static_cast<float>(splitmix64(seed * 0x100000001b3ull + i) >> 40) * (1.f / 16777216.f);
    const float x = (2.f * u - 1.f) * amp;
    if (t.bits == 32) static_cast<float*>(p)[i] = x;
    else if (t.code == kDLBfloat) static_cast<uint16_t*>(p)[i] = detail::float_to_bf16_bits(x);
    else static_cast<uint16_t*>(p)[i] = detail::float_to_fp16_bits(x);
  }
}

// The last-level cache of CPU 0: sysfs first (some hypervisors report the host's in
// sysconf), then sysconf, then 32 MiB.
size_t llc_bytes() {
  for (int index = 4; index >= 2; --index) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    size_t n = 0;
    std::string unit;
    if (f >> n) {
      f >> unit;
      return unit == "K" ? n << 10 : unit == "M" ? n << 20 : n;
    }
  }
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return static_cast<size_t>(l3);
  return size_t{32} << 20;
}

}  // namespace

std::string cpu_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t c = line.find(':');
      if (c != std::string::npos) return line.substr(line.find_first_not_of(" \t", c + 1));
    }
  return "unknown CPU";
}

namespace {

// Bytes of each of the copy's two buffers: 16 x the LLC (at least 512 MiB), so that the copy
// streams from DRAM, but both within an eighth of physical memory. Some virtual machines report
// the host's whole L3 (480 MiB on a two-core CI machine with 23 GB, where 16 x LLC took 15 GB per
// process and ctest's parallel bench tests were killed for memory).
size_t copy_buffer_bytes(size_t llc) {
  size_t bytes = std::max<size_t>(size_t{512} << 20, 16 * llc);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0) bytes = std::min(bytes, static_cast<size_t>(pages) * static_cast<size_t>(page) / 16);
  return bytes;
}

// Copy bandwidth over `threads` threads: read + written bytes over the median time. *busy as
// in Result.
double copy_gbs(size_t llc, double* busy) {
  const size_t bytes = copy_buffer_bytes(llc);
  Buffer a(bytes), b(bytes);
  const int threads = max_threads();
  const size_t share = (bytes / threads) / 4096 * 4096;
  std::vector<std::pair<double, double>> ts;
#pragma omp parallel num_threads(threads)
  {
    const size_t off = thread_num() * share;
    std::memset(a.get() + off, 1, share);  // first touch by the copying thread
    std::memset(b.get() + off, 0, share);
  }
  for (int rep = 0; rep < 8; ++rep) {
    const double c0 = process_cpu_seconds();
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads)
    {
      const size_t off = thread_num() * share;
      std::memcpy(b.get() + off, a.get() + off, share);
    }
    const double wall = seconds_since(t0);
    if (rep > 0) ts.emplace_back(wall, (process_cpu_seconds() - c0) / (wall * threads));
  }
  std::sort(ts.begin(), ts.end());
  *busy = ts[ts.size() / 2].second;
  return 2.0 * static_cast<double>(share * threads) / ts[ts.size() / 2].first / 1e9;
}

// The tensors of one configuration: one copy of the inputs, N state sets.
struct Setup {
  std::vector<DecodeArgs> sets;
  std::vector<FusedDecodeArgs> fsets;  // the fused rows: the same calls as fused-step arguments
  std::vector<Buffer> mem;
  int64_t valid = 0;
  double state_bytes = 0;  // per call
};

Setup make_setup(const Config& c, const BenchOptions& opt, size_t llc, uint64_t seed) {
  const Model& m = *c.model;
  const int64_t B = c.B, T = c.T, H = m.H, HV = m.HV, K = m.K, V = m.V;
  const int64_t rows = c.layout_kv ? K : V, cols = c.layout_kv ? V : K;
  const int64_t es = c.state.bits / 8;
  const int64_t slot_elems = HV * rows * cols;
  const int64_t pad = c.mode == Mode::kDense ? 0 : std::llround(0.2 * B);
  const int64_t P = c.mode == Mode::kDense ? B : 2 * B;
  const int64_t D = 2 * H * K + HV * V;
  Setup su;
  su.valid = B - pad;
  const double slot_bytes = double(slot_elems) * es;
  const double conv_bytes = c.fused ? double(D) * kConvL * 2 : 0.0;  // a slot of the conv pool
  su.state_bytes = su.valid * (slot_bytes * (1 + (c.update ? 1 : 0) + (c.cache ? T : 0)) + conv_bytes * (c.update ? 2 : 1));
  // Distinct bytes one call touches; the other sets' must cover llc_multiple x LLC.
  const double footprint = su.valid * ((slot_bytes + conv_bytes) * (c.mode == Mode::kSplit && c.update ? 2 : 1) +
                                       slot_bytes * (c.cache ? T : 0));
  const double cold = opt.llc_multiple * double(llc);
  int64_t N = footprint >= cold ? 1 : static_cast<int64_t>(std::ceil(cold / std::max(footprint, 1.0))) + 1;
  N = std::min<int64_t>(N, 1024);

  const DLDevice cpu = kCpu;
  auto take = [&](size_t bytes) -> char* {
    su.mem.emplace_back(bytes);
    return su.mem.back().get();
  };
  char* q = take(B * T * H * K * 2);
  char* k = take(B * T * H * K * 2);
  char* v = take(B * T * HV * V * 2);
  char* a = take(B * T * HV * 2);
  char* b = take(B * T * HV * 2);
  auto* A_log = reinterpret_cast<float*>(take(HV * 4));
  char* dt_bias = take(HV * 4);
  char* o = take(B * T * HV * V * 2);
  auto* rs = reinterpret_cast<int32_t*>(take(B * 4));
  auto* ws = reinterpret_cast<int32_t*>(take(B * 4));
  auto* seed_value = reinterpret_cast<int64_t*>(take(8));
  *seed_value = static_cast<int64_t>(seed);
  fill(q, kBFloat16, B * T * H * K, 1.732f, seed + 1);
  fill(k, kBFloat16, B * T * H * K, 1.732f, seed + 2);
  fill(v, kBFloat16, B * T * HV * V, 1.732f, seed + 3);
  fill(a, kBFloat16, B * T * HV, 1.732f, seed + 4);
  fill(b, kBFloat16, B * T * HV, 1.732f, seed + 5);
  fill(dt_bias, kFloat32, HV, 0.1732f, seed + 6);
  std::mt19937_64 rng(seed);
  {
    std::uniform_real_distribution<float> u(1.f, 16.f);
    for (int64_t h = 0; h < HV; ++h) A_log[h] = std::log(u(rng));
    // Scattered distinct slots; the padding rows spread over the batch.
    std::vector<int32_t> perm(P);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int64_t> rowperm(B);
    std::iota(rowperm.begin(), rowperm.end(), 0);
    std::shuffle(rowperm.begin(), rowperm.end(), rng);
    for (int64_t n = 0; n < B; ++n) {
      rs[n] = perm[n];
      ws[n] = c.mode == Mode::kSplit ? perm[B + n] : perm[n];
    }
    for (int64_t i = 0; i < pad; ++i) rs[rowperm[i]] = ws[rowperm[i]] = -1;
  }

  DecodeArgs base;
  base.q = make_view(q, kBFloat16, cpu, {B, T, H, K});
  base.k = make_view(k, kBFloat16, cpu, {B, T, H, K});
  base.v = make_view(v, kBFloat16, cpu, {B, T, HV, V});
  base.a = make_view(a, kBFloat16, cpu, {B, T, HV});
  base.b = make_view(b, kBFloat16, cpu, {B, T, HV});
  base.A_log = make_view(A_log, kFloat32, cpu, {HV});
  base.dt_bias = make_view(dt_bias, kFloat32, cpu, {HV});
  base.o = make_view(o, kBFloat16, cpu, {B, T, HV, V});
  base.layout = c.layout_kv ? StateLayout::kKV : StateLayout::kVK;
  base.update_state = c.update;
  if (c.mode != Mode::kDense) base.read_slots = make_view(rs, kInt32, cpu, {B});
  if (c.mode == Mode::kSplit) base.write_slots = make_view(ws, kInt32, cpu, {B});
  if (c.stochastic) base.rounding_seed = make_view(seed_value, kInt64, cpu, {1});
  FusedDecodeArgs fbase;
  if (c.fused) {
    char* x = take(B * T * D * 2);
    char* cw = take(D * kConvW * 2);
    fill(x, kBFloat16, B * T * D, 1.732f, seed + 7);
    fill(cw, kBFloat16, D * kConvW, 0.866f, seed + 8);
    static_cast<StepArgs&>(fbase) = static_cast<const StepArgs&>(base);
    fbase.mixed_qkv = make_view(x, kBFloat16, cpu, {B, T, D});
    fbase.conv_weight = make_view(cw, kBFloat16, cpu, {D, kConvW});
    if (opt.fused_norm) {
      char* z = take(B * T * HV * V * 2);
      char* nw = take(V * 2);
      fill(z, kBFloat16, B * T * HV * V, 1.732f, seed + 9);
      fill(nw, kBFloat16, V, 1.732f, seed + 10);
      fbase.z = make_view(z, kBFloat16, cpu, {B, T, HV, V});
      fbase.norm_weight = make_view(nw, kBFloat16, cpu, {V});
    }
  }

  // One random pool, copied into the other sets (the values do not change the time).
  const int64_t pool_elems = P * slot_elems;
  char* first = nullptr;
  for (int64_t i = 0; i < N; ++i) {
    DecodeArgs args = base;
    char* st = take(pool_elems * es);
    if (first == nullptr) {
      fill(st, c.state, pool_elems, 0.1732f, seed + 100);
      first = st;
    } else {
      const int64_t chunk = (pool_elems * es + 63) / 64;
#pragma omp parallel for schedule(static)
      for (int64_t j = 0; j < 64; ++j) {
        const int64_t b0 = j * chunk, b1 = std::min<int64_t>(pool_elems * es, b0 + chunk);
        if (b1 > b0) std::memcpy(st + b0, first + b0, b1 - b0);
      }
    }
    args.state = make_view(st, c.state, cpu, {P, HV, rows, cols});
    if (c.cache) {
      char* in = take(B * T * slot_elems * es);
      args.inter = make_view(in, c.state, cpu, {B, T, HV, rows, cols});
    }
    su.sets.push_back(args);
    if (c.fused) {
      FusedDecodeArgs f = fbase;
      static_cast<StepArgs&>(f) = static_cast<const StepArgs&>(args);
      char* cs = take(P * D * kConvL * 2);
      fill(cs, kBFloat16, P * D * kConvL, 1.732f, seed + 300 + i);
      f.conv_state = conv_pool_view(cs, cpu, P, D, opt);
      su.fsets.push_back(f);
    }
  }
  return su;
}

// One call of the configuration's operation on state set i.
Status run_op(const Setup& su, int64_t i) {
  return su.fsets.empty() ? decode(su.sets[i], nullptr) : fused_decode(su.fsets[i], nullptr);
}

Result run_config(const Config& c, const BenchOptions& opt, size_t llc, double copy, uint64_t seed) {
  Setup su = make_setup(c, opt, llc, seed);
  const int64_t N = static_cast<int64_t>(su.sets.size());
  Result r;
  r.c = c;
  r.valid = su.valid;
  r.sets = static_cast<int>(N);
  r.floor_us = su.state_bytes / (copy * 1e9) * 1e6;

  // Warm-up over every set: argument errors surface here, and the pass estimates the call.
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < N; ++i) {
    const Status st = run_op(su, i);
    if (!st.ok()) throw std::runtime_error(std::string(c.fused ? "gdn::fused_decode: " : "gdn::decode: ") + st.message());
  }
  const double est = seconds_since(t0) / N;
  // At least 50 ms per repetition, and every set once.
  const int64_t calls = std::max<int64_t>(N, static_cast<int64_t>(std::ceil(0.05 / std::max(est, 1e-7))));
  std::vector<std::pair<double, double>> per_call;  // wall, busy
  int64_t at = 0;
  for (int rep = 0; rep < opt.reps; ++rep) {
    const double c0 = process_cpu_seconds();
    const auto r0 = Clock::now();
    for (int64_t i = 0; i < calls; ++i, ++at) (void)run_op(su, at % N);
    const double wall = seconds_since(r0);
    per_call.emplace_back(wall / calls, (process_cpu_seconds() - c0) / (wall * max_threads()));
  }
  std::sort(per_call.begin(), per_call.end());
  r.us = per_call[per_call.size() / 2].first * 1e6;
  r.busy = per_call[per_call.size() / 2].second;
  r.gbs = su.state_bytes / (r.us * 1e-6) / 1e9;
  return r;
}

std::vector<Config> make_sweep(const BenchOptions& opt) {
  auto pick = [](const std::string& sel, const char* name) { return sel == "all" || sel == name; };
  std::vector<Mode> modes;
  for (Mode m : {Mode::kDense, Mode::kPool, Mode::kSplit})
    if (pick(opt.mode, mode_name(m))) modes.push_back(m);
  std::vector<Config> out;
  for (bool fused : {false, true}) {
    if (!pick(opt.op, fused ? "fused" : "decode")) continue;
    for (const Model& m : kModels) {
      if (!pick(opt.model, m.name)) continue;
      // Qwen3.5 moves twice the bytes per row: by default its rows are T = 1 only.
      const bool big = std::string(m.name) == "qwen3.5";
      std::vector<int> Ts = opt.T, Bs = opt.B;
      if (Ts.empty()) Ts = opt.quick || big ? std::vector<int>{1} : std::vector<int>{1, 2, 4};
      if (Bs.empty()) Bs = opt.quick ? std::vector<int>{8, 128} : std::vector<int>{8, 32, 128};
      for (DLDataType st : kStates) {
        if (!pick(opt.state, state_name(st))) continue;
        for (bool kv : {false, true}) {
          if (opt.layout == "vk" && kv) continue;
          if (opt.layout == "kv" && !kv) continue;
          for (Mode mode : modes)
            for (int T : Ts)
              for (int B : Bs)
                for (bool cache : {false, true})
                  for (bool update : {true, false})
                    for (bool sr : {false, true}) {
                      if (T == 1 && (cache || !update)) continue;  // cache/update sweep only for T > 1
                      if (!pick(opt.cache, cache ? "on" : "off")) continue;
                      if (!pick(opt.update, update ? "on" : "off")) continue;
                      if (!pick(opt.rounding, sr ? "stochastic" : "nearest")) continue;
                      if (sr && st.bits == 32) continue;  // fp32 stores never round
                      out.push_back(Config{&m, st, kv, mode, T, B, cache, update, sr, fused});
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

}  // namespace

int cpu_bench_main(const BenchOptions& opt) {
#ifdef _OPENMP
  if (opt.threads > 0) omp_set_num_threads(opt.threads);
#endif
  const int threads = max_threads();
  const size_t llc = llc_bytes();
  const std::string device = cpu_name();
  double busy0 = 0, busy1 = 0;
  const double copy0 = copy_gbs(llc, &busy0);

  std::printf("device %s, %d threads, LLC %.0f MiB, %s kernels; copy %.2f GB/s (read + written, busy %.2f)\n",
              device.c_str(), threads, llc / 1048576.0, detail::cpu::cpu_simd_name(), copy0, busy0);
  std::printf("%-6s %-10s %-5s %-3s %-5s %3s %4s %-5s %-6s %10s %7s %6s %10s %5s %5s\n", "op", "model", "state", "lay",
              "mode", "T", "B", "cache", "update", "us", "GB/s", "%copy", "floor_us", "busy", "round");
  const std::vector<Config> sweep = make_sweep(opt);
  std::vector<Result> results;
  int failures = 0;
  for (size_t i = 0; i < sweep.size(); ++i) {
    const Config& c = sweep[i];
    std::fprintf(stderr, "\r[bench %zu/%zu] %s %s %s %s T=%d B=%d          ", i + 1, sweep.size(), c.model->name,
                 state_name(c.state), c.layout_kv ? "KV" : "VK", mode_name(c.mode), c.T, c.B);
    std::fflush(stderr);
    try {
      const Result r = run_config(c, opt, llc, copy0, 1000 + i);
      results.push_back(r);
      std::printf("%-6s %-10s %-5s %-3s %-5s %3d %4d %-5s %-6s %10.1f %7.2f %5.1f%% %10.1f %5.2f %5s\n",
                  c.fused ? "fused" : "decode", c.model->name, state_name(c.state), c.layout_kv ? "KV" : "VK",
                  mode_name(c.mode), c.T, c.B, c.cache ? "on" : "off", c.update ? "on" : "off", r.us, r.gbs, 100.0 * r.gbs / copy0, r.floor_us, r.busy,
                  c.stochastic ? "sr" : "rne");
      std::fflush(stdout);
    } catch (const std::exception& e) {
      ++failures;
      std::fprintf(stderr, "\n[bench] %s %s T=%d B=%d: %s\n", c.model->name, state_name(c.state), c.T, c.B, e.what());
    }
  }
  std::fprintf(stderr, "\n");
  // Again at the end: the machine may be shared, and a drift shows here.
  const double copy1 = copy_gbs(llc, &busy1);
  std::printf("copy at the end %.2f GB/s (busy %.2f)\n", copy1, busy1);

  if (!opt.json.empty()) {
    nlohmann::json j;
    j["device"] = device;
    j["commit"] = GDN_GIT_COMMIT;
    j["date"] = today();
    j["threads"] = threads;
    j["llc_bytes"] = llc;
    j["cpu_kernels"] = detail::cpu::cpu_simd_name();
    j["copy_GBs"] = copy0;
    j["copy_busy"] = busy0;
    j["copy_GBs_end"] = copy1;
    j["copy_busy_end"] = busy1;
    nlohmann::json rows = nlohmann::json::array();
    for (const Result& r : results) {
      const Config& c = r.c;
      rows.push_back({{"backend", "cpu"},
                      {"op", c.fused ? "fused" : "decode"},
                      {"model", c.model->name},
                      {"state", state_name(c.state)},
                      {"layout", c.layout_kv ? "KV" : "VK"},
                      {"mode", mode_name(c.mode)},
                      {"T", c.T},
                      {"B", c.B},
                      {"valid_rows", r.valid},
                      {"H", c.model->H},
                      {"HV", c.model->HV},
                      {"K", c.model->K},
                      {"V", c.model->V},
                      {"cache", c.cache},
                      {"update", c.update},
                      {"rounding", c.stochastic ? "stochastic" : "nearest"},
                      {"state_sets", r.sets},
                      {"us", r.us},
                      {"GBs", r.gbs},
                      {"pct_copy", 100.0 * r.gbs / copy0},
                      {"floor_us", r.floor_us},
                      {"busy", r.busy}});
      if (c.fused) {
        rows.back()["norm"] = opt.fused_norm;
        rows.back()["conv_layout"] = opt.conv_layout;
      }
    }
    j["rows"] = rows;
    std::ofstream f(opt.json);
    f << j.dump(1) << "\n";
    if (!f) throw std::runtime_error("cannot write " + opt.json);
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace gdn::tools
