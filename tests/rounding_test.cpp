// Stochastic rounding of 16-bit state stores (StepArgs::rounding_seed, docs/semantics.md
// section 2). First src/rounding.h itself: representable values pass unchanged, every other
// value goes to one of its two neighbours, up with probability equal to its fraction of the gap
// (checked statistically over many keys), the specials as round-to-nearest-even, and bits that
// are a function of (seed, slot, head, token, element) alone. Then the rule on every backend:
// results against the oracle run with the same seed, reproducibility, which tensors the seed
// may not touch, the key's independence of the batch position, and a decay that
// round-to-nearest-even cannot follow and stochastic rounding must.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "harness.h"
#include "host_dtype.h"
#include "rounding.h"

namespace gdn::test {
namespace {

using detail::bf16_bits_to_float;
using detail::float_to_bf16_bits;
using detail::float_to_fp16_bits;
using detail::fp16_bits_to_float;

enum class Fmt { kBf16, kFp16 };

std::string fmt_name(Fmt f) { return f == Fmt::kBf16 ? "bf16" : "fp16"; }

uint16_t sr(Fmt f, float x, uint32_t r16) {
  return f == Fmt::kBf16 ? detail::sr_bf16_bits(x, r16) : detail::sr_fp16_bits(x, r16, float_to_fp16_bits);
}
float to_float(Fmt f, uint16_t h) { return f == Fmt::kBf16 ? bf16_bits_to_float(h) : fp16_bits_to_float(h); }

float bits_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The 16 random bits of key number i of a sweep that moves every component of the key: seed,
// read slot, head, token and element.
uint32_t key_bits(uint64_t i) {
  const int64_t seed = static_cast<int64_t>(i / 8192) * 7919 - 40000;
  const int64_t slot = static_cast<int64_t>((i / 2048) % 4) * 1000 + 3;
  const int64_t hv = static_cast<int64_t>((i / 512) % 4);
  const int64_t t = static_cast<int64_t>((i / 128) % 4);
  const int64_t e = static_cast<int64_t>(i % 128) * 131;
  return detail::sr_elem_bits(detail::sr_token_key(detail::sr_head_key(seed, slot, hv), t), e);
}

// Random bits to try on values whose result must not depend on them: the extremes, the halves,
// and many drawn by the key function.
std::vector<uint32_t> some_bits() {
  std::vector<uint32_t> r = {0, 1, 0x7fff, 0x8000, 0x8001, 0xfffe, 0xffff};
  for (uint64_t i = 0; i < 200; ++i) r.push_back(key_bits(i * 977));
  return r;
}

TEST(RoundingRule, RepresentableValuesAreUnchanged) {
  const std::vector<uint32_t> bits = some_bits();
  for (Fmt f : {Fmt::kBf16, Fmt::kFp16}) {
    SCOPED_TRACE(fmt_name(f));
    int tried = 0;
    std::vector<uint32_t> values = {0x0000, 0x8000, 0x7f80, 0xff80, 0x7f7f, 0xff7f, 0x7c00, 0xfc00, 0x7bff, 0xfbff};
    for (uint32_t h = 0; h < 0x10000; h += (h < 0x500 || (h >= 0x7b00 && h < 0x7c80) ? 1 : 7)) values.push_back(h);
    for (uint32_t h : values) {
      const uint16_t x = static_cast<uint16_t>(h);
      const float v = to_float(f, x);
      if (std::isnan(v)) continue;
      ++tried;
      for (uint32_t r : bits)
        ASSERT_EQ(sr(f, v, r), x) << "value bits 0x" << std::hex << h << ", random bits 0x" << r;
    }
    EXPECT_GT(tried, 9000);  // every exponent, subnormals, zeros, the largest finite values, Inf
  }
}

// Values at fractions of the gap between two neighbours (from 2^-13 of it, the finest an fp32
// value resolves in an fp16 normal's gap), over 65536 keys: each result is one of the two, and
// the number rounded up is the fraction within a 5-sigma binomial bound (so the mean of the
// results is x). fp16 subnormals drop the bits under 2^-40: a bias below 2^-16 of the gap, far
// inside the bound.
struct Between {
  Fmt fmt;
  uint16_t lo;  // lower neighbour's bits (for negative values: the one nearer zero)
  double frac;  // x = lo + frac * (next - lo), rounded to fp32
  std::string what;
};

std::vector<Between> between_cases() {
  std::vector<Between> c;
  const double fracs[] = {1.0 / 8192, 1.0 / 16, 0.25, 1.0 / 3, 0.5, 0.7, 15.0 / 16, 1.0 - 1.0 / 8192};
  const struct { Fmt f; uint16_t lo; const char* what; } bases[] = {
      {Fmt::kBf16, 0x3fa6, "bf16 near 1.3"},
      {Fmt::kBf16, 0x1f33, "bf16 near 4e-20"},
      {Fmt::kBf16, 0x7f7e, "bf16 below its largest finite"},
      {Fmt::kBf16, 0x3f7f, "bf16 below 1 (carry into the exponent)"},
      {Fmt::kBf16, 0x0005, "bf16 subnormal"},
      {Fmt::kBf16, 0xbfa6, "bf16 negative"},
      {Fmt::kFp16, 0x3d7b, "fp16 near 1.37"},
      {Fmt::kFp16, 0x1419, "fp16 near 1e-3"},
      {Fmt::kFp16, 0x63d0, "fp16 near 1000"},
      {Fmt::kFp16, 0x0003, "fp16 subnormal 3 * 2^-24"},
      {Fmt::kFp16, 0x0234, "fp16 subnormal near 3.4e-5"},
      {Fmt::kFp16, 0x03ff, "fp16 largest subnormal, below 2^-14"},
      {Fmt::kFp16, 0x0400, "fp16 2^-14, the smallest normal"},
      {Fmt::kFp16, 0x7bfe, "fp16 below 65504"},
      {Fmt::kFp16, 0xbd7b, "fp16 negative"},
      {Fmt::kFp16, 0x8123, "fp16 negative subnormal"},
  };
  for (const auto& b : bases)
    for (double f : fracs) c.push_back({b.f, b.lo, f, b.what});
  return c;
}

TEST(RoundingRule, UnbiasedBetweenNeighbours) {
  constexpr uint64_t kKeys = 65536;
  std::vector<uint32_t> bits(kKeys);
  for (uint64_t i = 0; i < kKeys; ++i) bits[i] = key_bits(i);
  for (const Between& b : between_cases()) {
    SCOPED_TRACE(b.what + " frac " + std::to_string(b.frac));
    const uint16_t hi = static_cast<uint16_t>(b.lo + 1);  // next magnitude up, same sign
    const double vlo = to_float(b.fmt, b.lo), vhi = to_float(b.fmt, hi);
    const float x = static_cast<float>(vlo + b.frac * (vhi - vlo));
    const double f = (static_cast<double>(x) - vlo) / (vhi - vlo);  // x's own fraction, after fp32
    ASSERT_GT(f, 0.0);
    ASSERT_LT(f, 1.0);
    uint64_t up = 0;
    double sum = 0;
    for (uint32_t r : bits) {
      const uint16_t y = sr(b.fmt, x, r);
      ASSERT_TRUE(y == b.lo || y == hi) << "x = " << x << " rounded to bits 0x" << std::hex << y;
      up += y == hi;
      sum += to_float(b.fmt, y);
    }
    const double n = static_cast<double>(kKeys);
    const double bound = 5 * std::sqrt(n * f * (1 - f)) + 1;  // +1: the count is an integer
    EXPECT_NEAR(static_cast<double>(up), n * f, bound) << "rounded up " << up << " of " << kKeys;
    EXPECT_NEAR(sum / n, static_cast<double>(x), bound / n * std::fabs(vhi - vlo)) << "mean of the rounded values";
  }
}

TEST(RoundingRule, SpecialsAndFp16OverflowAsRoundToNearestEven) {
  const std::vector<uint32_t> bits = some_bits();
  const uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fbfffffu, 0xff812345u, 0x7fffffffu};
  for (uint32_t u : nans)
    for (uint32_t r : bits) {
      ASSERT_TRUE(std::isnan(bf16_bits_to_float(detail::sr_bf16_bits(bits_f(u), r)))) << std::hex << u;
      ASSERT_TRUE(std::isnan(fp16_bits_to_float(detail::sr_fp16_bits(bits_f(u), r, float_to_fp16_bits)))) << std::hex << u;
    }
  for (float inf : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()})
    for (uint32_t r : bits) {
      ASSERT_EQ(bf16_bits_to_float(detail::sr_bf16_bits(inf, r)), inf);
      ASSERT_EQ(fp16_bits_to_float(detail::sr_fp16_bits(inf, r, float_to_fp16_bits)), inf);
    }
  // fp16 from its largest finite value up: RNE keeps 65504 below 65520 and overflows from there.
  const float big[] = {65504.f, 65505.f, 65519.f, 65519.996f, 65520.f, 65536.f, 1e6f, 3e38f};
  for (float v : big)
    for (float x : {v, -v})
      for (uint32_t r : bits)
        ASSERT_EQ(detail::sr_fp16_bits(x, r, float_to_fp16_bits), float_to_fp16_bits(x)) << x;
}

