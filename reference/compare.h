// Agreement between a backend's result and the oracle's, judged by the tolerances of
// docs/semantics.md section 6. One definition, used by the tests and by `gdn run`.
#pragma once

#include <cstdint>
#include <string>

#include "gdn/gdn.h"

namespace gdn::reference {

struct Agreement {
  int64_t elements = 0;
  int64_t vectors = 0;
  int64_t nan = 0;             // NaN or Inf in the result where the oracle is finite
  int64_t over_1ulp = 0;       // 16-bit storage: elements more than 1 ulp away
  int64_t over_2ulp = 0;       // 16-bit storage: elements more than 2 ulp away
  int64_t strict_over_2ulp = 0;  // same by raw bit distance, without the cancellation floor (reported only)
  double max_rel_frob = 0.0;   // max over vectors of ||got - want|| / max(||want||, tensor RMS norm / 16)
  int64_t zero_mismatch = 0;   // vectors where the oracle is exactly zero but the result is not

  // One call: fp32 <= 1e-5 relative Frobenius per vector; 16-bit: <= 1 ulp on >= 99.9%
  // of elements and <= 2 ulp everywhere. `many_steps`: relative Frobenius <= 1e-2 for 16-bit.
  bool ok(DLDataType storage, bool many_steps = false) const;
  std::string summary(DLDataType storage) const;
};

// Compares `nvec` vectors of `len` elements, stored contiguously in `storage` dtype
// (float32, bfloat16 or float16), and accumulates into `acc`. Pass a whole tensor of one call
// (all rows, tokens and heads) at once: the cancellation floor for 16-bit storage is taken
// relative to the RMS of everything passed.
void compare_vectors(const void* got, const void* want, DLDataType storage, int64_t nvec, int64_t len,
                     Agreement* acc);

// Distance in units in the last place between two 16-bit values (bf16 or fp16 bit patterns).
int64_t ulp_distance16(uint16_t a, uint16_t b);

}  // namespace gdn::reference
