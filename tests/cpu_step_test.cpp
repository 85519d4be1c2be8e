// The CPU backend's own paths (src/cpu): its 16-bit conversions at the edges of the formats,
// the state's round trip through the direct (T = 1) and tile kernels, NaN containment, and
// determinism across head splits. ctest runs these and the Cpu suites twice: with the SIMD
// kernels the machine selects and with GDN_CPU_SIMD=0 (the portable kernels).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/step_cpu.h"
#include "gdn/gdn.h"
#include "host_dtype.h"
#include "rounding.h"

namespace gdn::test {
namespace {

using detail::DType;

uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(CpuStep, ReportsItsKernels) {
  const std::string name = detail::cpu::cpu_simd_name();
  const char* env = std::getenv("GDN_CPU_SIMD");
  if (env != nullptr && std::string(env) == "0") EXPECT_EQ(name, "portable");
  else EXPECT_TRUE(name == "avx2" || name == "portable") << name;
  std::printf("CPU kernels: %s\n", name.c_str());
}

// fp32 values that stress a conversion: ties both ways, carries into the exponent, overflow
// to Inf, denormal results, signed zeros, Inf, NaNs with payloads, and random bit patterns.
std::vector<float> edge_values(DType to) {
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
                                0x7f800001u, 0x7fbfffffu, 0x7fffffffu, 0xffffffffu, 0xff800001u, 0x7f7fffffu,
                                0xff7fffffu, 0x00000001u, 0x807fffffu, 0x00800000u, 0x3f808000u, 0x3f818000u,
                                0x3f80ffffu, 0x3f817fffu, 0x3f7fffffu, 0x3fffffffu, 0x477fe000u, 0x477ff000u,
                                0x47800000u, 0x33800000u, 0x33000000u, 0x33000001u, 0xb3800001u, 0x38800000u,
                                0x387fe000u, 0x387ff000u};
  std::mt19937 rng(to == DType::kBF16 ? 1 : 2);
  while (bits.size() % 16 != 0 || bits.size() < 256) bits.push_back(rng());
  // fp16 ties at every exponent of its range: 1 + (2j + 1) 2^-11 scaled.
  if (to == DType::kF16)
    for (int e = -24; e < 16 && bits.size() < 512; ++e)
      for (int j : {0, 1, 2, 3}) {
        bits.push_back(f2u(std::ldexp(1.f + (2 * j + 1) * std::ldexp(1.f, -11), e)));
        bits.push_back(f2u(-std::ldexp(1.f + (2 * j + 1) * std::ldexp(1.f, -11), e)));
      }
  while (bits.size() % 256 != 0) bits.push_back(rng());
  std::vector<float> out;
  for (uint32_t b : bits) out.push_back(u2f(b));
  return out;
}

// store_o converts StepOutput to o's dtype: bit for bit what host_dtype.h's scalar RNE gives
// (for fp16 NaNs, any NaN: F16C and _Float16 may keep different payloads).
TEST(CpuStep, OutputConversionsRoundToNearestEven) {
  for (DType to : {DType::kBF16, DType::kF16}) {
    const std::vector<float> vals = edge_values(to);
    const int64_t V = 256;
    static detail::cpu::StepOutput out;
    std::vector<uint16_t> o(V);
    for (size_t base = 0; base < vals.size(); base += V) {
      for (int64_t c = 0; c < V; ++c) out.o[0][c] = vals[base + c];
      detail::Problem p;
      p.B = 1, p.T = 1, p.H = 1, p.HV = 1, p.K = V, p.V = V;
      p.o.data = o.data();
      p.o.dtype = to;
      p.o.s[0] = V, p.o.s[1] = V, p.o.s[2] = V, p.o.s[3] = 1;
      // Two ranges, as two parts of a head would store them.
      detail::cpu::store_o(p, 0, 0, 0, 1, 0, 128, out);
      detail::cpu::store_o(p, 0, 0, 0, 1, 128, V, out);
      for (int64_t c = 0; c < V; ++c) {
        const float x = vals[base + c];
        if (to == DType::kBF16) {
          ASSERT_EQ(o[c], detail::float_to_bf16_bits(x)) << "bf16 of 0x" << std::hex << f2u(x);
        } else if (std::isnan(x)) {
          ASSERT_TRUE(std::isnan(detail::fp16_bits_to_float(o[c]))) << "fp16 of 0x" << std::hex << f2u(x);
        } else {
          ASSERT_EQ(o[c], detail::float_to_fp16_bits(x)) << "fp16 of 0x" << std::hex << f2u(x);
        }
      }
    }
  }
}

// A pool-mode call with g = 1 (precomputed log-space 0) and beta = 0 leaves every finite
// state element as it was: S' = fma(k, 0, 1 * S) = S, stored in the state's dtype. So the
// state must come back bit-identical through the loads and stores of each kernel (T = 1:
// the direct kernels, their 16-bit pair order; T = 2: the tiles), denormals included, except
// where a NaN was planted: that element's dot makes delta NaN, which spreads along its VK row
// or KV column (and nowhere else) as NaN, never as Inf or a number.
struct Plain {
  int64_t B = 6, T = 1, H = 2, HV = 4, K = 128, V = 128, P = 9;
  DLDataType sdt = kBFloat16;
  StateLayout layout = StateLayout::kVK;
  std::vector<uint8_t> state;
  std::vector<uint16_t> q, k, v, beta;
  std::vector<float> g, o;
  std::vector<int32_t> slots;
  std::vector<uint8_t> inter;  // [B, T, HV, rows, cols] in the state's dtype, when with_inter
  bool with_inter = false;
  bool seeded = false;  // rounding_seed = seed_value
  int64_t seed_value = 0;