// The bits are a function of (seed, read slot, head, token, element) and nothing else: a
// recomputation in another order gives them again, and changing any one component changes
// them (up to a 2^-16 chance per comparison).
TEST(RoundingRule, BitsAreAFunctionOfTheKeyAlone) {
  struct Key {
    int64_t seed, slot, hv, t, e;
  };
  std::mt19937_64 rng(test_seed());
  std::vector<Key> keys(4096);
  for (Key& k : keys)
    k = {static_cast<int64_t>(rng() >> 1), static_cast<int64_t>(rng() % 100000), static_cast<int64_t>(rng() % 64),
         static_cast<int64_t>(rng() % 16), static_cast<int64_t>(rng() % 65536)};
  const auto bits = [](const Key& k) {
    return detail::sr_elem_bits(detail::sr_token_key(detail::sr_head_key(k.seed, k.slot, k.hv), k.t), k.e);
  };
  std::vector<uint32_t> first(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) first[i] = bits(keys[i]);
  for (size_t i = keys.size(); i-- > 0;) ASSERT_EQ(bits(keys[i]), first[i]);
  int same[5] = {};
  for (size_t i = 0; i < keys.size(); ++i) {
    for (int c = 0; c < 5; ++c) {
      Key k = keys[i];
      int64_t* field[5] = {&k.seed, &k.slot, &k.hv, &k.t, &k.e};
      *field[c] += 1;
      same[c] += bits(k) == first[i];
      ASSERT_LE(bits(k), 0xffffu);
    }
  }
  const char* names[5] = {"seed", "slot", "head", "token", "element"};
  for (int c = 0; c < 5; ++c) EXPECT_LE(same[c], 8) << "bits unchanged by a different " << names[c];
  // sr_elem_bits is the half of sr_pair_bits its element's parity names.
  for (const Key& k : keys) {
    const uint32_t tk = detail::sr_token_key(detail::sr_head_key(k.seed, k.slot, k.hv), k.t);
    const uint32_t pair = detail::sr_pair_bits(tk, static_cast<uint32_t>(k.e >> 1));
    ASSERT_EQ(detail::sr_elem_bits(tk, k.e), (k.e & 1) ? pair >> 16 : pair & 0xffffu);
  }
}

