// CPU backend of the fused layer step (docs/semantics.md section 6), per (row n, q/k head h),
// threaded: the conv outputs of q and k of head h, normalized once for the GVA group; then per
// value head hv of the group: its v channels' conv, the gates, the recurrence (step_cpu.h: the
// kernels decode runs, cache and state stores included), the gated RMSNorm on each whole output
// vector, the store of o. Each conv plane's new conv state (and conv_inter) is written as soon as
// its window is read: the item alone reads and writes those channels of the row (another row
// reading a slot this row writes is a caller error, section 3), so a write slot that is also the
// read slot (the usual in-place update) is safe, as on CUDA's group kernel.
//
// The conv works on planes: a run of consecutive channels (q or k of one head, v of one head)
// with one column (a conv-state column, a token of mixed_qkv, a tap) converted to fp32 at a
// time, so that the dtype and stride are resolved once per plane and the arithmetic runs along
// the channels, where it vectorizes. Measured on the project's 2-core EPYC (docs/performance_cpu.md,
// "The fused step"): with a dtype dispatch per element and a (row, value head) item each, the
// fused step took 2.9-5.4x decode's time; this form 1.5-2.3x.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../backends.h"
#include "../host_dtype.h"
#include "step_cpu.h"

namespace gdn::detail {
namespace {

constexpr int kMaxConvL = 16;                    // check.cpp: L in W - 1..16, T in 1..16
constexpr int kMaxWin = kMaxConvL + cpu::kMaxT;  // window columns: L old + T new
constexpr int kPlane = cpu::kMaxDim;             // channels per plane (K, V <= 256)

// A thread's buffers: the recurrence's, and the conv's planes (win[j]: window column j of the
// plane's channels; w[k]: tap k; bias; norm: z of one head and token, norm_weight).
struct Workspace {
  cpu::StepInputs in;
  cpu::StepOutput out;
  cpu::StepCarry carry;
  alignas(64) float win[kMaxWin][kPlane];
  alignas(64) float w[4][kPlane];
  alignas(64) float taps[4 * kPlane];  // a plane's row-major taps before they are split by tap
  alignas(64) float bias[kPlane];
  alignas(64) float nw[kPlane];
  alignas(64) float z[kPlane];
};

Workspace& workspace() {
  static thread_local Workspace w;
  return w;
}

// exp(x) without a library call, so that loops of it vectorize: 2^i * p(r) with i = round(x
// log2 e), r = x - i ln 2 in two parts (Cody-Waite) and p Cephes expf's polynomial, x clamped to
// [-87, 88] (a relative error of a few 1e-7 inside; exp(88) ~ 1.7e38 at the top, exp(-87) at the
// bottom). The rounding adds and subtracts 1.5 * 2^23 (no -ffast-math here to undo it).
inline float exp_poly(float x) {
  x = x > -87.f ? x : -87.f;  // selects, not branches: the loops of it vectorize (NaN -> -87)
  x = x < 88.f ? x : 88.f;
  const float kf = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = x - kf * 0.693359375f;
  r = r - kf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(kf) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// x * sigmoid(x). Below x = -88 the value is 0 (signed as x; |x| e^x < 1e-36 there), where the
// clamped exponential would not do; NaN and -inf give NaN, as x / (1 + exp(-x)) does.
// The exponential's argument is 0 there instead of -x: with -x, GCC's jump threading split off
// the path where exp_poly clamps at 88 and, in the vectorized loops, computed x / (1 + e^88) for
// every element, a denormal for |x| < 2 and a microcode assist each (a loop of it took 14 ns per
// element on a 2-core Intel Xeon VM, 2.6 ns without; the same bits).
inline float silu(float x) {
  const bool in_range = x >= -88.f;
  const float e = exp_poly(in_range ? -x : 0.f);
  return in_range ? x / (1.f + e) : 0.f * x;
}

// The SiLU passes over a plane (the conv's outputs, the norm's gate), where the fused step's
// arithmetic beyond decode's concentrates: on x86-64 with glibc also compiled for AVX2 and
// picked at load time (an ifunc), twice the lanes of the baseline's SSE for the division that
// dominates them. No FMA in that clone, so the bits are the baseline's (compared over 1.1 M
// values, NaN, infinities and denormals included); a 128-element loop took 1.67 ns per element
// with SSE, 0.86 with AVX2 (2-core Intel Xeon VM).
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define GDN_SILU_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef GDN_SILU_CLONES
#define GDN_SILU_CLONES
#endif

GDN_SILU_CLONES void silu_plane(float* y, int64_t n) {
  for (int64_t c = 0; c < n; ++c) y[c] = silu(y[c]);
}

// o[r] <- o[r] * fct * nw[r] * silu(z[r]) (z given) or o[r] * fct * nw[r].
GDN_SILU_CLONES void norm_plane(float* o, const float* nw, const float* z, float fct, int64_t n) {
  if (z != nullptr) {
    for (int64_t r = 0; r < n; ++r) o[r] = o[r] * fct * nw[r] * silu(z[r]);
  } else {
    for (int64_t r = 0; r < n; ++r) o[r] = o[r] * fct * nw[r];
  }
}

// out[i] = element base + i * stride of `data` as fp32, i < count: one dtype switch a plane.
template <typename E, typename Cvt>
void plane_in(const E* src, int64_t stride, int64_t count, float* out, Cvt cvt) {
  if (stride == 1) {
    for (int64_t i = 0; i < count; ++i) out[i] = cvt(src[i]);
  } else {
    for (int64_t i = 0; i < count; ++i) out[i] = cvt(src[i * stride]);
  }
}
void load_plane(const void* data, DType dt, int64_t base, int64_t stride, int64_t count, float* out) {
  switch (dt) {
    case DType::kF32:
      plane_in(static_cast<const float*>(data) + base, stride, count, out, [](float x) { return x; });
      break;
    case DType::kBF16:
      plane_in(static_cast<const uint16_t*>(data) + base, stride, count, out, bf16_bits_to_float);
      break;
    default:
      plane_in(static_cast<const uint16_t*>(data) + base, stride, count, out, fp16_bits_to_float);
      break;
  }
}

// Element base + i * stride of `data` <- in[i] in its dtype (RNE), i < count.
template <typename E, typename Cvt>
void plane_out(E* dst, int64_t stride, int64_t count, const float* in, Cvt cvt) {
  if (stride == 1) {
    for (int64_t i = 0; i < count; ++i) dst[i] = cvt(in[i]);
  } else {
    for (int64_t i = 0; i < count; ++i) dst[i * stride] = cvt(in[i]);
  }
}
void store_plane(void* data, DType dt, int64_t base, int64_t stride, int64_t count, const float* in) {
  switch (dt) {
    case DType::kF32:
      plane_out(static_cast<float*>(data) + base, stride, count, in, [](float x) { return x; });
      break;
    case DType::kBF16:
      plane_out(static_cast<uint16_t*>(data) + base, stride, count, in, float_to_bf16_bits);
      break;
    default:
      plane_out(static_cast<uint16_t*>(data) + base, stride, count, in, float_to_fp16_bits);
      break;
  }
}

// w[k][c] = taps[c * W + k]: one pass with W constant, which the compiler vectorizes (one loop
// a tap, with W a run-time stride, was a third of the conv's time).
template <int W>
void split_taps(const float* taps, int64_t cnt, float (*w)[kPlane]) {
  for (int64_t c = 0; c < cnt; ++c)
    for (int k = 0; k < W; ++k) w[k][c] = taps[c * W + k];
}

// The window of channels [d0, d0 + cnt) of row n: ws.win[j] = the read slot's conv-state
// column j (j < L), then x_t at j = L + t.
void load_window(const FusedProblem& f, int64_t n, int64_t slot, int64_t d0, int64_t cnt, Workspace& ws) {
  const Ptr& cs = f.conv_state;
  for (int64_t j = 0; j < f.L; ++j)
    load_plane(cs.data, cs.dtype, slot * cs.s[0] + d0 * cs.s[1] + j * cs.s[2], cs.s[1], cnt, ws.win[j]);
  for (int64_t t = 0; t < f.step.T; ++t)
    load_plane(f.x.data, f.x.dtype, n * f.x.s[0] + t * f.x.s[1] + d0 * f.x.s[2], f.x.s[2], cnt, ws.win[f.L + t]);
}

// The conv state of channels [d0, d0 + cnt) of row n after each stored token, and conv_inter,
// from the plane's window in ws.win: column j after token t is window entry t + 1 + j.
void store_window(const FusedProblem& f, int64_t n, const RowSlots& rs, int64_t d0, int64_t cnt,
                  const Workspace& ws) {
  const Problem& p = f.step;
  const Ptr& cs = f.conv_state;
  const Ptr& ci = f.conv_inter;
  for (int64_t t = 0; t < p.T; ++t) {
    const int64_t wslot = token_write_slot(p, rs, n, t);
    for (int64_t j = 0; j < f.L; ++j) {
      const float* const col = ws.win[t + 1 + j];
      if (ci.data != nullptr)
        store_plane(ci.data, ci.dtype, n * ci.s[0] + t * ci.s[1] + d0 * ci.s[2] + j * ci.s[3], ci.s[2], cnt, col);
      if (wslot >= 0) store_plane(cs.data, cs.dtype, wslot * cs.s[0] + d0 * cs.s[1] + j * cs.s[2], cs.s[1], cnt, col);
    }
  }
}

// The conv outputs of channels [d0, d0 + cnt) of row n, into a StepInputs array (q, k or v):
// y[t][c] = silu(bias + sum_k weight[d0 + c, k] * window[L + t - (W - 1) + k]) for t < T; and
// the plane's new conv state (store_window).
void conv_plane(const FusedProblem& f, int64_t n, const RowSlots& rs, int64_t d0, int64_t cnt, Workspace& ws,
                float (*y_out)[cpu::kMaxDim]) {
  load_window(f, n, rs.read, d0, cnt, ws);
  store_window(f, n, rs, d0, cnt, ws);
  const Ptr& cw = f.conv_weight;
  if (cw.s[1] == 1 && cw.s[0] == f.W) {  // row-major [D, W]: the plane's taps are one run
    load_plane(cw.data, cw.dtype, d0 * f.W, 1, cnt * f.W, ws.taps);
    switch (f.W) {
      case 2:
        split_taps<2>(ws.taps, cnt, ws.w);
        break;
      case 3:
        split_taps<3>(ws.taps, cnt, ws.w);
        break;
      default:
        split_taps<4>(ws.taps, cnt, ws.w);
        break;
    }
  } else {
    for (int64_t k = 0; k < f.W; ++k)
      load_plane(cw.data, cw.dtype, d0 * cw.s[0] + k * cw.s[1], cw.s[0], cnt, ws.w[k]);
  }
  if (f.conv_bias.data != nullptr) {
    load_plane(f.conv_bias.data, f.conv_bias.dtype, d0 * f.conv_bias.s[0], f.conv_bias.s[0], cnt, ws.bias);
  } else {
    std::fill(ws.bias, ws.bias + cnt, 0.f);
  }
  for (int64_t t = 0; t < f.step.T; ++t) {
    float* const y = y_out[t];
    std::copy(ws.bias, ws.bias + cnt, y);
    for (int64_t k = 0; k < f.W; ++k) {
      const float* const x = ws.win[f.L + t - (f.W - 1) + k];
      const float* const w = ws.w[k];
      for (int64_t c = 0; c < cnt; ++c) y[c] += w[c] * x[c];
    }
    silu_plane(y, cnt);
  }
}

// o[t] <- o[t] * rsqrt(mean(o[t]^2) + eps) * norm_weight * silu(z[n, t, hv]) for every token;
// ws.nw holds norm_weight.
void gated_norm(const FusedProblem& f, int64_t n, int64_t hv, Workspace& ws) {
  const Problem& p = f.step;
  const int64_t V = p.V;
  for (int64_t t = 0; t < p.T; ++t) {
    float* const o = ws.out.o[t];
    float ss = 0.f;
    for (int64_t r = 0; r < V; ++r) ss += o[r] * o[r];
    const float fct = 1.f / std::sqrt(ss / static_cast<float>(V) + f.norm_eps);
    if (f.z.data != nullptr)
      load_plane(f.z.data, f.z.dtype, n * f.z.s[0] + t * f.z.s[1] + hv * f.z.s[2], f.z.s[3], V, ws.z);
    norm_plane(o, ws.nw, f.z.data != nullptr ? ws.z : nullptr, fct, V);
  }
}

// Row n, q/k head h: q and k once, then each value head of the GVA group.
void run_group(const FusedProblem& f, int64_t n, int64_t h, const RowSlots& rs, const cpu::StateRounding& rounding,
               Workspace& ws) {
  const Problem& p = f.step;
  const int64_t T = p.T, K = p.K, V = p.V, group = p.HV / p.H;
  cpu::StepInputs& in = ws.in;
  in.t0 = 0;
  in.nt = T;
  conv_plane(f, n, rs, h * K, K, ws, in.q);
  conv_plane(f, n, rs, (p.H + h) * K, K, ws, in.k);
  for (int64_t t = 0; t < T; ++t) {
    cpu::normalize_qk(in.q[t], K, p.scale, p.use_qk_l2norm);
    cpu::normalize_qk(in.k[t], K, 1.f, p.use_qk_l2norm);
  }
  const Ptr& nw = f.norm_weight;
  if (nw.data != nullptr) load_plane(nw.data, nw.dtype, 0, nw.s[0], V, ws.nw);
  for (int64_t hv = h * group; hv < (h + 1) * group; ++hv) {
    conv_plane(f, n, rs, 2 * p.H * K + hv * V, V, ws, in.v);
    for (int64_t t = 0; t < T; ++t) cpu::step_gates(p, n, t, hv, &in.g[t], &in.beta[t]);
    cpu::step_head(p, n, hv, rs, in, 0, V, ws.out, ws.carry, rounding);
    if (f.norm_weight.data != nullptr) gated_norm(f, n, hv, ws);
    cpu::store_o(p, n, hv, 0, T, 0, V, ws.out);
  }
}

}  // namespace

void fused_decode_cpu(const FusedProblem& f) {
  const Problem& p = f.step;
  cpu::add_error_count(p, cpu::count_bad_rows(p));
  const int64_t items = p.B * p.H;
  const int64_t group = p.HV / p.H;
  const cpu::StateRounding rounding = cpu::state_rounding(p);
  const int64_t chunk = cpu::item_chunk(items, p.H);  // consecutive q/k heads, as decode's
#pragma omp parallel for schedule(dynamic, chunk)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t n = item / p.H, h = item % p.H;
    const RowSlots rs = resolve_row(p, n);
    if (rs.read < 0) {
      for (int64_t hv = h * group; hv < (h + 1) * group; ++hv) cpu::zero_o(p, n, hv, 0, p.V);
      continue;
    }
    run_group(f, n, h, rs, rounding, workspace());
  }
}

}  // namespace gdn::detail
