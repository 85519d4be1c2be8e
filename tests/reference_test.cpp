// The oracle itself, checked against numbers worked out by hand (K = V = 64 with only a 2x2
// corner nonzero, so the arithmetic fits in a comment) and against invariants that do not
// need a second implementation. Every backend test trusts the oracle; this is why it can.
#include <array>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest-spi.h>

#include "compare.h"
#include "gdn_reference.h"
#include "harness.h"
#include "host_dtype.h"
#include "rounding.h"

namespace gdn::test {
namespace {

void zero(const HostTensor& t) {
  if (t.defined()) t.for_each([&](const int64_t* i) { t.set(i, 0.0); });
}

// One row, one head, K = V = 64, fp32 everywhere, dense state; all tensors zero.
Case tiny_case(int64_t T, GateForm gates, StateLayout layout, bool l2norm, bool inter) {
  Config cfg;
  cfg.B = 1;
  cfg.T = T;
  cfg.H = cfg.HV = 1;
  cfg.input_dtype = kFloat32;
  cfg.gate_dtype = kFloat32;
  cfg.gates = gates;
  cfg.layout = layout;
  cfg.l2norm = l2norm;
  cfg.normalize_keys_without_l2norm = false;
  cfg.inter = inter ? InterMode::kCompact : InterMode::kNone;
  Case c = make_case(cfg, 1);
  for (Arg a : {Arg::kQ, Arg::kK, Arg::kV, Arg::kA, Arg::kB, Arg::kALog, Arg::kDtBias, Arg::kG, Arg::kBeta,
                Arg::kState})
    zero(c[a]);
  return c;
}

// Math element (value row r, key c) of the state, whatever the layout.
double state_at(const Case& c, int64_t slot, int64_t r, int64_t col) {
  return c.cfg.layout == StateLayout::kVK ? c[Arg::kState].get({slot, 0, r, col})
                                          : c[Arg::kState].get({slot, 0, col, r});
}
void set_state(Case& c, int64_t slot, int64_t r, int64_t col, double x) {
  if (c.cfg.layout == StateLayout::kVK)
    c[Arg::kState].set({slot, 0, r, col}, x);
  else
    c[Arg::kState].set({slot, 0, col, r}, x);
}
double inter_at(const Case& c, int64_t t, int64_t r, int64_t col) {
  return c.cfg.layout == StateLayout::kVK ? c[Arg::kInter].get({0, t, 0, r, col})
                                          : c[Arg::kInter].get({0, t, 0, col, r});
}

void expect_near_rel(double got, double want, const std::string& what) {
  EXPECT_NEAR(got, want, 1e-6 * std::fabs(want) + 1e-7) << what;
}

// Gates for all tokens: decay 1/2 and beta 1/2, in either form.
//   raw: x = a + dt_bias = 0.25 - 0.25 = 0, softplus(0) = log 2, g = exp(-exp(0) * log 2) = 1/2;
//        beta = sigmoid(0) = 1/2.
//   precomputed: g = log(1/2) (rounded to fp32), beta = 1/2.
void half_gates(Case& c) {
  for (int64_t t = 0; t < c.cfg.T; ++t) {
    if (c.cfg.gates == GateForm::kRaw) {
      c[Arg::kA].set({0, t, 0}, 0.25);
      c[Arg::kB].set({0, t, 0}, 0.0);
    } else {
      c[Arg::kG].set({0, t, 0}, std::log(0.5));
      c[Arg::kBeta].set({0, t, 0}, 0.5);
    }
  }
  if (c.cfg.gates == GateForm::kRaw) {
    c[Arg::kALog].set({0}, 0.0);
    c[Arg::kDtBias].set({0}, -0.25);
  }
}

// S = [[1, 2], [3, 4]] (rows are value rows), decay 1/2, beta 1/2, no l2norm, scale 1.
// Token 0: q = (1, 1), k = (1, 0), v = (1, 2).
//   row 0: h = (0.5, 1); delta = 0.5 * (1 - 0.5) = 0.25; h = (0.75, 1); o = 1.75
//   row 1: h = (1.5, 2); delta = 0.5 * (2 - 1.5) = 0.25; h = (1.75, 2); o = 3.75
// Token 1: q = (1, -1), k = (0, 1), v = (-1, 0.5).
//   row 0: h = (0.375, 0.5); delta = 0.5 * (-1 - 0.5) = -0.75; h = (0.375, -0.25); o = 0.625
//   row 1: h = (0.875, 1); delta = 0.5 * (0.5 - 1) = -0.25; h = (0.875, 0.75); o = 0.125
// Every other value row stays zero, so its outputs are exactly zero.
TEST(Oracle, HandComputedTwoTokens) {
  for (GateForm gates : {GateForm::kRaw, GateForm::kPrecomputed}) {
    for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
      SCOPED_TRACE(std::string(gates == GateForm::kRaw ? "raw" : "precomputed") +
                   (layout == StateLayout::kVK ? " VK" : " KV"));
      Case c = tiny_case(2, gates, layout, false, true);
      c.cfg.scale = 1.0f;
      half_gates(c);
      set_state(c, 0, 0, 0, 1);
      set_state(c, 0, 0, 1, 2);
      set_state(c, 0, 1, 0, 3);
      set_state(c, 0, 1, 1, 4);
      const HostTensor &q = c[Arg::kQ], &k = c[Arg::kK], &v = c[Arg::kV];
      q.set({0, 0, 0, 0}, 1), q.set({0, 0, 0, 1}, 1), k.set({0, 0, 0, 0}, 1);
      v.set({0, 0, 0, 0}, 1), v.set({0, 0, 0, 1}, 2);
      q.set({0, 1, 0, 0}, 1), q.set({0, 1, 0, 1}, -1), k.set({0, 1, 0, 1}, 1);
      v.set({0, 1, 0, 0}, -1), v.set({0, 1, 0, 1}, 0.5);
      const Case before = c.clone();
      ASSERT_TRUE(reference::decode(c.args()).ok());

      const HostTensor& o = c[Arg::kO];
      expect_near_rel(o.get({0, 0, 0, 0}), 1.75, "o[t=0, r=0]");
      expect_near_rel(o.get({0, 0, 0, 1}), 3.75, "o[t=0, r=1]");
      expect_near_rel(o.get({0, 1, 0, 0}), 0.625, "o[t=1, r=0]");
      expect_near_rel(o.get({0, 1, 0, 1}), 0.125, "o[t=1, r=1]");
      for (int64_t t = 0; t < 2; ++t)
        for (int64_t r = 2; r < 64; ++r) ASSERT_EQ(o.get({0, t, 0, r}), 0.0) << "t=" << t << " r=" << r;
      const double s0[2][2] = {{0.75, 1}, {1.75, 2}}, s1[2][2] = {{0.375, -0.25}, {0.875, 0.75}};
      for (int r = 0; r < 2; ++r)
        for (int col = 0; col < 2; ++col) {
          expect_near_rel(inter_at(c, 0, r, col), s0[r][col], "inter t=0");
          expect_near_rel(inter_at(c, 1, r, col), s1[r][col], "inter t=1");
          expect_near_rel(state_at(c, 0, r, col), s1[r][col], "final state");
        }
      EXPECT_EQ(state_at(c, 0, 5, 7), 0.0);
      expect_oracle_consistent(before, c);
    }
  }
}

// S = [[1, 2], [3, 4]], k = (3, 4), q = (0, 5), v = (1, -1), decay 1 (g = 0), beta 1,
// l2norm on, default scale 1/sqrt(64) = 1/8 (the 1e-6 epsilon moves nothing at 1e-6):
//   kh = (0.6, 0.8), qh = (0, 1) / 8
//   row 0: h = (1, 2); h.kh = 2.2; delta = 1 - 2.2 = -1.2; h = (0.28, 1.04); o = 0.13
//   row 1: h = (3, 4); h.kh = 5; delta = -1 - 5 = -6; h = (-0.6, -0.8); o = -0.1
// With beta 1 the update is a projection: h.kh equals v afterwards.
TEST(Oracle, HandComputedL2NormAndDefaultScale) {
  Case c = tiny_case(1, GateForm::kPrecomputed, StateLayout::kVK, true, false);
  c[Arg::kBeta].set({0, 0, 0}, 1.0);
  set_state(c, 0, 0, 0, 1);
  set_state(c, 0, 0, 1, 2);
  set_state(c, 0, 1, 0, 3);
  set_state(c, 0, 1, 1, 4);
  c[Arg::kK].set({0, 0, 0, 0}, 3), c[Arg::kK].set({0, 0, 0, 1}, 4);
  c[Arg::kQ].set({0, 0, 0, 1}, 5);
  c[Arg::kV].set({0, 0, 0, 0}, 1), c[Arg::kV].set({0, 0, 0, 1}, -1);
  ASSERT_TRUE(reference::decode(c.args()).ok());
  expect_near_rel(c[Arg::kO].get({0, 0, 0, 0}), 0.13, "o[r=0]");
  expect_near_rel(c[Arg::kO].get({0, 0, 0, 1}), -0.1, "o[r=1]");
  expect_near_rel(state_at(c, 0, 0, 0), 0.28, "S[0, 0]");
  expect_near_rel(state_at(c, 0, 0, 1), 1.04, "S[0, 1]");
  expect_near_rel(state_at(c, 0, 1, 0), -0.6, "S[1, 0]");
  expect_near_rel(state_at(c, 0, 1, 1), -0.8, "S[1, 1]");
}

// softplus(1000) = 1000, and with A_log = log(1e-3) the decay is exp(-1e-3 * 1000) = 1/e.
// beta = sigmoid(b) with b = log(3): 3/4. S row 0 = (2, 0), k = (0, 1) orthogonal, v = 0:
//   h = (2/e, 0); delta = 0.75 * (0 - 0) = 0; o = h.q = 2/e with q = (1, 0), scale 1.
TEST(Oracle, SoftplusThresholdAndSigmoid) {
  Case c = tiny_case(1, GateForm::kRaw, StateLayout::kVK, false, false);
  c.cfg.scale = 1.0f;
  c[Arg::kA].set({0, 0, 0}, 1000.0);
  c[Arg::kALog].set({0}, std::log(1e-3));
  c[Arg::kB].set({0, 0, 0}, std::log(3.0));
  set_state(c, 0, 0, 0, 2);
  c[Arg::kK].set({0, 0, 0, 1}, 1);
  c[Arg::kQ].set({0, 0, 0, 0}, 1);
  // Row 1 shows beta: S row 1 = 0 and v = 4, so delta = 0.75 * 4 = 3 and h = 3 * k = (0, 3).
  c[Arg::kV].set({0, 0, 0, 1}, 4);
  ASSERT_TRUE(reference::decode(c.args()).ok());
  expect_near_rel(c[Arg::kO].get({0, 0, 0, 0}), 2.0 / std::exp(1.0), "o[r=0] = 2/e");
  expect_near_rel(state_at(c, 0, 1, 1), 3.0, "S[1, 1] = beta * v");
  ASSERT_TRUE(std::isfinite(c[Arg::kO].get({0, 0, 0, 1})));
}

// GVA: value head hv uses q/k head hv / (HV / H). With H = 2, HV = 4 and q of head 1 zero
// (l2norm maps zero to zero), value heads 2 and 3 output exactly zero, heads 0 and 1 do not.
TEST(Oracle, GroupedValueHeadsShareQkHeads) {
  Config cfg;
  cfg.B = 2;
  cfg.T = 2;
  cfg.H = 2;
  cfg.HV = 4;
  cfg.out_dtype = kFloat32;
  Case c = make_case(cfg, 7);
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t t = 0; t < 2; ++t)
      for (int64_t i = 0; i < 64; ++i) c[Arg::kQ].set({n, t, 1, i}, 0.0);
  ASSERT_TRUE(reference::decode(c.args()).ok());
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t t = 0; t < 2; ++t)
      for (int64_t hv = 0; hv < 4; ++hv) {
        double ss = 0;
        for (int64_t r = 0; r < 64; ++r) ss += std::pow(c[Arg::kO].get({n, t, hv, r}), 2);
        if (hv < 2)
          EXPECT_GT(ss, 0.0) << "n=" << n << " t=" << t << " hv=" << hv;
        else
          EXPECT_EQ(ss, 0.0) << "n=" << n << " t=" << t << " hv=" << hv;
      }
}