// ---------------------------------------------------------------------------------------
// The rule on every backend.
// ---------------------------------------------------------------------------------------
class StochasticRounding : public BackendTest {};

Config base(Addressing mode, int64_t B, int64_t T, DLDataType state, StateLayout layout) {
  Config c;
  c.B = B;
  c.T = T;
  c.H = 1;
  c.HV = 2;
  c.addressing = mode;
  c.state_dtype = state;
  c.layout = layout;
  c.rounding_seed = 0x5eed0000 + T;
  return c;
}

std::string what(const Config& c) { return c.name(); }

void set_seed(Case& c, int64_t value) {
  const int64_t zero = 0;
  c[Arg::kRoundingSeed].set_bits(&zero, static_cast<uint64_t>(value));
}

const DLDataType kStates16[] = {kBFloat16, kFloat16};

// The oracle and a backend round nearly the same fp32 value with the same 16 random bits, so
// they store the same bits except where the two values straddle a rounding threshold: a
// fraction of the elements about (their difference) / (the 16-bit gap): at most 2e-4 for one
// call on the CPU; an fp32 error of 1e-6 relative would make it ~2e-3 in fp16. The one-call
// bound of SPEC section 6 cannot see a wrong rounding (any two roundings of one value are
// within 1 ulp); this can: other bits disagree on about a third of the elements,
// round-to-nearest-even on about a quarter. Checks the written state slots and inter entries
// of `got` against `want`, at most 2% of the elements differing.
void expect_same_rounding(const Case& before, const Case& want, const Case& got) {
  const Expected e = expected_effects(before);
  int64_t n = 0, diff = 0;
  const auto count = [&](const HostTensor& x, const HostTensor& y, std::vector<int64_t> lead) {
    const int nd = x.ndim();
    std::vector<int64_t> idx = lead;
    idx.resize(nd);
    for (int64_t r = 0; r < x.shape[nd - 2]; ++r)
      for (int64_t col = 0; col < x.shape[nd - 1]; ++col) {
        idx[nd - 2] = r;
        idx[nd - 1] = col;
        ++n;
        diff += x.bits(idx.data()) != y.bits(idx.data());
      }
  };
  const std::set<int64_t> dups(e.duplicated_slots.begin(), e.duplicated_slots.end());
  for (int64_t slot : e.written_slots)
    for (int64_t h = 0; h < before.cfg.HV && !dups.count(slot); ++h) count(got[Arg::kState], want[Arg::kState], {slot, h});
  if (before[Arg::kInter].defined())
    for (int64_t row = 0; row < before.cfg.B; ++row)
      for (int64_t t = 0; t < before.cfg.T && e.rows[row].kind == RowKind::kValid; ++t)
        for (int64_t h = 0; h < before.cfg.HV; ++h) count(got[Arg::kInter], want[Arg::kInter], {row, t, h});
  ASSERT_GT(n, 0) << "nothing stored to compare";
  const double frac = static_cast<double>(diff) / static_cast<double>(n);
  EXPECT_LE(frac, 0.02) << diff << " of " << n << " stored elements rounded otherwise than the oracle's";
  std::printf("stochastic rounding: %lld of %lld stored elements differ from the oracle's\n", static_cast<long long>(diff),
              static_cast<long long>(n));
}

