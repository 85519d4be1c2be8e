#include "compare.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "../src/host_dtype.h"

namespace gdn::reference {
namespace {

bool is16(DLDataType t) { return t.bits == 16; }

double to_double(const void* p, DLDataType t, int64_t i) {
  if (t.code == kDLBfloat) return detail::bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
  if (t.bits == 16) return detail::fp16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

}  // namespace

int64_t ulp_distance16(uint16_t a, uint16_t b) {
  // Map sign-magnitude bit patterns to a monotonic integer line (so -0 == +0).
  auto key = [](uint16_t x) -> int64_t { return (x & 0x8000) ? -static_cast<int64_t>(x & 0x7fff) : x; };
  const int64_t d = key(a) - key(b);
  return d < 0 ? -d : d;
}

void compare_vectors(const void* got, const void* want, DLDataType storage, int64_t nvec, int64_t len,
                     Agreement* acc) {
  // fp32 arithmetic leaves an absolute error of a few 2^-24 times the scale of the operands,
  // and cancellation (in S*g + delta*k, or in a k.q that scales a whole output vector) can
  // make a result far smaller than that scale. Such an element cannot be resolved to a
  // bf16/fp16 ulp by any fp32 implementation, so elements below 2^-12 x the RMS of the whole
  // compared tensor are measured in ulps of that floor; all others by exact bit distance
  // (docs/semantics.md, "How correct is correct"). strict_over_2ulp reports the raw count.
  double sum_sq = 0;
  for (int64_t i = 0; i < nvec * len; ++i) {
    const double w = to_double(want, storage, i);
    sum_sq += w * w;
  }
  const double floor_mag = nvec * len ? std::ldexp(std::sqrt(sum_sq / static_cast<double>(nvec * len)), -12) : 0.0;
  const int mant = storage.code == kDLBfloat ? 7 : 10;
  // Never finer than the dtype's subnormal spacing (fp16: 2^-24; bf16: 2^-133).
  const double min_ulp = storage.code == kDLBfloat ? std::ldexp(1.0, -133) : std::ldexp(1.0, -24);
  const double floor_ulp = floor_mag > 0 ? std::max(min_ulp, std::ldexp(1.0, std::ilogb(floor_mag) - mant)) : 0.0;
  // The same cancellation makes some whole vectors far smaller than their peers (a nearly
  // orthogonal k.q scales every output of a head); their relative error is taken against
  // 1/16 of the tensor's RMS vector norm instead of their own norm.
  const double vec_floor = nvec ? std::sqrt(sum_sq / static_cast<double>(nvec)) / 16.0 : 0.0;
  for (int64_t v = 0; v < nvec; ++v) {
    double num = 0, den = 0;
    bool nonzero_got = false;
    for (int64_t i = v * len; i < (v + 1) * len; ++i) {
      const double g = to_double(got, storage, i), w = to_double(want, storage, i);
      if (!std::isfinite(g) && std::isfinite(w)) ++acc->nan;
      num += (g - w) * (g - w);
      den += w * w;
      nonzero_got = nonzero_got || g != 0.0 || std::signbit(g) != std::signbit(w);
      if (is16(storage)) {
        const int64_t bits = ulp_distance16(static_cast<const uint16_t*>(got)[i], static_cast<const uint16_t*>(want)[i]);
        int64_t d = bits;
        if (floor_ulp > 0 && std::fabs(w) < floor_mag && std::fabs(g) < floor_mag)
          d = static_cast<int64_t>(std::ceil(std::fabs(g - w) / floor_ulp - 1e-9));
        acc->over_1ulp += d > 1;
        acc->over_2ulp += d > 2;
        acc->strict_over_2ulp += bits > 2;
      }
    }
    if (den == 0.0) {
      acc->zero_mismatch += nonzero_got || !(num == 0.0);
    } else {
      const double rel = std::sqrt(num) / std::max(std::sqrt(den), vec_floor);
      if (!(rel <= acc->max_rel_frob)) acc->max_rel_frob = std::isnan(rel) ? INFINITY : rel;
    }
    acc->elements += len;
    acc->vectors += 1;
  }
}

bool Agreement::ok(DLDataType storage, bool many_steps) const {
  if (nan || zero_mismatch) return false;
  if (!is16(storage)) return max_rel_frob <= 1e-5;
  if (many_steps) return max_rel_frob <= 1e-2;
  return over_2ulp == 0 && static_cast<double>(over_1ulp) <= 1e-3 * static_cast<double>(elements);
}

std::string Agreement::summary(DLDataType storage) const {
  char buf[256];
  if (is16(storage))
    std::snprintf(buf, sizeof buf, "%lld elems, >1ulp %lld, >2ulp %lld (strict bits %lld), max rel %.2e, nan %lld, zero-mismatch %lld",
                  static_cast<long long>(elements), static_cast<long long>(over_1ulp),
                  static_cast<long long>(over_2ulp), static_cast<long long>(strict_over_2ulp), max_rel_frob, static_cast<long long>(nan),
                  static_cast<long long>(zero_mismatch));
  else
    std::snprintf(buf, sizeof buf, "%lld vectors, max rel Frobenius %.2e, nan %lld, zero-mismatch %lld",
                  static_cast<long long>(vectors), max_rel_frob, static_cast<long long>(nan),
                  static_cast<long long>(zero_mismatch));
  return buf;
}

}  // namespace gdn::reference
