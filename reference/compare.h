// Agreement between a backend's result and the oracle's, judged by the tolerances of
// docs/semantics.md section 5 ("How correct is correct"). The one definition of that rule:
// used by the C++ tests, by the Python tests (through gdn._C._agreement) and by `gdn run`.
#pragma once

#include <cstdint>
#include <string>

#include "gdn/gdn.h"

namespace gdn::reference {

struct Agreement {
  // The rule the counts were taken for (set by compare_vectors).
  DLDataType storage = kFloat32;
  bool many_steps = false;

  int64_t elements = 0;
  int64_t vectors = 0;
  int64_t nan = 0;             // NaN anywhere, or an Inf in the result the oracle does not have
  int64_t over_1ulp = 0;       // 16-bit storage: elements more than 1 ulp away
  int64_t over_2ulp = 0;       // 16-bit storage: elements more than 2 ulp away
  int64_t strict_over_2ulp = 0;  // same by raw bit distance, without the cancellation floor (reported only)
  double max_rel_frob = 0.0;   // max over vectors of ||got - want|| / max(||want||, tensor RMS norm / 16)
  int64_t zero_mismatch = 0;   // vectors where the oracle is exactly zero but the result is not
  // Vectors that break the rule on their own: a NaN, a zero mismatch, or (16-bit, one call)
  // an element more than 2 ulp away, or (otherwise) a relative Frobenius error over the bound.
  int64_t failing_vectors = 0;

  // Scales of the last compare_vectors call, over everything it was passed.
  double tensor_rms = 0.0;    // RMS of the oracle's elements
  double vector_floor = 0.0;  // RMS vector norm / 16: the least norm a vector is measured against

  // Where the result is furthest from the oracle. 16-bit storage, one call: the element with
  // the largest ulp distance (`error`, in ulps after the cancellation floor; Inf for NaN).
  // Otherwise: the element with the largest |got - want| of the vector with the largest
  // relative Frobenius error (`error`; Inf for a NaN or a zero mismatch).
  struct Element {
    int64_t vector = -1;   // index among all vectors passed to compare_vectors for this Agreement
    int64_t element = -1;  // index within that vector
    double got = 0.0, want = 0.0;
    double error = -1.0;
    double norm = 0.0;     // ||want|| of that vector
  };
  Element worst;

  // fp32: <= 1e-5 relative Frobenius per vector; 16-bit, one call: <= 1 ulp on >= 99.9% of
  // elements and <= 2 ulp everywhere; 16-bit, many steps: relative Frobenius <= 1e-2. Always:
  // no NaN, exact zero where the oracle is exactly zero.
  bool ok() const;
  std::string summary() const;
  // Where and how far the worst element is off, for failure messages; `where` names its
  // vector ("vector <index>" when empty).
  std::string worst_summary(const std::string& where = "") const;
};

// Compares `nvec` vectors of `len` elements, stored contiguously in `storage` dtype
// (float32, bfloat16 or float16), and accumulates into `acc`. Pass a whole tensor of one call
// (all rows, tokens and heads) at once: the cancellation floors (16-bit elements, and the
// least norm of a vector) are taken relative to the RMS of everything passed. `many_steps`:
// judge by the many-steps bound (docs/semantics.md section 5).
void compare_vectors(const void* got, const void* want, DLDataType storage, int64_t nvec, int64_t len,
                     Agreement* acc, bool many_steps = false);

// Distance in units in the last place between two bf16 or fp16 values (`storage` says
// which) given as bit patterns; -0 == +0; NaN on either side is infinitely far (INT64_MAX).
int64_t ulp_distance16(DLDataType storage, uint16_t a, uint16_t b);

}  // namespace gdn::reference