  int es() const { return sdt.bits / 8; }
  int64_t head_elems() const { return K * V; }

  void fill(uint64_t seed, bool specials) {
    std::mt19937_64 rng(seed);
    state.assign(P * HV * head_elems() * es(), 0);
    const int64_t n = P * HV * head_elems();
    for (int64_t i = 0; i < n; ++i) {
      if (sdt.bits == 32) {
        const float x = std::ldexp(std::uniform_real_distribution<float>(0.5f, 1.f)(rng), int(rng() % 120) - 70) *
                        (rng() & 1 ? 1.f : -1.f);
        std::memcpy(&state[i * 4], &x, 4);
        continue;
      }
      uint16_t h;
      if (sdt.code == kDLBfloat) {
        // Finite bf16, exponent field 0..200 (denormals included), no -0.
        do h = static_cast<uint16_t>(((rng() % 201) << 7) | (rng() & 0x7f) | (rng() & 1 ? 0x8000 : 0));
        while (h == 0x8000);
        if (specials && i % 997 == 0) h = static_cast<uint16_t>(rng() % 128);  // denormal
      } else {
        do h = static_cast<uint16_t>(rng() & 0xffff);  // any finite fp16, no -0
        while ((h & 0x7c00) == 0x7c00 || h == 0x8000);
      }
      std::memcpy(&state[i * 2], &h, 2);
    }
    q.resize(B * T * H * K);
    k.resize(B * T * H * K);
    v.resize(B * T * HV * V);
    for (auto* t : {&q, &k, &v})
      for (auto& x : *t) x = detail::float_to_bf16_bits(std::normal_distribution<float>(0.f, 1.f)(rng));
    g.assign(B * T * HV, 0.f);
    beta.assign(B * T * HV, 0);  // bf16 +0
    o.assign(B * T * HV * V, NAN);
    inter.assign(with_inter ? B * T * HV * head_elems() * es() : 0, 0xff);
    slots.resize(B);
    for (int64_t n = 0; n < B; ++n) slots[n] = static_cast<int32_t>((n * 5 + 2) % P);
  }

  DecodeArgs args() {
    DecodeArgs a;
    const int64_t rows = layout == StateLayout::kVK ? V : K, cols = layout == StateLayout::kVK ? K : V;
    a.q = make_view(q.data(), kBFloat16, kCpu, {B, T, H, K});
    a.k = make_view(k.data(), kBFloat16, kCpu, {B, T, H, K});
    a.v = make_view(v.data(), kBFloat16, kCpu, {B, T, HV, V});
    a.g = make_view(g.data(), kFloat32, kCpu, {B, T, HV});
    a.beta = make_view(beta.data(), kBFloat16, kCpu, {B, T, HV});
    a.state = make_view(state.data(), sdt, kCpu, {P, HV, rows, cols});
    a.layout = layout;
    a.read_slots = make_view(slots.data(), kInt32, kCpu, {B});
    a.o = make_view(o.data(), kFloat32, kCpu, {B, T, HV, V});
    if (with_inter) a.inter = make_view(inter.data(), sdt, kCpu, {B, T, HV, rows, cols});
    if (seeded) a.rounding_seed = make_view(&seed_value, kInt64, kCpu, {1});
    return a;
  }
};

TEST(CpuStep, StateRoundTripsThroughEveryKernel) {
  for (bool seeded : {false, true})  // stochastic rounding keeps representable values too
  for (DLDataType sdt : {kFloat32, kBFloat16, kFloat16})
    for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV})
      for (int64_t T : {1, 2}) {
        SCOPED_TRACE(std::to_string(sdt.bits) + (sdt.code == kDLBfloat ? " bf16" : "") +
                     (layout == StateLayout::kVK ? " VK" : " KV") + " T=" + std::to_string(T) +
                     (seeded ? " stochastic" : ""));
        Plain c;
        c.sdt = sdt;
        c.layout = layout;
        c.T = T;
        c.seeded = seeded;
        c.seed_value = -12345;
        c.fill(17 + T, true);
        const std::vector<uint8_t> before = c.state;
        const Status st = decode(c.args());
        ASSERT_TRUE(st.ok()) << st.message();
        ASSERT_EQ(c.state, before);
        for (float x : c.o) ASSERT_TRUE(std::isfinite(x));
      }
}

