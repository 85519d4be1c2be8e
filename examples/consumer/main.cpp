// A program that uses gdn as an installed package: two T = 1 decode steps on host tensors
// through the public API (the README's C++ snippet with gdn::kCpu), checked against the
// closed form that the chosen inputs allow. Exits 1 on any mismatch.
//
// Inputs: q = k = 2 * e_j for q/k head j (so after the L2 norm kh = c * e_j, qh = c * scale * e_j
// with c = 2 / sqrt(4 + 1e-6)); pool row 0 reads and writes slot 2, which starts at zero; row 1
// is padding (slot -1). Then per value head hv (q/k head j = hv / 2) and value row r, the step
// of docs/semantics.md section 2 reduces to scalars:
//   call 1: d1 = beta1 * v1[r];                  S[r, j] = c * d1;            o = c^2 * scale * d1
//   call 2: d2 = beta2 * (v2[r] - g2 * c^2 * d1); S[r, j] = c * (g2 * d1 + d2); o = c * scale * S[r, j]
// and every other state element stays 0.
#include <gdn/gdn.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t H = 16, HV = 32, K = 128, V = 128;

// One T = 1 decode step for B requests over a pool of P fp32 states, K-last (VK) layout.
gdn::Status step(void* q, void* k, void* v, void* a, void* b, float* A_log, float* dt_bias,
                 float* pool, int32_t* slots, void* o, int64_t B, int64_t P, void* stream) {
  const DLDevice dev = gdn::kCpu;  // gdn::cuda_device(0) for device tensors
  gdn::DecodeArgs args;
  args.q = gdn::make_view(q, gdn::kBFloat16, dev, {B, 1, H, K});
  args.k = gdn::make_view(k, gdn::kBFloat16, dev, {B, 1, H, K});
  args.v = gdn::make_view(v, gdn::kBFloat16, dev, {B, 1, HV, V});
  args.a = gdn::make_view(a, gdn::kBFloat16, dev, {B, 1, HV});
  args.b = gdn::make_view(b, gdn::kBFloat16, dev, {B, 1, HV});
  args.A_log = gdn::make_view(A_log, gdn::kFloat32, dev, {HV});
  args.dt_bias = gdn::make_view(dt_bias, gdn::kFloat32, dev, {HV});
  args.state = gdn::make_view(pool, gdn::kFloat32, dev, {P, HV, V, K});
  args.layout = gdn::StateLayout::kVK;
  args.read_slots = gdn::make_view(slots, gdn::kInt32, dev, {B});  // -1 = padding row
  args.o = gdn::make_view(o, gdn::kBFloat16, dev, {B, 1, HV, V});
  return gdn::decode(args, stream);  // status.message() names the bad argument, if any
}

uint16_t to_bf16(float x) {  // round to nearest even; the inputs below are exact in bf16 anyway
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

int failures = 0;
void expect_near(const char* what, int64_t hv, int64_t r, double got, double want, double rel) {
  if (std::fabs(got - want) <= rel * std::fabs(want) + 1e-7) return;
  if (++failures <= 10) std::printf("MISMATCH %s hv=%lld r=%lld: got %.7g, want %.7g\n", what,
                                    static_cast<long long>(hv), static_cast<long long>(r), got, want);
}

}  // namespace

int main() {
  const int64_t B = 2, P = 3;
  std::vector<uint16_t> q(B * H * K, to_bf16(0.f)), v1(B * HV * V), v2(B * HV * V);
  std::vector<uint16_t> a(B * HV), b(B * HV), o(B * HV * V);
  std::vector<float> A_log(HV), dt_bias(HV), pool(P * HV * V * K, 0.f);
  std::vector<int32_t> slots = {2, -1};
  for (int64_t n = 0; n < B; ++n)
    for (int64_t j = 0; j < H; ++j) q[(n * H + j) * K + j] = to_bf16(2.f);
  for (int64_t i = 0; i < B * HV * V; ++i) {
    const int64_t hv = i / V % HV, r = i % V;
    v1[i] = to_bf16(static_cast<float>((r + 3 * hv) % 17 - 8) / 8);
    v2[i] = to_bf16(static_cast<float>((5 * r + hv) % 13 - 6) / 8);
  }
  for (int64_t i = 0; i < B * HV; ++i) {
    a[i] = to_bf16(static_cast<float>(i % 5 - 2) / 2);
    b[i] = to_bf16(static_cast<float>(i % 7 - 3) / 4);
  }
  for (int64_t hv = 0; hv < HV; ++hv) {
    A_log[hv] = std::log(1.f + static_cast<float>(hv % 4));
    dt_bias[hv] = 0.125f * static_cast<float>(hv % 3);
  }
  const float sentinel = 7.f;  // slots 0 and 1 are not named by the call: they must stay as they are
  std::fill(pool.begin(), pool.begin() + 2 * HV * V * K, sentinel);

  const double scale = 1 / std::sqrt(static_cast<double>(K));
  const double c = 2 / std::sqrt(4 + 1e-6);
  std::vector<double> d1(HV * V);
  for (int call = 1; call <= 2; ++call) {
    std::vector<uint16_t>& v = call == 1 ? v1 : v2;
    std::fill(o.begin(), o.end(), 0x7fc0);  // NaN: every output element must be written
    const gdn::Status s = step(q.data(), q.data(), v.data(), a.data(), b.data(), A_log.data(),
                               dt_bias.data(), pool.data(), slots.data(), o.data(), B, P, nullptr);
    if (!s.ok()) {
      std::printf("gdn::decode failed: %s\n", s.message().c_str());
      return 1;
    }
    for (int64_t hv = 0; hv < HV; ++hv) {
      const int64_t j = hv / (HV / H);
      const double x = from_bf16(a[hv]) + dt_bias[hv];
      const double softplus = x > 20 ? x : std::log1p(std::exp(x));
      const double g = std::exp(-std::exp(static_cast<double>(A_log[hv])) * softplus);
      const double beta = 1 / (1 + std::exp(-static_cast<double>(from_bf16(b[hv]))));
      for (int64_t r = 0; r < V; ++r) {
        const double vr = from_bf16(v[hv * V + r]);
        double s_rj, o_r;
        if (call == 1) {
          d1[hv * V + r] = beta * vr;
          s_rj = c * d1[hv * V + r];
          o_r = c * c * scale * d1[hv * V + r];
        } else {
          const double d2 = beta * (vr - g * c * c * d1[hv * V + r]);
          s_rj = c * (g * d1[hv * V + r] + d2);
          o_r = c * scale * s_rj;
        }
        expect_near("o (bf16)", hv, r, from_bf16(o[hv * V + r]), o_r, 1.0 / 128);
        const float* row = &pool[((2 * HV + hv) * V + r) * K];
        expect_near("state (fp32)", hv, r, row[j], s_rj, 1e-5);
        for (int64_t kk = 0; kk < K; ++kk)
          if (kk != j) expect_near("state off e_j", hv, r, row[kk], 0, 0);
        expect_near("padding row o", hv, r, from_bf16(o[(HV + hv) * V + r]), 0, 0);
      }
    }
  }
  for (int64_t i = 0; i < 2 * HV * V * K; ++i)
    if (pool[i] != sentinel) expect_near("untouched slots", i / (V * K) % HV, i / K % V, pool[i], sentinel, 0);

  std::printf("gdn consumer: 2 decode steps on the CPU (gdn::cuda_available(): %s): %s\n",
              gdn::cuda_available() ? "yes" : "no", failures ? "FAILED" : "all values as expected");
  return failures ? 1 : 0;
}