// run_and_compare, then the rounding itself (expect_same_rounding) on another pair of runs.
void compare_rounded(Backend backend, const Case& before) {
  run_and_compare(backend, before);
  Case want = before.clone(), got = before.clone();
  ASSERT_TRUE(run_reference(want).ok());
  ASSERT_TRUE(run_case(backend, got).ok());
  expect_same_rounding(before, want, got);
}
const StateLayout kLayouts[] = {StateLayout::kVK, StateLayout::kKV};

// Every addressing mode, T = 1 (on the CPU: the tile paths instead of the direct ones) and
// T > 1, with and without the intermediate cache, padded pools and odd strides: the oracle
// rounds with the same bits, so the results agree within the one-call bounds.
TEST_P(StochasticRounding, MatchesOracle) {
  GDN_SEED();
  struct Run {
    Addressing mode;
    int64_t B, T;
    InterMode inter;
    StrideMode strides;
    bool padding;
  };
  const Run runs[] = {
      {Addressing::kDense, 3, 1, InterMode::kNone, StrideMode::kCompact, false},
      {Addressing::kPool, 5, 1, InterMode::kNone, StrideMode::kPage, true},
      {Addressing::kPool, 2, 1, InterMode::kCompact, StrideMode::kCompact, false},
      {Addressing::kSplit, 3, 2, InterMode::kNone, StrideMode::kOdd, false},
      {Addressing::kPerToken, 3, 4, InterMode::kCompact, StrideMode::kCompact, true},
      {Addressing::kPerTokenFromFirst, 2, 3, InterMode::kStrided, StrideMode::kPage, false},
      {Addressing::kAccepted, 4, 3, InterMode::kStrided, StrideMode::kCompact, false},
      {Addressing::kPool, 2, 16, InterMode::kCompact, StrideMode::kCompact, false},
  };
  uint64_t s = seed;
  for (DLDataType sd : kStates16)
    for (StateLayout layout : kLayouts)
      for (const Run& r : runs) {
        Config cfg = base(r.mode, r.B, r.T, sd, layout);
        cfg.inter = r.inter;
        cfg.strides = r.strides;
        cfg.padding = r.padding;
        if (r.T == 16) cfg.K = cfg.V = 128;
        SCOPED_TRACE(what(cfg));
        compare_rounded(backend(), make_case(cfg, ++s));
      }
}