TEST(CpuStep, NanStaysInItsRowOrColumn) {
  for (DLDataType sdt : {kBFloat16, kFloat16})
    for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV})
    for (int64_t T : {1, 2}) {
      SCOPED_TRACE(std::string(sdt.code == kDLBfloat ? "bf16" : "fp16") + (layout == StateLayout::kVK ? " VK" : " KV") +
                   " T=" + std::to_string(T));
      Plain c;
      c.sdt = sdt;
      c.layout = layout;
      c.T = T;
      c.fill(5, false);
      // NaN at (row 3, col 7) of head 1 of row n = 0's slot: VK value row 3, KV column 7.
      const uint16_t nan = sdt.code == kDLBfloat ? 0x7fc1 : 0x7e01;
      const int64_t slot = c.slots[0], hv = 1, cols = layout == StateLayout::kVK ? c.K : c.V;
      const int64_t head = (slot * c.HV + hv) * c.head_elems();
      std::memcpy(&c.state[(head + 3 * cols + 7) * 2], &nan, 2);
      const std::vector<uint8_t> before = c.state;
      ASSERT_TRUE(decode(c.args()).ok());
      for (int64_t e = 0; e < static_cast<int64_t>(before.size()) / 2; ++e) {
        const int64_t in_head = e - head;
        const bool hit = in_head >= 0 && in_head < c.head_elems() &&
                         (layout == StateLayout::kVK ? in_head / cols == 3 : in_head % cols == 7);
        uint16_t got, was;
        std::memcpy(&got, &c.state[e * 2], 2);
        std::memcpy(&was, &before[e * 2], 2);
        const float x = sdt.code == kDLBfloat ? detail::bf16_bits_to_float(got) : detail::fp16_bits_to_float(got);
        if (hit) ASSERT_TRUE(std::isnan(x)) << "element " << in_head << " of the NaN's head";
        else ASSERT_EQ(got, was) << "element " << e;
      }
    }
}

// A head split into parts (few heads for the threads) gives the bits of the unsplit head:
// row 0 alone (B = 1, HV = 1: the head runs as several parts) against row 0 of a call with
// enough heads to run whole. T = 1 (direct kernels) and T = 3 (tiles).
TEST(CpuStep, HeadSplitsGiveTheSameBits) {
  for (bool seeded : {false, true})  // the random bits follow the element, not the split
  for (DLDataType sdt : {kFloat32, kBFloat16, kFloat16})
    for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV})
      for (int64_t T : {1, 3}) {
        SCOPED_TRACE(std::to_string(sdt.bits) + (layout == StateLayout::kVK ? " VK" : " KV") + " T=" +
                     std::to_string(T) + (seeded ? " stochastic" : ""));
        Plain whole;
        whole.seeded = seeded;
        whole.seed_value = 77;
        whole.sdt = sdt;
        whole.layout = layout;
        whole.T = T;
        whole.B = 64;
        whole.H = 1;
        whole.HV = 1;
        whole.P = 64;
        whole.fill(23, false);
        std::mt19937 rng(5);
        for (auto& x : whole.g) x = -std::uniform_real_distribution<float>(0.f, 1.f)(rng);
        for (auto& x : whole.beta) x = detail::float_to_bf16_bits(std::uniform_real_distribution<float>(0.f, 1.f)(rng));
        Plain alone = whole;
        alone.B = 1;
        ASSERT_TRUE(decode(whole.args()).ok());
        ASSERT_TRUE(decode(alone.args()).ok());
        const int64_t slot_bytes = whole.head_elems() * whole.es();
        const int64_t s0 = whole.slots[0];
        ASSERT_EQ(0, std::memcmp(&whole.state[s0 * slot_bytes], &alone.state[s0 * slot_bytes], slot_bytes));
        for (int64_t i = 0; i < T * whole.V; ++i) ASSERT_EQ(f2u(whole.o[i]), f2u(alone.o[i])) << "o element " << i;
      }
}

