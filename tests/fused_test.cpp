// The fused layer step (gdn::fused_decode, docs/semantics.md section 6) on every backend
// against the float64 oracle: a covering array over the step's factors and the conv's (taps,
// state width, dtypes, the vLLM transposed pool, bias, conv_inter, norm with and without the
// gate), then the rules one at a time: padding and bad slots touch neither pool, update_state
// covers both pools, interleaved pools, GVA groups that fill a 16-block cluster, many steps
// fed back, determinism, and every rejected input with nothing written.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <unistd.h>  // environ

#include "backends.h"
#include "check.h"
#include "covering.h"
#include "harness.h"

namespace gdn::test {
namespace {

enum Factor : int {
  kFB, kFT, kFHeads, kFK, kFV, kFLayout, kFStateDtype, kFInputDtype, kFOutDtype, kFGates, kFAddressing,
  kFPadding, kFInter, kFStrides, kFUpdate, kFW, kFL, kFConvDtype, kFWeightDtype, kFTransposed, kFNorm,
  kFExtras, kNumFactors
};
const std::vector<int> kLevels = {3, 5, 3, 3, 3, 2, 3, 3, 3, 2, 7, 2, 3, 3, 2, 3, 3, 3, 3, 2, 3, 4};
constexpr int64_t kBs[] = {1, 3, 33};
constexpr int64_t kTs[] = {1, 2, 4, 8, 16};
constexpr int64_t kHs[][2] = {{1, 2}, {2, 8}, {16, 32}};
constexpr int64_t kDims[] = {64, 128, 256};
const DLDataType kFloats[] = {kFloat32, kBFloat16, kFloat16};
const DLDataType kInputs[] = {kBFloat16, kFloat16, kFloat32};
const std::pair<Addressing, DLDataType> kAddr[] = {
    {Addressing::kDense, kInt32},    {Addressing::kPool, kInt32},     {Addressing::kPool, kInt64},
    {Addressing::kSplit, kInt64},    {Addressing::kPerToken, kInt32}, {Addressing::kPerTokenFromFirst, kInt64},
    {Addressing::kAccepted, kInt32}};
constexpr int64_t kMaxWork = int64_t{1} << 22;
constexpr int64_t kMaxPool = int64_t{1} << 23;

bool feasible(const std::vector<int>& a) {
  const bool pad = a[kFPadding] == 1;
  if (pad && a[kFAddressing] == 0) return false;
  if (pad && a[kFB] == 0) return false;
  const int64_t B = a[kFB] >= 0 ? kBs[a[kFB]] : (pad ? 3 : 1);
  const int64_t T = a[kFT] >= 0 ? kTs[a[kFT]] : 1;
  const int64_t HV = a[kFHeads] >= 0 ? kHs[a[kFHeads]][1] : 2;
  const int64_t K = a[kFK] >= 0 ? kDims[a[kFK]] : 64;
  const int64_t V = a[kFV] >= 0 ? kDims[a[kFV]] : 64;
  int64_t P = pad ? 4 * B + 3 : B;
  if (a[kFAddressing] >= 0) {
    const Addressing m = kAddr[a[kFAddressing]].first;
    if (m == Addressing::kPool || m == Addressing::kSplit) P = 4 * B + 3;
    if (m == Addressing::kPerToken || m == Addressing::kPerTokenFromFirst || m == Addressing::kAccepted)
      P = 2 * B * (T + 1) + 3;
  }
  return B * T * HV * K * V <= kMaxWork && P * HV * K * V <= kMaxPool;
}

Config from_levels(const std::vector<int>& a) {
  Config c;
  c.fused = true;
  c.B = kBs[a[kFB]];
  c.T = kTs[a[kFT]];
  c.H = kHs[a[kFHeads]][0];
  c.HV = kHs[a[kFHeads]][1];
  c.K = kDims[a[kFK]];
  c.V = kDims[a[kFV]];
  c.layout = a[kFLayout] == 0 ? StateLayout::kVK : StateLayout::kKV;
  c.state_dtype = kFloats[a[kFStateDtype]];
  c.input_dtype = kInputs[a[kFInputDtype]];
  c.out_dtype = kFloats[a[kFOutDtype]];
  c.gates = a[kFGates] == 0 ? GateForm::kRaw : GateForm::kPrecomputed;
  c.addressing = kAddr[a[kFAddressing]].first;
  c.slot_dtype = kAddr[a[kFAddressing]].second;
  c.padding = a[kFPadding] == 1;
  c.inter = static_cast<InterMode>(a[kFInter]);
  c.strides = static_cast<StrideMode>(a[kFStrides]);
  c.update_state = a[kFUpdate] == 0;
  c.W = 2 + a[kFW];
  c.conv_L = a[kFL] == 0 ? c.W - 1 : a[kFL] == 1 ? c.W : c.W + 2;
  c.conv_dtype = kFloats[(a[kFConvDtype] + 1) % 3];  // bf16 first: the engines' dtype
  c.weight_dtype = kFloats[(a[kFWeightDtype] + 1) % 3];
  c.conv_transposed = a[kFTransposed] == 0;
  c.norm = a[kFNorm] >= 1;
  c.gate_z = a[kFNorm] == 2;
  c.conv_bias = a[kFExtras] & 1;
  c.conv_inter = (a[kFExtras] & 2) != 0;
  return c;
}

struct FusedParam {
  Backend backend;
  Config cfg;
  int index;
};

void PrintTo(const FusedParam& p, std::ostream* os) { *os << backend_name(p.backend) << " " << p.cfg.name(); }

std::vector<FusedParam> params(Backend b) {
  static const std::vector<Config> configs = [] {
    std::vector<Config> out;
    for (const auto& row : covering_array(kLevels, feasible, 20261124)) out.push_back(from_levels(row));
    return out;
  }();
  std::vector<FusedParam> p;
  for (size_t i = 0; i < configs.size(); ++i) p.push_back({b, configs[i], static_cast<int>(i)});
  return p;
}

std::string param_name(const ::testing::TestParamInfo<FusedParam>& info) {
  char idx[8];
  std::snprintf(idx, sizeof idx, "f%02d_", info.param.index);
  return idx + info.param.cfg.name();
}

class FusedMatrix : public ::testing::TestWithParam<FusedParam> {
 protected:
  void SetUp() override {
    if (std::string why = backend_unavailable(GetParam().backend); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(FusedMatrix, MatchesOracle) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed) + " config=" + GetParam().cfg.name());
  run_and_compare(GetParam().backend, make_case(GetParam().cfg, seed));
}

INSTANTIATE_TEST_SUITE_P(Cpu, FusedMatrix, ::testing::ValuesIn(params(Backend::kCpu)), param_name);
#if defined(GDN_WITH_CUDA)
INSTANTIATE_TEST_SUITE_P(Cuda, FusedMatrix, ::testing::ValuesIn(params(Backend::kCuda)), param_name);
#endif

TEST(FusedMatrixCoverage, EveryLevelAppearsAndBudgetHolds) {
  const auto ps = params(Backend::kCpu);
  std::set<int64_t> Ts, Ws, Ls;
  for (const auto& p : ps) {
    Ts.insert(p.cfg.T);
    Ws.insert(p.cfg.W);
    Ls.insert(p.cfg.conv_L);
    EXPECT_LE(p.cfg.B * p.cfg.T * p.cfg.HV * p.cfg.K * p.cfg.V, kMaxWork) << p.cfg.name();
  }
  EXPECT_EQ(Ts.size(), 5u);
  EXPECT_EQ(Ws.size(), 3u);
  EXPECT_GE(Ls.size(), 4u);
  EXPECT_LT(ps.size(), 90u) << "the covering array grew; check the suite's run time";
}

// ---------------------------------------------------------------------------------------
// The rules one at a time.
// ---------------------------------------------------------------------------------------
class Fused : public BackendTest {};

Config base(Addressing mode, int64_t B, int64_t T) {
  Config c;
  c.fused = true;
  c.B = B;
  c.T = T;
  c.H = 1;
  c.HV = 2;
  c.addressing = mode;
  c.out_dtype = kBFloat16;
  c.conv_inter = true;
  return c;
}

// Qwen3-Next's layer (H = 16, HV = 32, K = V = 128, W = 4) as vLLM holds it: conv pool [P, L, D]
// interleaved page by page with the state pool, bf16 everything but the state, gated norm.
TEST_P(Fused, Qwen3NextLayerInAHybridCache) {
  GDN_SEED();
  for (DLDataType sd : {kFloat32, kBFloat16}) {
    for (int64_t T : {1, 4}) {
      SCOPED_TRACE("state " + dtype_name(sd) + " T=" + std::to_string(T));
      Config cfg = base(T == 1 ? Addressing::kPool : Addressing::kAccepted, 2, T);
      cfg.qwen3_next_heads();
      cfg.state_dtype = sd;
      cfg.strides = StrideMode::kPage;
      cfg.padding = true;
      run_and_compare(backend(), make_case(cfg, seed));
    }
  }
}

// transformers' layout: a compact [B, D, W] conv state (L = W), KV recurrent state.
TEST_P(Fused, TransformersConvStateAndKvLayout) {
  GDN_SEED();
  for (int64_t T : {1, 3}) {
    Config cfg = base(Addressing::kDense, 2, T);
    cfg.H = 2;
    cfg.HV = 4;
    cfg.layout = StateLayout::kKV;
    cfg.conv_L = cfg.W;
    cfg.conv_transposed = false;
    cfg.conv_bias = true;
    run_and_compare(backend(), make_case(cfg, seed));
  }
}

// The conv pools of SGLang ([P, D, W - 1]) and transformers ([P, D, W]): each channel's columns
// contiguous, the channels packed, with a channel-major conv_inter. On CUDA, with 16-bit
// activations and taps, the conv's 16-byte path takes them as 8L-element groups (fused.cuh,
// conv_cm_transpose); here in the cluster form (both layouts, small B), at Qwen3-Next's heads.
TEST_P(Fused, ChannelMajorConvPools) {
  GDN_SEED();
  for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
    for (int64_t L : {3, 4}) {
      for (int64_t T : {1, 3}) {
        SCOPED_TRACE(std::string(layout == StateLayout::kVK ? "VK" : "KV") + " L=" + std::to_string(L) +
                     " T=" + std::to_string(T));
        Config cfg = base(Addressing::kPool, 3, T);
        cfg.qwen3_next_heads();
        cfg.layout = layout;
        cfg.padding = true;
        cfg.conv_L = L;
        cfg.conv_transposed = false;
        cfg.conv_bias = T == 1;
        run_and_compare(backend(), make_case(cfg, seed));
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

// GVA groups of 4 value heads (Qwen3.5's ratio) at B = 1: on CUDA the cluster of one (row, q/k
// head) holds 4 heads x their tiles, 16 blocks, so the conv-state handoff and the norm's sums
// cross the largest cluster.
TEST_P(Fused, LargeGvaGroups) {
  GDN_SEED();
  for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
    for (DLDataType sd : {kFloat32, kBFloat16}) {
      SCOPED_TRACE(std::string(layout == StateLayout::kVK ? "VK " : "KV ") + dtype_name(sd));
      Config cfg = base(Addressing::kPool, 1, 2);
      cfg.H = 4;
      cfg.HV = 16;
      cfg.K = cfg.V = 128;
      cfg.layout = layout;
      cfg.state_dtype = sd;
      run_and_compare(backend(), make_case(cfg, seed));
    }
  }
}

// A GVA group times T above 128 (16 value heads per q/k head, T = 9): more (head, token) gates
// than the CUDA group kernel's 128 threads load, one each, so its planners must refuse the shape
// (group_shape_ok) and another kernel runs. decode on the KV layout, where the group kernel's
// shared memory would fit it: under ctest's group_forced.* copy (GDN_CUDA_GROUP=2) this fails if
// the check goes. And the fused step on VK, whose cluster form then holds 16 blocks of one tile
// per value head. (CUDA's fused step does not take this group on KV at V = 128: two column tiles
// per head would make clusters of 32.)
TEST_P(Fused, GvaGroupTimesTokensAbove128) {
  GDN_SEED();
  for (bool fused : {true, false}) {
    SCOPED_TRACE(fused ? "fused VK" : "decode KV");
    Config cfg = base(Addressing::kPool, 1, 9);
    cfg.HV = 16;
    cfg.K = cfg.V = 128;
    cfg.layout = fused ? StateLayout::kVK : StateLayout::kKV;
    cfg.state_dtype = kBFloat16;
    cfg.fused = fused;
    cfg.norm = cfg.gate_z = false;
    run_and_compare(backend(), make_case(cfg, seed + (fused ? 0 : 1)));
  }
}

// SiLU far outside its exponential's range, in the conv and in the norm's gate: mixed_qkv
// entries of +-1000 at token 1 make conv outputs of both signs far beyond +-88, where silu(x) is x
// or a signed zero, and z at -1000 over a whole (row, token, value head) zeroes that output
// vector exactly (the oracle's too). On the CPU the exponential clamps its argument by vectorized
// selects (fused_cpu.cpp, silu); on CUDA __expf overflows to inf (silu_fast).
TEST_P(Fused, SiluFarOutsideTheExponentialsRange) {
  GDN_SEED();
  for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
    SCOPED_TRACE(layout == StateLayout::kVK ? "VK" : "KV");
    Config cfg = base(Addressing::kPool, 2, 2);
    cfg.HV = 2;
    cfg.K = cfg.V = 128;
    cfg.layout = layout;
    Case c = make_case(cfg, seed + (layout == StateLayout::kKV ? 1 : 0));
    for (int64_t d = 0; d < cfg.D(); d += 5) c[Arg::kMixedQkv].set({0, 1, d}, d % 2 == 0 ? 1000.0 : -1000.0);
    for (int64_t v = 0; v < cfg.V; ++v) c[Arg::kZ].set({1, 0, 1, v}, -1000.0);
    for (int64_t v = 0; v < cfg.V; v += 3) c[Arg::kZ].set({0, 1, 0, v}, 1000.0);
    run_and_compare(backend(), c);
  }
}

// Serving batches of the engines' layouts (K = 128, the conv's 16-byte path): B = 34 rows of
// Qwen3-Next hold 35.7 MB of bf16 state, so on CUDA the group kernel (group.cuh: one block
// per row and q/k head, the GVA group's state streamed through stage buffers) runs wherever the
// GPU has at most 232 SMs (plan_fused_group: 150 KiB of state per SM). On 132 SMs its 16-bit VK
// cases at T <= 2 take two q/k heads per block (544 blocks of one head are past one wave); the
// B = 20 case keeps one. Every state dtype,
// T = 1..3, each addressing family, the cache, stochastic rounding, the norm with and without its
// gate and without it, GVA groups of 2 and 4; VK and KV each. (ctest's group_forced.* copy runs
// the other fused tests with the group kernel forced wherever it applies.)
void serving_batches(Backend backend, uint64_t seed, StateLayout layout) {
  if (backend == Backend::kCpu)
    GTEST_SKIP() << "sized for the CUDA group kernel (a minute of oracle time on two cores); the CPU fused step's "
                    "paths are covered by FusedMatrix at smaller shapes";
  struct Variant {
    const char* name;
    std::function<void(Config&)> set;
  };
  const Variant variants[] = {
      {"bf16 pool T=1 vLLM pages, bias, conv_inter, padding",
       [](Config& c) {
         c.strides = StrideMode::kPage;
         c.conv_bias = true;
         c.padding = true;
       }},
      {"fp32 accepted T=3 inter, norm without gate",
       [](Config& c) {
         c.state_dtype = kFloat32;
         c.T = 3;
         c.addressing = Addressing::kAccepted;
         c.inter = InterMode::kCompact;
         c.gate_z = false;
       }},
      {"fp16 per-token T=3, no norm",
       [](Config& c) {
         c.state_dtype = kFloat16;
         c.T = 3;
         c.addressing = Addressing::kPerToken;
         c.norm = c.gate_z = false;
       }},
      {"bf16 split T=2 GVA 4 (Qwen3.5), precomputed gates",
       [](Config& c) {
         c.HV = 64;
         c.T = 2;
         c.addressing = Addressing::kSplit;
         c.gates = GateForm::kPrecomputed;
       }},
      {"bf16 pool T=2 stochastic rounding, fp32 output",
       [](Config& c) {
         c.T = 2;
         c.rounding_seed = 20261127;
         c.out_dtype = kFloat32;
       }},
      // 320 blocks, within one wave of three per SM: the 16-bit KV group kernel compiled for three
      // blocks with the rounding (B = 34 takes the four-block one past a wave).
      {"bf16 pool T=1 stochastic rounding, B=20",
       [](Config& c) {
         c.B = 20;
         c.rounding_seed = 20261129;
       }},
      {"bf16 pool T=1 update_state false", [](Config& c) { c.update_state = false; }},
      {"bf16 pool T=2 SGLang's channel-major conv pool [P, D, 3], bias, conv_inter, padding",
       [](Config& c) {
         c.T = 2;
         c.conv_transposed = false;
         c.conv_bias = true;
         c.conv_inter = true;
         c.padding = true;
       }},
      {"fp32 pool T=1 transformers' conv pool [P, D, 4] in vLLM pages",
       [](Config& c) {
         c.state_dtype = kFloat32;
         c.conv_L = 4;
         c.conv_transposed = false;
         c.strides = StrideMode::kPage;
       }},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    Config cfg = base(Addressing::kPool, 34, 1);
    cfg.qwen3_next_heads();
    cfg.state_dtype = kBFloat16;
    cfg.conv_inter = false;
    cfg.layout = layout;
    v.set(cfg);
    run_and_compare(backend, make_case(cfg, seed));
    if (::testing::Test::HasFailure()) return;
  }
}

TEST_P(Fused, ServingBatchOneBlockPerQkHead) {
  GDN_SEED();
  serving_batches(backend(), seed, StateLayout::kVK);
}

// transformers' and FLA's layout.
TEST_P(Fused, ServingBatchOneBlockPerQkHeadKv) {
  GDN_SEED();
  serving_batches(backend(), seed, StateLayout::kKV);
}

TEST_P(Fused, PaddingAndBadSlotsTouchNeitherPool) {
  GDN_SEED();
  Config cfg = base(Addressing::kPerToken, 5, 3);
  Case c = make_case(cfg, seed);
  c[Arg::kReadSlots].set({0}, -1);                                  // padding
  c[Arg::kReadSlots].set({2}, static_cast<double>(c.P));            // out of range: counted
  c[Arg::kTokenSlots].set({3, 1}, static_cast<double>(c.P + 4));    // a token slot out of range
  c[Arg::kTokenSlots].set({4, 2}, -1);                              // the last token's state dropped
  const Expected e = expected_effects(c);
  ASSERT_EQ(e.error_delta, 2);
  run_and_compare(backend(), c);
}

TEST_P(Fused, UpdateStateFalseLeavesBothPoolsBitIdentical) {
  GDN_SEED();
  for (Addressing m : {Addressing::kPool, Addressing::kPerToken}) {
    Config cfg = base(m, 3, 2);
    cfg.update_state = false;
    const Case before = make_case(cfg, seed);
    run_and_compare(backend(), before);
    Case got = before.clone();
    ASSERT_TRUE(run_fused(backend(), got).ok());
    for (Arg a : {Arg::kState, Arg::kConvState}) {
      const auto sb = before[a].storage, sg = got[a].storage;
      EXPECT_TRUE(sb->same_bytes(*sg)) << arg_name(a) << " changed with update_state = false";
    }
  }
}

// Each decode step feeds the next, both pools carried: 24 steps of T = 1 then verify steps of
// T = 3 continuing from the accepted token, against the oracle's own chain.
TEST_P(Fused, ManyStepsFedBack) {
  GDN_SEED();
  for (DLDataType sd : {kFloat32, kBFloat16}) {
    SCOPED_TRACE("state " + dtype_name(sd));
    Config cfg = base(Addressing::kPool, 3, 1);
    cfg.state_dtype = sd;
    cfg.conv_inter = false;
    Case want = make_case(cfg, seed), got = want.clone();
    for (int step = 0; step < 24; ++step) {
      const Case bw = want.clone(), bg = got.clone();
      ASSERT_TRUE(run_reference(want).ok());
      ASSERT_TRUE(run_fused(backend(), got).ok());
      expect_matches(bw, want, bg, got, many_steps_tolerance(sd), "step " + std::to_string(step));
      if (::testing::Test::HasFailure()) return;
      fill_inputs(want, seed + step + 1);
      fill_inputs(got, seed + step + 1);
    }
  }
}

TEST_P(Fused, BitIdenticalRunToRun) {
  GDN_SEED();
  Config cfg = base(Addressing::kAccepted, 4, 4);
  cfg.H = 2;
  cfg.HV = 4;
  cfg.K = cfg.V = 128;
  const Case before = make_case(cfg, seed);
  Case first = before.clone(), second = before.clone();
  ASSERT_TRUE(run_fused(backend(), first).ok());
  ASSERT_TRUE(run_fused(backend(), second).ok());
  EXPECT_TRUE(same_bits(first, second));
}

TEST_P(Fused, EmptyBatchIsANoOp) {
  GDN_SEED();
  const Case before = make_case(base(Addressing::kPool, 0, 2), seed);
  Case got = before.clone();
  const Status st = run_fused(backend(), got);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_TRUE(same_bits(before, got));
}

INSTANTIATE_TEST_SUITE_P(Cpu, Fused, ::testing::Values(Backend::kCpu),
                         [](const auto&) { return std::string("cpu"); });
#if defined(GDN_WITH_CUDA)
INSTANTIATE_TEST_SUITE_P(Cuda, Fused, ::testing::Values(Backend::kCuda),
                         [](const auto&) { return std::string("cuda"); });
#endif

// ---------------------------------------------------------------------------------------
// Rejected inputs: the status, a message naming the argument, can_implement agreeing, and not
// one byte written (both pools included).
// ---------------------------------------------------------------------------------------
struct FusedError {
  std::string name;
  std::function<void(FusedDecodeArgs&)> mutate;
  std::string message;
  StatusCode code = StatusCode::kInvalidArgument;
};

std::vector<FusedError> errors() {
  const auto f32 = [](void* p, int64_t off) { return static_cast<float*>(p) + off; };
  return {
      {"MissingMixedQkv", [](FusedDecodeArgs& a) { a.mixed_qkv = {}; }, "mixed_qkv is required"},
      {"MissingConvWeight", [](FusedDecodeArgs& a) { a.conv_weight = {}; }, "conv_weight is required"},
      {"MissingConvState", [](FusedDecodeArgs& a) { a.conv_state = {}; }, "conv_state is required"},
      {"MissingLayout", [](FusedDecodeArgs& a) { a.layout.reset(); }, "layout is required"},
      {"DNotMatchingHeads", [](FusedDecodeArgs& a) { a.mixed_qkv.shape[2] -= 1; }, "mixed_qkv.shape[2] (D"},
      {"WeightChannels", [](FusedDecodeArgs& a) { a.conv_weight.shape[0] += 1; }, "conv_weight.shape[0]"},
      {"FiveTaps", [](FusedDecodeArgs& a) { a.conv_weight.shape[1] = 5; }, "conv_weight.shape[1] (W)"},
      {"ConvStateTooNarrow", [](FusedDecodeArgs& a) { a.conv_state.shape[2] = 2; }, "conv_state.shape[2] (L)"},
      {"ConvPoolSize", [](FusedDecodeArgs& a) { a.conv_state.shape[0] -= 1; }, "conv_state.shape[0]"},
      {"ConvStateInt32", [](FusedDecodeArgs& a) { a.conv_state.dtype = kInt32; }, "conv_state dtype"},
      {"ConvInterDtype", [](FusedDecodeArgs& a) { a.conv_inter.dtype = kFloat16; }, "conv_inter dtype must match"},
      {"ConvInterTokens", [](FusedDecodeArgs& a) { a.conv_inter.shape[1] = 1; }, "conv_inter.shape[1]"},
      {"ZWithoutNorm", [](FusedDecodeArgs& a) { a.norm_weight = {}; }, "z needs norm_weight"},
      {"NormWeightSize", [](FusedDecodeArgs& a) { a.norm_weight.shape[0] = 32; }, "norm_weight.shape[0]"},
      {"NormEpsNaN", [](FusedDecodeArgs& a) { a.norm_eps = NAN; }, "norm_eps must be finite"},
      {"TooManyTokens",
       [](FusedDecodeArgs& a) {
         for (TensorView* v : {&a.mixed_qkv, &a.o, &a.a, &a.b, &a.z, &a.conv_inter}) v->shape[1] = 17;
       },
       "(T) must be in 1..16"},
      {"ConvStateOverlapsState", [=](FusedDecodeArgs& a) { a.conv_state.data = f32(a.state.data, 8); },
       "must not overlap"},
      {"OOverlapsMixedQkv", [=](FusedDecodeArgs& a) { a.mixed_qkv.data = f32(a.o.data, 4); },
       "o must not overlap mixed_qkv"},
      {"ConvInterOverlapsZ", [=](FusedDecodeArgs& a) { a.z.data = f32(a.conv_inter.data, 2); },
       "conv_inter must not overlap z"},
      {"ConvStateSlotsAlias", [](FusedDecodeArgs& a) { a.conv_state.strides[0] = 0; },
       "conv_state must not overlap itself"},
      {"ConvWeightMisaligned", [](FusedDecodeArgs& a) { a.conv_weight.data = static_cast<char*>(a.conv_weight.data) + 1; },
       "conv_weight data pointer must be aligned"},
  };
}

struct FusedErrorParam {
  Backend backend;
  FusedError e;
};
void PrintTo(const FusedErrorParam& p, std::ostream* os) { *os << backend_name(p.backend) << " " << p.e.name; }

class FusedRejects : public ::testing::TestWithParam<FusedErrorParam> {
 protected:
  void SetUp() override {
    if (std::string why = backend_unavailable(GetParam().backend); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(FusedRejects, WithStatusMessageAndNoWrites) {
  GDN_SEED();
  Config cfg = base(Addressing::kPool, 2, 2);
  cfg.oversize = 4;
  const Case before = make_case(cfg, seed);
  ASSERT_TRUE(can_implement(before.fused_args()).ok()) << can_implement(before.fused_args()).message();
  Case got = before.clone();
  Status checked;
  const Status st = run_fused(GetParam().backend, got, GetParam().e.mutate, &checked);
  EXPECT_EQ(st.code(), GetParam().e.code) << st.message();
  EXPECT_NE(st.message().find(GetParam().e.message), std::string::npos)
      << "message \"" << st.message() << "\" lacks \"" << GetParam().e.message << "\"";
  EXPECT_EQ(checked.message(), st.message());
  EXPECT_TRUE(same_bits(before, got)) << "a rejected call wrote memory";
}

std::vector<FusedErrorParam> error_params(Backend b) {
  std::vector<FusedErrorParam> p;
  for (auto& e : errors()) p.push_back({b, e});
  return p;
}
std::string error_name(const ::testing::TestParamInfo<FusedErrorParam>& info) { return info.param.e.name; }

INSTANTIATE_TEST_SUITE_P(Cpu, FusedRejects, ::testing::ValuesIn(error_params(Backend::kCpu)), error_name);
#if defined(GDN_WITH_CUDA)
INSTANTIATE_TEST_SUITE_P(Cuda, FusedRejects, ::testing::ValuesIn(error_params(Backend::kCuda)), error_name);

// A state pool off the 16-byte grid is a valid call the CUDA fused path does not take: it
// says so (kNotSupported, naming the reason) and writes nothing; the CPU backend runs it.
TEST(CudaFused, UnalignedStateIsNotSupported) {
  if (std::string why = backend_unavailable(Backend::kCuda); !why.empty()) GTEST_SKIP() << why;
  const uint64_t seed = test_seed();
  Config cfg = base(Addressing::kPool, 2, 1);
  cfg.oversize = 2;
  Case before = make_case(cfg, seed);
  // One element in: rows no longer start on 16 bytes (a view of the same storage).
  HostTensor& st = before[Arg::kState];
  st.byte_offset += dtype_size(st.dtype);  // same shape and strides (the storage is oversized)
  Case got = before.clone();
  Status checked;
  const Status s = run_fused(Backend::kCuda, got, {}, &checked);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.message();
  EXPECT_NE(s.message().find("16-byte aligned"), std::string::npos) << s.message();
  EXPECT_EQ(checked.message(), s.message());
  EXPECT_TRUE(same_bits(before, got));
  run_and_compare(Backend::kCpu, before);
}

// The CUDA planner's descriptions (src/backends.h) for cfg: {decode's plan for the same recurrence
// (the same shapes without the conv and the norm), the fused step's}, each after a successful
// call; empty where the call's problem did not build.
std::pair<std::string, std::string> cuda_plans(const Config& cfg, uint64_t seed) {
  std::string fused, step;
  Case got = make_case(cfg, seed);
  const Status st = run_fused(Backend::kCuda, got, [&](FusedDecodeArgs& a) {
    detail::FusedProblem f;
    if (detail::build_fused_problem(a, &f).ok()) fused = detail::describe_fused_cuda_plan(f);
  });
  EXPECT_TRUE(st.ok()) << st.message();
  Config dcfg = cfg;
  dcfg.fused = false;
  Case dgot = make_case(dcfg, seed);
  const Status ds = run_decode(Backend::kCuda, dgot, [&](DecodeArgs& a) {
    detail::Problem p;
    if (detail::build_problem(a, &p).ok()) step = detail::describe_cuda_plan(p);
  });
  EXPECT_TRUE(ds.ok()) << ds.message();
  return {step, fused};
}

// The planner's description (src/backends.h, for gdn bench's rows) names the kernel that runs,
// and its fields agree with the plan's own arithmetic. (The serving batches check these plans'
// results against the oracle.)
TEST(CudaFused, PlanDescriptionNamesTheKernel) {
  if (std::string why = backend_unavailable(Backend::kCuda); !why.empty()) GTEST_SKIP() << why;
  const uint64_t seed = test_seed();
  const auto field = [](const std::string& s, const std::string& name) {
    const size_t at = s.find(" " + name + "=");
    return at == std::string::npos ? int64_t{-1} : std::stoll(s.substr(at + name.size() + 2));
  };
  for (const int64_t B : {int64_t{1}, int64_t{34}}) {
    SCOPED_TRACE("B = " + std::to_string(B));
    Config cfg = base(Addressing::kPool, B, 1);
    cfg.qwen3_next_heads();
    cfg.state_dtype = kBFloat16;
    cfg.conv_inter = false;
    const auto [step, fused] = cuda_plans(cfg, seed);
    ASSERT_FALSE(fused.empty());
    EXPECT_EQ(step.rfind("vk", 0), 0u) << step;  // a VK kernel family
    EXPECT_GT(field(step, "blocks"), 0) << step;
    if (B == 1) {
      // The cluster form: one block per value head of the GVA group (two), one cluster per q/k head.
      EXPECT_EQ(fused.rfind("vk-tile", 0), 0u) << fused;
      EXPECT_EQ(field(fused, "cluster"), 2) << fused;
    } else {
      // 35.7 MB of state: the group kernel on any GPU of at most 232 SMs, with one or two q/k heads
      // per block by the grid's waves.
      EXPECT_EQ(fused.rfind("group ", 0), 0u) << fused;
      const int64_t hpb = field(fused, "hpb");
      EXPECT_TRUE(hpb == 1 || hpb == 2) << fused;
      EXPECT_EQ(field(fused, "blocks"), B * cfg.H / hpb) << fused;
    }
  }
}

// cuda_plans for Qwen3-Next's heads at B = 1, KV, pool addressing, without the cache.
std::pair<std::string, std::string> kv_plans_b1(int64_t T, DLDataType sd, uint64_t seed) {
  Config cfg = base(Addressing::kPool, 1, T);
  cfg.qwen3_next_heads();
  cfg.layout = StateLayout::kKV;
  cfg.state_dtype = sd;
  cfg.conv_inter = false;
  return cuda_plans(cfg, seed);
}

bool starts_with_kv_vt(const std::string& plan) { return plan.rfind("kv-vt", 0) == 0; }

// The plans take decode_kv_vt_kernel where they should (Qwen3-Next heads, B = 1, T = 1 and 4, fp32
// and bf16):
// - under the kv_vt. ctest prefix (GDN_CUDA_KV_VT=2, tests/CMakeLists.txt), forced: decode at
//   every shape here (the small 16-bit tiles too) and the fused step where it stores the state
//   from registers (fp32), so that the prefix's tests run it rather than a fallback;
// - without knobs, the measured rule (kv_vt_pays, plan_fused_kv_vt; src/cuda/decode_cuda.cu):
//   decode at every shape here too, the fused step at fp32 from T = 2 only (at T = 1 the fused KV
//   tile kernel is faster).
TEST(CudaKvVt, PlansTakeIt) {
  if (std::string why = backend_unavailable(Backend::kCuda); !why.empty()) GTEST_SKIP() << why;
  const char* const mode = std::getenv("GDN_CUDA_KV_VT");
  const bool forced = mode != nullptr && std::string(mode) == "2";
  for (char** e = environ; !forced && *e != nullptr; ++e) {
    if (std::string_view(*e).rfind("GDN_CUDA_", 0) == 0)
      GTEST_SKIP() << "checks the forced plans (GDN_CUDA_KV_VT=2) or the default rule (no GDN_CUDA_ knob); "
                   << *e << " is set";
  }
  const uint64_t seed = test_seed();
  for (const int64_t T : {int64_t{1}, int64_t{4}}) {
    for (const DLDataType sd : {kFloat32, kBFloat16}) {
      SCOPED_TRACE("T = " + std::to_string(T) + (sd.bits == 32 ? " fp32" : " bf16"));
      const auto [step, fused] = kv_plans_b1(T, sd, seed);
      EXPECT_TRUE(starts_with_kv_vt(step)) << step;
      if (!forced) {
        EXPECT_EQ(starts_with_kv_vt(fused), sd.bits == 32 && T > 1) << fused;
      } else if (sd.bits == 32) {
        EXPECT_TRUE(starts_with_kv_vt(fused)) << fused;
      }
    }
  }
}
#endif

}  // namespace
}  // namespace gdn::test