// The fused step's recurrence stores round the same way; its conv pool does not round at all.
TEST_P(StochasticRounding, FusedMatchesOracle) {
  GDN_SEED();
  uint64_t s = seed;
  for (DLDataType sd : kStates16)
    for (StateLayout layout : kLayouts)
      for (int64_t T : {1, 3}) {
        Config cfg = base(T == 1 ? Addressing::kPool : Addressing::kAccepted, 3, T, sd, layout);
        cfg.fused = true;
        cfg.H = 2;
        cfg.HV = 4;
        cfg.inter = T == 1 ? InterMode::kNone : InterMode::kCompact;
        cfg.conv_inter = T > 1;
        cfg.out_dtype = kBFloat16;
        SCOPED_TRACE(what(cfg));
        compare_rounded(backend(), make_case(cfg, ++s));
      }
}

// Decode steps fed back, the seed advanced every step as a caller does, against the oracle's
// own chain: the stochastic roundings of the two stay the same bits and within SPEC's
// many-step bound.
TEST_P(StochasticRounding, ManyStepsFedBack) {
  GDN_SEED();
  for (DLDataType sd : kStates16)
    for (StateLayout layout : kLayouts) {
      Config cfg = base(Addressing::kPool, 3, 1, sd, layout);
      cfg.out_dtype = sd;
      SCOPED_TRACE(what(cfg));
      Case want = make_case(cfg, seed), got = want.clone();
      for (int step = 0; step < 64; ++step) {
        if (step > 0)
          for (Case* c : {&want, &got}) {
            fill_inputs(*c, seed + step);
            poison((*c)[Arg::kO]);
            set_seed(*c, *cfg.rounding_seed + step);
          }
        const Case bw = want.clone(), bg = got.clone();
        ASSERT_TRUE(run_reference(want).ok());
        ASSERT_TRUE(run_decode(backend(), got).ok());
        expect_matches(bw, want, bg, got, many_steps_tolerance(sd), "step " + std::to_string(step));
        if (HasFailure()) return;
      }
    }
}

// Bytes of tensor `a` of two results of one case (same storages, same views).
bool same_tensor(const Case& x, const Case& y, Arg a) { return x[a].storage->same_bytes(*y[a].storage); }