// Tokens carry the state: one call with T = 2 equals two calls with T = 1 (fp32 state; the
// only difference is the fp32 rounding of the state between the calls).
TEST(Oracle, TwoTokensEqualTwoCalls) {
  Config cfg;
  cfg.B = 2;
  cfg.T = 2;
  cfg.HV = 2;
  cfg.input_dtype = kFloat32;
  Case both = make_case(cfg, 11);
  Config one_cfg = cfg;
  one_cfg.T = 1;
  Case first = make_case(one_cfg, 12), second = make_case(one_cfg, 13);
  // Copy token t of `both` into the single-token cases, and the initial state.
  for (Case* c : {&first, &second}) {
    const int64_t t = c == &first ? 0 : 1;
    for (Arg a : {Arg::kQ, Arg::kK, Arg::kV, Arg::kA, Arg::kB}) {
      const HostTensor &src = both[a], &dst = (*c)[a];
      dst.for_each([&](const int64_t* i) {
        int64_t j[4] = {i[0], t, i[2], dst.ndim() > 3 ? i[3] : 0};
        dst.set(i, src.get(j));
      });
    }
    for (Arg a : {Arg::kALog, Arg::kDtBias})
      (*c)[a].for_each([&](const int64_t* i) { (*c)[a].set(i, both[a].get(i)); });
  }
  first[Arg::kState].for_each([&](const int64_t* i) { first[Arg::kState].set(i, both[Arg::kState].get(i)); });
  ASSERT_TRUE(reference::decode(both.args()).ok());
  ASSERT_TRUE(reference::decode(first.args()).ok());
  second[Arg::kState].for_each([&](const int64_t* i) { second[Arg::kState].set(i, first[Arg::kState].get(i)); });
  ASSERT_TRUE(reference::decode(second.args()).ok());
  double num = 0, den = 0;
  both[Arg::kO].for_each([&](const int64_t* i) {
    if (i[1] != 1) return;
    const int64_t j[4] = {i[0], 0, i[2], i[3]};
    const double d = both[Arg::kO].get(i) - second[Arg::kO].get(j);
    num += d * d;
    den += std::pow(both[Arg::kO].get(i), 2);
  });
  EXPECT_LE(std::sqrt(num / den), 1e-6);
  EXPECT_GT(den, 0.0);
}

