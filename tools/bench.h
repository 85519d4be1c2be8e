// `gdn bench`: per-call time of gdn::decode against the machine's copy bandwidth measured in
// the same run. One subcommand for both backends: --device cpu times the CPU backend
// (bench_cpu.cpp, every build), --device cuda the CUDA kernels (bench.cu, CUDA builds); auto
// takes CUDA when the build has it and a GPU is visible, else the CPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "gdn/gdn.h"

namespace gdn::tools {

// The fused rows' conv in both benches, as the models have it: W = 4 taps, a bf16 conv pool of
// L = W - 1 columns, in vLLM's [P, L, D] memory (a transposed view) or channel-major [P, D, L]
// (SGLang's; FLA and transformers keep L = W) by --conv-layout.
constexpr int64_t kConvW = 4;
constexpr int64_t kConvL = kConvW - 1;

// A state dtype's name in the benches' rows and options: fp32, bf16 or fp16.
inline const char* state_name(DLDataType t) { return t.bits == 32 ? "fp32" : t.code == kDLBfloat ? "bf16" : "fp16"; }

// The options of both benches. An empty list or string means "the bench's own default".
struct BenchOptions {
  std::string device = "auto";
  std::string op = "decode";   // decode | fused | all (gdn::fused_decode rows)
  bool fused_norm = true;      // the fused rows' gated RMSNorm
  std::string conv_layout = "vllm";  // vllm | channel-major: the fused rows' conv pool
  std::string rounding = "nearest";  // nearest | stochastic | all (16-bit state stores)
  std::string model = "all", state = "all", mode, layout = "default";
  std::string cache, update;  // default: all (CUDA); off and on (CPU)
  std::vector<int> T, B;
  bool quick = false;
  std::string json;
  int calls = 20;
  int reps = 5;
  double l2_multiple = 4.0;    // CUDA: state sets rotated so the others' bytes are >= this x L2
  bool copy_kernel = false;    // CUDA only
  int threads = 0;             // CPU only: OpenMP threads (0: the runtime's default)
  double llc_multiple = 4.0;   // CPU: state sets rotated so the others' bytes are >= this x LLC
};

// The fused rows' conv pool of P slots over D channels at `data` (P * D * kConvL bf16 elements)
// on `device`, in the layout --conv-layout names: the one view both benches pass.
inline TensorView conv_pool_view(void* data, DLDevice device, int64_t P, int64_t D, const BenchOptions& opt) {
  return opt.conv_layout == "channel-major"
             ? make_view(data, kBFloat16, device, {P, D, kConvL}, {D * kConvL, kConvL, 1})
             : make_view(data, kBFloat16, device, {P, D, kConvL}, {D * kConvL, 1, D});
}

void add_bench_command(CLI::App& app);

// The CPU's model name from /proc/cpuinfo (the JSON's device field of CPU runs).
std::string cpu_name();

// Both return the process exit code (0: every configuration ran).
int cpu_bench_main(const BenchOptions& opt);
#ifdef GDN_WITH_CUDA
int cuda_bench_main(const BenchOptions& opt);
#endif

}  // namespace gdn::tools
