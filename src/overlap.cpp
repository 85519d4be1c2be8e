// Exact overlap tests for strided views; see overlap.h for the formulation.
#include "overlap.h"

#include <algorithm>
#include <utility>
#include <cstdlib>
#include <numeric>

namespace gdn::detail {
namespace {

using i128 = __int128;

// Bounded linear Diophantine equation sum_k a_k z_k = rhs, 0 <= z_k <= ub_k, a_k > 0.
// With `nontrivial`, a solution must differ from `center` in some tracked term (center >= 0):
// the internal-overlap form, whose trivial solution is "an element overlaps itself".
struct Term {
  int64_t a = 0;
  int64_t ub = 0;
  int64_t center = -1;
};

constexpr int kMaxTerms = 2 * kMaxRank + 1;
// Search nodes before giving up. Real layouts (each stride beyond the extent of the smaller
// dims, or interleaved views of such a buffer) take a few nodes per term.
constexpr int64_t kMaxWork = 1 << 14;

int64_t gcd64(int64_t a, int64_t b) { return std::gcd(a, b); }

// x with (a * x) % m == 1 for gcd(a, m) == 1, m >= 1.
int64_t mod_inverse(int64_t a, int64_t m) {
  i128 t = 0, nt = 1, r = m, nr = a % m;
  while (nr != 0) {
    const i128 q = r / nr;
    const i128 tt = t - q * nt;
    t = nt;
    nt = tt;
    const i128 rr = r - q * nr;
    r = nr;
    nr = rr;
  }
  if (t < 0) t += m;
  return static_cast<int64_t>(t);
}

class Solver {
 public:
  Solver(Term* terms, int n, bool nontrivial) : t_(terms), n_(n), nontrivial_(nontrivial) {
    // Insertion sort by coefficient, largest first (n <= kMaxTerms).
    for (int i = 1; i < n_; ++i)
      for (int j = i; j > 0 && t_[j - 1].a < t_[j].a; --j) std::swap(t_[j - 1], t_[j]);
    rest_[n_] = 0;
    gsuf_[n_] = 0;
    for (int i = n_ - 1; i >= 0; --i) {
      rest_[i] = rest_[i + 1] + static_cast<i128>(t_[i].a) * t_[i].ub;
      gsuf_[i] = gcd64(t_[i].a, gsuf_[i + 1]);
    }
  }

  Overlap solve(i128 rhs) {
    const int r = dfs(0, rhs, false);
    return r < 0 ? Overlap::kTooHard : r > 0 ? Overlap::kYes : Overlap::kNo;
  }

 private:
  // 1: a solution exists; 0: none; -1: the work bound was hit.
  int dfs(int i, i128 rhs, bool differs) {
    if (++work_ > kMaxWork) return -1;
    if (rhs < 0 || rhs > rest_[i]) return 0;
    if (i == n_) return rhs == 0 && (!nontrivial_ || differs) ? 1 : 0;
    if (rhs % gsuf_[i] != 0) return 0;
    const Term& tm = t_[i];
    const i128 a = tm.a;
    // a*z <= rhs and rhs - a*z <= rest_[i + 1].
    i128 lo = rhs - rest_[i + 1] <= 0 ? 0 : (rhs - rest_[i + 1] + a - 1) / a;
    i128 hi = std::min<i128>(tm.ub, rhs / a);
    if (lo > hi) return 0;
    // rhs - a*z must be a multiple of g, the gcd of the remaining coefficients: z = z0 mod m.
    const int64_t g = gsuf_[i + 1];
    i128 m = 1, z0 = 0;
    if (g == 0) {  // last term: z is determined
      if (rhs % a != 0) return 0;
      lo = hi = rhs / a;
      if (lo > tm.ub) return 0;
    } else {
      const int64_t d = gcd64(tm.a, g);
      m = g / d;
      if (m > 1) {
        const int64_t ad = static_cast<int64_t>((a / d) % m);
        const i128 r = (rhs / d) % m;
        z0 = (r * mod_inverse(ad, static_cast<int64_t>(m))) % m;
      }
    }
    // Largest z <= hi with z = z0 (mod m), then downwards.
    i128 z = hi - ((hi - z0) % m + m) % m;
    for (; z >= lo; z -= m) {
      const bool d = differs || (tm.center >= 0 && z != tm.center);
      const int r = dfs(i + 1, rhs - a * z, d);
      if (r != 0) return r;
    }
    return 0;
  }

