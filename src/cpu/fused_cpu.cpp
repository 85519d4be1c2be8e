// CPU backend of the fused layer step (docs/semantics.md section 6), in two phases:
//   1. per (row n, value head hv), threaded: the conv outputs of the channels the head needs
//      (q and k of its q/k head, its own v) into the recurrence's StepInputs, the recurrence
//      itself (step_cpu.h: the kernels decode runs, cache and state stores included), the gated
//      RMSNorm on each whole output vector, the store of o;
//   2. per row, threaded: the conv state after each stored token, and conv_inter.
// Phase 2 runs after every read of the conv pool in phase 1 (the parallel loop's barrier), so a
// write slot that is also a read slot (the usual in-place update) is safe.
#include <cmath>

#include "../backends.h"
#include "../host_dtype.h"
#include "step_cpu.h"

namespace gdn::detail {
namespace {

constexpr int kMaxConvL = 16;  // check.cpp: L in W - 1..16, T in 1..16

struct Workspace {
  cpu::StepInputs in;
  cpu::StepOutput out;
  cpu::StepCarry carry;
};

Workspace& workspace() {
  static thread_local Workspace w;
  return w;
}

float silu(float x) { return x / (1.f + std::exp(-x)); }

// Conv channel d's window for row n: [the read slot's L columns | x_0..x_{T-1}] into w.
void window(const FusedProblem& f, int64_t n, int64_t slot, int64_t d, float* w) {
  for (int64_t j = 0; j < f.L; ++j)
    w[j] = load_f32(f.conv_state.data, f.conv_state.dtype,
                    slot * f.conv_state.s[0] + d * f.conv_state.s[1] + j * f.conv_state.s[2]);
  for (int64_t t = 0; t < f.step.T; ++t)
    w[f.L + t] = load_f32(f.x.data, f.x.dtype, n * f.x.s[0] + t * f.x.s[1] + d * f.x.s[2]);
}

// y[t * ystride] = silu(bias + sum_w weight[d, w] * window[L + t - (W - 1) + w]) for t < T.
void conv_outputs(const FusedProblem& f, int64_t n, int64_t slot, int64_t d, float* y, int64_t ystride) {
  float win[kMaxConvL + cpu::kMaxT], w[4];
  window(f, n, slot, d, win);
  for (int64_t k = 0; k < f.W; ++k)
    w[k] = load_f32(f.conv_weight.data, f.conv_weight.dtype, d * f.conv_weight.s[0] + k * f.conv_weight.s[1]);
  const float bias = f.conv_bias.data ? load_f32(f.conv_bias.data, f.conv_bias.dtype, d * f.conv_bias.s[0]) : 0.f;
  for (int64_t t = 0; t < f.step.T; ++t) {
    float acc = bias;
    for (int64_t k = 0; k < f.W; ++k) acc += w[k] * win[f.L + t - (f.W - 1) + k];
    y[t * ystride] = silu(acc);
  }
}

void run_head(const FusedProblem& f, int64_t n, int64_t hv, const RowSlots& rs, const cpu::StateRounding& rounding,
              Workspace& ws) {
  const Problem& p = f.step;
  const int64_t T = p.T, K = p.K, V = p.V, h = hv / (p.HV / p.H);
  cpu::StepInputs& in = ws.in;
  in.t0 = 0;
  in.nt = T;
  for (int64_t i = 0; i < K; ++i) {
    conv_outputs(f, n, rs.read, h * K + i, &in.q[0][i], cpu::kMaxDim);
    conv_outputs(f, n, rs.read, (p.H + h) * K + i, &in.k[0][i], cpu::kMaxDim);
  }
  for (int64_t r = 0; r < V; ++r) conv_outputs(f, n, rs.read, 2 * p.H * K + hv * V + r, &in.v[0][r], cpu::kMaxDim);
  for (int64_t t = 0; t < T; ++t) {
    cpu::normalize_qk(in.q[t], K, p.scale, p.use_qk_l2norm);
    cpu::normalize_qk(in.k[t], K, 1.f, p.use_qk_l2norm);
    cpu::step_gates(p, n, t, hv, &in.g[t], &in.beta[t]);
  }
  cpu::step_head(p, n, hv, rs, in, 0, V, ws.out, ws.carry, rounding);
  if (f.norm_weight.data) {
    for (int64_t t = 0; t < T; ++t) {
      float* o = ws.out.o[t];
      float ss = 0.f;
      for (int64_t r = 0; r < V; ++r) ss += o[r] * o[r];
      const float fct = 1.f / std::sqrt(ss / static_cast<float>(V) + f.norm_eps);
      for (int64_t r = 0; r < V; ++r) {
        float x = o[r] * fct * load_f32(f.norm_weight.data, f.norm_weight.dtype, r * f.norm_weight.s[0]);
        if (f.z.data)
          x *= silu(load_f32(f.z.data, f.z.dtype, n * f.z.s[0] + t * f.z.s[1] + hv * f.z.s[2] + r * f.z.s[3]));
        o[r] = x;
      }
    }
  }
  cpu::store_o(p, n, hv, 0, T, 0, V, ws.out);
}

// The conv state after each stored token of row n, and conv_inter: column j after token t is
// window entry t + 1 + j. Every value a channel needs is read before any is written.
void store_conv(const FusedProblem& f, int64_t n, const RowSlots& rs) {
  const Problem& p = f.step;
  float win[kMaxConvL + cpu::kMaxT];
  for (int64_t d = 0; d < f.D; ++d) {
    window(f, n, rs.read, d, win);
    for (int64_t t = 0; t < p.T; ++t) {
      const int64_t ws = token_write_slot(p, rs, n, t);
      for (int64_t j = 0; j < f.L; ++j) {
        const float x = win[t + 1 + j];
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

}  // namespace

void fused_decode_cpu(const FusedProblem& f) {
  const Problem& p = f.step;
  cpu::add_error_count(p, cpu::count_bad_rows(p));
  const int64_t items = p.B * p.HV;
  const cpu::StateRounding rounding = cpu::state_rounding(p);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t n = item / p.HV, hv = item % p.HV;
    const RowSlots rs = resolve_row(p, n);
    if (rs.read < 0) {
      cpu::zero_o(p, n, hv, 0, p.V);
      continue;
    }
    run_head(f, n, hv, rs, rounding, workspace());
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t n = 0; n < p.B; ++n) {
    const RowSlots rs = resolve_row(p, n);
    if (rs.read >= 0) store_conv(f, n, rs);
  }
}

}  // namespace gdn::detail