// Fraction of the elements of the written state slots that differ between two results.
double differing_state_fraction(const Case& before, const Case& x, const Case& y) {
  const HostTensor& sx = x[Arg::kState];
  const HostTensor& sy = y[Arg::kState];
  int64_t n = 0, diff = 0;
  for (int64_t slot : expected_effects(before).written_slots)
    for (int64_t h = 0; h < sx.shape[1]; ++h)
      for (int64_t r = 0; r < sx.shape[2]; ++r)
        for (int64_t col = 0; col < sx.shape[3]; ++col) {
          const int64_t idx[4] = {slot, h, r, col};
          ++n;
          diff += sx.bits(idx) != sy.bits(idx);
        }
  return n ? static_cast<double>(diff) / static_cast<double>(n) : 0.0;
}

// One seed gives one result, bit for bit; another seed rounds about a third of the elements
// differently (two draws at fraction f differ with probability 2f(1 - f)); o never depends on
// the seed (it reads the fp32 state), nor does the conv pool of the fused step.
TEST_P(StochasticRounding, SeedDeterminesTheBitsAndOnlyTheStateStores) {
  GDN_SEED();
  for (bool fused : {false, true})
    for (DLDataType sd : kStates16)
      for (StateLayout layout : kLayouts) {
        Config cfg = base(Addressing::kPerToken, 4, 3, sd, layout);
        cfg.fused = fused;
        cfg.conv_inter = fused;
        cfg.inter = InterMode::kCompact;
        cfg.K = cfg.V = 128;
        SCOPED_TRACE(what(cfg));
        const Case before = make_case(cfg, seed);
        Case first = before.clone(), again = before.clone(), other = before.clone(), rne = before.clone();
        set_seed(other, *cfg.rounding_seed + 1);
        rne[Arg::kRoundingSeed] = HostTensor{};
        for (Case* c : {&first, &again, &other, &rne}) ASSERT_TRUE(run_case(backend(), *c).ok());
        EXPECT_TRUE(same_bits(first, again));
        const double diff = differing_state_fraction(before, first, other);
        EXPECT_GT(diff, 0.2) << "another seed changed only " << diff << " of the stored elements";
        // Stochastic rounding takes the farther neighbour with probability min(f, 1 - f): 1/4 on average.
        EXPECT_GT(differing_state_fraction(before, first, rne), 0.15) << "rounded as without a seed";
        for (const Case* c : {&other, &rne}) {
          EXPECT_TRUE(same_tensor(first, *c, Arg::kO)) << "o depends on the rounding";
          if (fused) {
            EXPECT_TRUE(same_tensor(first, *c, Arg::kConvState)) << "the conv pool depends on the rounding";
            EXPECT_TRUE(same_tensor(first, *c, Arg::kConvInter)) << "conv_inter depends on the rounding";
          }
        }
      }
}

// An fp32 state never rounds: with a seed, every byte is what it is without one.
TEST_P(StochasticRounding, Fp32StateIgnoresTheSeed) {
  GDN_SEED();
  for (bool fused : {false, true})
    for (StateLayout layout : kLayouts) {
      Config cfg = base(Addressing::kPerToken, 3, 2, kFloat32, layout);
      cfg.fused = fused;
      cfg.inter = InterMode::kStrided;
      SCOPED_TRACE(what(cfg));
      const Case before = make_case(cfg, seed);
      Case with = before.clone(), without = before.clone();
      without[Arg::kRoundingSeed] = HostTensor{};
      ASSERT_TRUE(run_case(backend(), with).ok());
      ASSERT_TRUE(run_case(backend(), without).ok());
      for (Arg a : {Arg::kState, Arg::kInter, Arg::kO}) EXPECT_TRUE(same_tensor(with, without, a)) << arg_name(a);
      run_and_compare(backend(), before);
    }
}

