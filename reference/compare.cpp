#include "compare.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "../src/host_dtype.h"

namespace gdn::reference {
namespace {

constexpr double kRelFp32 = 1e-5;       // fp32 storage
constexpr double kRelManySteps = 1e-2;  // 16-bit storage after many steps

bool is16(DLDataType t) { return t.bits == 16; }
bool is_bf16(DLDataType t) { return t.code == kDLBfloat; }

double to_double(const void* p, DLDataType t, int64_t i) {
  if (is_bf16(t)) return detail::bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
  if (t.bits == 16) return detail::fp16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

}  // namespace

int64_t ulp_distance16(DLDataType storage, uint16_t a, uint16_t b) {
  const uint16_t inf = is_bf16(storage) ? 0x7f80 : 0x7c00;
  if ((a & 0x7fff) > inf || (b & 0x7fff) > inf) return std::numeric_limits<int64_t>::max();
  // Map sign-magnitude bit patterns to a monotonic integer line (so -0 == +0).
  auto key = [](uint16_t x) -> int64_t { return (x & 0x8000) ? -static_cast<int64_t>(x & 0x7fff) : x; };
  const int64_t d = key(a) - key(b);
  return d < 0 ? -d : d;
}

void compare_vectors(const void* got, const void* want, DLDataType storage, int64_t nvec, int64_t len,
                     Agreement* acc, bool many_steps) {
  acc->storage = storage;
  acc->many_steps = many_steps;
  const bool ulp_rule = is16(storage) && !many_steps;
  const double rel_bound = is16(storage) ? kRelManySteps : kRelFp32;
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
  acc->tensor_rms = nvec * len ? std::sqrt(sum_sq / static_cast<double>(nvec * len)) : 0.0;
  const double floor_mag = std::ldexp(acc->tensor_rms, -12);
  const int mant = is_bf16(storage) ? 7 : 10;
  // Never finer than the dtype's subnormal spacing (fp16: 2^-24; bf16: 2^-133).
  const double min_ulp = is_bf16(storage) ? std::ldexp(1.0, -133) : std::ldexp(1.0, -24);
  const double floor_ulp = floor_mag > 0 ? std::max(min_ulp, std::ldexp(1.0, std::ilogb(floor_mag) - mant)) : 0.0;
  // The same cancellation makes some whole vectors far smaller than their peers (a nearly
  // orthogonal k.q scales every output of a head); their relative error is taken against
  // 1/16 of the tensor's RMS vector norm instead of their own norm.
  const double vec_floor = nvec ? std::sqrt(sum_sq / static_cast<double>(nvec)) / 16.0 : 0.0;
  acc->vector_floor = vec_floor;
  for (int64_t v = 0; v < nvec; ++v) {
    double num = 0, den = 0, max_abs = -1;
    int64_t max_at = v * len;
    bool nonzero_got = false, bad_value = false;
    int64_t max_ulp = 0;
    for (int64_t i = v * len; i < (v + 1) * len; ++i) {
      const double g = to_double(got, storage, i), w = to_double(want, storage, i);
      // NaN never passes; an Inf only where the oracle has the same Inf.
      const bool bad = std::isnan(g) || std::isnan(w) || (std::isinf(g) && g != w);
      acc->nan += bad;
      bad_value = bad_value || bad;
      num += (g - w) * (g - w);
      den += w * w;
      nonzero_got = nonzero_got || g != 0.0 || std::signbit(g) != std::signbit(w);
      const double a = bad ? INFINITY : std::fabs(g - w);
      if (a > max_abs) max_abs = a, max_at = i;
      if (is16(storage)) {
        const int64_t bits =
            ulp_distance16(storage, static_cast<const uint16_t*>(got)[i], static_cast<const uint16_t*>(want)[i]);
        int64_t d = bits;
        if (floor_ulp > 0 && std::fabs(w) < floor_mag && std::fabs(g) < floor_mag)
          d = static_cast<int64_t>(std::ceil(std::fabs(g - w) / floor_ulp - 1e-9));
        acc->over_1ulp += d > 1;
        acc->over_2ulp += d > 2;
        acc->strict_over_2ulp += bits > 2;
        max_ulp = std::max(max_ulp, d);
        const double e = d == std::numeric_limits<int64_t>::max() ? INFINITY : static_cast<double>(d);
        if (ulp_rule && e > acc->worst.error)
          acc->worst = {acc->vectors, i - v * len, g, w, e, 0.0};
      }
    }
    double rel;
    bool zero_mismatch = false;
    if (den == 0.0) {
      zero_mismatch = nonzero_got || !(num == 0.0);
      acc->zero_mismatch += zero_mismatch;
      rel = zero_mismatch ? INFINITY : 0.0;
    } else {
      rel = std::sqrt(num) / std::max(std::sqrt(den), vec_floor);
      if (std::isnan(rel)) rel = INFINITY;
      if (!(rel <= acc->max_rel_frob)) acc->max_rel_frob = rel;
    }
    if (ulp_rule) {
      acc->worst.norm = acc->worst.vector == acc->vectors ? std::sqrt(den) : acc->worst.norm;
    } else if (rel > acc->worst.error) {
      acc->worst = {acc->vectors, max_at - v * len, to_double(got, storage, max_at), to_double(want, storage, max_at),
                    rel, std::sqrt(den)};
    }
    acc->failing_vectors += bad_value || zero_mismatch || (ulp_rule ? max_ulp > 2 : !(rel <= rel_bound));
    acc->elements += len;
    acc->vectors += 1;
  }
}

bool Agreement::ok() const {
  if (nan || zero_mismatch) return false;
  if (!is16(storage)) return max_rel_frob <= kRelFp32;
  if (many_steps) return max_rel_frob <= kRelManySteps;
  return over_2ulp == 0 && static_cast<double>(over_1ulp) <= 1e-3 * static_cast<double>(elements);
}

std::string Agreement::summary() const {
  char buf[320];
  if (is16(storage) && !many_steps)
    std::snprintf(buf, sizeof buf,
                  "%lld elems, >1ulp %lld (allowed %lld), >2ulp %lld (strict bits %lld), max rel %.2e, nan %lld, "
                  "zero-mismatch %lld",
                  static_cast<long long>(elements), static_cast<long long>(over_1ulp),
                  static_cast<long long>(1e-3 * static_cast<double>(elements)), static_cast<long long>(over_2ulp),
                  static_cast<long long>(strict_over_2ulp), max_rel_frob, static_cast<long long>(nan),
                  static_cast<long long>(zero_mismatch));
  else
    std::snprintf(buf, sizeof buf, "%lld vectors, max rel Frobenius %.2e (bound %.0e), nan %lld, zero-mismatch %lld",
                  static_cast<long long>(vectors), max_rel_frob, is16(storage) ? kRelManySteps : kRelFp32,
                  static_cast<long long>(nan), static_cast<long long>(zero_mismatch));
  return buf;
}

std::string Agreement::worst_summary(const std::string& where) const {
  if (worst.vector < 0) return "no element compared";
  char buf[320];
  const bool ulps = is16(storage) && !many_steps;
  std::snprintf(buf, sizeof buf,
                " element %lld: got %.9g want %.9g (%s %.3g; vector norm %.3g, floor %.3g, tensor RMS %.3g)",
                static_cast<long long>(worst.element), worst.got, worst.want,
                ulps ? "ulp" : "rel Frobenius of its vector", worst.error, worst.norm, vector_floor, tensor_rms);
  return (where.empty() ? "vector " + std::to_string(worst.vector) : where) + buf;
}

}  // namespace gdn::reference
