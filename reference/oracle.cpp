// The float64 oracle. Deliberately independent of the backends: it reads the caller's
// TensorViews with its own index arithmetic and resolves slots from the text of
// docs/semantics.md section 3, so a bug in the flattened Problem or in resolve_row shows up
// as a mismatch instead of being shared. Only argument validation (can_implement) and the
// scalar rounding helpers are common code.
#include <cmath>
#include <vector>

#include "../src/host_dtype.h"
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
  if (t.dtype.bits == 16) return detail::fp16_bits_to_float(static_cast<const uint16_t*>(t.data)[off]);
  return static_cast<const float*>(t.data)[off];
}

int64_t get_index(const TensorView& t, std::initializer_list<int64_t> idx) {
  const int64_t off = offset_of(t, idx);
  return t.dtype.bits == 64 ? static_cast<const int64_t*>(t.data)[off]
                            : static_cast<int64_t>(static_cast<const int32_t*>(t.data)[off]);
}

// One rounding from float64 to the storage dtype (round-to-nearest-even).
void put(const TensorView& t, std::initializer_list<int64_t> idx, double x) {
  const int64_t off = offset_of(t, idx);
  if (t.dtype.code == kDLBfloat) static_cast<uint16_t*>(t.data)[off] = double_to_bf16_bits(x);
  else if (t.dtype.bits == 16) static_cast<uint16_t*>(t.data)[off] = double_to_fp16_bits(x);
  else static_cast<float*>(t.data)[off] = static_cast<float>(x);
}

// State element (value row r, key c) of head hv in slot `slot` (or batch row, for inter).
double get_state(const TensorView& s, bool kv, int64_t slot, int64_t hv, int64_t r, int64_t c) {
  return kv ? get(s, {slot, hv, c, r}) : get(s, {slot, hv, r, c});
}
void put_state(const TensorView& s, bool kv, int64_t slot, int64_t hv, int64_t r, int64_t c, double x) {
  kv ? put(s, {slot, hv, c, r}, x) : put(s, {slot, hv, r, c}, x);
}
void put_inter(const TensorView& s, bool kv, int64_t n, int64_t t, int64_t hv, int64_t r, int64_t c, double x) {
  kv ? put(s, {n, t, hv, c, r}, x) : put(s, {n, t, hv, r, c}, x);
}

struct Row {
  bool valid = false;    // false: padding (or invalid) row
  bool invalid = false;  // a slot >= P or num_accepted outside 1..T
  int64_t read = -1;
  std::vector<int64_t> write;  // per token: slot written with the state after token t, or -1
};

Row resolve(const DecodeArgs& a, int64_t n, int64_t T, int64_t P) {
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

}  // namespace

Status decode(const DecodeArgs& a) {
  Status s = can_implement(a);
  if (!s.ok()) return s;
  if (a.state.device.device_type != kDLCPU)
    return Status(StatusCode::kNotSupported, "the oracle runs on host (kDLCPU) tensors only");
  const int64_t B = a.q.shape[0], T = a.q.shape[1], H = a.q.shape[2], K = a.q.shape[3];
  const int64_t HV = a.v.shape[2], V = a.v.shape[3], P = a.state.shape[0];
  const bool kv = *a.layout == StateLayout::kKV;
  const bool raw = a.a.defined();
  const double scale = a.scale.has_value() ? static_cast<double>(*a.scale) : 1.0 / std::sqrt(static_cast<double>(K));

  std::vector<Row> rows(B);
  int bad = 0;
  for (int64_t n = 0; n < B; ++n) {
    rows[n] = resolve(a, n, T, P);
    bad += rows[n].invalid ? 1 : 0;
  }
  if (a.check_duplicate_writes) {
    for (int64_t n = 0; n < B; ++n) {
      bool dup = false;
      for (int64_t m = 0; m < B && !dup; ++m) {
        if (m == n) continue;
        for (int64_t x : rows[n].write)
          for (int64_t y : rows[m].write) dup = dup || (x >= 0 && x == y);
      }
      bad += dup ? 1 : 0;
    }
  }
  if (a.error_count.defined()) *static_cast<int32_t*>(a.error_count.data) += bad;

  std::vector<double> S(V * K), qh(K), kh(K), h(K);
  for (int64_t n = 0; n < B; ++n) {
    const Row& row = rows[n];
    for (int64_t hv = 0; hv < HV; ++hv) {
      if (!row.valid) {
        for (int64_t t = 0; t < T; ++t)
          for (int64_t r = 0; r < V; ++r) put(a.o, {n, t, hv, r}, 0.0);
        continue;
      }
      const int64_t hq = hv / (HV / H);
      for (int64_t r = 0; r < V; ++r)
        for (int64_t c = 0; c < K; ++c) S[r * K + c] = get_state(a.state, kv, row.read, hv, r, c);
      for (int64_t t = 0; t < T; ++t) {
        double g, beta;
        if (raw) {
          const double x = get(a.a, {n, t, hv}) + get(a.dt_bias, {hv});
          const double sp = x <= 20.0 ? std::log1p(std::exp(x)) : x;
          g = std::exp(-std::exp(get(a.A_log, {hv})) * sp);
          beta = 1.0 / (1.0 + std::exp(-get(a.b, {n, t, hv})));
        } else {
          g = std::exp(get(a.g, {n, t, hv}));
          beta = get(a.beta, {n, t, hv});
        }
        double sq = 0, sk = 0;
        for (int64_t c = 0; c < K; ++c) {
          qh[c] = get(a.q, {n, t, hq, c});
          kh[c] = get(a.k, {n, t, hq, c});
          sq += qh[c] * qh[c];
          sk += kh[c] * kh[c];
        }
        const double fq = (a.use_qk_l2norm ? 1.0 / std::sqrt(sq + 1e-6) : 1.0) * scale;
        const double fk = a.use_qk_l2norm ? 1.0 / std::sqrt(sk + 1e-6) : 1.0;
        for (int64_t c = 0; c < K; ++c) {
          qh[c] *= fq;
          kh[c] *= fk;
        }
        for (int64_t r = 0; r < V; ++r) {
          double* Sr = &S[r * K];
          double hk = 0;
          for (int64_t c = 0; c < K; ++c) {
            h[c] = g * Sr[c];
            hk += h[c] * kh[c];
          }
          const double delta = beta * (get(a.v, {n, t, hv, r}) - hk);
          double out = 0;
          for (int64_t c = 0; c < K; ++c) {
            h[c] += delta * kh[c];
            out += h[c] * qh[c];
            Sr[c] = h[c];
          }
          put(a.o, {n, t, hv, r}, out);
        }
        if (a.inter.defined())
          for (int64_t r = 0; r < V; ++r)
            for (int64_t c = 0; c < K; ++c) put_inter(a.inter, kv, n, t, hv, r, c, S[r * K + c]);
        if (row.write[t] >= 0)
          for (int64_t r = 0; r < V; ++r)
            for (int64_t c = 0; c < K; ++c) put_state(a.state, kv, row.write[t], hv, r, c, S[r * K + c]);
      }
    }
  }
  return Status::Ok();
}

}  // namespace gdn::reference