// Stochastic rounding in the oracle, against src/rounding.h applied here: with beta = 0 the
// step is S <- g * S in float64 (delta = 0), so the stored element e of head hv after token t
// of row n must be sr(fp32(g_t ... g_0 S), bits(seed, the row's read slot, hv, t, e)) with e in
// the head's storage order, in the pool and in inter. Pool slots are read by rows other than
// their own index, so a key taken from the batch position shows.
TEST(Oracle, StochasticRoundingFollowsTheRule) {
  for (DLDataType sd : {kBFloat16, kFloat16})
    for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
      SCOPED_TRACE(dtype_name(sd) + (layout == StateLayout::kVK ? " VK" : " KV"));
      Config cfg;
      cfg.B = 3;
      cfg.T = 2;
      cfg.HV = 2;
      cfg.V = 128;
      cfg.layout = layout;
      cfg.state_dtype = sd;
      cfg.gates = GateForm::kPrecomputed;
      cfg.addressing = Addressing::kPool;
      cfg.inter = InterMode::kStrided;
      cfg.rounding_seed = -987654321;
      Case c = make_case(cfg, 21);
      zero(c[Arg::kBeta]);
      const Case before = c.clone();
      ASSERT_TRUE(reference::decode(c.args()).ok());
      const bool bf = sd.code == kDLBfloat;
      const HostTensor &st = c[Arg::kState], &in = c[Arg::kInter];
      int64_t farther = 0, total = 0;
      for (int64_t n = 0; n < cfg.B; ++n) {
        const int64_t slot = static_cast<int64_t>(c[Arg::kReadSlots].get({n}));
        ASSERT_NE(slot, n);
        for (int64_t hv = 0; hv < cfg.HV; ++hv) {
          const uint32_t head_key = detail::sr_head_key(*cfg.rounding_seed, slot, hv);
          for (int64_t i = 0; i < cfg.rows(); ++i)
            for (int64_t j = 0; j < cfg.cols(); ++j) {
              double x = before[Arg::kState].get({slot, hv, i, j});
              for (int64_t t = 0; t < cfg.T; ++t) {
                x = std::exp(c[Arg::kG].get({n, t, hv})) * x;
                const float f = static_cast<float>(x);
                const uint32_t r16 = detail::sr_elem_bits(detail::sr_token_key(head_key, t), i * cfg.cols() + j);
                const uint16_t want = bf ? detail::sr_bf16_bits(f, r16) : detail::sr_fp16_bits(f, r16, detail::float_to_fp16_bits);
                const int64_t ii[5] = {n, t, hv, i, j};
                ASSERT_EQ(in.bits(ii), want) << "inter[" << n << ", " << t << ", " << hv << "] (" << i << ", " << j << ")";
                const uint16_t rne = bf ? detail::float_to_bf16_bits(f) : detail::float_to_fp16_bits(f);
                farther += want != rne;
                ++total;
              }
              const int64_t si[4] = {slot, hv, i, j};
              ASSERT_EQ(st.bits(si), in.bits(std::array<int64_t, 5>{n, cfg.T - 1, hv, i, j}.data()));
            }
        }
      }
      // Not round-to-nearest-even in disguise: about a quarter of the elements take the farther neighbour.
      EXPECT_GT(farther, total / 8);
    }
}

