// The CPU step (step_cpu.h): the kernels of step_kernels.inc instantiated twice, over
// portable C++ vector ops and over AVX2+FMA+F16C intrinsics compiled for that target only
// (GCC/Clang target regions, so the rest of the library keeps the baseline ISA), and the
// run-time choice between them.
#include "step_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "../host_dtype.h"
#include "../rounding.h"

// GDN_CPU_X86=0 on the command line builds the portable kernels alone, as on other ISAs.
#ifndef GDN_CPU_X86
#if defined(__x86_64__) || defined(__i386__)
#define GDN_CPU_X86 1
#else
#define GDN_CPU_X86 0
#endif
#endif
#if GDN_CPU_X86
#include <cpuid.h>
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace gdn::detail::cpu {

void step_gates(const Problem& p, int64_t n, int64_t t, int64_t hv, float* g, float* beta) {
  if (!p.raw_gates) {
    *g = std::exp(load_f32(p.g.data, p.g.dtype, n * p.g.s[0] + t * p.g.s[1] + hv * p.g.s[2]));
    *beta = load_f32(p.beta.data, p.beta.dtype, n * p.beta.s[0] + t * p.beta.s[1] + hv * p.beta.s[2]);
    return;
  }
  const float x = load_f32(p.a.data, p.a.dtype, n * p.a.s[0] + t * p.a.s[1] + hv * p.a.s[2]) +
                  load_f32(p.dt_bias.data, p.dt_bias.dtype, hv * p.dt_bias.s[0]);
  const float sp = x <= 20.f ? std::log1p(std::exp(x)) : x;  // softplus, threshold 20
  const float A = std::exp(load_f32(p.A_log.data, p.A_log.dtype, hv * p.A_log.s[0]));
  *g = std::exp(-A * sp);
  const float b = load_f32(p.b.data, p.b.dtype, n * p.b.s[0] + t * p.b.s[1] + hv * p.b.s[2]);
  *beta = 1.f / (1.f + std::exp(-b));
}

StateRounding state_rounding(const Problem& p) {
  if (p.rounding_seed == nullptr) return {};
  return {true, *p.rounding_seed};
}

// One fp32 value to 16-bit storage bits with the 16 random bits r16 (src/rounding.h).
template <DType D>
inline uint16_t sr_store_bits(float x, uint32_t r16) {
  if constexpr (D == DType::kBF16) return sr_bf16_bits(x, r16);
  else return sr_fp16_bits(x, r16, float_to_fp16_bits);
}

void zero_o(const Problem& p, int64_t n, int64_t hv, int64_t v0, int64_t v1) {
  const int es = dtype_size(p.o.dtype);
  for (int64_t t = 0; t < p.T; ++t) {
    const int64_t off = n * p.o.s[0] + t * p.o.s[1] + hv * p.o.s[2] + v0;
    std::memset(static_cast<char*>(p.o.data) + off * es, 0, (v1 - v0) * es);  // +0 in every float dtype
  }
}

// ---------------------------------------------------------------------------------------
// Portable ops: eight lanes in plain C++ (the compiler vectorizes what the target allows).
// hsum adds in the order of the AVX2 one.
// ---------------------------------------------------------------------------------------
struct PortableOps {
  struct F {
    float v[8];
  };
  static F zero() { return set1(0.f); }
  static F set1(float x) {
    F r;
    for (int i = 0; i < 8; ++i) r.v[i] = x;
    return r;
  }
  static F load(const float* p) {
    F r;
    for (int i = 0; i < 8; ++i) r.v[i] = p[i];
    return r;
  }
  static void store(float* p, F x) {
    for (int i = 0; i < 8; ++i) p[i] = x.v[i];
  }
  static F add(F a, F b) {
    for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
    return a;
  }
  static F sub(F a, F b) {
    for (int i = 0; i < 8; ++i) a.v[i] -= b.v[i];
    return a;
  }
  static F mul(F a, F b) {
    for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static F fma(F a, F b, F c) {  // a * b + c
    for (int i = 0; i < 8; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
  }
  static float hsum(F x) {
    const float w0 = x.v[0] + x.v[4], w1 = x.v[1] + x.v[5], w2 = x.v[2] + x.v[6], w3 = x.v[3] + x.v[7];
    return (w0 + w1) + (w2 + w3);
  }
  template <DType D, typename E>
  static F load_e(const E* p) {
    F r;
    for (int i = 0; i < 8; ++i) {
      if constexpr (D == DType::kF32) r.v[i] = p[i];
      else if constexpr (D == DType::kBF16) r.v[i] = bf16_bits_to_float(p[i]);
      else r.v[i] = fp16_bits_to_float(p[i]);
    }
    return r;
  }
  template <DType D, typename E>
  static void store_e(E* p, F x) {
    for (int i = 0; i < 8; ++i) {
      if constexpr (D == DType::kF32) p[i] = x.v[i];
      else if constexpr (D == DType::kBF16) p[i] = float_to_bf16_bits(x.v[i]);
      else p[i] = float_to_fp16_bits(x.v[i]);
    }
  }
  template <DType D, typename E>
  static void load2_e(const E* p, F* a, F* b) {
    *a = load_e<D>(p);
    *b = load_e<D>(p + 8);
  }
  // kNanFree: the caller knows a and b hold no NaN (the AVX2 ops skip their NaN fix-up).
  template <DType D, bool kNanFree = false, typename E>
  static void store2_e(E* p, F a, F b) {
    store_e<D>(p, a);
    store_e<D>(p + 8, b);
  }
  // 16 elements in pair order (step_kernels.inc): here the natural one.
  template <DType D>
  static constexpr bool kEvenOdd = false;
  template <DType D, typename E>
  static void load_pair(const E* p, F* a, F* b) {
    load2_e<D>(p, a, b);
  }
  template <DType D, bool kNanFree = false, typename E>
  static void store_pair(E* p, F a, F b) {
    store2_e<D, kNanFree>(p, a, b);
  }
  // Stochastic rounding (src/rounding.h) of the 16 values x[0..16) of a 16-bit state, elements
  // 2 * pair0 .. 2 * pair0 + 15 of the head's matrix, whose bits come from token_key.
  template <DType D>
  static void store_sr(uint16_t* p, const float* x, uint32_t token_key, uint32_t pair0) {
    for (uint32_t j = 0; j < 8; ++j) {
      const uint32_t r = sr_pair_bits(token_key, pair0 + j);
      p[2 * j] = sr_store_bits<D>(x[2 * j], r & 0xffffu);
      p[2 * j + 1] = sr_store_bits<D>(x[2 * j + 1], r >> 16);
    }
  }
};

namespace portable {
using O = PortableOps;
#include "step_kernels.inc"
}  // namespace portable

}  // namespace gdn::detail::cpu

// ---------------------------------------------------------------------------------------
// AVX2 + FMA + F16C ops, compiled for that target only.
// ---------------------------------------------------------------------------------------
#if GDN_CPU_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace gdn::detail::cpu {

struct Avx2Ops {
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(F x) {
    __m128 w = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    __m128 sh = _mm_movehdup_ps(w);  // w1 w1 w3 w3
    __m128 s = _mm_add_ps(w, sh);    // w0+w1 . w2+w3 .
    sh = _mm_movehl_ps(sh, s);       // w2+w3
    return _mm_cvtss_f32(_mm_add_ss(s, sh));
  }
  template <DType D, typename E>
  static F load_e(const E* p) {
    if constexpr (D == DType::kF32) {
      return _mm256_loadu_ps(p);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      if constexpr (D == DType::kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      else return _mm256_cvtph_ps(h);
    }
  }
  template <DType D, typename E>
  static void store_e(E* p, F x) {
    if constexpr (D == DType::kF32) _mm256_storeu_ps(p, x);
    else if constexpr (D == DType::kF16) _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(bf16_pack<false>(x, x)));
  }

  // 16 elements: two vectors. bf16 as 256-bit load, one lane shuffle and two unpacks (the
  // element order comes out straight: quads 0 2 | 1 3, then low and high words of each lane).
  template <DType D, typename E>
  static void load2_e(const E* p, F* a, F* b) {
    if constexpr (D == DType::kBF16) {
      const __m256i x = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 0xD8);
      const __m256i z = _mm256_setzero_si256();
      *a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x));
      *b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x));
    } else {
      *a = load_e<D>(p);
      *b = load_e<D>(p + 8);
    }
  }

  // float_to_bf16_bits in integer lanes, RNE: add 0x7fff + the kept lsb, keep the high half.
  static __m256i bf16_round(__m256i u) {
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  }
  // NaN lanes as float_to_bf16_bits makes them: sign and top payload kept, quieted.
  static __m256i bf16_fix_nan(__m256i r, F x) {
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, quiet, nan);
  }

  // a and b as 16 bf16 (RNE) in element order. kNanFree: the caller knows there is no NaN.
  template <bool kNanFree>
  static __m256i bf16_pack(F a, F b) {
    __m256i ra = bf16_round(_mm256_castps_si256(a));
    __m256i rb = bf16_round(_mm256_castps_si256(b));
    if constexpr (!kNanFree) {
      // One compare finds a NaN in either vector; the blends run only then.
      if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q)) != 0, 0)) {
        ra = bf16_fix_nan(ra, a);
        rb = bf16_fix_nan(rb, b);
      }
    }
    // packus interleaves quads (a0-3 b0-3 | a4-7 b4-7); the permute puts them in order.
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(ra, rb), 0xD8);
  }

  template <DType D, bool kNanFree = false, typename E>
  static void store2_e(E* p, F a, F b) {
    if constexpr (D == DType::kF32) {
      _mm256_storeu_ps(p, a);
      _mm256_storeu_ps(p + 8, b);
    } else if constexpr (D == DType::kF16) {
      store_e<D>(p, a);
      store_e<D>(p + 8, b);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_pack<kNanFree>(a, b));
    }
  }

  // Pair order (step_kernels.inc): bf16 moves as the even and the odd elements of 16, which
  // needs no lane shuffles: a 32-bit lane holds elements 2j (low half) and 2j + 1 (high
  // half), so even = lane << 16 and odd = lane & 0xffff0000, and the way back is one shift
  // and a merge. Shifts and shuffles share two of the four vector pipes; this form needs 4
  // of them per 16 elements instead of 9.
  template <DType D>
  static constexpr bool kEvenOdd = D == DType::kBF16;
  template <DType D, typename E>
  static void load_pair(const E* p, F* a, F* b) {
    if constexpr (D == DType::kBF16) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      *a = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      *b = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    } else {
      load2_e<D>(p, a, b);
    }
  }
  // float_to_bf16_bits with the result left in the high half of the lane.
  template <bool kNanFree>
  static __m256i bf16_round_high(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    if constexpr (!kNanFree) {
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
    }
    return r;
  }
  template <DType D, bool kNanFree = false, typename E>
  static void store_pair(E* p, F a, F b) {
    if constexpr (D == DType::kBF16) {
      const __m256i lo = _mm256_srli_epi32(bf16_round_high<kNanFree>(a), 16);
      const __m256i hi = _mm256_and_si256(bf16_round_high<kNanFree>(b), _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_or_si256(lo, hi));
    } else {
      store2_e<D, kNanFree>(p, a, b);
    }
  }

  // PortableOps::store_sr in eight lanes: the same bits (tests/cpu_step_test.cpp checks them
  // against src/rounding.h). Lane i takes element e + i: its group's hash (sr_group_seed),
  // then the LCG jump to its place in the group (sr_group_bits).
  static __m256i sr_bits8(uint32_t token_key, uint32_t e) {
    alignas(32) static const struct Jumps {
      uint32_t a[8], c[8];
      Jumps() {
        for (int j = 0; j < 8; ++j) sr_lcg_jump(j, a[j], c[j]);
      }
    } jumps;
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(e)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i x = _mm256_xor_si256(_mm256_srli_epi32(idx, 3), _mm256_set1_epi32(static_cast<int>(token_key)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));  // sr_mix32
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    const __m256i j = _mm256_and_si256(idx, _mm256_set1_epi32(7));
    const __m256i a = _mm256_permutevar8x32_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(jumps.a)), j);
    const __m256i c = _mm256_permutevar8x32_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(jumps.c)), j);
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_mullo_epi32(x, a), c), 16);
  }
  static void sr_bits(uint32_t token_key, uint32_t pair0, __m256i* lo, __m256i* hi) {
    *lo = sr_bits8(token_key, 2 * pair0);
    *hi = sr_bits8(token_key, 2 * pair0 + 8);
  }
  template <DType D>
  static void store_sr(uint16_t* p, const float* src, uint32_t token_key, uint32_t pair0) {
    __m256i lo, hi;
    sr_bits(token_key, pair0, &lo, &hi);
    // packus interleaves quads (a0-3 b0-3 | a4-7 b4-7); the permute puts them in order.
    const __m256i r = _mm256_packus_epi32(sr_round<D>(_mm256_loadu_ps(src), lo), sr_round<D>(_mm256_loadu_ps(src + 8), hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(r, 0xD8));
  }
  // One vector's 16-bit results (in 32-bit lanes) from random bits r16.
  template <DType D>
  static __m256i sr_round(F x, __m256i r16) {
    const __m256i u = _mm256_castps_si256(x);
    __m256i r;
    if constexpr (D == DType::kBF16) {  // sr_bf16_bits
      r = _mm256_srli_epi32(_mm256_add_epi32(u, r16), 16);
      r = bf16_fix_nan(r, x);
    } else {  // sr_fp16_bits
      const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
      const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000));
      // Normal: 13 random bits over the 13 dropped; (b >> 13) - (112 << 10) is the rebiased
      // exponent and the 10 kept bits in one subtraction.
      const __m256i b = _mm256_add_epi32(a, _mm256_srli_epi32(r16, 3));
      const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(b, 13), _mm256_set1_epi32(112 << 10));
      const __m256i is_normal = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x387fffff));
      const __m256i is_big = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x477fdfff));
      const __m256i other = _mm256_or_si256(_mm256_xor_si256(is_normal, _mm256_set1_epi32(-1)), is_big);
      if (_mm256_testz_si256(other, other)) return _mm256_or_si256(sign, normal);  // the common case
      // Subnormal: |x| in units of 2^-40, 16 random bits below fp16's step (counts >= 32 give 0).
      const __m256i e = _mm256_srli_epi32(a, 23);
      const __m256i m = _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0x7fffff)),
                                        _mm256_and_si256(_mm256_cmpgt_epi32(e, _mm256_setzero_si256()),
                                                         _mm256_set1_epi32(0x800000)));
      const __m256i shift = _mm256_sub_epi32(_mm256_max_epi32(e, _mm256_set1_epi32(1)), _mm256_set1_epi32(110));
      const __m256i q = _mm256_blendv_epi8(_mm256_sllv_epi32(m, shift),
                                           _mm256_srlv_epi32(m, _mm256_sub_epi32(_mm256_setzero_si256(), shift)),
                                           _mm256_cmpgt_epi32(_mm256_setzero_si256(), shift));
      const __m256i sub = _mm256_srli_epi32(_mm256_add_epi32(q, r16), 16);
      r = _mm256_or_si256(sign, _mm256_blendv_epi8(sub, normal, is_normal));
      // |x| >= 65504, Inf, NaN: round to nearest even.
      const __m256i rne = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
      r = _mm256_blendv_epi8(r, rne, is_big);
    }
    return r;
  }
};

