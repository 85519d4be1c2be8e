// Internal: the flat, validated description of one decode call that every backend
// consumes (FlashAttention/Mamba-style params struct: raw pointers plus int64 strides in
// elements). Built once by check.cpp from gdn::DecodeArgs; backends never see TensorView.
// Compiles as host and device code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define GDN_HD __host__ __device__ __forceinline__
#else
#define GDN_HD inline
#endif

namespace gdn::detail {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2, kI32 = 3, kI64 = 4 };

// A strided view of at most 4 dims, dims known from context. Stride units are elements.
struct Ptr {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t s[4] = {0, 0, 0, 0};
};

struct Problem {
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, P = 0;

  // q, k: [B, T, H, K]; v: [B, T, HV, V]; s[0..2] = b, t, head strides, s[3] the innermost
  // (1 on the fast path; any value is read element by element). In a fused problem they are
  // the views of mixed_qkv's q, k and v parts (the conv inputs), never read as the step's q, k, v.
  Ptr q, k, v;
  // Gates: [B, T, HV], s[0..2]. raw_gates: a, b, A_log[HV] (s[0]), dt_bias[HV] (s[0]);
  // else g (fp32), beta.
  bool raw_gates = true;
  Ptr a, b, A_log, dt_bias, g, beta;

  // State: s[0] slot, s[1] head, s[2] row (row = V index for VK, K index for KV); inner 1.
  Ptr state;
  bool layout_kv = false;  // false: VK [.., V, K]; true: KV [.., K, V]
  int64_t rows = 0;        // V for VK, K for KV
  int64_t cols = 0;        // K for VK, V for KV (the contiguous dim)

  // Addressing. Absent pointers have data == nullptr. s[0] (and s[1] for token_slots).
  Ptr read_slots, write_slots, token_slots, num_accepted;

  // Intermediate cache [B, T, HV, rows, cols]: s[0] b, s[1] t, s[2] head, s[3] row.
  Ptr inter;
  // Output [B, T, HV, V]: s[0] b, s[1] t, s[2] head, innermost 1.
  Ptr o;

  int* error_count = nullptr;
  // Stochastic rounding of 16-bit state stores: the seed's address (int64 [1]); null = RNE.
  // Set only for bf16 / fp16 states (fp32 stores never round). src/rounding.h has the rule.
  const int64_t* rounding_seed = nullptr;
  int device_id = 0;  // CUDA device of every tensor (kDLCUDA calls)
  float scale = 1.f;
  bool use_qk_l2norm = true;
  bool update_state = true;
  bool check_duplicate_writes = false;
};

// The fused layer step (gdn::fused_decode): the recurrence's Problem plus the conv update and
// the gated norm (docs/semantics.md section 6). step.q, step.k, step.v view mixed_qkv's parts
// (the conv inputs of the newest token); the backends compute the step's q, k, v from the conv.
struct FusedProblem {
  Problem step;
  int64_t D = 0;  // conv channels: 2*H*K + HV*V, in the order q | k | v
  int64_t W = 0;  // conv taps, 2..4
  int64_t L = 0;  // conv-state columns, >= W - 1; column L - 1 is the newest input
  Ptr x;            // mixed_qkv [B, T, D]: s[0] b, s[1] t, s[2] d
  Ptr conv_weight;  // [D, W]: s[0] d, s[1] w
  Ptr conv_bias;    // [D]: s[0]; data null when absent
  Ptr conv_state;   // [P, D, L]: s[0] slot, s[1] d, s[2] column
  Ptr conv_inter;   // [B, T, D, L]: s[0] b, s[1] t, s[2] d, s[3] column; data null when absent
  Ptr norm_weight;  // [V]: s[0]; data null when absent (no norm)
  Ptr z;            // [B, T, HV, V]: s[0..3]; data null when absent (no gate)
  float norm_eps = 1e-6f;
};

GDN_HD int64_t load_index(const Ptr& p, int64_t offset) {
  return p.dtype == DType::kI64 ? static_cast<const int64_t*>(p.data)[offset]
                                : static_cast<int64_t>(static_cast<const int32_t*>(p.data)[offset]);
}

// Where row n's state comes from and goes to (docs/semantics.md section 3).
struct RowSlots {
  int64_t read = -1;   // < 0: padding row (no reads, no writes, zero output)
  int64_t write = -1;  // final-state slot; < 0: not written. Unused with token_slots.
  bool invalid = false;  // some slot the row names >= P, or num_accepted outside 1..T: counted
                         // and padded (read = write = -1)
};

// The slot row n reads its state from, before the range check against P: accepted-token
// continuation, read slots, token 0's slot, or n itself (dense). Sets `bad_accepted` when
// num_accepted[n] is outside 1..T (the row is invalid). `load(ptr, offset)` reads one index:
// resolve_row passes load_index, the CUDA L2 prefetch an L2-only load.
template <typename Load>
GDN_HD int64_t read_slot(const Problem& p, int64_t n, bool& bad_accepted, Load load) {
  bad_accepted = false;
  if (p.num_accepted.data != nullptr) {
    const int64_t acc = load(p.num_accepted, n * p.num_accepted.s[0]);
    if (acc < 1 || acc > p.T) {
      bad_accepted = true;
      return -1;
    }
    return load(p.token_slots, n * p.token_slots.s[0] + (acc - 1) * p.token_slots.s[1]);
  }
  if (p.read_slots.data != nullptr) return load(p.read_slots, n * p.read_slots.s[0]);
  if (p.token_slots.data != nullptr) return load(p.token_slots, n * p.token_slots.s[0]);
  return n;  // dense
}

GDN_HD RowSlots resolve_row(const Problem& p, int64_t n) {
  RowSlots r;
  const bool per_token = p.token_slots.data != nullptr;
  bool bad_accepted = false;
  const int64_t read = read_slot(p, n, bad_accepted, [](const Ptr& x, int64_t off) { return load_index(x, off); });
  if (bad_accepted) {
    r.invalid = true;
    return r;
  }
  // Every slot the row names is range-checked, a padding row's too: a slot >= P is a caller
  // bug worth counting whatever the row's other slots say (docs/semantics.md section 3).
  bool bad = read >= p.P;
  int64_t write = -1;
  if (per_token) {
    for (int64_t t = 0; t < p.T; ++t)
      bad |= load_index(p.token_slots, n * p.token_slots.s[0] + t * p.token_slots.s[1]) >= p.P;
  } else {
    write = p.write_slots.data != nullptr ? load_index(p.write_slots, n * p.write_slots.s[0]) : read;
    bad |= write >= p.P;
  }
  if (bad) {
    r.invalid = true;
    return r;
  }
  if (read < 0) return r;  // padding
  r.read = read;
  r.write = write;
  return r;
}

// Whether states before the last token leave the kernel (intermediate cache or per-token
// slots). Without them the kernels may carry the state in an implicit form across the tokens
// (CUDA VK: lazy decay, the chunked kernel).
GDN_HD bool stores_token_states(const Problem& p) {
  return p.inter.data != nullptr || p.token_slots.data != nullptr;
}

// Slot the state after token t is written to (< 0: none). Final state goes to
// token_slots[n, T-1] in per-token mode, else to the row's write slot.
GDN_HD int64_t token_write_slot(const Problem& p, const RowSlots& r, int64_t n, int64_t t) {
  if (!p.update_state || r.read < 0) return -1;
  if (p.token_slots.data != nullptr)
    return load_index(p.token_slots, n * p.token_slots.s[0] + t * p.token_slots.s[1]);
  return t == p.T - 1 ? r.write : -1;
}

}  // namespace gdn::detail
