// CPU backend: the step of docs/semantics.md section 2, threaded with OpenMP over work items
// (row n, value head hv, part of the head's value indices). Each item loads its tokens'
// inputs, runs the recurrence and stores o through the pieces of step_cpu.h, which the fused
// layer step shares. Items of one head touch disjoint state rows (VK) or columns (KV), so
// any split gives the same bits; heads are split only when there are too few of them to
// keep every thread busy.
#include <algorithm>
#include <atomic>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../backends.h"
#include "step_cpu.h"

namespace gdn::detail {
namespace {

// Per-thread buffers: fixed size, so the call never allocates.
struct Workspace {
  cpu::StepInputs in;
  cpu::StepOutput out;
  cpu::StepCarry carry;
};

Workspace& workspace() {
  static thread_local Workspace w;
  return w;
}

int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Parts per head: enough items for four per thread, parts of at least 32 value indices.
int64_t parts_per_head(const Problem& p) {
  const int64_t want = 4 * static_cast<int64_t>(max_threads());
  int64_t parts = 1;
  while (p.B * p.HV * parts < want && p.V / (2 * parts) >= 32) parts *= 2;
  return parts;
}

void run_item(const Problem& p, int64_t item, int64_t parts, int64_t width, const cpu::StateRounding& rounding) {
  const int64_t head = item / parts;
  const int64_t n = head / p.HV, hv = head % p.HV;
  const int64_t v0 = (item % parts) * width, v1 = v0 + width;
  const RowSlots rs = resolve_row(p, n);
  if (rs.read < 0) {
    cpu::zero_o(p, n, hv, v0, v1);
    return;
  }
  Workspace& w = workspace();
  for (int64_t t0 = 0; t0 < p.T; t0 += cpu::kMaxT) {
    const int64_t nt = std::min<int64_t>(cpu::kMaxT, p.T - t0);
    cpu::load_step_inputs(p, n, hv, t0, nt, w.in);
    cpu::step_head(p, n, hv, rs, w.in, v0, v1, w.out, w.carry, rounding);
    cpu::store_o(p, n, hv, t0, nt, v0, v1, w.out);
  }
}

void run_all(const Problem& p) {
  const int64_t parts = parts_per_head(p);
  const int64_t width = p.V / parts;
  const int64_t items = p.B * p.HV * parts;
  // Chunks of consecutive heads (cpu::item_chunk), handed out dynamically: padding rows cost
  // nothing, so equal shares are not equal work.
  const int64_t chunk = cpu::item_chunk(items, p.HV * parts);
  const cpu::StateRounding rounding = cpu::state_rounding(p);
#pragma omp parallel for schedule(dynamic, chunk)
  for (int64_t item = 0; item < items; ++item) run_item(p, item, parts, width, rounding);
}

// Slots written by row n (final or per-token), for the duplicate-write check.
bool writes_slot(const Problem& p, int64_t n, int64_t slot) {
  const RowSlots rs = resolve_row(p, n);
  for (int64_t t = 0; t < p.T; ++t)
    if (token_write_slot(p, rs, n, t) == slot) return true;
  return false;
}

}  // namespace

int cpu::count_bad_rows(const Problem& p) {
  int bad = 0;
  for (int64_t n = 0; n < p.B; ++n) bad += resolve_row(p, n).invalid ? 1 : 0;
  if (p.check_duplicate_writes && p.update_state) {
    // O((B*T)^2) and allocation-free: a debugging mode, not the hot path.
    for (int64_t n = 0; n < p.B; ++n) {
      const RowSlots rs = resolve_row(p, n);
      bool dup = false;
      for (int64_t t = 0; t < p.T && !dup; ++t) {
        const int64_t s = token_write_slot(p, rs, n, t);
        if (s < 0) continue;
        for (int64_t m = 0; m < p.B && !dup; ++m) dup = m != n && writes_slot(p, m, s);
      }
      bad += dup ? 1 : 0;
    }
  }
  return bad;
}

void cpu::add_error_count(const Problem& p, int bad) {
  // Atomic: the counter may be shared by calls running on other threads at the same time.
  if (p.error_count != nullptr && bad != 0) std::atomic_ref<int>(*p.error_count).fetch_add(bad);
}

void decode_cpu(const Problem& p) {
  cpu::add_error_count(p, cpu::count_bad_rows(p));
  run_all(p);
}

}  // namespace gdn::detail
