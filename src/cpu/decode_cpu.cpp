// CPU backend: the step of docs/semantics.md section 2 in fp32, threaded over (row n, value
// head hv) with OpenMP. The state of one (n, hv) is processed kChunk value rows at a time:
// the rows of the math (S[r, :], a K-vector) are independent of each other across all T
// tokens, so a chunk is loaded once into fp32, carried through every token, and stored
// (rounded) only where the contract stores it. The same loop serves both layouts; only the
// gather/scatter of a chunk differs (VK rows are contiguous, KV rows are strided columns).
#include <atomic>
#include <cmath>
#include <cstring>

#include "../backends.h"
#include "../host_dtype.h"

namespace gdn::detail {
namespace {

constexpr int kMaxDim = 256;   // largest K or V (check.cpp enforces 64/128/256)
constexpr int kMaxT = 16;      // tokens whose q/k/gates are staged on the stack at once
constexpr int kChunk = 8;      // value rows carried together through the tokens

// Eight partial sums: the compiler vectorizes it without -ffast-math, and the pairwise
// final sum keeps the rounding error near sqrt(n) ulps.
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {};
  for (int i = 0; i < n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <DType S>
struct Storage;
template <>
struct Storage<DType::kF32> {
  using T = float;
  static float load(T x) { return x; }
  static T store(float x) { return x; }
};
template <>
struct Storage<DType::kBF16> {
  using T = uint16_t;
  static float load(T x) { return bf16_bits_to_float(x); }
  static T store(float x) { return float_to_bf16_bits(x); }
};
template <>
struct Storage<DType::kF16> {
  using T = uint16_t;
  static float load(T x) { return fp16_bits_to_float(x); }
  static T store(float x) { return float_to_fp16_bits(x); }
};

struct TokenInputs {
  float qh[kMaxT][kMaxDim];
  float kh[kMaxT][kMaxDim];
  float g[kMaxT];
  float beta[kMaxT];
};

float gate_g(const Problem& p, int64_t n, int64_t t, int64_t hv) {
  if (!p.raw_gates) return std::exp(load_f32(p.g.data, p.g.dtype, n * p.g.s[0] + t * p.g.s[1] + hv * p.g.s[2]));
  const float x = load_f32(p.a.data, p.a.dtype, n * p.a.s[0] + t * p.a.s[1] + hv * p.a.s[2]) +
                  load_f32(p.dt_bias.data, p.dt_bias.dtype, hv * p.dt_bias.s[0]);
  const float sp = x <= 20.f ? std::log1p(std::exp(x)) : x;  // softplus, threshold 20
  const float A = std::exp(load_f32(p.A_log.data, p.A_log.dtype, hv * p.A_log.s[0]));
  return std::exp(-A * sp);
}

float gate_beta(const Problem& p, int64_t n, int64_t t, int64_t hv) {
  if (!p.raw_gates) return load_f32(p.beta.data, p.beta.dtype, n * p.beta.s[0] + t * p.beta.s[1] + hv * p.beta.s[2]);
  const float b = load_f32(p.b.data, p.b.dtype, n * p.b.s[0] + t * p.b.s[1] + hv * p.b.s[2]);
  return 1.f / (1.f + std::exp(-b));
}

// q or k of token t, head h, normalized (and scaled) into dst.
void load_qk(const Problem& p, const Ptr& x, int64_t n, int64_t t, int64_t h, float scale, float* dst) {
  const int64_t base = n * x.s[0] + t * x.s[1] + h * x.s[2];
  float ss = 0.f;
  for (int64_t i = 0; i < p.K; ++i) {
    dst[i] = load_f32(x.data, x.dtype, base + i * x.s[3]);
    ss += dst[i] * dst[i];
  }
  const float f = (p.use_qk_l2norm ? 1.f / std::sqrt(ss + 1e-6f) : 1.f) * scale;
  for (int64_t i = 0; i < p.K; ++i) dst[i] *= f;
}

template <DType SD>
void run_head(const Problem& p, int64_t n, int64_t hv, const RowSlots& rs, int64_t t0, int64_t nt,
              TokenInputs& in, float* carry /* [rows of math, K] fp32, state between token blocks */) {
  using St = Storage<SD>;
  using Elem = typename St::T;
  const int64_t h = hv / (p.HV / p.H);
  const int K = static_cast<int>(p.K), V = static_cast<int>(p.V);
  for (int64_t j = 0; j < nt; ++j) {
    const int64_t t = t0 + j;
    load_qk(p, p.q, n, t, h, p.scale, in.qh[j]);
    load_qk(p, p.k, n, t, h, 1.f, in.kh[j]);
    in.g[j] = gate_g(p, n, t, hv);
    in.beta[j] = gate_beta(p, n, t, hv);
  }
  const Elem* src = static_cast<const Elem*>(p.state.data) + rs.read * p.state.s[0] + hv * p.state.s[1];
  // In the layout's terms: element (r, c) of the math (value row r, key c) lives at
  // r * rs_ + c * cs_ from the head's base.
  const int64_t r_stride = p.layout_kv ? 1 : p.state.s[2];
  const int64_t c_stride = p.layout_kv ? p.state.s[2] : 1;
  const int64_t ir_stride = p.inter.data ? (p.layout_kv ? 1 : p.inter.s[3]) : 0;
  const int64_t ic_stride = p.inter.data ? (p.layout_kv ? p.inter.s[3] : 1) : 0;

  for (int r0 = 0; r0 < V; r0 += kChunk) {
    float S[kChunk][kMaxDim];
    if (t0 == 0) {
      for (int r = 0; r < kChunk; ++r)
        for (int c = 0; c < K; ++c) S[r][c] = St::load(src[(r0 + r) * r_stride + c * c_stride]);
    } else {
      for (int r = 0; r < kChunk; ++r) std::memcpy(S[r], carry + static_cast<int64_t>(r0 + r) * K, sizeof(float) * K);
    }
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t t = t0 + j;
      const float g = in.g[j], beta = in.beta[j];
      for (int r = 0; r < kChunk; ++r) {
        float* row = S[r];
        for (int c = 0; c < K; ++c) row[c] *= g;
        const float vr = load_f32(p.v.data, p.v.dtype, n * p.v.s[0] + t * p.v.s[1] + hv * p.v.s[2] + (r0 + r) * p.v.s[3]);
        const float delta = beta * (vr - dot(row, in.kh[j], K));
        for (int c = 0; c < K; ++c) row[c] += delta * in.kh[j][c];
        store_f32(p.o.data, p.o.dtype, n * p.o.s[0] + t * p.o.s[1] + hv * p.o.s[2] + r0 + r, dot(row, in.qh[j], K));
      }
      if (p.inter.data) {
        Elem* dst = static_cast<Elem*>(p.inter.data) + n * p.inter.s[0] + t * p.inter.s[1] + hv * p.inter.s[2];
        for (int r = 0; r < kChunk; ++r)
          for (int c = 0; c < K; ++c) dst[(r0 + r) * ir_stride + c * ic_stride] = St::store(S[r][c]);
      }
      const int64_t ws = token_write_slot(p, rs, n, t);
      if (ws >= 0) {
        Elem* dst = static_cast<Elem*>(p.state.data) + ws * p.state.s[0] + hv * p.state.s[1];
        for (int r = 0; r < kChunk; ++r)
          for (int c = 0; c < K; ++c) dst[(r0 + r) * r_stride + c * c_stride] = St::store(S[r][c]);
      }
    }
    if (t0 + nt < p.T)
      for (int r = 0; r < kChunk; ++r) std::memcpy(carry + static_cast<int64_t>(r0 + r) * K, S[r], sizeof(float) * K);
  }
}

template <DType SD>
void run_all(const Problem& p) {
  const int64_t items = p.B * p.HV;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t n = item / p.HV, hv = item % p.HV;
    const RowSlots rs = resolve_row(p, n);
    if (rs.read < 0) {
      for (int64_t t = 0; t < p.T; ++t)
        for (int64_t r = 0; r < p.V; ++r) store_f32(p.o.data, p.o.dtype, n * p.o.s[0] + t * p.o.s[1] + hv * p.o.s[2] + r, 0.f);
      continue;
    }
    TokenInputs in;
    // State carried between blocks of kMaxT tokens (T > 16 is rare: verify steps are <= 16).
    static thread_local float carry[kMaxDim * kMaxDim];
    for (int64_t t0 = 0; t0 < p.T; t0 += kMaxT) {
      const int64_t nt = p.T - t0 < kMaxT ? p.T - t0 : kMaxT;
      run_head<SD>(p, n, hv, rs, t0, nt, in, carry);
    }
  }
}

// Slots written by row n (final or per-token), for the duplicate-write check.
bool writes_slot(const Problem& p, int64_t n, int64_t slot) {
  const RowSlots rs = resolve_row(p, n);
  for (int64_t t = 0; t < p.T; ++t)
    if (token_write_slot(p, rs, n, t) == slot) return true;
  return false;
}

}  // namespace

void decode_cpu(const Problem& p) {
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
  // Atomic: the counter may be shared by calls running on other threads at the same time.
  if (p.error_count != nullptr && bad != 0) std::atomic_ref<int>(*p.error_count).fetch_add(bad);
  switch (p.state.dtype) {
    case DType::kF32: run_all<DType::kF32>(p); break;
    case DType::kBF16: run_all<DType::kBF16>(p); break;
    default: run_all<DType::kF16>(p); break;
  }
}

}  // namespace gdn::detail
