// Internal: exact memory-overlap tests for strided views (docs/semantics.md section 4).
//
// A call's written tensors must share no byte with any other tensor of the call, and no two
// elements of a written tensor may share a byte. Bounding byte ranges alone would refuse
// disjoint interleaved views of one buffer (vLLM keeps a layer's conv state and recurrent
// state interleaved in one page per slot; packed projections interleave q, k, v and z), so a
// range test that finds the two ranges intersecting is followed by an exact one: whether the
// bounded linear Diophantine equation "address of an element of x plus a byte within it ==
// the same for y" has a solution (the formulation of numpy's mem_overlap.c, solved here by a
// depth-first search over the largest coefficients with gcd pruning). Real layouts are
// decided in a handful of steps; a search that exceeds its work bound reports kTooHard, which
// the checks treat as an overlap (refused with a message that says so).
#pragma once

#include <cstdint>

#include "gdn/gdn.h"

namespace gdn::detail {

// The byte footprint of a view: element (i_0, .., i_{n-1}) covers bytes
// [lo + sum_d i_d * stride_d, + itemsize), every stride positive after normalization
// (negative strides are flipped by moving lo; size-1 and zero-size dims are dropped;
// stride-0 dims are kept, because they matter for internal overlap).
struct Footprint {
  bool empty = false;  // no element at all: overlaps nothing
  uint64_t lo = 0;     // lowest byte address touched
  uint64_t hi = 0;     // one past the highest byte address touched
  int64_t itemsize = 0;
  int n = 0;
  int64_t stride[kMaxRank] = {};  // bytes, >= 0
  int64_t count[kMaxRank] = {};   // elements along the dim, >= 2
};

enum class Overlap { kNo, kYes, kTooHard };

// Fills `out` for `v` with elements of `itemsize` bytes. Returns false when a byte offset or
// address of the view cannot be represented (int64 overflow) or lies beyond 2^57 bytes, where no
// address space reaches: such a view is refused before any other test.
bool footprint(const TensorView& v, int64_t itemsize, Footprint* out);

// The first `elements` elements of a rank-1 view only (error_count uses element 0).
Footprint first_element(const TensorView& v, int64_t itemsize);

// Whether some byte lies in both footprints.
Overlap overlaps(const Footprint& x, const Footprint& y);

// Whether two distinct elements of `x` share a byte.
Overlap self_overlaps(const Footprint& x);

}  // namespace gdn::detail