// decode_exact is decode without the state's rounding: from the same fp32 state, a T = 1 call
// gives decode's o bit for bit (o is rounded once from the same float64 values) and a float64
// state that rounds to decode's fp32 state; a state of another dtype is refused.
TEST(Oracle, DecodeExactIsDecodeUnrounded) {
  Config cfg;
  cfg.B = 2;
  cfg.HV = 2;
  cfg.addressing = Addressing::kPool;
  Case c = make_case(cfg, 21);
  const HostTensor& st = c[Arg::kState];
  const std::vector<int64_t> strides = compact_strides(st.shape);
  auto at = [&](const int64_t* i) {
    int64_t off = 0;
    for (int d = 0; d < st.ndim(); ++d) off += i[d] * strides[d];
    return off;
  };
  std::vector<double> s64(st.numel());
  st.for_each([&](const int64_t* i) { s64[at(i)] = st.get(i); });
  const HostTensor o = make_tensor(c[Arg::kO].dtype, c[Arg::kO].shape);
  DecodeArgs exact = c.args();
  exact.state.data = s64.data();
  exact.state.dtype = DLDataType{kDLFloat, 64, 1};
  for (int d = 0; d < st.ndim(); ++d) exact.state.strides[d] = strides[d];
  exact.o = o.view();
  exact.error_count = TensorView();
  ASSERT_TRUE(reference::decode_exact(exact).ok());
  ASSERT_TRUE(reference::decode(c.args()).ok());
  c[Arg::kO].for_each([&](const int64_t* i) { ASSERT_EQ(c[Arg::kO].bits(i), o.bits(i)); });
  bool moved = false;
  st.for_each([&](const int64_t* i) {
    ASSERT_EQ(static_cast<float>(s64[at(i)]), st.get(i));
    moved = moved || static_cast<double>(static_cast<float>(s64[at(i)])) != s64[at(i)];
  });
  EXPECT_TRUE(moved) << "the float64 state holds no digits beyond fp32: nothing was tested";
  EXPECT_EQ(reference::decode_exact(c.args()).code(), StatusCode::kInvalidArgument);
}

