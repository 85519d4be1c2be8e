// `gdn run`: the main job. Simulates what a serving engine does with one GDN layer:
// a pool of P recurrent-state slots, each request of the batch holding a random distinct
// slot, the batch padded to a CUDA-graph size with -1 rows, q/k/v sliced from one packed
// projection buffer, and `--steps` calls of decode (T = 1) or of speculative verify
// (T > 1: per-token slots, the next step continuing from the last accepted token). Every
// step is checked against the float64 oracle (all rows when cheap, a random sample
// otherwise) and reported with its time and state traffic. --fused runs the layer's whole
// decode path instead (gdn::fused_decode): the packed buffer is the conv's input, a conv pool
// of kConvL columns in vLLM's [P, L, D] memory follows the state slots, and the gated RMSNorm
// takes z; the oracle checks o, the states and the conv states it wrote.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#ifdef GDN_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "compare.h"
#include "gdn/gdn.h"
#include "gdn_reference.h"
#include "host_dtype.h"
#include "run.h"

namespace gdn::tools {
namespace {

struct ModelShape {
  int H, HV, K, V, gdn_layers;
};

// Published configs: Qwen3-Next-80B-A3B (48 layers, 36 of them GDN) and Qwen3.5-397B-A17B
// (60 layers, 45 GDN): linear_num_key_heads, linear_num_value_heads, linear_key/value_head_dim.
const std::map<std::string, ModelShape> kModels = {
    {"qwen3-next", {16, 32, 128, 128, 36}},
    {"qwen3.5", {16, 64, 128, 128, 45}},
};

// The conv of Qwen3-Next's and Qwen3.5's GDN layers (conv_kernel_size 4), with a conv pool of
// W - 1 columns as vLLM keeps it.
constexpr int64_t kConvW = 4;
constexpr int64_t kConvL = kConvW - 1;

struct Options {
  std::string model = "qwen3-next";
  int tp = 1;
  int batch = 30;
  int64_t pool = 0;
  int steps = 8;
  int tokens = 1;
  std::string state = "fp32";
  std::string layout = "VK";
  std::string dtype = "bf16";
  std::string device = "auto";
  uint64_t seed = 0;
  int max_verify_rows = 0;
  bool cache = false;
  bool fused = false;
  std::string slots = "token";
};

DLDataType parse_dtype(const std::string& s) {
  if (s == "fp32") return kFloat32;
  if (s == "bf16") return kBFloat16;
  return kFloat16;
}

int elsize(DLDataType t) { return t.bits / 8; }

// vLLM's CUDA-graph capture sizes: 1, 2, 4, then multiples of 8.
int graph_batch(int b) {
  if (b <= 2) return b;
  if (b <= 4) return 4;
  return (b + 7) / 8 * 8;
}

// Host or device memory, with copies in both directions; the run works on either.
struct Mem {
  void* ptr = nullptr;
  size_t bytes = 0;
  bool gpu = false;
  Mem() = default;
  Mem(size_t n, bool on_gpu) : bytes(n), gpu(on_gpu) {
    if (n == 0) return;  // an unused buffer (null; never copied)
#ifdef GDN_WITH_CUDA
    if (gpu) {
      if (cudaMalloc(&ptr, n) != cudaSuccess) throw std::runtime_error("cudaMalloc failed for " + std::to_string(n) + " bytes");
      return;
    }
#endif
    ptr = std::malloc(n);
    if (!ptr) throw std::runtime_error("out of host memory");
  }
  Mem(const Mem&) = delete;
  ~Mem() {
#ifdef GDN_WITH_CUDA
    if (gpu) { cudaFree(ptr); return; }
#endif
    std::free(ptr);
  }
  void upload(const void* src, size_t n, size_t off = 0) {
#ifdef GDN_WITH_CUDA
    if (gpu) { cudaMemcpy(static_cast<char*>(ptr) + off, src, n, cudaMemcpyHostToDevice); return; }
#endif
    std::memcpy(static_cast<char*>(ptr) + off, src, n);
  }
  void download(void* dst, size_t n, size_t off = 0) const {
#ifdef GDN_WITH_CUDA
    if (gpu) { cudaMemcpy(dst, static_cast<const char*>(ptr) + off, n, cudaMemcpyDeviceToHost); return; }
#endif
    std::memcpy(dst, static_cast<const char*>(ptr) + off, n);
  }
};

void fill_normal(std::vector<uint8_t>& buf, DLDataType t, std::mt19937_64& rng, double mean, double sd) {
  std::normal_distribution<float> d(static_cast<float>(mean), static_cast<float>(sd));
  const size_t n = buf.size() / elsize(t);
  for (size_t i = 0; i < n; ++i) {
    const float x = d(rng);
    if (t.bits == 32) reinterpret_cast<float*>(buf.data())[i] = x;
    else if (t.code == kDLBfloat) reinterpret_cast<uint16_t*>(buf.data())[i] = detail::float_to_bf16_bits(x);
    else reinterpret_cast<uint16_t*>(buf.data())[i] = detail::float_to_fp16_bits(x);
  }
}

void fill_nan(std::vector<uint8_t>& buf, DLDataType t) {
  if (t.bits == 32) std::fill_n(reinterpret_cast<float*>(buf.data()), buf.size() / 4, NAN);
  else std::fill_n(reinterpret_cast<uint16_t*>(buf.data()), buf.size() / 2, uint16_t{0x7fff});
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int run(const Options& opt) {
  auto it = kModels.find(opt.model);
  ModelShape m = it->second;
  if (m.H % opt.tp || m.HV % opt.tp) {
    std::fprintf(stderr, "gdn run: --tp %d must divide H = %d and HV = %d\n", opt.tp, m.H, m.HV);
    return 2;
  }
  const int64_t H = m.H / opt.tp, HV = m.HV / opt.tp, K = m.K, V = m.V, T = opt.tokens;
  const int64_t Breal = opt.batch, B = graph_batch(opt.batch);
  const int64_t P = opt.pool > 0 ? opt.pool : 2 * B * T + 16;
  if (P < Breal * T) {
    std::fprintf(stderr, "gdn run: --pool %lld is too small for %lld requests x %lld tokens\n",
                 static_cast<long long>(P), static_cast<long long>(Breal), static_cast<long long>(T));
    return 2;
  }
  const DLDataType sdt = parse_dtype(opt.state), idt = parse_dtype(opt.dtype), odt = idt;
  const bool kv = opt.layout == "KV";

  bool gpu = false;
  if (opt.device == "cuda" || (opt.device == "auto" && cuda_available())) gpu = true;
  if (gpu && !cuda_available()) {
    std::fprintf(stderr, "gdn run: --device cuda, but %s\n",
#ifdef GDN_WITH_CUDA
                 "no CUDA device is visible"
#else
                 "this build has no CUDA backend"
#endif
    );
    return 2;
  }
  const DLDevice dev = gpu ? cuda_device(0) : kCpu;
  const uint64_t seed = opt.seed ? opt.seed : std::random_device{}();
  std::mt19937_64 rng(seed);

  const int64_t slot_elems = HV * V * K;
  const size_t slot_bytes = slot_elems * elsize(sdt);
  std::printf("gdn run: model %s (TP %d: H=%lld HV=%lld K=%lld V=%lld), backend %s\n", opt.model.c_str(), opt.tp,
              (long long)H, (long long)HV, (long long)K, (long long)V, gpu ? "cuda" : "cpu");
  std::printf("  batch %lld requests padded to %lld (CUDA-graph size), T=%lld, pool %lld slots of %.2f MiB (%s %s), "
              "inputs %s, seed %llu\n",
              (long long)Breal, (long long)B, (long long)T, (long long)P, slot_bytes / 1048576.0, opt.state.c_str(),
              kv ? "KV" : "VK", opt.dtype.c_str(), (unsigned long long)seed);

  // The pool, random N(0, 0.1) as after some history; the kernel's only large operand.
  Mem pool(P * slot_bytes, gpu);
  {
    std::vector<uint8_t> chunk(slot_bytes);
    for (int64_t s = 0; s < P; ++s) {
      fill_normal(chunk, sdt, rng, 0.0, 0.1);
      pool.upload(chunk.data(), slot_bytes, s * slot_bytes);
    }
  }
  // Each request owns T distinct slots (T = 1: one slot updated in place).
  std::vector<int32_t> all_slots(P);
  std::iota(all_slots.begin(), all_slots.end(), 0);
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  auto req_slot = [&](int64_t n, int64_t t) { return all_slots[n * T + t]; };

  // Layer weights: A_log = log(U(1, 16)), dt_bias ~ N(0, 0.1), fp32.
  std::vector<float> A_log(HV), dt_bias(HV);
  {
    std::uniform_real_distribution<float> u(1.f, 16.f);
    std::normal_distribution<float> nd(0.f, 0.1f);
    for (auto& x : A_log) x = std::log(u(rng));
    for (auto& x : dt_bias) x = nd(rng);
  }
  Mem A_log_d(HV * 4, gpu), dt_bias_d(HV * 4, gpu);
  A_log_d.upload(A_log.data(), HV * 4);
  dt_bias_d.upload(dt_bias.data(), HV * 4);

  // Packed projection output [B, T, 2*H*K + HV*V] as an engine has it: q, k, v are views.
  const int64_t qkv_w = 2 * H * K + HV * V;
  std::vector<uint8_t> qkv_h(B * T * qkv_w * elsize(idt)), a_h(B * T * HV * elsize(idt)), b_h(a_h.size());
  std::vector<uint8_t> o_h(B * T * HV * V * elsize(odt));
  Mem qkv_d(qkv_h.size(), gpu), a_d(a_h.size(), gpu), b_d(b_h.size(), gpu), o_d(o_h.size(), gpu);
  std::vector<int32_t> read_h(B), write_h(B), tok_h(B * T), acc_h(B);
  Mem read_d(B * 4, gpu), write_d(B * 4, gpu), tok_d(B * T * 4, gpu), acc_d(B * 4, gpu), err_d(4, gpu);
  const int32_t zero = 0;
  err_d.upload(&zero, 4);
  const int64_t inter_elems = B * T * slot_elems;
  std::unique_ptr<Mem> inter_d;
  if (opt.cache) inter_d = std::make_unique<Mem>(inter_elems * elsize(sdt), gpu);

  char* qkv_base = static_cast<char*>(qkv_d.ptr);
  DecodeArgs args;
  args.q = make_view(qkv_base, idt, dev, {B, T, H, K}, {T * qkv_w, qkv_w, K, 1});
  args.k = make_view(qkv_base + H * K * elsize(idt), idt, dev, {B, T, H, K}, {T * qkv_w, qkv_w, K, 1});
  args.v = make_view(qkv_base + 2 * H * K * elsize(idt), idt, dev, {B, T, HV, V}, {T * qkv_w, qkv_w, V, 1});
  args.a = make_view(a_d.ptr, idt, dev, {B, T, HV});
  args.b = make_view(b_d.ptr, idt, dev, {B, T, HV});
  args.A_log = make_view(A_log_d.ptr, kFloat32, dev, {HV});
  args.dt_bias = make_view(dt_bias_d.ptr, kFloat32, dev, {HV});
  args.state = make_view(pool.ptr, sdt, dev, {P, HV, kv ? K : V, kv ? V : K});
  args.layout = kv ? StateLayout::kKV : StateLayout::kVK;
  args.o = make_view(o_d.ptr, odt, dev, {B, T, HV, V});
  args.error_count = make_view(err_d.ptr, kInt32, dev, {1});
  // T > 1: per-token slots with accepted-token continuation (vLLM's verify), or --slots pool: a
  // read and a write slot per row and the final state only (FlashInfer's verify).
  const bool pool_slots = T > 1 && opt.slots == "pool";
  if (T == 1) {
    args.read_slots = make_view(read_d.ptr, kInt32, dev, {B});
  } else if (pool_slots) {
    args.read_slots = make_view(read_d.ptr, kInt32, dev, {B});
    args.write_slots = make_view(write_d.ptr, kInt32, dev, {B});
  } else {
    args.token_slots = make_view(tok_d.ptr, kInt32, dev, {B, T});
    args.num_accepted = make_view(acc_d.ptr, kInt32, dev, {B});
  }
  if (opt.cache) args.inter = make_view(inter_d->ptr, sdt, dev, {B, T, HV, kv ? K : V, kv ? V : K});

  // --fused: the conv pool (random, as after some history), the conv taps, z and the norm
  // weight, all in the inputs' dtype; the packed buffer becomes mixed_qkv.
  const size_t fes = opt.fused ? elsize(idt) : 0;  // element size of the fused-only buffers (0: none)
  const size_t conv_slot_bytes = qkv_w * kConvL * fes;
  std::vector<uint8_t> conv_w_h(qkv_w * kConvW * fes), norm_w_h(V * fes), z_h(B * T * HV * V * fes);
  Mem conv_pool(P * conv_slot_bytes, gpu), conv_w_d(conv_w_h.size(), gpu), norm_w_d(norm_w_h.size(), gpu),
      z_d(z_h.size(), gpu);
  FusedDecodeArgs fargs;
  if (opt.fused) {
    std::vector<uint8_t> chunk(conv_slot_bytes);
    for (int64_t s = 0; s < P; ++s) {
      fill_normal(chunk, idt, rng, 0.0, 1.0);
      conv_pool.upload(chunk.data(), conv_slot_bytes, s * conv_slot_bytes);
    }
    fill_normal(conv_w_h, idt, rng, 0.0, 0.5);
    fill_normal(norm_w_h, idt, rng, 1.0, 0.1);
    conv_w_d.upload(conv_w_h.data(), conv_w_h.size());
    norm_w_d.upload(norm_w_h.data(), norm_w_h.size());
    static_cast<StepArgs&>(fargs) = static_cast<const StepArgs&>(args);
    fargs.mixed_qkv = make_view(qkv_base, idt, dev, {B, T, qkv_w});
    fargs.conv_weight = make_view(conv_w_d.ptr, idt, dev, {qkv_w, kConvW});
    fargs.conv_state = make_view(conv_pool.ptr, idt, dev, {P, qkv_w, kConvL}, {qkv_w * kConvL, 1, qkv_w});
    fargs.z = make_view(z_d.ptr, idt, dev, {B, T, HV, V});
    fargs.norm_weight = make_view(norm_w_d.ptr, idt, dev, {V});
  }

  // Verification samples rows when the float64 oracle over the whole batch would be slow.
  const int64_t oracle_cost = B * HV * T * V * K;
  const int64_t max_rows = opt.max_verify_rows > 0 ? opt.max_verify_rows
                           : oracle_cost <= (int64_t{1} << 27) ? B
                                                               : std::max<int64_t>(2, (int64_t{1} << 27) / (HV * T * V * K));

  std::printf("\n%5s %9s %10s %9s %9s  %s\n", "step", "valid", "us", "GB/s", "accepted", "verification vs float64 oracle");
  std::vector<double> times, rates;
  bool all_ok = true;
  std::uniform_int_distribution<int> acc_dist(1, static_cast<int>(T));
  std::vector<int32_t> accepted(B, 1);  // first verify step starts from each request's slot 0

  for (int step = 0; step < opt.steps; ++step) {
    // Fresh activations every step (never zeros), padding rows included.
    fill_normal(qkv_h, idt, rng, 0.0, 1.0);
    fill_normal(a_h, idt, rng, 0.0, 1.0);
    fill_normal(b_h, idt, rng, 0.0, 1.0);
    if (opt.fused) fill_normal(z_h, idt, rng, 0.0, 1.0);
    fill_nan(o_h, odt);
    // Request n (padding beyond Breal) sits at batch row perm[n]: padding rows land at random
    // positions, as after an engine drops finished requests.
    std::vector<int64_t> perm(B);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t n = 0; n < B; ++n) {
      const bool real = n < Breal;
      const int64_t row = perm[n];
      read_h[row] = real ? req_slot(n, 0) : -1;
      write_h[row] = real ? req_slot(n, T - 1) : -1;  // pool_slots (T > 1: not the read slot)
      for (int64_t t = 0; t < T; ++t) tok_h[row * T + t] = real ? req_slot(n, t) : -1;
      acc_h[row] = real ? accepted[n] : 1;
    }
    qkv_d.upload(qkv_h.data(), qkv_h.size());
    a_d.upload(a_h.data(), a_h.size());
    b_d.upload(b_h.data(), b_h.size());
    if (opt.fused) z_d.upload(z_h.data(), z_h.size());
    o_d.upload(o_h.data(), o_h.size());
    read_d.upload(read_h.data(), B * 4);
    write_d.upload(write_h.data(), B * 4);
    tok_d.upload(tok_h.data(), B * T * 4);
    acc_d.upload(acc_h.data(), B * 4);

    // Rows to verify, and the oracle's private copy of their starting states.
    std::vector<int64_t> rows(B);
    std::iota(rows.begin(), rows.end(), 0);
    if (static_cast<int64_t>(rows.size()) > max_rows) {
      std::shuffle(rows.begin(), rows.end(), rng);
      rows.resize(max_rows);
      std::sort(rows.begin(), rows.end());
    }
    const int64_t R = rows.size();
    auto read_slot_of = [&](int64_t n) -> int64_t {
      return T == 1 || pool_slots ? read_h[n] : (tok_h[n * T] < 0 ? -1 : tok_h[n * T + acc_h[n] - 1]);
    };
    // Where the call stores row n's state after token t (-1: not stored).
    auto stored_slot = [&](int64_t n, int64_t t) -> int64_t {
      if (read_slot_of(n) < 0) return -1;
      if (T == 1) return read_h[n];
      if (pool_slots) return t == T - 1 ? write_h[n] : -1;
      return tok_h[n * T + t];
    };
    // Oracle pool: slot i*(T+1) holds row i's start state, i*(T+1)+1+t its state after token t.
    std::vector<uint8_t> ref_pool(R * (T + 1) * slot_bytes), ref_conv(R * (T + 1) * conv_slot_bytes);
    for (int64_t i = 0; i < R; ++i) {
      const int64_t s = read_slot_of(rows[i]);
      if (s < 0) continue;
      pool.download(ref_pool.data() + i * (T + 1) * slot_bytes, slot_bytes, s * slot_bytes);
      if (opt.fused)
        conv_pool.download(ref_conv.data() + i * (T + 1) * conv_slot_bytes, conv_slot_bytes, s * conv_slot_bytes);
    }

    // The timed call.
    double us = 0;
#ifdef GDN_WITH_CUDA
    cudaEvent_t e0, e1;
    if (gpu) {
      cudaDeviceSynchronize();
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      cudaEventRecord(e0);
    }
#endif
    const auto t0 = std::chrono::steady_clock::now();
    Status st = opt.fused ? fused_decode(fargs, nullptr) : decode(args, nullptr);
#ifdef GDN_WITH_CUDA
    if (gpu) {
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      us = ms * 1e3;
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
      cudaError_t ce = cudaGetLastError();
      if (st.ok() && ce != cudaSuccess) st = Status(StatusCode::kCudaError, cudaGetErrorString(ce));
    }
#endif
    if (!gpu) us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (!st.ok()) {
      std::fprintf(stderr, "gdn run: %s failed: %s\n", opt.fused ? "fused_decode" : "decode", st.message().c_str());
      return 1;
    }
    if (step > 0 || opt.steps == 1) times.push_back(us);  // step 0 pays one-time start-up costs

    // The oracle on the sampled rows, as a compact batch of its own.
    std::vector<uint8_t> q_r(R * T * H * K * elsize(idt)), k_r(q_r.size()), v_r(R * T * HV * V * elsize(idt));
    std::vector<uint8_t> a_r(R * T * HV * elsize(idt)), b_r(a_r.size()), o_r(R * T * HV * V * elsize(odt));
    std::vector<int32_t> rread(R), rtok(R * T);
    std::vector<uint8_t> x_r(opt.fused ? R * T * qkv_w * elsize(idt) : 0), z_r(opt.fused ? R * T * HV * V * elsize(idt) : 0);
    const int64_t es = elsize(idt);
    for (int64_t i = 0; i < R; ++i) {
      const int64_t n = rows[i];
      if (opt.fused) {
        std::memcpy(x_r.data() + i * T * qkv_w * es, qkv_h.data() + n * T * qkv_w * es, T * qkv_w * es);
        std::memcpy(z_r.data() + i * T * HV * V * es, z_h.data() + n * T * HV * V * es, T * HV * V * es);
      }
      for (int64_t t = 0; t < T; ++t) {
        const uint8_t* src = qkv_h.data() + (n * T + t) * qkv_w * es;
        std::memcpy(q_r.data() + (i * T + t) * H * K * es, src, H * K * es);
        std::memcpy(k_r.data() + (i * T + t) * H * K * es, src + H * K * es, H * K * es);
        std::memcpy(v_r.data() + (i * T + t) * HV * V * es, src + 2 * H * K * es, HV * V * es);
        std::memcpy(a_r.data() + (i * T + t) * HV * es, a_h.data() + (n * T + t) * HV * es, HV * es);
        std::memcpy(b_r.data() + (i * T + t) * HV * es, b_h.data() + (n * T + t) * HV * es, HV * es);
        // The state after token t is stored where the engine stores it: T = 1 writes the final
        // state back in place; T > 1 every token's state to its token slot (--slots pool: the
        // final state to the write slot).
        rtok[i * T + t] = stored_slot(n, t) >= 0 ? static_cast<int32_t>(i * (T + 1) + 1 + t) : -1;
      }
      rread[i] = read_slot_of(n) >= 0 ? static_cast<int32_t>(i * (T + 1)) : -1;
    }
    fill_nan(o_r, odt);
    DecodeArgs ref;
    ref.q = make_view(q_r.data(), idt, kCpu, {R, T, H, K});
    ref.k = make_view(k_r.data(), idt, kCpu, {R, T, H, K});
    ref.v = make_view(v_r.data(), idt, kCpu, {R, T, HV, V});
    ref.a = make_view(a_r.data(), idt, kCpu, {R, T, HV});
    ref.b = make_view(b_r.data(), idt, kCpu, {R, T, HV});
    ref.A_log = make_view(A_log.data(), kFloat32, kCpu, {HV});
    ref.dt_bias = make_view(dt_bias.data(), kFloat32, kCpu, {HV});
    ref.state = make_view(ref_pool.data(), sdt, kCpu, {R * (T + 1), HV, kv ? K : V, kv ? V : K});
    ref.layout = args.layout;
    ref.read_slots = make_view(rread.data(), kInt32, kCpu, {R});
    std::vector<int32_t> rwrite(R);
    for (int64_t i = 0; i < R; ++i) rwrite[i] = rtok[i * T + T - 1];
    if (pool_slots) {
      ref.write_slots = make_view(rwrite.data(), kInt32, kCpu, {R});
    } else {
      ref.token_slots = make_view(rtok.data(), kInt32, kCpu, {R, T});
    }
    ref.o = make_view(o_r.data(), odt, kCpu, {R, T, HV, V});
    Status rs;
    if (opt.fused) {
      FusedDecodeArgs fref;
      static_cast<StepArgs&>(fref) = static_cast<const StepArgs&>(ref);
      fref.mixed_qkv = make_view(x_r.data(), idt, kCpu, {R, T, qkv_w});
      fref.conv_weight = make_view(conv_w_h.data(), idt, kCpu, {qkv_w, kConvW});
      fref.conv_state =
          make_view(ref_conv.data(), idt, kCpu, {R * (T + 1), qkv_w, kConvL}, {qkv_w * kConvL, 1, qkv_w});
      fref.z = make_view(z_r.data(), idt, kCpu, {R, T, HV, V});
      fref.norm_weight = make_view(norm_w_h.data(), idt, kCpu, {V});
      rs = reference::fused_decode(fref);
    } else {
      rs = reference::decode(ref);
    }
    if (!rs.ok()) {
      std::fprintf(stderr, "gdn run: oracle failed: %s\n", rs.message().c_str());
      return 1;
    }

    // Compare outputs and every state the call wrote for the sampled rows, each as one tensor.
    o_d.download(o_h.data(), o_h.size());
    const size_t row_bytes = T * HV * V * elsize(odt);
    std::vector<uint8_t> o_got(R * row_bytes), st_got, st_want, conv_got, conv_want;
    for (int64_t i = 0; i < R; ++i) {
      std::memcpy(o_got.data() + i * row_bytes, o_h.data() + rows[i] * row_bytes, row_bytes);
      for (int64_t t = 0; t < T; ++t) {
        if (rtok[i * T + t] < 0) continue;
        const int64_t s = stored_slot(rows[i], t);
        const size_t at = st_got.size();
        st_got.resize(at + slot_bytes);
        pool.download(st_got.data() + at, slot_bytes, s * slot_bytes);
        st_want.insert(st_want.end(), ref_pool.data() + rtok[i * T + t] * slot_bytes,
                       ref_pool.data() + (rtok[i * T + t] + 1) * slot_bytes);
        if (opt.fused) {
          const size_t c = conv_got.size();
          conv_got.resize(c + conv_slot_bytes);
          conv_pool.download(conv_got.data() + c, conv_slot_bytes, s * conv_slot_bytes);
          conv_want.insert(conv_want.end(), ref_conv.data() + rtok[i * T + t] * conv_slot_bytes,
                           ref_conv.data() + (rtok[i * T + t] + 1) * conv_slot_bytes);
        }
      }
    }
    reference::Agreement out_agree, state_agree, conv_agree;
    reference::compare_vectors(o_got.data(), o_r.data(), odt, R * T * HV, V, &out_agree);
    reference::compare_vectors(st_got.data(), st_want.data(), sdt, st_got.size() / slot_bytes * HV * V, K, &state_agree);
    // The conv states are copies of inputs: they must agree bit for bit.
    const bool conv_ok = conv_got == conv_want;
    const bool ok = out_agree.ok() && state_agree.ok() && conv_ok;
    all_ok = all_ok && ok;

    // Traffic: each valid row reads one state and writes one per stored token.
    int64_t valid = 0, writes = 0;
    for (int64_t n = 0; n < B; ++n) {
      if (read_slot_of(n) < 0) continue;
      ++valid;
      writes += T == 1 || pool_slots ? 1 : T;
    }
    const double bytes = static_cast<double>(slot_bytes) * (valid + writes) +
                         (opt.cache ? static_cast<double>(valid) * T * slot_bytes : 0.0);
    if (step > 0 || opt.steps == 1) rates.push_back(bytes / us * 1e-3);
    double mean_acc = 0;
    for (int64_t n = 0; n < Breal; ++n) mean_acc += accepted[n];
    std::printf("%5d %4lld/%-4lld %10.1f %9.1f %9.2f  %s (%lld rows): out %s; state %s%s\n", step, (long long)valid,
                (long long)B, us, bytes / us * 1e-3, T == 1 || pool_slots ? 1.0 * T : mean_acc / Breal, ok ? "PASS" : "FAIL",
                (long long)R, out_agree.summary().c_str(), state_agree.summary().c_str(),
                !opt.fused ? "" : conv_ok ? "; conv state bit-identical" : "; conv state DIFFERS");

    // The engine accepts a random number of draft tokens; the next step continues from there.
    for (int64_t n = 0; n < Breal; ++n) accepted[n] = acc_dist(rng);
  }

  int32_t errors = 0;
  err_d.download(&errors, 4);
  const double med = median(times);
  std::printf("\nsummary: %d steps, median %.1f us per call (%.1f GB/s of state traffic), "
              "%.1f us per decode step over the model's %d GDN layers; error_count %d; verification %s\n",
              opt.steps, med, median(rates), med * m.gdn_layers, m.gdn_layers, errors,
              all_ok ? "PASS" : "FAIL");
  return all_ok && errors == 0 ? 0 : 1;
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto opt = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("run", "simulate a serving engine's GDN decode on a model's shapes and verify every step");
  std::vector<std::string> models;
  for (auto& [name, _] : kModels) models.push_back(name);
  cmd->add_option("--model", opt->model, "model preset")->check(CLI::IsMember(models))->capture_default_str();
  cmd->add_option("--tp", opt->tp, "tensor-parallel degree (divides H and HV)")->check(CLI::Range(1, 64))->capture_default_str();
  cmd->add_option("--batch", opt->batch, "requests in the batch (padded up to a CUDA-graph size with -1 rows)")
      ->check(CLI::Range(1, 4096))->capture_default_str();
  cmd->add_option("--pool", opt->pool, "state slots in the pool (default 2 * padded batch * tokens + 16)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_option("--steps", opt->steps, "calls to run")->check(CLI::Range(1, 100000))->capture_default_str();
  cmd->add_option("--tokens", opt->tokens, "T: 1 = decode, 2..16 = speculative verify with accepted-token continuation")
      ->check(CLI::Range(1, 64))->capture_default_str();
  cmd->add_option("--state", opt->state, "state dtype")->check(CLI::IsMember({"fp32", "bf16", "fp16"}))->capture_default_str();
  cmd->add_option("--layout", opt->layout, "state layout: VK (K-last) or KV (V-last)")
      ->check(CLI::IsMember({"VK", "KV"}))->capture_default_str();
  cmd->add_option("--dtype", opt->dtype, "dtype of q, k, v, a, b and o")->check(CLI::IsMember({"bf16", "fp16", "fp32"}))->capture_default_str();
  cmd->add_option("--device", opt->device, "backend: auto uses the GPU when one is visible")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))->capture_default_str();
  cmd->add_option("--seed", opt->seed, "random seed (0: a fresh one, printed)");
  cmd->add_option("--verify-rows", opt->max_verify_rows, "rows checked against the oracle per step (default: all when cheap)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_flag("--cache", opt->cache, "also write the intermediate cache [B, T, HV, ...]");
  cmd->add_flag("--fused", opt->fused,
                "the layer's whole decode path through gdn::fused_decode: causal conv (W = 4, a conv pool "
                "following the state slots), q/k/v split, the recurrence and the gated RMSNorm");
  cmd->add_option("--slots", opt->slots,
                  "T > 1: token = a slot per token and accepted-token continuation (vLLM); pool = a read and a "
                  "write slot per row, the final state only (FlashInfer)")
      ->check(CLI::IsMember({"token", "pool"}))
      ->capture_default_str();
  cmd->callback([opt]() {
    int rc;
    try {
      rc = run(*opt);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gdn run: %s\n", e.what());
      rc = 1;
    }
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace gdn::tools
