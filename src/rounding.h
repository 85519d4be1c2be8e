// Stochastic rounding of fp32 state values to bf16 / fp16 (docs/semantics.md section 2,
// StepArgs::rounding_seed). One definition for the CPU backend, the CUDA kernels and the
// oracle: integer operations only, so every backend and the oracle produce the same bits for
// the same fp32 value, seed, slot, head, token and element.
//
// The random bits are counter-based (no generator state kept between calls): a key per
// (seed, read slot, head) mixed with splitmix64, a key per token from it, and 16 bits per
// element from the token key and the element's index in the head's matrix (below). The
// rounding adds the random bits to the bits the target type drops and truncates, so a value
// rounds up with probability (its distance above the lower neighbour) / (the gap): unbiased
// (exactly, for the 16 bits of bf16 and the 13 of a normal fp16; to 2^-16 of the gap for fp16
// subnormals). NaN stays NaN; fp16's largest finite value and beyond, and infinities, round
// as RNE does. Not a cryptographic generator: its purpose is decorrelated rounding.
#pragma once

#include <cstdint>
#include <cstring>

#include "problem.h"

namespace gdn::detail {

GDN_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

GDN_HD uint64_t sr_mix64(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

GDN_HD uint32_t sr_mix32(uint32_t x) {  // murmur3's fmix32: a bijection with full avalanche
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  return x ^ (x >> 16);
}

// The key of one row: the seed value and the row's read slot (the slot its state came from;
// in dense mode the row index). Computed once per row, when the slots are resolved.
GDN_HD uint64_t sr_row_key(int64_t seed, int64_t read_slot) {
  const uint64_t x = sr_mix64(static_cast<uint64_t>(seed) + 0x9e3779b97f4a7c15ull);
  return sr_mix64(x ^ static_cast<uint64_t>(read_slot));
}

// The key of one value head of that row.
GDN_HD uint32_t sr_head_key(uint64_t row_key, int64_t hv) {
  return static_cast<uint32_t>(sr_mix64(row_key ^ (static_cast<uint64_t>(hv) + 0x632be59bd9b4e019ull)) >> 32);
}
GDN_HD uint32_t sr_head_key(int64_t seed, int64_t read_slot, int64_t hv) {
  return sr_head_key(sr_row_key(seed, read_slot), hv);
}

// The key of token t (0-based within the call) of that head: the state after token t.
GDN_HD uint32_t sr_token_key(uint32_t head_key, int64_t t) {
  return sr_mix32(head_key ^ (static_cast<uint32_t>(t) * 0x9e3779b9u + 0x7f4a7c15u));
}

// The elements of a head's matrix in storage order (v * K + k for VK, k * V + v for KV) come
// in groups of 8 (one 16-byte vector of a 16-bit state): group g's 32-bit seed is a hash of
// the token key and g, and element j of the group takes the top 16 bits of the j-th step of
// PCG's 32-bit LCG from that seed, reached directly as x_j = A^j * x_0 + C_j. One hash per
// 8 elements and one multiply-add per element: a full hash per element pair cost the CUDA
// kernels about twice as many instructions (docs/design.md, "Stochastic rounding").
constexpr uint32_t kSrLcgA = 747796405u, kSrLcgC = 2891336453u;

GDN_HD uint32_t sr_group_seed(uint32_t token_key, int64_t group) {
  return sr_mix32(token_key ^ static_cast<uint32_t>(group));
}

// A^j and C_j of x_j = A^j * x_0 + C_j, j in 0..7.
GDN_HD void sr_lcg_jump(int j, uint32_t& a, uint32_t& c) {
  a = 1u;
  c = 0u;
  for (int i = 0; i < j; ++i) {
    c = c * kSrLcgA + kSrLcgC;
    a *= kSrLcgA;
  }
}

// The 16 random bits of element j of a group whose seed is x0.
GDN_HD uint32_t sr_group_bits(uint32_t x0, int j) {
  uint32_t a, c;
  sr_lcg_jump(j, a, c);
  return (x0 * a + c) >> 16;
}

// The 16 random bits of element e.
GDN_HD uint32_t sr_elem_bits(uint32_t token_key, int64_t e) {
  return sr_group_bits(sr_group_seed(token_key, e >> 3), static_cast<int>(e & 7));
}

// The bits of the elements 2 * pair (low half) and 2 * pair + 1 (high half).
GDN_HD uint32_t sr_pair_bits(uint32_t token_key, int64_t pair) {
  const uint32_t x0 = sr_group_seed(token_key, pair >> 2);
  const int j = static_cast<int>(2 * (pair & 3));
  return sr_group_bits(x0, j) | sr_group_bits(x0, j + 1) << 16;
}

// fp32 -> bf16 bits, rounded stochastically with 16 random bits r16.
GDN_HD uint16_t sr_bf16_bits(float x, uint32_t r16) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  // Sign and magnitude: the carry out of the dropped half rounds the magnitude up; an infinity
  // (zero low half) stays one; the largest finite values may carry into infinity, as RNE does.
  return static_cast<uint16_t>((u + r16) >> 16);
}

// fp32 -> fp16 bits, rounded stochastically with 16 random bits r16. `rne` is the caller's
// round-to-nearest-even conversion, used for NaN, infinities and |x| >= 65504, fp16's largest
// finite value (above it RNE keeps 65504 up to 65520 and overflows beyond; stochastic rounding
// would send values just above 65504 to infinity).
template <typename Rne>
GDN_HD uint16_t sr_fp16_bits(float x, uint32_t r16, Rne rne) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x477fe000u) return rne(x);  // 65504, inf, NaN
  if (a >= 0x38800000u) {               // |x| >= 2^-14: a normal fp16 keeps 10 of 23 bits
    const uint32_t b = a + (r16 >> 3);  // the top 13 random bits over the 13 dropped bits
    return static_cast<uint16_t>(sign | (((b >> 23) - 112u) << 10) | ((b >> 13) & 0x3ffu));
  }
  // fp16 subnormal range: |x| in units of 2^-40 (fp16's step 2^-24, with 16 bits below it);
  // bits under 2^-40 are dropped (a bias below 2^-16 of the step). A carry to 1024 steps is
  // exactly the smallest normal's encoding.
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7fffffu) | (e != 0 ? 0x800000u : 0u);
  const int shift = static_cast<int>(e != 0 ? e : 1) - 110;  // <= 2
  const uint32_t q = shift >= 0 ? m << shift : (-shift >= 32 ? 0u : m >> -shift);
  return static_cast<uint16_t>(sign | ((q + r16) >> 16));
}

}  // namespace gdn::detail