// The fused oracle against the definition written the way transformers writes it: the conv
// as conv1d (no padding) over cat([conv_state, x]) keeping the last T outputs, SiLU, the split,
// then the decode oracle on those q, k, v (stored in fp32), then the gated RMSNorm; and the conv
// state afterwards = the last L columns of the cat. fp32 storage everywhere, so the only
// difference is the fp32 rounding of the conv outputs: far inside the 1e-5 bound.
TEST(Oracle, FusedIsConvThenDecodeThenGatedNorm) {
  for (int64_t W : {2, 4}) {
    for (int64_t L : {W - 1, W + 1}) {
      for (bool norm : {false, true}) {
        SCOPED_TRACE("W=" + std::to_string(W) + " L=" + std::to_string(L) + (norm ? " norm" : ""));
        Config cfg;
        cfg.fused = true;
        cfg.B = 2;
        cfg.T = 3;
        cfg.H = 1;
        cfg.HV = 2;
        cfg.addressing = Addressing::kPool;
        cfg.input_dtype = cfg.out_dtype = cfg.conv_dtype = cfg.weight_dtype = kFloat32;
        cfg.W = W;
        cfg.conv_L = L;
        cfg.conv_bias = true;
        cfg.norm = cfg.gate_z = norm;
        cfg.conv_transposed = false;
        const Case before = make_case(cfg, 7 + W + L);
        Case fused = before.clone();
        ASSERT_TRUE(run_reference(fused).ok());

        // The same call as decode on explicit conv outputs.
        Config dcfg = cfg;
        dcfg.fused = false;
        Case dec = make_case(dcfg, 99);
        const Case copy = before.clone();  // the same gates, slots and starting state
        for (Arg a : {Arg::kA, Arg::kB, Arg::kALog, Arg::kDtBias, Arg::kReadSlots, Arg::kErrorCount, Arg::kState})
          dec[a] = copy[a];
        const int64_t B = cfg.B, T = cfg.T, K = cfg.K, V = cfg.V, HV = cfg.HV, D = cfg.D();
        const HostTensor &x = before[Arg::kMixedQkv], &w = before[Arg::kConvWeight], &bias = before[Arg::kConvBias],
                         &cs = before[Arg::kConvState], &rs = before[Arg::kReadSlots];
        std::vector<double> y(B * T * D);
        for (int64_t n = 0; n < B; ++n) {
          const int64_t slot = static_cast<int64_t>(rs.get({n}));
          for (int64_t d = 0; d < D; ++d) {
            std::vector<double> cat;
            for (int64_t j = 0; j < L; ++j) cat.push_back(cs.get({slot, d, j}));
            for (int64_t t = 0; t < T; ++t) cat.push_back(x.get({n, t, d}));
            const int64_t outs = L + T - W + 1;  // conv1d without padding
            for (int64_t t = 0; t < T; ++t) {
              const int64_t i = outs - T + t;
              double acc = bias.get({d});
              for (int64_t k = 0; k < W; ++k) acc += w.get({d, k}) * cat[i + k];
              y[(n * T + t) * D + d] = acc / (1.0 + std::exp(-acc));
            }
            // The conv state afterwards: the last L columns of cat.
            for (int64_t j = 0; j < L; ++j)
              EXPECT_EQ(fused[Arg::kConvState].get({slot, d, j}), cat[T + j]) << "n " << n << " d " << d << " j " << j;
          }
        }
        for (int64_t n = 0; n < B; ++n)
          for (int64_t t = 0; t < T; ++t)
            for (int64_t i = 0; i < K; ++i) {
              dec[Arg::kQ].set({n, t, 0, i}, y[(n * T + t) * D + i]);
              dec[Arg::kK].set({n, t, 0, i}, y[(n * T + t) * D + K + i]);
            }
        for (int64_t n = 0; n < B; ++n)
          for (int64_t t = 0; t < T; ++t)
            for (int64_t hv = 0; hv < HV; ++hv)
              for (int64_t r = 0; r < V; ++r) dec[Arg::kV].set({n, t, hv, r}, y[(n * T + t) * D + 2 * K + hv * V + r]);
        ASSERT_TRUE(run_reference(dec).ok());
        std::vector<float> got, want;
        for (int64_t n = 0; n < B; ++n)
          for (int64_t t = 0; t < T; ++t)
            for (int64_t hv = 0; hv < HV; ++hv) {
              double ss = 0;
              for (int64_t r = 0; r < V; ++r) ss += std::pow(dec[Arg::kO].get({n, t, hv, r}), 2);
              for (int64_t r = 0; r < V; ++r) {
                double o = dec[Arg::kO].get({n, t, hv, r});
                if (norm) {
                  const double z = before[Arg::kZ].get({n, t, hv, r});
                  o *= before[Arg::kNormWeight].get({r}) / std::sqrt(ss / V + cfg.norm_eps) * z / (1 + std::exp(-z));
                }
                want.push_back(static_cast<float>(o));
                got.push_back(static_cast<float>(fused[Arg::kO].get({n, t, hv, r})));
              }
            }
        reference::Agreement a;
        reference::compare_vectors(got.data(), want.data(), kFloat32, B * T * HV, V, &a);
        EXPECT_TRUE(a.ok()) << a.summary() << " " << a.worst_summary();
        for (int64_t hv = 0; hv < HV; ++hv)  // the state written by both
          for (int64_t n = 0; n < B; ++n) {
            const int64_t slot = static_cast<int64_t>(rs.get({n}));
            for (int64_t r = 0; r < V; r += 17)
              EXPECT_NEAR(fused[Arg::kState].get({slot, hv, r, 5}), dec[Arg::kState].get({slot, hv, r, 5}), 1e-5);
          }
      }
    }
  }
}

