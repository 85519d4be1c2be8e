// The CPU recurrence (docs/semantics.md section 2) in three pieces, shared by decode
// (decode_cpu.cpp) and the fused layer step (fused_cpu.cpp), for one (row n, value head hv)
// and one block of at most kMaxT tokens of the call:
//
//   1. inputs      StepInputs holds the block's per-token q, k (normalized, q scaled), v, g
//                  and beta in fp32. Decode fills it with load_step_inputs (from p.q, p.k, p.v
//                  and the gates). The fused step sets t0 and nt, writes q, k, v from its conv
//                  instead, then calls normalize_qk on q (p.scale) and k (1) and takes g and
//                  beta from step_gates.
//   2. recurrence  step_head runs the block's tokens over value indices [v0, v1) of the head:
//                  it reads the state from slot rs.read (first block) or from the carry,
//                  stores intermediate-cache entries and state slots where the contract says
//                  (per-token slots, final write slot, update_state), rounding 16-bit stores
//                  as StateRounding says, and writes o as fp32 into StepOutput. Value indices
//                  are independent in the math (the rounding's random bits depend on the
//                  element's index, not on the split), so disjoint [v0, v1) ranges of one head
//                  may run on different threads.
//   3. output      store_o converts StepOutput to p.o's dtype. The fused step instead applies
//                  its gated RMSNorm to each full V-vector before storing, so it passes
//                  v0 = 0, v1 = V to step_head.
//
// Padding rows (rs.read < 0) never reach step_head: the caller writes zeros (zero_o).
// Everything here is allocation-free and deterministic (fixed summation orders, no
// dependence on threads). Each function dispatches at run time to AVX2+FMA+F16C kernels
// when the CPU has them (GCC/Clang target attributes, x86 only), else to portable C++;
// GDN_CPU_SIMD=0 in the environment (read once) forces the portable kernels, for tests.
#pragma once

#include <cstdint>

#include "../problem.h"

namespace gdn::detail::cpu {

constexpr int kMaxDim = 256;  // largest K or V (check.cpp enforces 64, 128, 256)
constexpr int kMaxT = 16;     // tokens per block; longer calls run in blocks, carrying the state
constexpr int kVecWidth = 8;  // fp32 lanes of a kernel vector; v0 and v1 are multiples of 2 * kVecWidth

// How the call rounds its 16-bit state stores (StepArgs::rounding_seed, src/rounding.h):
// resolved once per call by state_rounding, which reads the seed's value, so every head of the
// call uses the same one. Without a seed (or with an fp32 state): round-to-nearest-even.
struct StateRounding {
  bool stochastic = false;
  int64_t seed = 0;
};
StateRounding state_rounding(const Problem& p);

// Per-token inputs of one (n, hv) for tokens t0 .. t0 + nt - 1 of the call.
struct StepInputs {
  int64_t t0 = 0;
  int64_t nt = 0;                          // 1..kMaxT
  alignas(64) float q[kMaxT][kMaxDim];     // q * rsqrt(sum q^2 + 1e-6) * scale (or q * scale)
  alignas(64) float k[kMaxT][kMaxDim];     // k * rsqrt(sum k^2 + 1e-6) (or k)
  alignas(64) float v[kMaxT][kMaxDim];
  float g[kMaxT];     // decay: exp(-exp(A_log) * softplus(a + dt_bias)), or exp(g_in)
  float beta[kMaxT];  // sigmoid(b), or beta_in
};

// o[j][c]: output of token t0 + j, value index c, fp32 (only [v0, v1) written).
struct StepOutput {
  alignas(64) float o[kMaxT][kMaxDim];
};

// Row stride of the KV layout's fp32 head tile in StepCarry (rows padded, see step_kernels.inc).
constexpr int64_t kKvLd(int64_t V) { return V + 16; }

// The state of one head between token blocks (calls with T > kMaxT), fp32: VK [V][K]; KV
// K rows of kKvLd(V) floats (the KV tile path works in it for every T > 1).
struct StepCarry {
  alignas(64) float s[kMaxDim * kKvLd(kMaxDim)];
};

// Fills `in` for tokens [t0, t0 + nt) of (n, hv) from p.q, p.k, p.v (any strides, dtypes) and
// the gates (raw or precomputed).
void load_step_inputs(const Problem& p, int64_t n, int64_t hv, int64_t t0, int64_t nt, StepInputs& in);

// x[0..K) <- x * rsqrt(sum x^2 + 1e-6) * scale when l2norm, else x * scale. K % kVecWidth == 0.
void normalize_qk(float* x, int64_t K, float scale, bool l2norm);

// g and beta of token t of (n, hv) (section 2: softplus threshold 20, sigmoid; or as given).
void step_gates(const Problem& p, int64_t n, int64_t t, int64_t hv, float* g, float* beta);

// The recurrence for the tokens of `in` on value indices [v0, v1) of head hv of row n.
// rs must be a valid row (rs.read >= 0). `carry` holds the state between blocks (read when
// in.t0 > 0, holding the state when tokens remain after this block) and is the KV tile path's
// scratch for every T > 1 and every stochastically rounded call. One carry per thread; the same
// thread runs a head's blocks. `rounding` is the call's state_rounding(p).
void step_head(const Problem& p, int64_t n, int64_t hv, const RowSlots& rs, const StepInputs& in,
               int64_t v0, int64_t v1, StepOutput& out, StepCarry& carry, const StateRounding& rounding);

// o[n, t0 + j, hv, v0..v1) <- out.o[j][v0..v1) in p.o's dtype (RNE), j < nt.
void store_o(const Problem& p, int64_t n, int64_t hv, int64_t t0, int64_t nt, int64_t v0, int64_t v1,
             const StepOutput& out);

// o[n, t, hv, v0..v1) <- exact zeros for every token t of the call (padding rows).
void zero_o(const Problem& p, int64_t n, int64_t hv, int64_t v0, int64_t v1);

// Rows the call counts into error_count (docs/semantics.md section 3): invalid rows, plus with
// check_duplicate_writes the rows writing a slot another row writes (O((B*T)^2), a debugging
// mode). add_error_count adds them atomically (the counter may be shared across threads).
int count_bad_rows(const Problem& p);
void add_error_count(const Problem& p, int bad);

// The chunk of consecutive work items a thread takes at a time (OpenMP dynamic schedule): up to
// `per_row` (the items of one row, whose state is adjacent in a compact pool), at least four
// chunks per thread. A thread then streams through contiguous state: with one head at a time
// the two cores of the project's machine took alternate heads, the hardware prefetchers of each
// ran into its neighbour's, and 16-bit states moved 23-27 GB/s instead of 35-38 (Qwen3-Next).
int64_t item_chunk(int64_t items, int64_t per_row);

// Which kernels run: "avx2" or "portable".
const char* cpu_simd_name();

}  // namespace gdn::detail::cpu
