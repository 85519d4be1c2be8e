// CPU backend of the fused layer step (docs/semantics.md section 6), in two phases:
//   1. per (row n, value head hv), threaded: the conv outputs of the channels the head needs
//      (q and k of its q/k head, its own v), the recurrence of section 2, the gated RMSNorm,
//      the stores of o, inter and the state;
//   2. per row, threaded: the conv state after each stored token, and conv_inter.
// Phase 2 runs after every read of the conv pool in phase 1 (the parallel loop's barrier), so a
// write slot that is also a read slot (the usual in-place update) is safe.
#include <atomic>
#include <cmath>
#include <cstring>

#include "../backends.h"
#include "../host_dtype.h"

namespace gdn::detail {
namespace {

constexpr int kMaxDim = 256;  // largest K or V
constexpr int kMaxT = 16;     // fused_decode takes T <= 16
constexpr int kMaxConvL = 16; // and L <= 16 (check.cpp)

struct HeadInputs {
  float q[kMaxT][kMaxDim];  // normalized and scaled
  float k[kMaxT][kMaxDim];  // normalized
  float v[kMaxT][kMaxDim];
  float o[kMaxT][kMaxDim];
  float g[kMaxT];
  float beta[kMaxT];
};

float silu(float x) { return x / (1.f + std::exp(-x)); }

// The conv window of channel d for row n: element j of [the read slot's L columns | x_0..x_{T-1}].
float window(const FusedProblem& f, int64_t n, int64_t slot, int64_t d, int64_t j) {
  if (j < f.L)
    return load_f32(f.conv_state.data, f.conv_state.dtype,
                    slot * f.conv_state.s[0] + d * f.conv_state.s[1] + j * f.conv_state.s[2]);
  return load_f32(f.x.data, f.x.dtype, n * f.x.s[0] + (j - f.L) * f.x.s[1] + d * f.x.s[2]);
}

// y[t] = silu(bias + sum_w weight[d, w] * window[L + t - (W - 1) + w]) for t < T.
void conv_outputs(const FusedProblem& f, int64_t n, int64_t slot, int64_t d, float* y, int64_t ystride) {
  float w[4];
  for (int64_t k = 0; k < f.W; ++k)
    w[k] = load_f32(f.conv_weight.data, f.conv_weight.dtype, d * f.conv_weight.s[0] + k * f.conv_weight.s[1]);
  const float bias = f.conv_bias.data ? load_f32(f.conv_bias.data, f.conv_bias.dtype, d * f.conv_bias.s[0]) : 0.f;
  for (int64_t t = 0; t < f.step.T; ++t) {
    float acc = bias;
    for (int64_t k = 0; k < f.W; ++k) acc += w[k] * window(f, n, slot, d, f.L + t - (f.W - 1) + k);
    y[t * ystride] = silu(acc);
  }
}

void gates(const Problem& p, int64_t n, int64_t t, int64_t hv, float* g, float* beta) {
  if (!p.raw_gates) {
    *g = std::exp(load_f32(p.g.data, p.g.dtype, n * p.g.s[0] + t * p.g.s[1] + hv * p.g.s[2]));
    *beta = load_f32(p.beta.data, p.beta.dtype, n * p.beta.s[0] + t * p.beta.s[1] + hv * p.beta.s[2]);
    return;
  }
  const float x = load_f32(p.a.data, p.a.dtype, n * p.a.s[0] + t * p.a.s[1] + hv * p.a.s[2]) +
                  load_f32(p.dt_bias.data, p.dt_bias.dtype, hv * p.dt_bias.s[0]);
  const float sp = x <= 20.f ? std::log1p(std::exp(x)) : x;
  *g = std::exp(-std::exp(load_f32(p.A_log.data, p.A_log.dtype, hv * p.A_log.s[0])) * sp);
  *beta = 1.f / (1.f + std::exp(-load_f32(p.b.data, p.b.dtype, n * p.b.s[0] + t * p.b.s[1] + hv * p.b.s[2])));
}

void normalize(float* x, int64_t K, bool l2, float scale) {
  float ss = 0.f;
  for (int64_t i = 0; i < K; ++i) ss += x[i] * x[i];
  const float fct = (l2 ? 1.f / std::sqrt(ss + 1e-6f) : 1.f) * scale;
  for (int64_t i = 0; i < K; ++i) x[i] *= fct;
}

void run_head(const FusedProblem& f, int64_t n, int64_t hv, const RowSlots& rs, HeadInputs& in) {
  const Problem& p = f.step;
  const int64_t T = p.T, K = p.K, V = p.V, h = hv / (p.HV / p.H);
  for (int64_t i = 0; i < K; ++i) {
    conv_outputs(f, n, rs.read, h * K + i, &in.q[0][i], kMaxDim);
    conv_outputs(f, n, rs.read, (p.H + h) * K + i, &in.k[0][i], kMaxDim);
  }
  for (int64_t r = 0; r < V; ++r) conv_outputs(f, n, rs.read, 2 * p.H * K + hv * V + r, &in.v[0][r], kMaxDim);
  for (int64_t t = 0; t < T; ++t) {
    normalize(in.q[t], K, p.use_qk_l2norm, p.scale);
    normalize(in.k[t], K, p.use_qk_l2norm, 1.f);
    gates(p, n, t, hv, &in.g[t], &in.beta[t]);
  }
  // Element (r, c) of the math (value row r, key c) in the layout.
  const int64_t r_st = p.layout_kv ? 1 : p.state.s[2], c_st = p.layout_kv ? p.state.s[2] : 1;
  const int64_t r_in = p.inter.data ? (p.layout_kv ? 1 : p.inter.s[3]) : 0;
  const int64_t c_in = p.inter.data ? (p.layout_kv ? p.inter.s[3] : 1) : 0;
  const int64_t src = rs.read * p.state.s[0] + hv * p.state.s[1];
  float S[kMaxDim];
  for (int64_t r = 0; r < V; ++r) {
    for (int64_t c = 0; c < K; ++c) S[c] = load_f32(p.state.data, p.state.dtype, src + r * r_st + c * c_st);
    for (int64_t t = 0; t < T; ++t) {
      float hk = 0.f;
      for (int64_t c = 0; c < K; ++c) {
        S[c] *= in.g[t];
        hk += S[c] * in.k[t][c];
      }
      const float delta = in.beta[t] * (in.v[t][r] - hk);
      float o = 0.f;
      for (int64_t c = 0; c < K; ++c) {
        S[c] += delta * in.k[t][c];
        o += S[c] * in.q[t][c];
      }
      in.o[t][r] = o;
      if (p.inter.data) {
        const int64_t ib = n * p.inter.s[0] + t * p.inter.s[1] + hv * p.inter.s[2] + r * r_in;
        for (int64_t c = 0; c < K; ++c) store_f32(p.inter.data, p.inter.dtype, ib + c * c_in, S[c]);
      }
      const int64_t ws = token_write_slot(p, rs, n, t);
      if (ws >= 0) {
        const int64_t wb = ws * p.state.s[0] + hv * p.state.s[1] + r * r_st;
        for (int64_t c = 0; c < K; ++c) store_f32(p.state.data, p.state.dtype, wb + c * c_st, S[c]);
      }
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    float fct = 1.f;
    if (f.norm_weight.data) {
      float ss = 0.f;
      for (int64_t r = 0; r < V; ++r) ss += in.o[t][r] * in.o[t][r];
      fct = 1.f / std::sqrt(ss / static_cast<float>(V) + f.norm_eps);
    }
    for (int64_t r = 0; r < V; ++r) {
      float x = in.o[t][r];
      if (f.norm_weight.data) {
        x *= fct * load_f32(f.norm_weight.data, f.norm_weight.dtype, r * f.norm_weight.s[0]);
        if (f.z.data)
          x *= silu(load_f32(f.z.data, f.z.dtype, n * f.z.s[0] + t * f.z.s[1] + hv * f.z.s[2] + r * f.z.s[3]));
      }
      store_f32(p.o.data, p.o.dtype, n * p.o.s[0] + t * p.o.s[1] + hv * p.o.s[2] + r, x);
    }
  }
}

// The conv state after each stored token of row n, and conv_inter: column j after token t is
// window element t + 1 + j. Every value a channel needs is read before any is written.
void store_conv(const FusedProblem& f, int64_t n, const RowSlots& rs) {
  const Problem& p = f.step;
  float ext[kMaxConvL + kMaxT];
  for (int64_t d = 0; d < f.D; ++d) {
    for (int64_t j = 0; j < f.L + p.T; ++j) ext[j] = window(f, n, rs.read, d, j);
    for (int64_t t = 0; t < p.T; ++t) {
      const int64_t ws = token_write_slot(p, rs, n, t);
      for (int64_t j = 0; j < f.L; ++j) {
        const float x = ext[t + 1 + j];
        if (f.conv_inter.data)
          store_f32(f.conv_inter.data, f.conv_inter.dtype,
                    n * f.conv_inter.s[0] + t * f.conv_inter.s[1] + d * f.conv_inter.s[2] + j * f.conv_inter.s[3], x);
        if (ws >= 0)
          store_f32(f.conv_state.data, f.conv_state.dtype,
                    ws * f.conv_state.s[0] + d * f.conv_state.s[1] + j * f.conv_state.s[2], x);
      }
    }
  }
}

bool writes_slot(const Problem& p, int64_t n, int64_t slot) {
  const RowSlots rs = resolve_row(p, n);
  for (int64_t t = 0; t < p.T; ++t)
    if (token_write_slot(p, rs, n, t) == slot) return true;
  return false;
}

}  // namespace

void fused_decode_cpu(const FusedProblem& f) {
  const Problem& p = f.step;
  int bad = 0;
  for (int64_t n = 0; n < p.B; ++n) bad += resolve_row(p, n).invalid ? 1 : 0;
  if (p.check_duplicate_writes && p.update_state) {
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
  if (p.error_count != nullptr && bad != 0) std::atomic_ref<int>(*p.error_count).fetch_add(bad);

  const int64_t items = p.B * p.HV;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t n = item / p.HV, hv = item % p.HV;
    const RowSlots rs = resolve_row(p, n);
    if (rs.read < 0) {
      for (int64_t t = 0; t < p.T; ++t)
        for (int64_t r = 0; r < p.V; ++r)
          store_f32(p.o.data, p.o.dtype, n * p.o.s[0] + t * p.o.s[1] + hv * p.o.s[2] + r, 0.f);
      continue;
    }
    static thread_local HeadInputs in;
    run_head(f, n, hv, rs, in);
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t n = 0; n < p.B; ++n) {
    const RowSlots rs = resolve_row(p, n);
    if (rs.read >= 0) store_conv(f, n, rs);
  }
}

}  // namespace gdn::detail