// The state after token t goes to inter[n, t] and to slot token_slots[n, t] by one rounding:
// the two copies are the same bits.
TEST_P(StochasticRounding, InterAndPoolCopiesAreOneRounding) {
  GDN_SEED();
  for (DLDataType sd : kStates16)
    for (StateLayout layout : kLayouts) {
      Config cfg = base(Addressing::kPerToken, 3, 4, sd, layout);
      cfg.inter = InterMode::kStrided;
      SCOPED_TRACE(what(cfg));
      Case c = make_case(cfg, seed);
      ASSERT_TRUE(run_decode(backend(), c).ok());
      const HostTensor &st = c[Arg::kState], &in = c[Arg::kInter], &ts = c[Arg::kTokenSlots];
      int64_t compared = 0;
      for (int64_t n = 0; n < cfg.B; ++n)
        for (int64_t t = 0; t < cfg.T; ++t) {
          const int64_t slot = static_cast<int64_t>(ts.get({n, t}));
          for (int64_t h = 0; h < cfg.HV; ++h)
            for (int64_t r = 0; r < cfg.rows(); ++r)
              for (int64_t col = 0; col < cfg.cols(); ++col) {
                const int64_t si[4] = {slot, h, r, col}, ii[5] = {n, t, h, r, col};
                ASSERT_EQ(st.bits(si), in.bits(ii)) << "slot " << slot << " vs inter[" << n << ", " << t << "], head "
                                                    << h << ", element (" << r << ", " << col << ")";
                ++compared;
              }
        }
      EXPECT_EQ(compared, cfg.B * cfg.T * cfg.HV * cfg.K * cfg.V);
    }
}

// Copies row `from` of every per-row tensor of `src` (leading dim B: inputs, gates, slots) to row
// `to` of `dst`.
void copy_row(const Case& src, int64_t from, Case& dst, int64_t to) {
  for (Arg a : {Arg::kQ, Arg::kK, Arg::kV, Arg::kA, Arg::kB, Arg::kG, Arg::kBeta, Arg::kReadSlots, Arg::kWriteSlots,
                Arg::kTokenSlots, Arg::kNumAccepted, Arg::kMixedQkv, Arg::kZ}) {
    const HostTensor& s = src[a];
    if (!s.defined()) continue;
    const HostTensor& d = dst[a];
    s.for_each([&](const int64_t* idx) {
      if (idx[0] != from) return;
      std::vector<int64_t> j(idx, idx + s.ndim());
      j[0] = to;
      d.set_bits(j.data(), s.bits(idx));
    });
  }
}

// The key is the row's read slot, not its batch position: the rows of a call permuted give
// the same states in the same slots, and the same inter entries and outputs in the permuted
// rows; two rows reading one slot (update_state off, so nobody writes it) with the same
// inputs give the same inter entries.
TEST_P(StochasticRounding, BatchPositionDoesNotMatter) {
  GDN_SEED();
  for (DLDataType sd : kStates16)
    for (StateLayout layout : kLayouts) {
      Config cfg = base(Addressing::kPool, 4, 2, sd, layout);
      cfg.inter = InterMode::kCompact;
      SCOPED_TRACE(what(cfg));
      const Case before = make_case(cfg, seed);
      const int64_t perm[4] = {2, 0, 3, 1};
      Case permuted = before.clone();
      for (int64_t n = 0; n < 4; ++n) copy_row(before, n, permuted, perm[n]);
      Case got = before.clone();
      ASSERT_TRUE(run_decode(backend(), got).ok());
      ASSERT_TRUE(run_decode(backend(), permuted).ok());
      EXPECT_TRUE(same_tensor(got, permuted, Arg::kState));
      for (Arg a : {Arg::kInter, Arg::kO}) {
        const HostTensor &x = got[a], &y = permuted[a];
        x.for_each([&](const int64_t* idx) {
          std::vector<int64_t> j(idx, idx + x.ndim());
          j[0] = perm[idx[0]];
          if (x.bits(idx) != y.bits(j.data()))
            ADD_FAILURE() << arg_name(a) << " of row " << idx[0] << " differs once the row is at " << j[0];
        });
        if (HasFailure()) return;
      }

      Config one = cfg;
      one.B = 2;
      one.update_state = false;
      Case shared = make_case(one, seed + 1);
      copy_row(shared, 0, shared, 1);  // row 1: row 0's inputs and read slot
      ASSERT_TRUE(run_decode(backend(), shared).ok());
      const HostTensor& in = shared[Arg::kInter];
      in.for_each([&](const int64_t* idx) {
        if (idx[0] != 0) return;
        std::vector<int64_t> j(idx, idx + in.ndim());
        j[0] = 1;
        if (in.bits(idx) != in.bits(j.data())) ADD_FAILURE() << "two rows of one slot rounded differently";
      });
      if (HasFailure()) return;
    }
}

