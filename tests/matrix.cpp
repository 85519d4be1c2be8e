// The configuration matrix of SPEC section 6, as a covering array (covering.h): every pair of
// levels of any two factors (B, T, heads, K, V, layout, dtypes, gate form, l2norm, scale,
// addressing, padding, intermediate cache, strides, update_state) appears in at least one case.
#include <array>
#include <cstdio>
#include <set>
#include <vector>

#include "covering.h"
#include "harness.h"

namespace gdn::test {
namespace {

enum Factor : int {
  kFB, kFT, kFHeads, kFK, kFV, kFLayout, kFStateDtype, kFInputDtype, kFOutDtype, kFGates,
  kFGateDtype, kFL2norm, kFScale, kFAddressing, kFPadding, kFInter, kFStrides, kFUpdate, kNumFactors
};

constexpr std::array<int, kNumFactors> kLevels = {3, 5, 4, 3, 3, 2, 3, 3, 3, 2, 3, 2, 2, 7, 2, 3, 3, 2};
constexpr int64_t kBs[] = {1, 3, 64};
constexpr int64_t kTs[] = {1, 2, 4, 8, 16};
constexpr int64_t kHs[][2] = {{1, 1}, {1, 2}, {1, 4}, {16, 32}};
constexpr int64_t kDims[] = {64, 128, 256};
const DLDataType kFloats[] = {kFloat32, kBFloat16, kFloat16};
const DLDataType kInputs[] = {kBFloat16, kFloat16, kFloat32};
// Addressing levels, each with its slot index dtype.
const std::pair<Addressing, DLDataType> kAddr[] = {
    {Addressing::kDense, kInt32},    {Addressing::kPool, kInt32},     {Addressing::kPool, kInt64},
    {Addressing::kSplit, kInt64},    {Addressing::kPerToken, kInt32}, {Addressing::kPerTokenFromFirst, kInt64},
    {Addressing::kAccepted, kInt32}};

// Budget per case, in state elements: B*T*HV*K*V (oracle work) and the pool size. Keeps
// the whole CPU matrix within tens of seconds on two cores.
constexpr int64_t kMaxWork = int64_t{1} << 23;
constexpr int64_t kMaxPool = int64_t{1} << 23;

using Assignment = std::vector<int>;  // -1: not chosen yet

bool feasible(const Assignment& a) {
  const bool pad = a[kFPadding] == 1;
  if (pad && a[kFAddressing] == 0) return false;  // dense rows cannot be padding
  if (pad && a[kFB] == 0) return false;           // a padded batch needs rows besides the padding
  const int64_t B = a[kFB] >= 0 ? kBs[a[kFB]] : (pad ? 3 : 1);
  const int64_t T = a[kFT] >= 0 ? kTs[a[kFT]] : 1;
  const int64_t HV = a[kFHeads] >= 0 ? kHs[a[kFHeads]][1] : 1;
  const int64_t K = a[kFK] >= 0 ? kDims[a[kFK]] : 64;
  const int64_t V = a[kFV] >= 0 ? kDims[a[kFV]] : 64;
  int64_t P = pad ? 4 * B + 3 : B;  // padding needs a pool
  if (a[kFAddressing] >= 0) {
    const Addressing m = kAddr[a[kFAddressing]].first;
    if (m == Addressing::kPool || m == Addressing::kSplit) P = 4 * B + 3;
    if (m == Addressing::kPerToken || m == Addressing::kPerTokenFromFirst || m == Addressing::kAccepted)
      P = 2 * B * (T + 1) + 3;
  }
  return B * T * HV * K * V <= kMaxWork && P * HV * K * V <= kMaxPool;
}

std::vector<Config> generate() {
  const std::vector<std::vector<int>> rows =
      covering_array(std::vector<int>(kLevels.begin(), kLevels.end()), feasible, 20261122);
  std::vector<Config> out;
  for (const Assignment& a : rows) {
    Config c;
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
    c.gate_dtype = kFloats[a[kFGateDtype]];
    c.l2norm = a[kFL2norm] == 0;
    if (a[kFScale] == 1) c.scale = 0.37f;
    c.addressing = kAddr[a[kFAddressing]].first;
    c.slot_dtype = kAddr[a[kFAddressing]].second;
    c.padding = a[kFPadding] == 1;
    c.inter = static_cast<InterMode>(a[kFInter]);
    c.strides = static_cast<StrideMode>(a[kFStrides]);
    c.update_state = a[kFUpdate] == 0;
    out.push_back(c);
  }
  return out;
}

struct MatrixParam {
  Backend backend;
  Config cfg;
  int index;
};

void PrintTo(const MatrixParam& p, std::ostream* os) { *os << backend_name(p.backend) << " " << p.cfg.name(); }

std::vector<MatrixParam> params(Backend b) {
  static const std::vector<Config> configs = generate();
  std::vector<MatrixParam> p;
  for (size_t i = 0; i < configs.size(); ++i) p.push_back({b, configs[i], static_cast<int>(i)});
  return p;
}

std::string param_name(const ::testing::TestParamInfo<MatrixParam>& info) {
  char idx[8];
  std::snprintf(idx, sizeof idx, "c%02d_", info.param.index);
  return idx + info.param.cfg.name();
}

class Matrix : public ::testing::TestWithParam<MatrixParam> {
 protected:
  void SetUp() override {
    if (std::string why = backend_unavailable(GetParam().backend); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(Matrix, MatchesOracle) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed) + " config=" + GetParam().cfg.name());
  const Case before = make_case(GetParam().cfg, seed);
  run_and_compare(GetParam().backend, before);
}

INSTANTIATE_TEST_SUITE_P(Cpu, Matrix, ::testing::ValuesIn(params(Backend::kCpu)), param_name);
#if defined(GDN_WITH_CUDA)
INSTANTIATE_TEST_SUITE_P(Cuda, Matrix, ::testing::ValuesIn(params(Backend::kCuda)), param_name);
#endif

// The generator's promise, checked: every level of every factor is used and the budget holds.
TEST(MatrixCoverage, EveryLevelAppearsAndBudgetHolds) {
  const auto ps = params(Backend::kCpu);
  std::set<int64_t> Bs, Ts, Ks, Vs;
  std::set<std::string> modes;
  for (const auto& p : ps) {
    Bs.insert(p.cfg.B);
    Ts.insert(p.cfg.T);
    Ks.insert(p.cfg.K);
    Vs.insert(p.cfg.V);
    EXPECT_LE(p.cfg.B * p.cfg.T * p.cfg.HV * p.cfg.K * p.cfg.V, kMaxWork) << p.cfg.name();
  }
  EXPECT_EQ(Bs.size(), 3u);
  EXPECT_EQ(Ts.size(), 5u);
  EXPECT_EQ(Ks.size(), 3u);
  EXPECT_EQ(Vs.size(), 3u);
  EXPECT_LT(ps.size(), 80u) << "the covering array grew; check the suite's run time";
}

}  // namespace
}  // namespace gdn::test