// Stochastic rounding through every kernel, bit for bit against src/rounding.h: with beta = 0
// a token's update is S <- fma(k, 0, g * S) = the fp32 product g * S, carried in fp32 from
// token to token, so every stored element must be sr(g_t * ... * g_0 * S, bits of (seed, the
// row's read slot, head, token, element)). T = 1 without and with the cache, T = 2 and 3 (the
// tiles, the KV blocks' per-token stores); subnormals, both signs, g = 1 on some heads
// (representable values, fp16's 65504 included) and g > 1 on others (fp16 values past 65504:
// round-to-nearest-even, up to Inf).
TEST(CpuStep, StochasticStoresFollowTheRuleBitForBit) {
  for (DLDataType sdt : {kBFloat16, kFloat16})
    for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV})
      for (int64_t T : {1, 2, 3})
        for (bool with_inter : {false, true}) {
          if (T == 2 && with_inter) continue;
          SCOPED_TRACE(std::string(sdt.code == kDLBfloat ? "bf16" : "fp16") + (layout == StateLayout::kVK ? " VK" : " KV") +
                       " T=" + std::to_string(T) + (with_inter ? " inter" : ""));
          Plain c;
          c.sdt = sdt;
          c.layout = layout;
          c.T = T;
          c.with_inter = with_inter;
          c.seeded = true;
          c.seed_value = 0x0123456789abcdefll + T;
          c.fill(31 + T, true);
          // log g per (n, t, hv): decay, none, growth, decay.
          for (int64_t n = 0; n < c.B; ++n)
            for (int64_t t = 0; t < T; ++t)
              for (int64_t hv = 0; hv < c.HV; ++hv) {
                const float lg[4] = {std::log(0.75f) - 0.01f * static_cast<float>(t), 0.f, 0.0003f, -1e-4f};
                c.g[(n * T + t) * c.HV + hv] = lg[hv % 4];
              }
          const std::vector<uint8_t> before = c.state;
          ASSERT_TRUE(decode(c.args()).ok());
          const bool bf = sdt.code == kDLBfloat;
          const auto load = [&](const std::vector<uint8_t>& buf, int64_t i) {
            uint16_t h;
            std::memcpy(&h, &buf[i * 2], 2);
            return h;
          };
          const int64_t E = c.head_elems();
          std::vector<float> S(E);
          for (int64_t n = 0; n < c.B; ++n)
            for (int64_t hv = 0; hv < c.HV; ++hv) {
              const int64_t head = (c.slots[n] * c.HV + hv) * E;
              for (int64_t e = 0; e < E; ++e) {
                const uint16_t h = load(before, head + e);
                S[e] = bf ? detail::bf16_bits_to_float(h) : detail::fp16_bits_to_float(h);
              }
              const uint32_t head_key = detail::sr_head_key(c.seed_value, c.slots[n], hv);
              for (int64_t t = 0; t < T; ++t) {
                const float g = std::exp(c.g[(n * T + t) * c.HV + hv]);  // as the backend: exp in fp32
                const uint32_t key = detail::sr_token_key(head_key, t);
                for (int64_t e = 0; e < E; ++e) {
                  S[e] = g * S[e];
                  const uint32_t r16 = detail::sr_elem_bits(key, e);
                  const uint16_t want = bf ? detail::sr_bf16_bits(S[e], r16)
                                           : detail::sr_fp16_bits(S[e], r16, detail::float_to_fp16_bits);
                  if (with_inter) {
                    const uint16_t got = load(c.inter, ((n * T + t) * c.HV + hv) * E + e);
                    ASSERT_EQ(got, want) << "inter[" << n << ", " << t << ", " << hv << "] element " << e << " of "
                                         << S[e];
                  }
                  if (t == T - 1) {
                    ASSERT_EQ(load(c.state, head + e), want) << "row " << n << " head " << hv << " element " << e
                                                             << " of " << S[e];
                  }
                }
              }
            }
        }
}

}  // namespace
}  // namespace gdn::test
