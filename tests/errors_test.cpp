// Every rejected input of SPEC section 4: the status code, a message naming the argument,
// can_implement agreeing exactly, and not one byte of o, state, inter, error_count or any
// input written. Each case edits a valid call's arguments (on the backend's device) in one
// way; storages are oversized so that a check that wrongly passed could not read out of
// bounds, only fail the "nothing written" assertion.
#include <climits>
#include <functional>
#include <string>
#include <vector>

#include "harness.h"

namespace gdn::test {
namespace {

using Mutation = std::function<void(DecodeArgs&)>;

struct ErrorCase {
  std::string name;
  Config cfg;
  Mutation mutate;
  std::string message;  // substring of the status message
  StatusCode code = StatusCode::kInvalidArgument;
};

Config base(Addressing mode = Addressing::kPool) {
  Config c;
  c.B = 2;
  c.T = 2;
  c.H = 1;
  c.HV = 2;
  c.addressing = mode;
  c.inter = InterMode::kCompact;
  c.oversize = 4;
  return c;
}

Config with(Config c, const std::function<void(Config&)>& f) {
  f(c);
  return c;
}

// A bf16 state with a rounding seed (so the seed would matter if a bad one slipped through).
Config seeded() {
  return with(base(), [](Config& c) {
    c.state_dtype = kBFloat16;
    c.rounding_seed = 11;
  });
}

Config pre() {
  return with(base(), [](Config& c) { c.gates = GateForm::kPrecomputed; });
}

DLDataType dt(uint8_t code, uint8_t bits, uint16_t lanes = 1) { return DLDataType{code, bits, lanes}; }

// The device of `v` flipped to the other kind, as a caller passing one host tensor among
// CUDA ones (or the reverse) would.
void flip_device(TensorView& v) {
  v.device = v.device.device_type == kDLCPU ? cuda_device(0) : kCpu;
}

std::vector<ErrorCase> cases() {
  std::vector<ErrorCase> e;
  const auto add = [&](std::string name, Config cfg, Mutation m, std::string msg,
                       StatusCode code = StatusCode::kInvalidArgument) {
    e.push_back({std::move(name), std::move(cfg), std::move(m), std::move(msg), code});
  };

  // Missing required tensors.
  add("MissingQ", base(), [](DecodeArgs& a) { a.q = {}; }, "q is required");
  add("MissingK", base(), [](DecodeArgs& a) { a.k = {}; }, "k is required");
  add("MissingV", base(), [](DecodeArgs& a) { a.v = {}; }, "v is required");
  add("MissingState", base(), [](DecodeArgs& a) { a.state = {}; }, "state is required");
  add("MissingO", base(), [](DecodeArgs& a) { a.o = {}; }, "o is required");
  add("NullQData", base(), [](DecodeArgs& a) { a.q.data = nullptr; }, "q has a null data pointer");

  // Ranks.
  add("QRank3", base(), [](DecodeArgs& a) { a.q.ndim = 3; }, "q must have rank 4");
  add("KRank5", base(), [](DecodeArgs& a) { a.k.ndim = 5; a.k.shape[4] = 1; a.k.strides[4] = 1; }, "k must have rank 4");
  add("VRank3", base(), [](DecodeArgs& a) { a.v.ndim = 3; }, "v must have rank 4");
  add("ORank3", base(), [](DecodeArgs& a) { a.o.ndim = 3; }, "o must have rank 4");
  add("StateRank3", base(), [](DecodeArgs& a) { a.state.ndim = 3; }, "state must have rank 4");
  add("ARank2", base(), [](DecodeArgs& a) { a.a.ndim = 2; }, "a must have rank 3");
  add("BetaRank4", pre(), [](DecodeArgs& a) { a.beta.ndim = 4; a.beta.shape[3] = 1; a.beta.strides[3] = 1; },
      "beta must have rank 3");
  add("ALogRank2", base(), [](DecodeArgs& a) { a.A_log.ndim = 2; a.A_log.shape[1] = 1; }, "A_log must have rank 1");
  add("ReadSlotsRank2", base(), [](DecodeArgs& a) { a.read_slots.ndim = 2; a.read_slots.shape[1] = 1; },
      "read_slots must have rank 1");
  add("TokenSlotsRank1", base(Addressing::kPerToken), [](DecodeArgs& a) { a.token_slots.ndim = 1; },
      "token_slots must have rank 2");
  add("InterRank4", base(), [](DecodeArgs& a) { a.inter.ndim = 4; }, "inter must have rank 5");
  add("ErrorCountRank2", base(), [](DecodeArgs& a) { a.error_count.ndim = 2; a.error_count.shape[1] = 1; },
      "error_count must have rank 1");

  // Shapes against B, T, H, HV, K, V.
  add("KBatch", base(), [](DecodeArgs& a) { a.k.shape[0] = 1; }, "k.shape[0]");
  add("KHeads", base(), [](DecodeArgs& a) { a.k.shape[2] = 2; }, "k.shape[2]");
  add("KDim", with(base(), [](Config& c) { c.K = 128; }), [](DecodeArgs& a) { a.k.shape[3] = 64; }, "k.shape[3]");
  add("VBatch", base(), [](DecodeArgs& a) { a.v.shape[0] = 1; }, "v.shape[0]");
  add("VTokens", base(), [](DecodeArgs& a) { a.v.shape[1] = 1; }, "v.shape[1]");
  add("OHeads", base(), [](DecodeArgs& a) { a.o.shape[2] = 1; }, "o.shape[2]");
  add("ODim", with(base(), [](Config& c) { c.V = 128; }), [](DecodeArgs& a) { a.o.shape[3] = 64; }, "o.shape[3]");
  add("StateHeads", base(), [](DecodeArgs& a) { a.state.shape[1] = 1; }, "state.shape[1]");
  add("StateRowsVK", with(base(), [](Config& c) { c.V = 128; }), [](DecodeArgs& a) { a.state.shape[2] = 64; },
      "state.shape[2]");
  add("StateColsVK", with(base(), [](Config& c) { c.K = 128; }), [](DecodeArgs& a) { a.state.shape[3] = 64; },
      "state.shape[3]");
  // K != V: a VK-shaped pool passed as layout KV is caught by shape.
  add("StateLayoutMismatch", with(base(), [](Config& c) { c.V = 128; }),
      [](DecodeArgs& a) { a.layout = StateLayout::kKV; }, "state.shape[2]");
  add("DenseStateSlots", base(Addressing::kDense), [](DecodeArgs& a) { a.state.shape[0] = 1; }, "state.shape[0]");
  add("AHeads", base(), [](DecodeArgs& a) { a.a.shape[2] = 1; }, "a.shape[2]");
  add("BBatch", base(), [](DecodeArgs& a) { a.b.shape[0] = 1; }, "b.shape[0]");
  add("GTokens", pre(), [](DecodeArgs& a) { a.g.shape[1] = 1; }, "g.shape[1]");
  add("BetaHeads", pre(), [](DecodeArgs& a) { a.beta.shape[2] = 1; }, "beta.shape[2]");
  add("ALogHeads", base(), [](DecodeArgs& a) { a.A_log.shape[0] = 3; }, "A_log.shape[0]");
  add("DtBiasHeads", base(), [](DecodeArgs& a) { a.dt_bias.shape[0] = 1; }, "dt_bias.shape[0]");
  add("ReadSlotsBatch", base(), [](DecodeArgs& a) { a.read_slots.shape[0] = 3; }, "read_slots.shape[0]");
  add("WriteSlotsBatch", base(Addressing::kSplit), [](DecodeArgs& a) { a.write_slots.shape[0] = 1; },
      "write_slots.shape[0]");
  add("TokenSlotsTokens", base(Addressing::kPerToken), [](DecodeArgs& a) { a.token_slots.shape[1] = 1; },
      "token_slots.shape[1]");
  add("NumAcceptedBatch", base(Addressing::kAccepted), [](DecodeArgs& a) { a.num_accepted.shape[0] = 1; },
      "num_accepted.shape[0]");
  add("InterTokens", base(), [](DecodeArgs& a) { a.inter.shape[1] = 1; }, "inter.shape[1]");
  add("InterRows", with(base(), [](Config& c) { c.V = 128; }), [](DecodeArgs& a) { a.inter.shape[3] = 64; },
      "inter.shape[3]");
  add("ErrorCountEmpty", base(), [](DecodeArgs& a) { a.error_count.shape[0] = 0; }, "error_count");
  add("ZeroTokens", base(),
      [](DecodeArgs& a) {
        for (TensorView* v : {&a.q, &a.k, &a.v, &a.o, &a.a, &a.b, &a.inter}) v->shape[1] = 0;
      },
      "(T) must be >= 1");

  // HV % H, supported K and V.
  add("HvNotMultipleOfH", with(base(), [](Config& c) { c.H = 2; c.HV = 4; }),
      [](DecodeArgs& a) { a.v.shape[2] = 3; a.o.shape[2] = 3; }, "must be a positive multiple of q.shape[2]");
  for (int64_t K : {96, 32, 512}) {
    add("UnsupportedK" + std::to_string(K), with(base(), [](Config& c) { c.K = 256; }),
        [K](DecodeArgs& a) { a.q.shape[3] = a.k.shape[3] = K; }, "q.shape[3] (K) must be 64, 128 or 256");
  }
  add("UnsupportedV96", with(base(), [](Config& c) { c.V = 128; }),
      [](DecodeArgs& a) { a.v.shape[3] = a.o.shape[3] = 96; }, "v.shape[3] (V) must be 64, 128 or 256");

  // Dtypes.
  add("QFloat64", base(), [](DecodeArgs& a) { a.q.dtype = dt(kDLFloat, 64); }, "q dtype");
  add("QVector", base(), [](DecodeArgs& a) { a.q.dtype = dt(kDLBfloat, 16, 2); }, "q dtype");
  add("KDiffersFromQ", base(), [](DecodeArgs& a) { a.k.dtype = kFloat16; }, "q, k and v must share one dtype");
  add("VInt32", base(), [](DecodeArgs& a) { a.v.dtype = kInt32; }, "v dtype");
  add("StateInt32", base(), [](DecodeArgs& a) { a.state.dtype = kInt32; }, "state dtype");
  add("StateFloat64", base(), [](DecodeArgs& a) { a.state.dtype = dt(kDLFloat, 64); }, "state dtype");
  add("OInt32", base(), [](DecodeArgs& a) { a.o.dtype = kInt32; }, "o dtype");
  add("AInt32", base(), [](DecodeArgs& a) { a.a.dtype = kInt32; }, "a dtype");
  add("BFloat64", base(), [](DecodeArgs& a) { a.b.dtype = dt(kDLFloat, 64); }, "b dtype");
  add("ALogBf16", base(), [](DecodeArgs& a) { a.A_log.dtype = kBFloat16; }, "A_log dtype must be float32");
  add("DtBiasInt32", base(), [](DecodeArgs& a) { a.dt_bias.dtype = kInt32; }, "dt_bias dtype");
  add("GBf16", pre(), [](DecodeArgs& a) { a.g.dtype = kBFloat16; }, "g dtype must be float32");
  add("BetaInt32", pre(), [](DecodeArgs& a) { a.beta.dtype = kInt32; }, "beta dtype");
  add("ReadSlotsFloat", base(), [](DecodeArgs& a) { a.read_slots.dtype = kFloat32; }, "read_slots dtype");
  add("WriteSlotsUint32", base(Addressing::kSplit), [](DecodeArgs& a) { a.write_slots.dtype = dt(kDLUInt, 32); },
      "write_slots dtype");
  add("TokenSlotsInt16", base(Addressing::kPerToken), [](DecodeArgs& a) { a.token_slots.dtype = dt(kDLInt, 16); },
      "token_slots dtype");
  add("NumAcceptedFloat", base(Addressing::kAccepted), [](DecodeArgs& a) { a.num_accepted.dtype = kFloat32; },
      "num_accepted dtype");
  add("InterDtype", base(), [](DecodeArgs& a) { a.inter.dtype = kBFloat16; }, "inter dtype must match");
  add("ErrorCountInt64", base(), [](DecodeArgs& a) { a.error_count.dtype = kInt64; }, "error_count dtype");
  add("ErrorCountFloat", base(), [](DecodeArgs& a) { a.error_count.dtype = kFloat32; }, "error_count dtype");

  // Innermost strides.
  add("OInnerStride", base(), [](DecodeArgs& a) { a.o.strides[3] = 2; }, "o.stride[3] must be 1");
  // A KV-stored pool (K == V) passed as VK through transposed strides: SPEC's own example.
  add("StateTransposedVK", base(),
      [](DecodeArgs& a) { std::swap(a.state.strides[2], a.state.strides[3]); },
      "state.stride[3] must be 1 for layout VK, got 64");
  add("StateTransposedKV", with(base(), [](Config& c) { c.layout = StateLayout::kKV; }),
      [](DecodeArgs& a) { std::swap(a.state.strides[2], a.state.strides[3]); },
      "state.stride[3] must be 1 for layout KV, got 64");
  add("InterInnerStride", base(), [](DecodeArgs& a) { a.inter.strides[4] = 2; }, "inter.stride[4] must be 1");

  // Gate forms.
  add("BothGateForms", base(),
      [](DecodeArgs& a) {
        a.g = a.a;
        a.g.dtype = kFloat32;
        a.beta = a.b;
      },
      "not both");
  add("NoGates", base(),
      [](DecodeArgs& a) { a.a = a.b = a.A_log = a.dt_bias = {}; }, "gates are required");
  add("RawWithoutB", base(), [](DecodeArgs& a) { a.b = {}; }, "b is required");
  add("RawWithoutALog", base(), [](DecodeArgs& a) { a.A_log = {}; }, "A_log is required");
  add("RawWithoutDtBias", base(), [](DecodeArgs& a) { a.dt_bias = {}; }, "dt_bias is required");
  add("PrecomputedWithoutBeta", pre(), [](DecodeArgs& a) { a.beta = {}; }, "beta is required");
  add("PrecomputedWithoutG", pre(), [](DecodeArgs& a) { a.g = {}; }, "g is required");

  // Addressing combinations.
  add("WriteSlotsWithTokenSlots", base(Addressing::kPerToken), [](DecodeArgs& a) { a.write_slots = a.read_slots; },
      "write_slots cannot be combined with token_slots");
  add("NumAcceptedWithoutTokenSlots", base(), [](DecodeArgs& a) { a.num_accepted = a.read_slots; },
      "num_accepted needs token_slots");
  add("WriteSlotsWithoutReadSlots", base(Addressing::kSplit), [](DecodeArgs& a) { a.read_slots = {}; },
      "write_slots needs read_slots");
  add("NumAcceptedWithReadSlots", base(Addressing::kAccepted),
      [](DecodeArgs& a) { a.read_slots = a.num_accepted; }, "num_accepted cannot be combined with read_slots");

  // Outputs overlapping the state (the backends read the state while writing them).
  add("OAliasesState", base(), [](DecodeArgs& a) { a.o.data = a.state.data; }, "o must not overlap state");
  add("OOverlapsStateTail", base(),
      [](DecodeArgs& a) {
        const int64_t last = (a.state.shape[0] - 1) * a.state.strides[0];  // start of the last slot
        a.o.data = static_cast<float*>(a.state.data) + last + 100;
      },
      "o must not overlap state");
  add("InterOverlapsState", base(),
      [](DecodeArgs& a) { a.inter.data = static_cast<float*>(a.state.data) + 3 * 4096 + 1; },
      "state must not overlap inter");

  // Devices.
  add("QOnOtherDevice", base(), [](DecodeArgs& a) { flip_device(a.q); }, "q must be on the state's device");
  add("ReadSlotsOnOtherDevice", base(), [](DecodeArgs& a) { flip_device(a.read_slots); },
      "read_slots must be on the state's device");
  add("ErrorCountOnOtherDevice", base(), [](DecodeArgs& a) { flip_device(a.error_count); },
      "error_count must be on the state's device");
  add("InterOnOtherDevice", base(), [](DecodeArgs& a) { flip_device(a.inter); }, "inter must be on the state's device");
  add("StateOnUnsupportedDevice", base(),
      [](DecodeArgs& a) {
        for (int i = 0; i < kNumArgs; ++i) {
          TensorView& v = arg_view(a, static_cast<Arg>(i));
          if (v.defined()) v.device = DLDevice{kDLVulkan, 0};
        }
      },
      "state must be on a CPU");

  // Stochastic rounding's seed: int64 [1] on the state's device, read-only.
  add("RoundingSeedInt32", seeded(), [](DecodeArgs& a) { a.rounding_seed.dtype = kInt32; },
      "rounding_seed dtype must be int64");
  add("RoundingSeedFloat64", seeded(), [](DecodeArgs& a) { a.rounding_seed.dtype = dt(kDLFloat, 64); },
      "rounding_seed dtype must be int64");
  add("RoundingSeedTwoElements", seeded(), [](DecodeArgs& a) { a.rounding_seed.shape[0] = 2; },
      "rounding_seed must hold exactly one element");
  add("RoundingSeedEmpty", seeded(), [](DecodeArgs& a) { a.rounding_seed.shape[0] = 0; },
      "rounding_seed must hold exactly one element");
  add("RoundingSeedRank2", seeded(),
      [](DecodeArgs& a) {
        a.rounding_seed.ndim = 2;
        a.rounding_seed.shape[1] = 1;
        a.rounding_seed.strides[1] = 1;
      },
      "rounding_seed must have rank 1");
  add("RoundingSeedOnOtherDevice", seeded(), [](DecodeArgs& a) { flip_device(a.rounding_seed); },
      "rounding_seed must be on the state's device");
  add("RoundingSeedMisaligned", seeded(),
      [](DecodeArgs& a) { a.rounding_seed.data = static_cast<char*>(a.rounding_seed.data) + 4; },
      "rounding_seed data pointer must be aligned");
  add("RoundingSeedInsideState", seeded(),
      [](DecodeArgs& a) { a.rounding_seed.data = static_cast<uint16_t*>(a.state.data) + 4096; },
      "state must not overlap rounding_seed");

  // Options.
  add("ScaleNaN", base(), [](DecodeArgs& a) { a.scale = NAN; }, "scale must be finite");
  add("ScaleInf", base(), [](DecodeArgs& a) { a.scale = -INFINITY; }, "scale must be finite");
  add("BadLayout", base(), [](DecodeArgs& a) { a.layout = static_cast<StateLayout>(7); }, "layout");
  add("MissingLayout", base(), [](DecodeArgs& a) { a.layout.reset(); }, "layout is required");
  add("NegativeB", base(), [](DecodeArgs& a) { a.q.shape[0] = -1; }, "q.shape[0] (B) must be >= 0");

  // Alignment and representable sizes.
  add("QMisaligned", base(), [](DecodeArgs& a) { a.q.data = static_cast<char*>(a.q.data) + 1; },
      "q data pointer must be aligned to its element size");
  add("StateMisaligned", base(), [](DecodeArgs& a) { a.state.data = static_cast<char*>(a.state.data) + 2; },
      "state data pointer must be aligned");
  add("ErrorCountMisaligned", base(),
      [](DecodeArgs& a) { a.error_count.data = static_cast<char*>(a.error_count.data) + 1; },
      "error_count data pointer must be aligned");
  add("HugeStrideOverflows", base(), [](DecodeArgs& a) { a.q.strides[0] = INT64_MAX / 2; },
      "reaches outside the address space");
  add("HugeNegativeStrideOverflows", base(), [](DecodeArgs& a) { a.k.strides[1] = INT64_MIN + 1; },
      "reaches outside the address space");

  // Every written tensor against every other tensor of the call, and against itself.
  // The smaller view is moved inside the larger one's storage, so that no other tensor is hit.
  add("OOverlapsQ", base(), [](DecodeArgs& a) { a.q.data = static_cast<float*>(a.o.data) + 1; },
      "o must not overlap q");
  add("OOverlapsGate", base(), [](DecodeArgs& a) { a.b.data = static_cast<float*>(a.o.data) + 7; },
      "o must not overlap b");
  add("OOverlapsBeta", pre(), [](DecodeArgs& a) { a.beta.data = static_cast<float*>(a.o.data) + 9; },
      "o must not overlap beta");
  add("InterOverlapsO", base(), [](DecodeArgs& a) { a.o.data = static_cast<float*>(a.inter.data) + 64; },
      "o must not overlap inter");
  add("InterOverlapsK", base(), [](DecodeArgs& a) { a.k.data = static_cast<float*>(a.inter.data) + 3; },
      "inter must not overlap k");
  add("ErrorCountInsideO", base(),
      [](DecodeArgs& a) { a.error_count.data = static_cast<float*>(a.o.data) + 5; },
      "o must not overlap error_count");
  add("ErrorCountInsideState", base(),
      [](DecodeArgs& a) { a.error_count.data = static_cast<float*>(a.state.data) + 4097; },
      "state must not overlap error_count");
  add("ReadSlotsInsideO", base(), [](DecodeArgs& a) { a.read_slots.data = static_cast<float*>(a.o.data) + 2; },
      "o must not overlap read_slots");
  add("TokenSlotsInsideInter", base(Addressing::kPerToken),
      [](DecodeArgs& a) { a.token_slots.data = a.inter.data; }, "inter must not overlap token_slots");
  add("OOverlapsItself", base(), [](DecodeArgs& a) { a.o.strides[2] = 0; }, "o must not overlap itself");
  add("InterRowsOverlap", base(), [](DecodeArgs& a) { a.inter.strides[3] = 3; }, "inter must not overlap itself");
  add("StateSlotsAlias", base(), [](DecodeArgs& a) { a.state.strides[0] = 0; }, "state must not overlap itself");
  // A read-only state may alias its slots, but a written tensor still may not overlap it.
  add("OOverlapsReadOnlyState", with(base(), [](Config& c) { c.update_state = false; }),
      [](DecodeArgs& a) { a.o.data = static_cast<float*>(a.state.data) + 64; }, "o must not overlap state");
  return e;
}

struct ErrorParam {
  Backend backend;
  ErrorCase c;
};

void PrintTo(const ErrorParam& p, std::ostream* os) { *os << backend_name(p.backend) << " " << p.c.name; }

std::vector<ErrorParam> params(Backend b) {
  std::vector<ErrorParam> p;
  for (auto& c : cases()) p.push_back({b, c});
  return p;
}

class Rejects : public ::testing::TestWithParam<ErrorParam> {
 protected:
  void SetUp() override {
    if (std::string why = backend_unavailable(GetParam().backend); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(Rejects, WithStatusMessageAndNoWrites) {
  const ErrorParam& p = GetParam();
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  const Case before = make_case(p.c.cfg, seed);
  // The unmodified call is valid, so the one edit is what gets rejected.
  ASSERT_TRUE(can_implement(before.args()).ok()) << can_implement(before.args()).message();
  Case got = before.clone();
  Status checked;
  const Status st = run_decode(p.backend, got, p.c.mutate, &checked);
  EXPECT_EQ(st.code(), p.c.code) << "message: " << st.message();
  EXPECT_NE(st.message().find(p.c.message), std::string::npos)
      << "message \"" << st.message() << "\" lacks \"" << p.c.message << "\"";
  EXPECT_EQ(checked.code(), st.code()) << "can_implement: " << checked.message();
  EXPECT_EQ(checked.message(), st.message());
  EXPECT_TRUE(same_bits(before, got)) << "a rejected call wrote memory";
}

std::string name(const ::testing::TestParamInfo<ErrorParam>& info) { return info.param.c.name; }

INSTANTIATE_TEST_SUITE_P(Cpu, Rejects, ::testing::ValuesIn(params(Backend::kCpu)), name);
#if defined(GDN_WITH_CUDA)
INSTANTIATE_TEST_SUITE_P(Cuda, Rejects, ::testing::ValuesIn(params(Backend::kCuda)), name);

// A view on a second CUDA device among views on the first.
TEST(CudaRejects, ViewOnAnotherGpu) {
  if (std::string why = backend_unavailable(Backend::kCuda); !why.empty()) GTEST_SKIP() << why;
  const Case before = make_case(base(), test_seed());
  Case got = before.clone();
  Status checked;
  const Status st = run_decode(Backend::kCuda, got, [](DecodeArgs& a) { a.q.device = cuda_device(1); }, &checked);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("q must be on the state's device"), std::string::npos) << st.message();
  EXPECT_EQ(checked.message(), st.message());
  EXPECT_TRUE(same_bits(before, got));
}
#endif

}  // namespace
}  // namespace gdn::test
