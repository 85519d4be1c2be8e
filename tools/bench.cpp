// `gdn bench`: the command line of both benches and the choice between them (bench.h).
#include <cstdio>
#include <exception>
#include <memory>

#include "bench.h"
#include "gdn/gdn.h"

namespace gdn::tools {
namespace {

int dispatch(BenchOptions opt) {
  bool cuda = opt.device == "cuda";
#ifdef GDN_WITH_CUDA
  if (opt.device == "auto") cuda = gdn::cuda_available();
  if (cuda && !gdn::cuda_available()) {
    std::fprintf(stderr, "gdn bench: --device cuda, but no CUDA device is visible\n");
    return 2;
  }
#else
  if (cuda) {
    std::fprintf(stderr, "gdn bench: --device cuda, but this build has no CUDA backend\n");
    return 2;
  }
#endif
  if (cuda) {
#ifdef GDN_WITH_CUDA
    if (opt.mode.empty()) opt.mode = "all";
    if (opt.cache.empty()) opt.cache = "all";
    if (opt.update.empty()) opt.update = "all";
    return cuda_bench_main(opt);
#endif
  }
  if (opt.mode.empty()) opt.mode = "pool";
  if (opt.cache.empty()) opt.cache = "off";
  if (opt.update.empty()) opt.update = "on";
  return cpu_bench_main(opt);
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto opt = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "bench", "Time gdn::decode against the copy bandwidth measured in the same run (CPU or CUDA)");
  cmd->add_option("--device", opt->device,
                  "cpu | cuda | auto (CUDA when this build has it and a GPU is visible, else CPU)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--op", opt->op,
                  "decode | fused | all: gdn::decode, or gdn::fused_decode (conv W = 4, bf16 conv pool in "
                  "vLLM's [P, L, D] memory, gated RMSNorm on unless --fused-norm false)")
      ->check(CLI::IsMember({"decode", "fused", "all"}));
  cmd->add_option("--fused-norm", opt->fused_norm, "the fused rows' gated RMSNorm (true | false)")
      ->capture_default_str();
  cmd->add_option("--conv-layout", opt->conv_layout,
                  "vllm | channel-major: the fused rows' conv pool as vLLM's [P, L, D] memory, or [P, D, L] "
                  "with each channel's columns contiguous (SGLang's; FLA's and transformers' kind)")
      ->check(CLI::IsMember({"vllm", "channel-major"}))
      ->capture_default_str();
  cmd->add_option("--rounding", opt->rounding,
                  "nearest | stochastic | all: 16-bit state stores round to nearest even, or "
                  "stochastically (StepArgs::rounding_seed); fp32 rows are always nearest")
      ->check(CLI::IsMember({"nearest", "stochastic", "all"}))
      ->capture_default_str();
  cmd->add_option("--model", opt->model, "qwen3-next | qwen3.5 | all")
      ->check(CLI::IsMember({"qwen3-next", "qwen3.5", "all"}));
  cmd->add_option("--state", opt->state, "fp32 | bf16 | fp16 | all (CUDA: fp32 and bf16; fp16 when named)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "all"}));
  cmd->add_option("--mode", opt->mode, "dense | pool | split | all (default: all on CUDA, pool on the CPU)")
      ->check(CLI::IsMember({"dense", "pool", "split", "all"}));
  cmd->add_option("--layout", opt->layout,
                  "vk | kv | all | default (CUDA: VK, plus KV on a subset; CPU: both)")
      ->check(CLI::IsMember({"vk", "kv", "all", "default"}));
  cmd->add_option("--cache", opt->cache, "on | off | all (T > 1; default: all on CUDA, off on the CPU)")
      ->check(CLI::IsMember({"on", "off", "all"}));
  cmd->add_option("--update", opt->update, "on | off | all (T > 1; default: all on CUDA, on on the CPU)")->check(CLI::IsMember({"on", "off", "all"}));
  cmd->add_option("--T", opt->T, "tokens per row (list)")->delimiter(',');
  cmd->add_option("--B", opt->B, "batch sizes (list)")->delimiter(',');
  cmd->add_flag("--quick", opt->quick, "a short sweep");
  cmd->add_option("--json", opt->json, "write the results as JSON to this path");
  cmd->add_option("--calls", opt->calls, "CUDA: calls per captured graph (at least the state sets)");
  cmd->add_option("--reps", opt->reps, "timed repetitions (median)")->check(CLI::Range(1, 1000));
  cmd->add_flag("--copy-kernel", opt->copy_kernel,
                "CUDA: also time a plain copy kernel that moves the same state bytes the same way "
                "(launch + latency + bandwidth floor; rows without the cache)");
  cmd->add_option("--threads", opt->threads, "CPU: OpenMP threads for the copy and the calls (0: default)")
      ->check(CLI::Range(0, 4096));
  cmd->add_option("--llc-multiple", opt->llc_multiple,
                  "CPU: rotate state sets so that the others' bytes are at least this many last-level "
                  "caches (0: one set)")
      ->check(CLI::Range(0.0, 64.0))
      ->capture_default_str();
  cmd->callback([opt] {
    int rc = 1;
    try {
      rc = dispatch(*opt);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gdn bench: %s\n", e.what());
    }
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace gdn::tools