  Term* t_;
  int n_;
  bool nontrivial_;
  int64_t work_ = 0;
  i128 rest_[kMaxTerms + 1];
  int64_t gsuf_[kMaxTerms + 1];
};

bool mul_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
bool add_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

}  // namespace

bool footprint(const TensorView& v, int64_t itemsize, Footprint* out) {
  Footprint f;
  f.itemsize = itemsize;
  for (int i = 0; i < v.ndim; ++i)
    if (v.shape[i] == 0) {
      f.empty = true;
      *out = f;
      return true;
    }
  int64_t neg = 0, pos = 0;  // byte spans below and above element [0, ...]
  for (int i = 0; i < v.ndim; ++i) {
    if (v.shape[i] < 0) return false;
    if (v.shape[i] == 1) continue;
    int64_t s, span;
    if (v.strides[i] == INT64_MIN || !mul_ok(std::abs(v.strides[i]), itemsize, &s) ||
        !mul_ok(v.shape[i] - 1, s, &span))
      return false;
    if (!add_ok(v.strides[i] < 0 ? neg : pos, span, v.strides[i] < 0 ? &neg : &pos)) return false;
    f.stride[f.n] = s;
    f.count[f.n] = v.shape[i];
    ++f.n;
  }
  const uint64_t base = reinterpret_cast<uintptr_t>(v.data);
  int64_t top;
  if (!add_ok(pos, itemsize, &top)) return false;
  // No address space reaches 2^57 bytes (x86-64 with five-level paging; AArch64 and CUDA's
  // unified addresses stay lower): a view beyond it cannot be memory, however its arithmetic
  // fits 64 bits.
  constexpr uint64_t kAddressLimit = uint64_t{1} << 57;
  if (base < static_cast<uint64_t>(neg) || base > kAddressLimit || static_cast<uint64_t>(top) > kAddressLimit - base)
    return false;
  f.lo = base - static_cast<uint64_t>(neg);
  f.hi = base + static_cast<uint64_t>(top);
  *out = f;
  return true;
}

Footprint first_element(const TensorView& v, int64_t itemsize) {
  Footprint f;
  f.itemsize = itemsize;
  f.lo = reinterpret_cast<uintptr_t>(v.data);
  f.hi = f.lo + static_cast<uint64_t>(itemsize);
  return f;
}

Overlap overlaps(const Footprint& x, const Footprint& y) {
  if (x.empty || y.empty) return Overlap::kNo;
  if (x.hi <= y.lo || y.hi <= x.lo) return Overlap::kNo;
  // x.lo + sum a_i x_i + c == y.lo + sum b_j y_j + d, c < x.itemsize, d < y.itemsize.
  // With y'_j = ub_j - y_j and d' = y.itemsize - 1 - d every coefficient is positive:
  //   sum a_i x_i + sum b_j y'_j + (c + d') = y.hi - 1 - x.lo.
  // Terms of equal coefficient merge into one (their sum takes every value in between).
  Term terms[kMaxTerms];
  int n = 0;
  const auto add = [&](int64_t a, int64_t ub) {
    if (a == 0 || ub == 0) return;
    for (int k = 0; k < n; ++k)
      if (terms[k].a == a) {
        terms[k].ub += ub;
        return;
      }
    terms[n++] = Term{a, ub, -1};
  };
  for (int i = 0; i < x.n; ++i) add(x.stride[i], x.count[i] - 1);
  for (int j = 0; j < y.n; ++j) add(y.stride[j], y.count[j] - 1);
  add(1, x.itemsize - 1 + y.itemsize - 1);
  Solver s(terms, n, false);
  return s.solve(static_cast<i128>(y.hi) - 1 - static_cast<i128>(x.lo));
}

Overlap self_overlaps(const Footprint& x) {
  if (x.empty || x.n == 0) return Overlap::kNo;
  int order[kMaxRank];
  for (int i = 0; i < x.n; ++i) {
    // Two neighbours along a dim share a byte, or two dims walk the same steps.
    if (x.stride[i] < x.itemsize) return Overlap::kYes;
    for (int j = 0; j < i; ++j)
      if (x.stride[j] == x.stride[i]) return Overlap::kYes;
    order[i] = i;
  }
  // Nested strides (each beyond the whole extent of the smaller ones): no two elements meet.
  for (int i = 1; i < x.n; ++i)
    for (int j = i; j > 0 && x.stride[order[j - 1]] > x.stride[order[j]]; --j) std::swap(order[j - 1], order[j]);
  i128 extent = x.itemsize;
  bool nested = true;
  for (int k = 0; k < x.n && nested; ++k) {
    const int d = order[k];
    nested = x.stride[d] >= extent;
    extent += static_cast<i128>(x.stride[d]) * (x.count[d] - 1);
  }
  if (nested) return Overlap::kNo;
  // Distinct elements i, i' overlap iff sum s_d (i_d - i'_d) = r, r in [0, itemsize) for some
  // nonzero difference. With z_d = i_d - i'_d + ub_d in [0, 2 ub_d] and r' = itemsize - 1 - r:
  //   sum s_d z_d + r' = sum s_d ub_d + itemsize - 1, with z != ub.
  Term terms[kMaxTerms];
  int n = 0;
  i128 rhs = x.itemsize - 1;
  for (int i = 0; i < x.n; ++i) {
    terms[n++] = Term{x.stride[i], 2 * (x.count[i] - 1), x.count[i] - 1};
    rhs += static_cast<i128>(x.stride[i]) * (x.count[i] - 1);
  }
  if (x.itemsize > 1) terms[n++] = Term{1, x.itemsize - 1, -1};
  Solver s(terms, n, true);
  return s.solve(rhs);
}

}  // namespace gdn::detail
