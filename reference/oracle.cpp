// The float64 oracle. Deliberately independent of the backends: it reads the caller's
// TensorViews with its own index arithmetic and resolves slots from the text of
// docs/semantics.md section 3, so a bug in the flattened Problem or in resolve_row shows up
// as a mismatch instead of being shared. Only argument validation (can_implement) and the
// scalar rounding helpers are common code.
#include <cmath>
#include <vector>

#include "../src/host_dtype.h"
#include "../src/rounding.h"
#include "gdn_reference.h"

namespace gdn::reference {
namespace {

using detail::double_to_bf16_bits;
using detail::double_to_fp16_bits;

int64_t offset_of(const TensorView& t, std::initializer_list<int64_t> idx) {
  int64_t off = 0;
  int i = 0;
  for (int64_t x : idx) off += x * t.strides[i++];
  return off;
}

double get(const TensorView& t, std::initializer_list<int64_t> idx) {
  const int64_t off = offset_of(t, idx);
  if (t.dtype.code == kDLInt)
    return t.dtype.bits == 64 ? static_cast<double>(static_cast<const int64_t*>(t.data)[off])
                              : static_cast<double>(static_cast<const int32_t*>(t.data)[off]);
  if (t.dtype.code == kDLBfloat) return detail::bf16_bits_to_float(static_cast<const uint16_t*>(t.data)[off]);
  if (t.dtype.bits == 64) return static_cast<const double*>(t.data)[off];  // decode_exact only
  if (t.dtype.bits == 16) return detail::fp16_bits_to_float(static_cast<const uint16_t*>(t.data)[off]);
  return static_cast<const float*>(t.data)[off];
}

int64_t get_index(const TensorView& t, std::initializer_list<int64_t> idx) {
  const int64_t off = offset_of(t, idx);
  return t.dtype.bits == 64 ? static_cast<const int64_t*>(t.data)[off]
                            : static_cast<int64_t>(static_cast<const int32_t*>(t.data)[off]);
}

// One rounding from float64 to the storage dtype (round-to-nearest-even); none for float64.
void put(const TensorView& t, std::initializer_list<int64_t> idx, double x) {
  const int64_t off = offset_of(t, idx);
  if (t.dtype.code == kDLBfloat) static_cast<uint16_t*>(t.data)[off] = double_to_bf16_bits(x);
  else if (t.dtype.bits == 16) static_cast<uint16_t*>(t.data)[off] = double_to_fp16_bits(x);
  else if (t.dtype.bits == 64) static_cast<double*>(t.data)[off] = x;
  else static_cast<float*>(t.data)[off] = static_cast<float>(x);
}

// Stochastic rounding of a state store (StepArgs::rounding_seed, src/rounding.h): the float64
// value rounded to fp32 (RNE), then to the 16-bit dtype with the element's 16 random bits.
struct Rounding {
  bool on = false;    // a seed was given and the state is bf16 or fp16
  uint32_t key = 0;   // sr_token_key of the stored token
};

void put_rounded(const TensorView& t, std::initializer_list<int64_t> idx, double x, const Rounding& rd, int64_t e) {
  if (!rd.on) return put(t, idx, x);
  const float f = static_cast<float>(x);
  const uint32_t r16 = detail::sr_elem_bits(rd.key, e);
  static_cast<uint16_t*>(t.data)[offset_of(t, idx)] =
      t.dtype.code == kDLBfloat ? detail::sr_bf16_bits(f, r16) : detail::sr_fp16_bits(f, r16, detail::float_to_fp16_bits);
}

// State element (value row r, key c) of head hv in slot `slot` (or batch row, for inter). The
// element's index in the head's matrix in storage order is r * K + c (VK) or c * V + r (KV).
double get_state(const TensorView& s, bool kv, int64_t slot, int64_t hv, int64_t r, int64_t c) {
  return kv ? get(s, {slot, hv, c, r}) : get(s, {slot, hv, r, c});
}
void put_state(const TensorView& s, bool kv, int64_t slot, int64_t hv, int64_t r, int64_t c, double x,
               const Rounding& rd) {
  kv ? put_rounded(s, {slot, hv, c, r}, x, rd, c * s.shape[3] + r)
     : put_rounded(s, {slot, hv, r, c}, x, rd, r * s.shape[3] + c);
}
void put_inter(const TensorView& s, bool kv, int64_t n, int64_t t, int64_t hv, int64_t r, int64_t c, double x,
               const Rounding& rd) {
  kv ? put_rounded(s, {n, t, hv, c, r}, x, rd, c * s.shape[4] + r)
     : put_rounded(s, {n, t, hv, r, c}, x, rd, r * s.shape[4] + c);
}

struct Row {
  bool valid = false;    // false: padding (or invalid) row
  bool invalid = false;  // a slot >= P or num_accepted outside 1..T
  int64_t read = -1;
  std::vector<int64_t> write;  // per token: slot written with the state after token t, or -1
};

Row resolve(const StepArgs& a, int64_t n, int64_t T, int64_t P) {
  Row row;
  row.write.assign(T, -1);
  const bool per_token = a.token_slots.defined();
  int64_t read;
  if (a.num_accepted.defined()) {
    const int64_t acc = get_index(a.num_accepted, {n});
    if (acc < 1 || acc > T) { row.invalid = true; return row; }
    read = get_index(a.token_slots, {n, acc - 1});
  } else if (a.read_slots.defined()) {
    read = get_index(a.read_slots, {n});
  } else if (per_token) {
    read = get_index(a.token_slots, {n, 0});
  } else {
    read = n;
  }
  // Every slot the row names is range-checked, a padding row's too (semantics section 3).
  bool bad = read >= P;
  std::vector<int64_t> w(T, -1);
  if (per_token) {
    for (int64_t t = 0; t < T; ++t) {
      w[t] = get_index(a.token_slots, {n, t});
      bad = bad || w[t] >= P;
    }
  } else {
    w[T - 1] = a.write_slots.defined() ? get_index(a.write_slots, {n}) : read;
    bad = bad || w[T - 1] >= P;
  }
  if (bad) { row.invalid = true; return row; }
  if (read < 0) return row;  // padding
  row.valid = true;
  row.read = read;
  if (a.update_state) row.write = w;  // negative entries: not stored
  return row;
}

// The shapes and options of one call, as the oracle reads them.
struct Call {
  int64_t B, T, H, HV, K, V, P;
  bool kv, raw;
  double scale;
};

// Rows resolved and counted into error_count (semantics section 3), duplicate writers too.
std::vector<Row> resolve_all(const StepArgs& a, const Call& c) {
  std::vector<Row> rows(c.B);
  int bad = 0;
  for (int64_t n = 0; n < c.B; ++n) {
    rows[n] = resolve(a, n, c.T, c.P);
    bad += rows[n].invalid ? 1 : 0;
  }
  if (a.check_duplicate_writes) {
    for (int64_t n = 0; n < c.B; ++n) {
      bool dup = false;
      for (int64_t m = 0; m < c.B && !dup; ++m) {
        if (m == n) continue;
        for (int64_t x : rows[n].write)
          for (int64_t y : rows[m].write) dup = dup || (x >= 0 && x == y);
      }
      bad += dup ? 1 : 0;
    }
  }
  if (a.error_count.defined()) *static_cast<int32_t*>(a.error_count.data) += bad;
  return rows;
}

// Section 2 for row n, value head hv of a valid row: q(t, c), k(t, c), v(t, r) give the raw
// inputs of token t; emit(t, r, o) receives each output element; inter and the written slots
// are stored here.
template <typename Q, typename Kf, typename Vf, typename Emit>
void run_head(const StepArgs& a, const Call& c, const Row& row, int64_t n, int64_t hv, Q q, Kf k, Vf v,
              Emit emit) {
  const int64_t K = c.K, V = c.V;
  // The random bits' key of this head: the seed's value, the row's read slot, the head.
  const bool stochastic = a.rounding_seed.defined() && a.state.dtype.bits == 16;
  const uint32_t head_key =
      stochastic ? detail::sr_head_key(*static_cast<const int64_t*>(a.rounding_seed.data), row.read, hv) : 0;
  std::vector<double> S(V * K), qh(K), kh(K), h(K);
  for (int64_t r = 0; r < V; ++r)
    for (int64_t col = 0; col < K; ++col) S[r * K + col] = get_state(a.state, c.kv, row.read, hv, r, col);
  for (int64_t t = 0; t < c.T; ++t) {
    double g, beta;
    if (c.raw) {
      const double x = get(a.a, {n, t, hv}) + get(a.dt_bias, {hv});
      const double sp = x <= 20.0 ? std::log1p(std::exp(x)) : x;
      g = std::exp(-std::exp(get(a.A_log, {hv})) * sp);
      beta = 1.0 / (1.0 + std::exp(-get(a.b, {n, t, hv})));
    } else {
      g = std::exp(get(a.g, {n, t, hv}));
      beta = get(a.beta, {n, t, hv});
    }
    double sq = 0, sk = 0;
    for (int64_t col = 0; col < K; ++col) {
      qh[col] = q(t, col);
      kh[col] = k(t, col);
      sq += qh[col] * qh[col];
      sk += kh[col] * kh[col];
    }
    const double fq = (a.use_qk_l2norm ? 1.0 / std::sqrt(sq + 1e-6) : 1.0) * c.scale;
    const double fk = a.use_qk_l2norm ? 1.0 / std::sqrt(sk + 1e-6) : 1.0;
    for (int64_t col = 0; col < K; ++col) {
      qh[col] *= fq;
      kh[col] *= fk;
    }
    for (int64_t r = 0; r < V; ++r) {
      double* Sr = &S[r * K];
      double hk = 0;
      for (int64_t col = 0; col < K; ++col) {
        h[col] = g * Sr[col];
        hk += h[col] * kh[col];
      }
      const double delta = beta * (v(t, r) - hk);
      double out = 0;
      for (int64_t col = 0; col < K; ++col) {
        h[col] += delta * kh[col];
        out += h[col] * qh[col];
        Sr[col] = h[col];
      }
      emit(t, r, out);
    }
    Rounding rd;
    rd.on = stochastic;
    rd.key = stochastic ? detail::sr_token_key(head_key, t) : 0;
    if (a.inter.defined())
      for (int64_t r = 0; r < V; ++r)
        for (int64_t col = 0; col < K; ++col) put_inter(a.inter, c.kv, n, t, hv, r, col, S[r * K + col], rd);
    if (row.write[t] >= 0)
      for (int64_t r = 0; r < V; ++r)
        for (int64_t col = 0; col < K; ++col)
          put_state(a.state, c.kv, row.write[t], hv, r, col, S[r * K + col], rd);
  }
}

// `checked` is `a` as validated: `a` itself, or for decode_exact `a` with its float64 views
// retyped as fp32.
Status decode_as(const DecodeArgs& a, const DecodeArgs& checked) {
  Status s = can_implement(checked);
  if (!s.ok()) return s;
  if (a.state.device.device_type != kDLCPU)
    return Status(StatusCode::kNotSupported, "the oracle runs on host (kDLCPU) tensors only");
  Call c;
  c.B = a.q.shape[0], c.T = a.q.shape[1], c.H = a.q.shape[2], c.K = a.q.shape[3];
  c.HV = a.v.shape[2], c.V = a.v.shape[3], c.P = a.state.shape[0];
  c.kv = *a.layout == StateLayout::kKV;
  c.raw = a.a.defined();
  c.scale = a.scale.has_value() ? static_cast<double>(*a.scale) : 1.0 / std::sqrt(static_cast<double>(c.K));
  const std::vector<Row> rows = resolve_all(a, c);
  for (int64_t n = 0; n < c.B; ++n) {
    for (int64_t hv = 0; hv < c.HV; ++hv) {
      if (!rows[n].valid) {
        for (int64_t t = 0; t < c.T; ++t)
          for (int64_t r = 0; r < c.V; ++r) put(a.o, {n, t, hv, r}, 0.0);
        continue;
      }
      const int64_t hq = hv / (c.HV / c.H);
      run_head(
          a, c, rows[n], n, hv, [&](int64_t t, int64_t i) { return get(a.q, {n, t, hq, i}); },
          [&](int64_t t, int64_t i) { return get(a.k, {n, t, hq, i}); },
          [&](int64_t t, int64_t r) { return get(a.v, {n, t, hv, r}); },
          [&](int64_t t, int64_t r, double o) { put(a.o, {n, t, hv, r}, o); });
    }
  }
  return Status::Ok();
}

}  // namespace

Status decode(const DecodeArgs& a) { return decode_as(a, a); }

Status decode_exact(const DecodeArgs& a) {
  constexpr DLDataType kFloat64{kDLFloat, 64, 1};
  auto same = [](DLDataType x, DLDataType y) { return x.code == y.code && x.bits == y.bits && x.lanes == y.lanes; };
  if (!same(a.state.dtype, kFloat64) || (a.inter.defined() && !same(a.inter.dtype, kFloat64)))
    return Status(StatusCode::kInvalidArgument, "decode_exact: state (and inter, if given) must be float64");
  DecodeArgs checked = a;
  checked.state.dtype = kFloat32;
  if (checked.inter.defined()) checked.inter.dtype = kFloat32;
  if (same(a.o.dtype, kFloat64)) checked.o.dtype = kFloat32;
  return decode_as(a, checked);
}

// Section 6: the conv update over the window [conv state of the read slot | the T new inputs],
// SiLU, the split into q | k | v, section 2, and the gated RMSNorm; the conv state after each
// token goes where section 3 sends the recurrent state after that token, and to conv_inter.
Status fused_decode(const FusedDecodeArgs& a) {
  Status s = can_implement(a);
  if (!s.ok()) return s;
  if (a.state.device.device_type != kDLCPU)
    return Status(StatusCode::kNotSupported, "the oracle runs on host (kDLCPU) tensors only");
  Call c;
  c.kv = *a.layout == StateLayout::kKV;
  c.B = a.mixed_qkv.shape[0], c.T = a.mixed_qkv.shape[1];
  c.HV = a.state.shape[1], c.P = a.state.shape[0];
  c.K = a.state.shape[c.kv ? 2 : 3], c.V = a.state.shape[c.kv ? 3 : 2];
  const int64_t D = a.mixed_qkv.shape[2], W = a.conv_weight.shape[1], L = a.conv_state.shape[2];
  c.H = (D - c.HV * c.V) / (2 * c.K);
  c.raw = a.a.defined();
  c.scale = a.scale.has_value() ? static_cast<double>(*a.scale) : 1.0 / std::sqrt(static_cast<double>(c.K));
  const std::vector<Row> rows = resolve_all(a, c);
  const int64_t T = c.T, V = c.V, K = c.K, H = c.H;

  for (int64_t n = 0; n < c.B; ++n) {
    const Row& row = rows[n];
    if (!row.valid) {
      for (int64_t t = 0; t < T; ++t)
        for (int64_t hv = 0; hv < c.HV; ++hv)
          for (int64_t r = 0; r < V; ++r) put(a.o, {n, t, hv, r}, 0.0);
      continue;
    }
    // ext[d][j]: the L old columns of the read slot, then the T new inputs.
    std::vector<double> ext(D * (L + T)), y(T * D);
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t j = 0; j < L; ++j) ext[d * (L + T) + j] = get(a.conv_state, {row.read, d, j});
      for (int64_t t = 0; t < T; ++t) ext[d * (L + T) + L + t] = get(a.mixed_qkv, {n, t, d});
      for (int64_t t = 0; t < T; ++t) {
        double acc = a.conv_bias.defined() ? get(a.conv_bias, {d}) : 0.0;
        for (int64_t w = 0; w < W; ++w) acc += get(a.conv_weight, {d, w}) * ext[d * (L + T) + L + t - (W - 1) + w];
        y[t * D + d] = acc / (1.0 + std::exp(-acc));  // SiLU
      }
    }
    // The conv state after token t: the last L entries of ext up to that token.
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t d = 0; d < D; ++d)
        for (int64_t j = 0; j < L; ++j) {
          const double x = ext[d * (L + T) + t + 1 + j];
          if (a.conv_inter.defined()) put(a.conv_inter, {n, t, d, j}, x);
          if (row.write[t] >= 0) put(a.conv_state, {row.write[t], d, j}, x);
        }
    }
    for (int64_t hv = 0; hv < c.HV; ++hv) {
      const int64_t hq = hv / (c.HV / H);
      std::vector<double> o(T * V);
      run_head(
          a, c, row, n, hv, [&](int64_t t, int64_t i) { return y[t * D + hq * K + i]; },
          [&](int64_t t, int64_t i) { return y[t * D + H * K + hq * K + i]; },
          [&](int64_t t, int64_t r) { return y[t * D + 2 * H * K + hv * V + r]; },
          [&](int64_t t, int64_t r, double x) { o[t * V + r] = x; });
      for (int64_t t = 0; t < T; ++t) {
        double f = 1.0;
        if (a.norm_weight.defined()) {
          double ss = 0;
          for (int64_t r = 0; r < V; ++r) ss += o[t * V + r] * o[t * V + r];
          f = 1.0 / std::sqrt(ss / static_cast<double>(V) + static_cast<double>(a.norm_eps));
        }
        for (int64_t r = 0; r < V; ++r) {
          double x = o[t * V + r];
          if (a.norm_weight.defined()) {
            x *= f * get(a.norm_weight, {r});
            if (a.z.defined()) {
              const double z = get(a.z, {n, t, hv, r});
              x *= z / (1.0 + std::exp(-z));
            }
          }
          put(a.o, {n, t, hv, r}, x);
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace gdn::reference