// A decay too slow for round-to-nearest-even: g = 1 - 2^-(m + 3) per step (m: the dtype's
// mantissa bits) moves an element by at most half of half an ulp, so RNE rounds every step
// back to the old value and the state stands still. Stochastic rounding, its seed advanced
// per step, keeps the mean of the state on the exact decay g^N. beta = 0, so the step is
// S <- g * S alone; the state starts in [1, 2).
TEST_P(StochasticRounding, SlowDecayStagnatesWithoutAndFollowsWith) {
  GDN_SEED();
  constexpr int kSteps = 256;
  for (DLDataType sd : kStates16)
    for (bool stochastic : {false, true}) {
      const int m = sd.code == kDLBfloat ? 7 : 10;
      Config cfg = base(Addressing::kDense, 2, 1, sd, StateLayout::kVK);
      cfg.HV = 4;
      cfg.gates = GateForm::kPrecomputed;
      if (!stochastic) cfg.rounding_seed.reset();
      SCOPED_TRACE(what(cfg));
      Case c = make_case(cfg, seed);
      const float log_g = static_cast<float>(std::log1p(-std::ldexp(1.0, -(m + 3))));
      c[Arg::kG].for_each([&](const int64_t* i) { c[Arg::kG].set(i, log_g); });
      c[Arg::kBeta].for_each([&](const int64_t* i) { c[Arg::kBeta].set(i, 0.0); });
      std::mt19937_64 rng(seed);
      const HostTensor& st = c[Arg::kState];
      double sum0 = 0;
      st.for_each([&](const int64_t* i) {
        st.set(i, 1.0 + std::uniform_real_distribution<double>(0, 1)(rng));
        sum0 += st.get(i);
      });
      const Case start = c.clone();
      for (int step = 0; step < kSteps; ++step) {
        if (stochastic) set_seed(c, *cfg.rounding_seed + step);
        ASSERT_TRUE(run_decode(backend(), c).ok());
      }
      double sum = 0;
      st.for_each([&](const int64_t* i) { sum += st.get(i); });
      const double elems = static_cast<double>(st.numel());
      if (!stochastic) {
        EXPECT_TRUE(same_tensor(start, c, Arg::kState)) << "RNE moved the state: the decay is too fast for this test";
        continue;
      }
      // Each step adds an independent rounding error of variance <= ulp^2 / 4 per element
      // (ulp <= 2^-m on [0, 2)), so the mean's error has sigma <= sqrt(N / elems) * 2^-m / 2.
      const double exact = std::exp(kSteps * static_cast<double>(log_g)) * sum0 / elems;
      const double sigma = std::sqrt(kSteps / elems) * std::ldexp(1.0, -m) / 2;
      EXPECT_NEAR(sum / elems, exact, 5 * sigma) << "start mean " << sum0 / elems;
      EXPECT_LT(sum / elems, sum0 / elems - 50 * sigma) << "the state did not decay";
    }
}

INSTANTIATE_TEST_SUITE_P(Cpu, StochasticRounding, ::testing::Values(Backend::kCpu),
                         [](const auto&) { return std::string("cpu"); });
#if defined(GDN_WITH_CUDA)
INSTANTIATE_TEST_SUITE_P(Cuda, StochasticRounding, ::testing::Values(Backend::kCuda),
                         [](const auto&) { return std::string("cuda"); });
#endif

}  // namespace
}  // namespace gdn::test