// The shared rounding (src/host_dtype.h) and ulp distance (reference/compare.h) that the
// harness and the comparator rely on.
TEST(Harness, RoundToNearestEven) {
  using detail::bf16_bits_to_float, detail::float_to_bf16_bits, detail::fp16_bits_to_float,
      detail::float_to_fp16_bits;
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie to even (down)
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie to even (up)
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_EQ(float_to_fp16_bits(1.0f), 0x3c00);
  EXPECT_EQ(float_to_fp16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16_bits(65520.0f), 0x7c00);  // the tie above the largest finite rounds to inf
  EXPECT_EQ(float_to_fp16_bits(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -25)), 0x0000);  // tie to even: zero
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(3.0f, -25)), 0x0002);  // tie to even: 2
  EXPECT_EQ(float_to_fp16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even (down)
  EXPECT_EQ(float_to_fp16_bits(1.0f + std::ldexp(3.0f, -11)), 0x3c02);  // tie to even (up)
  for (uint32_t h = 0; h < 0x7c00; ++h)
    ASSERT_EQ(float_to_fp16_bits(fp16_bits_to_float(static_cast<uint16_t>(h))), h);
  for (uint32_t h = 0; h < 0x7f80; h += 7)
    ASSERT_EQ(float_to_bf16_bits(bf16_bits_to_float(static_cast<uint16_t>(h))), h);
  using reference::ulp_distance16;
  EXPECT_EQ(ulp_distance16(kBFloat16, 0x3f80, 0x3f81), 1);
  EXPECT_EQ(ulp_distance16(kBFloat16, 0x0000, 0x8000), 0);  // +0 and -0
  EXPECT_EQ(ulp_distance16(kFloat16, 0x0001, 0x8001), 2);
  EXPECT_EQ(ulp_distance16(kBFloat16, 0x7fc0, 0x7fc0), std::numeric_limits<int64_t>::max());  // NaN never passes
  EXPECT_EQ(ulp_distance16(kFloat16, 0x7e00, 0x7e00), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(ulp_distance16(kFloat16, 0x7c00, 0x7bff), 1);  // fp16 inf is not a NaN
}

// reference::compare_vectors on hand-made vectors: each bound of docs/semantics.md section 5
// and the diagnostics the tests report from.
TEST(Harness, CompareVectorsRule) {
  using reference::Agreement;
  using reference::compare_vectors;
  const auto judge = [](const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, DLDataType dt,
                        int64_t len, bool many_steps = false) {
    Agreement a;
    compare_vectors(got.data(), want.data(), dt, static_cast<int64_t>(got.size()) / len, len, &a, many_steps);
    return a;
  };
  // 4000 bf16 elements of 1.0 in 40 vectors; bits nudged by hand.
  std::vector<uint16_t> want(4000, 0x3f80), got = want;
  EXPECT_TRUE(judge(got, want, kBFloat16, 100).ok());
  got[5] += 1, got[1234] += 1, got[2000] -= 1, got[3999] += 2;  // 1 ulp three times, 2 ulp once
  EXPECT_TRUE(judge(got, want, kBFloat16, 100).ok());
  got[10] += 2, got[20] += 2;  // 3 elements over 1 ulp: 0.075% <= 0.1% (4 allowed)
  EXPECT_TRUE(judge(got, want, kBFloat16, 100).ok());
  got[30] += 2, got[40] += 2;  // 5 over 1 ulp: 0.125% > 0.1%
  Agreement a = judge(got, want, kBFloat16, 100);
  EXPECT_FALSE(a.ok());
  EXPECT_EQ(a.over_1ulp, 5);
  EXPECT_EQ(a.failing_vectors, 0);  // no single vector breaks the rule: the count does
  got = want;
  got[2345] += 3;  // one element 3 ulp away
  a = judge(got, want, kBFloat16, 100);
  EXPECT_FALSE(a.ok());
  EXPECT_EQ(a.failing_vectors, 1);
  EXPECT_EQ(a.worst.vector, 23);
  EXPECT_EQ(a.worst.element, 45);
  EXPECT_EQ(a.worst.error, 3.0);
  EXPECT_EQ(a.worst.want, 1.0);
  EXPECT_TRUE(judge(got, want, kBFloat16, 100, /*many_steps=*/true).ok());  // 3 ulp of 1.0 = 0.023, over a norm of 10
  got[2345] = 0x7fc0;  // NaN never passes, not even against NaN
  EXPECT_FALSE(judge(got, want, kBFloat16, 100, true).ok());
  want[2345] = 0x7fc0;
  a = judge(got, want, kBFloat16, 100, true);
  EXPECT_FALSE(a.ok());
  EXPECT_EQ(a.nan, 1);
  // Below 2^-12 of the tensor's RMS, elements are measured in ulps of that floor.
  want.assign(4000, 0x3f80);
  want[7] = 0x3000;  // 2^-31
  got = want;
  got[7] = 0x3010;  // 16 bf16 ulps at 2^-31, far below 1 ulp of the floor 2^-12 (ulp 2^-19)
  a = judge(got, want, kBFloat16, 100);
  EXPECT_TRUE(a.ok());
  EXPECT_EQ(a.strict_over_2ulp, 1);
  // An exactly zero oracle vector must be exactly zero, sign included.
  want.assign(200, 0x3f80);
  std::fill(want.begin(), want.begin() + 100, 0);
  got = want;
  EXPECT_TRUE(judge(got, want, kBFloat16, 100, true).ok());
  got[3] = 0x8000;
  a = judge(got, want, kBFloat16, 100, true);
  EXPECT_FALSE(a.ok());
  EXPECT_EQ(a.zero_mismatch, 1);
  // fp32: relative Frobenius 1e-5 per vector, against max(its norm, RMS vector norm / 16).
  std::vector<float> fw(64 * 3, 1.0f), fg = fw;
  std::fill(fw.begin() + 64, fw.begin() + 128, 1e-3f);  // a small vector: floor = RMS norm / 16
  fg = fw;
  fg[64] += 2e-7f;  // 2e-7 / max(8e-3, ~0.41) < 1e-5 although 2.5e-5 of its own norm
  Agreement f;
  compare_vectors(fg.data(), fw.data(), kFloat32, 3, 64, &f);
  EXPECT_TRUE(f.ok()) << f.summary();
  fg[0] += 1e-4f;  // 1.25e-5 of the first vector's norm 8
  Agreement f2;
  compare_vectors(fg.data(), fw.data(), kFloat32, 3, 64, &f2);
  EXPECT_FALSE(f2.ok());
  EXPECT_EQ(f2.failing_vectors, 1);
  EXPECT_EQ(f2.worst.vector, 0);
  EXPECT_EQ(f2.worst.element, 0);
}

// The comparators must be able to fail: a poisoned output, a perturbed state, a write to an
// unnamed slot and a wrong error count are each reported.
TEST(Harness, ComparatorsCatchWhatTheyShould) {
  Config cfg;
  cfg.B = 3;
  cfg.T = 2;
  cfg.HV = 2;
  cfg.addressing = Addressing::kPool;
  cfg.state_dtype = kBFloat16;
  cfg.out_dtype = kFloat16;
  cfg.inter = InterMode::kCompact;
  const Case before = make_case(cfg, 5);
  Case want = before.clone();
  ASSERT_TRUE(reference::decode(want.args()).ok());
  const auto failures_of = [&](const std::function<void(Case&)>& spoil) {
    Case got = want.clone();
    spoil(got);
    ::testing::TestPartResultArray results;
    {
      ::testing::ScopedFakeTestPartResultReporter reporter(
          ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
      expect_matches(before, want, got, one_call_tolerance(), "spoiled");
    }
    return results.size();
  };
  EXPECT_EQ(failures_of([](Case&) {}), 0);
  EXPECT_GT(failures_of([](Case& g) { g[Arg::kO].set({1, 1, 1, 5}, NAN); }), 0);
  EXPECT_GT(failures_of([](Case& g) { poison(g[Arg::kO]); }), 0);
  EXPECT_GT(failures_of([](Case& g) {
    const int64_t slot = static_cast<int64_t>(g[Arg::kReadSlots].get({0}));
    const int64_t i[4] = {slot, 0, 3, 3};
    g[Arg::kState].set_bits(i, g[Arg::kState].bits(i) + 3);  // 3 ulp
  }), 0);
  EXPECT_GT(failures_of([](Case& g) {
    int64_t unnamed = 0;
    while (unnamed == g[Arg::kReadSlots].get({0}) || unnamed == g[Arg::kReadSlots].get({1}) ||
           unnamed == g[Arg::kReadSlots].get({2}))
      ++unnamed;
    const int64_t i[4] = {unnamed, 1, 0, 0};
    g[Arg::kState].set_bits(i, g[Arg::kState].bits(i) ^ 1);
  }), 0);
  EXPECT_GT(failures_of([](Case& g) { g[Arg::kErrorCount].set({0}, g[Arg::kErrorCount].get({0}) + 1); }), 0);
  EXPECT_GT(failures_of([](Case& g) { g[Arg::kQ].set({0, 0, 0, 0}, 123.0); }), 0);  // inputs are read-only
  EXPECT_GT(failures_of([](Case& g) { g[Arg::kInter].set({2, 1, 1, 0, 0}, 0.0); }), 0);
}

}  // namespace
}  // namespace gdn::test