namespace avx2 {
using O = Avx2Ops;
#include "step_kernels.inc"
}  // namespace avx2

}  // namespace gdn::detail::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // GDN_CPU_X86

// ---------------------------------------------------------------------------------------
// Run-time choice, made once.
// ---------------------------------------------------------------------------------------
namespace gdn::detail::cpu {
namespace {

bool use_avx2() {
  static const bool v = [] {
#if GDN_CPU_X86
    const char* env = std::getenv("GDN_CPU_SIMD");
    if (env != nullptr && env[0] == '0' && env[1] == '\0') return false;
    __builtin_cpu_init();
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
    // __builtin_cpu_supports also checks that the OS saves the AVX registers.
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
#else
    return false;
#endif
  }();
  return v;
}

}  // namespace

const char* cpu_simd_name() { return use_avx2() ? "avx2" : "portable"; }

int64_t item_chunk(int64_t items, int64_t per_row) {
#ifdef _OPENMP
  const int64_t threads = omp_get_max_threads();
#else
  const int64_t threads = 1;
#endif
  return std::max<int64_t>(1, std::min<int64_t>(per_row, items / (4 * threads)));
}

#if GDN_CPU_X86
#define GDN_CPU_DISPATCH(fn, ...) (use_avx2() ? avx2::fn(__VA_ARGS__) : portable::fn(__VA_ARGS__))
#else
#define GDN_CPU_DISPATCH(fn, ...) portable::fn(__VA_ARGS__)
#endif

void load_step_inputs(const Problem& p, int64_t n, int64_t hv, int64_t t0, int64_t nt, StepInputs& in) {
  GDN_CPU_DISPATCH(load_step_inputs_impl, p, n, hv, t0, nt, in);
}

void normalize_qk(float* x, int64_t K, float scale, bool l2norm) {
  GDN_CPU_DISPATCH(normalize_qk_impl, x, K, scale, l2norm);
}

void step_head(const Problem& p, int64_t n, int64_t hv, const RowSlots& rs, const StepInputs& in, int64_t v0,
               int64_t v1, StepOutput& out, StepCarry& carry, const StateRounding& rounding) {
  GDN_CPU_DISPATCH(step_head_impl, p, n, hv, rs, in, v0, v1, out, carry, rounding);
}

void store_o(const Problem& p, int64_t n, int64_t hv, int64_t t0, int64_t nt, int64_t v0, int64_t v1,
             const StepOutput& out) {
  GDN_CPU_DISPATCH(store_o_impl, p, n, hv, t0, nt, v0, v1, out);
}

#undef GDN_CPU_DISPATCH

}  // namespace gdn::detail::cpu
