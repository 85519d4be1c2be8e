// Host-side scalar conversions between fp32 and the 16-bit storage types, round-to-nearest-even
// (docs/semantics.md: a bf16/fp16 state is rounded RNE only where it is stored). Shared by the
// CPU backend, the oracle and the tests so that there is one definition of the rounding.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "problem.h"

namespace gdn::detail {

inline float bf16_bits_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_bits_to_float(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}

// _Float16 conversion from float is correctly rounded (RNE) per IEEE 754 in GCC and Clang.
inline uint16_t float_to_fp16_bits(float f) {
  _Float16 x = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

// Double to 16-bit storage in one rounding (the oracle rounds float64 results directly).
inline uint16_t double_to_bf16_bits(double d) {
  // Round-to-odd to float first keeps the second rounding (to bf16) correct.
  float f = static_cast<float>(d);
  if (std::isfinite(d) && f != 0.f && std::isfinite(f) && static_cast<double>(f) != d) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 1u) == 0) {
      // f was rounded to even; move it one ulp towards d so the sticky bit is set.
      u += (static_cast<double>(f) < d) == (f > 0) ? 1 : -1;
      std::memcpy(&f, &u, 4);
    }
  }
  return float_to_bf16_bits(f);
}

inline uint16_t double_to_fp16_bits(double d) {
  _Float16 x = static_cast<_Float16>(d);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

inline int dtype_size(DType t) {
  switch (t) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kI64: return 8;
    default: return 2;
  }
}

// Loads element `offset` (in elements) of a float-typed buffer as fp32.
inline float load_f32(const void* base, DType t, int64_t offset) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(base)[offset];
    case DType::kBF16: return bf16_bits_to_float(static_cast<const uint16_t*>(base)[offset]);
    default: return fp16_bits_to_float(static_cast<const uint16_t*>(base)[offset]);
  }
}

inline void store_f32(void* base, DType t, int64_t offset, float x) {
  switch (t) {
    case DType::kF32: static_cast<float*>(base)[offset] = x; break;
    case DType::kBF16: static_cast<uint16_t*>(base)[offset] = float_to_bf16_bits(x); break;
    default: static_cast<uint16_t*>(base)[offset] = float_to_fp16_bits(x); break;
  }
}

}  // namespace gdn::detail
