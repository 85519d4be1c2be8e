// `gdn drift`: how far a recurrent state kept in fp32, bf16 or fp16 (rounded to nearest, or
// stochastically through StepArgs::rounding_seed) drifts from the exact trajectory over
// thousands of chained calls of the CPU backend. Every variant and a float64 state
// (reference::decode_exact) see the same inputs and slots call after call, so the only
// difference between them is where and how the state is rounded. Two modes: T = 1 decode in
// place, and T-token speculative verify as vLLM runs it (a slot per token, the next call
// continuing from the last accepted token).
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <nlohmann/json.hpp>

#include "bench.h"
#include "drift.h"
#include "gdn/gdn.h"
#include "gdn_reference.h"
#include "host_dtype.h"

#ifndef GDN_GIT_COMMIT
#define GDN_GIT_COMMIT "unknown"
#endif

namespace gdn::tools {
namespace {

// Qwen3-Next-80B-A3B's GDN layer: linear_num_key_heads, linear_num_value_heads, head dims.
constexpr int kH = 16, kHV = 32, kK = 128, kV = 128;
constexpr DLDataType kFloat64{kDLFloat, 64, 1};
// dt of the gates, log-uniform in [kDtMin, kDtMax] per head (see make_weights).
constexpr double kDtMin = 1e-4, kDtMax = 1e-2;

struct Options {
  int tp = 4;
  int batch = 4;
  int steps = 4096;
  int tokens = 4;
  double accept = 0.7;
  double b_mean = 0.0;
  std::string mode = "all";
  std::string layout = "VK";
  uint64_t seed = 1;
  std::string json;
};

struct Variant {
  const char* name;
  DLDataType state;
  bool stochastic;
};
constexpr Variant kVariants[] = {{"fp32", kFloat32, false},
                                 {"bf16", kBFloat16, false},
                                 {"bf16+sr", kBFloat16, true},
                                 {"fp16", kFloat16, false},
                                 {"fp16+sr", kFloat16, true}};
constexpr int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

double element(const void* base, DLDataType t, int64_t i) {
  if (t.bits == 32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return t.code == kDLBfloat ? detail::bf16_bits_to_float(h) : detail::fp16_bits_to_float(h);
}

// The layer's gate weights, per value head. A_log = log(U(1, 16)): Qwen3-Next's initialisation
// of A (transformers draws U(0, 16); 1 as the lower bound, as the tests do, keeps every head
// decaying). dt_bias = softplus^-1(dt), dt log-uniform in [1e-4, 1e-2]: FLA's (Mamba-2's) dt
// initialisation a decade lower, so that with a ~ N(0, 1) the decays land mostly in
// 0.9..0.9999, the slowly forgetting heads that make long-range drift matter. The run reports
// the quantiles of the g it actually used.
void make_weights(int64_t HV, uint64_t seed, std::vector<float>& A_log, std::vector<float>& dt_bias) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> A(1.0, 16.0), log_dt(std::log(kDtMin), std::log(kDtMax));
  A_log.resize(HV);
  dt_bias.resize(HV);
  for (int64_t h = 0; h < HV; ++h) {
    A_log[h] = static_cast<float>(std::log(A(rng)));
    const double dt = std::exp(log_dt(rng));
    dt_bias[h] = static_cast<float>(dt + std::log(-std::expm1(-dt)));
  }
}

struct Mode {
  std::string name;
  int64_t T;
};

// What one mode records: at each sample (log-spaced in accepted tokens), per variant, the
// relative error of o of that call, its mean over the calls since the previous sample, and
// the relative error of the rows' current states.
struct ModeResult {
  Mode mode;
  int64_t calls = 0;
  double seconds = 0;
  std::vector<int64_t> call;
  std::vector<double> tokens, exact_o_rms, exact_state_rms;
  std::array<std::vector<double>, kNumVariants> o, o_mean, state;
  std::array<bool, kNumVariants> differs{};  // the state's bits ever differed from the RNE variant's
  std::vector<float> g;                      // every decay the calls used
};

// Sample points: 8 per octave of accepted tokens, and the last step.
std::vector<double> sample_targets(int steps) {
  std::vector<double> out;
  for (int i = 0;; ++i) {
    const double s = std::round(std::exp2(i / 8.0));
    if (s > steps) break;
    if (out.empty() || s > out.back()) out.push_back(s);
  }
  if (out.back() < steps) out.push_back(steps);
  return out;
}

// Rows n0 .. n0 + count - 1 of a view whose first dimension is the batch.
TensorView rows_of(TensorView t, int64_t n0, int64_t count) {
  if (!t.defined()) return t;
  t.data = static_cast<char*>(t.data) + n0 * t.strides[0] * (t.dtype.bits / 8);
  t.shape[0] = count;
  return t;
}

// The float64 oracle is single-threaded and most of the study's time: its rows (disjoint
// slots) run as separate calls on the machine's cores.
void exact_step(const DecodeArgs& args, int64_t B) {
  const int64_t parts = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, B);
  std::vector<Status> status(parts);
  std::vector<std::thread> threads;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t n0 = B * p / parts, n1 = B * (p + 1) / parts;
    DecodeArgs c = args;
    for (TensorView* t : {&c.q, &c.k, &c.v, &c.a, &c.b, &c.o, &c.read_slots, &c.token_slots, &c.num_accepted})
      *t = rows_of(*t, n0, n1 - n0);
    threads.emplace_back([c, &status, p] { status[p] = reference::decode_exact(c); });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : status)
    if (!s.ok()) throw std::runtime_error("decode_exact: " + s.message());
}

void fill_bf16(std::vector<uint16_t>& buf, std::mt19937_64& rng, double mean = 0.0) {
  std::normal_distribution<float> nd(static_cast<float>(mean), 1.f);
  for (auto& x : buf) x = detail::float_to_bf16_bits(nd(rng));
}

ModeResult run_mode(const Options& opt, const Mode& mode, const std::vector<float>& A_log,
                    const std::vector<float>& dt_bias) {
  const int64_t H = kH / opt.tp, HV = kHV / opt.tp, K = kK, V = kV, T = mode.T, B = opt.batch;
  const int64_t P = 4 * B * T, slot = HV * V * K;
  const bool kv = opt.layout == "KV";
  const DLDevice dev = kCpu;
  std::mt19937_64 rng(opt.seed * 1000003 + T);

  // Each row owns T random distinct slots of the pool; every pool starts at zero (a fresh
  // sequence), exact in every dtype.
  std::vector<int32_t> slots(P);
  for (int64_t i = 0; i < P; ++i) slots[i] = static_cast<int32_t>(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<int32_t> read_slots(B), token_slots(B * T), num_accepted(B, 1);
  for (int64_t n = 0; n < B; ++n) {
    read_slots[n] = slots[n * T];
    for (int64_t t = 0; t < T; ++t) token_slots[n * T + t] = slots[n * T + t];
  }

  std::vector<uint16_t> q(B * T * H * K), k(q.size()), v(B * T * HV * V), a(B * T * HV), b(a.size());
  std::vector<std::vector<uint8_t>> pools(kNumVariants);
  std::vector<std::vector<float>> outs(kNumVariants, std::vector<float>(B * T * HV * V));
  std::vector<int64_t> seeds(kNumVariants);
  std::vector<double> pool64(P * slot, 0.0), o64(B * T * HV * V);
  for (int i = 0; i < kNumVariants; ++i) pools[i].assign(P * slot * (kVariants[i].state.bits / 8), 0);

  DecodeArgs args;
  args.q = make_view(q.data(), kBFloat16, dev, {B, T, H, K});
  args.k = make_view(k.data(), kBFloat16, dev, {B, T, H, K});
  args.v = make_view(v.data(), kBFloat16, dev, {B, T, HV, V});
  args.a = make_view(a.data(), kBFloat16, dev, {B, T, HV});
  args.b = make_view(b.data(), kBFloat16, dev, {B, T, HV});
  args.A_log = make_view(const_cast<float*>(A_log.data()), kFloat32, dev, {HV});
  args.dt_bias = make_view(const_cast<float*>(dt_bias.data()), kFloat32, dev, {HV});
  args.layout = kv ? StateLayout::kKV : StateLayout::kVK;
  if (T == 1) {
    args.read_slots = make_view(read_slots.data(), kInt32, dev, {B});
  } else {
    args.token_slots = make_view(token_slots.data(), kInt32, dev, {B, T});
    args.num_accepted = make_view(num_accepted.data(), kInt32, dev, {B});
  }
  auto state_view = [&](void* p, DLDataType t) { return make_view(p, t, dev, {P, HV, kv ? K : V, kv ? V : K}); };

  ModeResult res;
  res.mode = mode;
  const std::vector<double> targets = sample_targets(opt.steps);
  size_t next = 0;
  std::array<double, kNumVariants> o_sum{};
  int64_t o_calls = 0;
  std::vector<double> pos(B, 0.0);
  std::vector<int32_t> accepted(B, 1);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  const auto t0 = std::chrono::steady_clock::now();

  while (next < targets.size()) {
    ++res.calls;
    fill_bf16(q, rng);
    fill_bf16(k, rng);
    fill_bf16(v, rng);
    fill_bf16(a, rng);
    fill_bf16(b, rng, opt.b_mean);
    for (int64_t i = 0; i < B * T; ++i)
      for (int64_t h = 0; h < HV; ++h) {
        const double x = detail::bf16_bits_to_float(a[i * HV + h]) + dt_bias[h];
        const double sp = x <= 20.0 ? std::log1p(std::exp(x)) : x;
        res.g.push_back(static_cast<float>(std::exp(-std::exp(static_cast<double>(A_log[h])) * sp)));
      }

    for (int i = 0; i < kNumVariants; ++i) {
      DecodeArgs c = args;
      c.state = state_view(pools[i].data(), kVariants[i].state);
      c.o = make_view(outs[i].data(), kFloat32, dev, {B, T, HV, V});
      // Advanced every call: the same value on the same slot would repeat the same bits.
      seeds[i] = static_cast<int64_t>(opt.seed) * 65536 + res.calls;
      if (kVariants[i].stochastic) c.rounding_seed = make_view(&seeds[i], kInt64, dev, {1});
      const Status s = decode(c);
      if (!s.ok()) throw std::runtime_error(std::string("decode (") + kVariants[i].name + "): " + s.message());
    }
    {
      DecodeArgs c = args;
      c.state = state_view(pool64.data(), kFloat64);
      c.o = make_view(o64.data(), kFloat64, dev, {B, T, HV, V});
      exact_step(c, B);
    }

    // Relative error of o over the whole call: all rows, tokens, heads.
    double o_ref = 0;
    for (double x : o64) o_ref += x * x;
    std::array<double, kNumVariants> o_err{};
    for (int i = 0; i < kNumVariants; ++i) {
      double d = 0;
      for (size_t j = 0; j < o64.size(); ++j) d += (outs[i][j] - o64[j]) * (outs[i][j] - o64[j]);
      o_err[i] = std::sqrt(d / o_ref);
      if (!std::isfinite(o_err[i])) throw std::runtime_error(std::string(kVariants[i].name) + ": o is not finite");
      o_sum[i] += o_err[i];
    }
    ++o_calls;

    // The verifier accepts each draft token with probability --accept, up to the first reject:
    // 1..T tokens of this call, and the next call continues from the last one.
    double mean_pos = 0;
    for (int64_t n = 0; n < B; ++n) {
      int32_t acc = 1;
      while (acc < T && u01(rng) < opt.accept) ++acc;
      accepted[n] = acc;
      pos[n] += acc;
      mean_pos += pos[n] / B;
    }

    if (mean_pos >= targets[next]) {
      double s_ref = 0;
      std::array<double, kNumVariants> s_err{};
      for (int64_t n = 0; n < B; ++n) {
        const int64_t s = T == 1 ? read_slots[n] : token_slots[n * T + accepted[n] - 1];
        const double* e = &pool64[s * slot];
        for (int64_t j = 0; j < slot; ++j) s_ref += e[j] * e[j];
        for (int i = 0; i < kNumVariants; ++i) {
          const void* base = pools[i].data() + s * slot * (kVariants[i].state.bits / 8);
          for (int64_t j = 0; j < slot; ++j) {
            const double d = element(base, kVariants[i].state, j) - e[j];
            s_err[i] += d * d;
          }
        }
      }
      res.call.push_back(res.calls);
      res.tokens.push_back(mean_pos);
      res.exact_o_rms.push_back(std::sqrt(o_ref / o64.size()));
      res.exact_state_rms.push_back(std::sqrt(s_ref / (B * slot)));
      for (int i = 0; i < kNumVariants; ++i) {
        res.o[i].push_back(o_err[i]);
        res.o_mean[i].push_back(o_sum[i] / o_calls);
        res.state[i].push_back(std::sqrt(s_err[i] / s_ref));
        o_sum[i] = 0;
      }
      o_calls = 0;
      while (next < targets.size() && targets[next] <= mean_pos) ++next;
    }
    for (int64_t n = 0; n < B; ++n) num_accepted[n] = accepted[n];
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Stochastic rounding shows as bits that differ from the RNE variant of the same dtype.
  for (int i = 1; i < kNumVariants; ++i)
    if (kVariants[i].stochastic) res.differs[i] = pools[i] != pools[i - 1];
  return res;
}

std::string today() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", std::gmtime(&t));
  return buf;
}

double quantile(std::vector<float> v, double p) {
  if (v.empty()) return NAN;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + i, v.end());
  return v[i];
}

// The first sample at or past `step` accepted tokens.
size_t sample_at(const ModeResult& r, double step) {
  for (size_t i = 0; i < r.tokens.size(); ++i)
    if (r.tokens[i] >= step) return i;
  return r.tokens.size() - 1;
}

// One markdown table over every mode (docs/precision.md shows it as printed): o at log-spaced
// accepted tokens, the state at the last.
void print_table(const std::vector<ModeResult>& results, int steps) {
  std::vector<int> at;
  for (int s : {1, 16, 256, 1024, 4096})
    if (s < steps) at.push_back(s);
  at.push_back(steps);
  std::printf("\nRelative error against the float64 state: of o (mean over the calls since the previous sample) "
              "at accepted tokens, and of the state at the last:\n\n| mode | state |");
  for (int s : at) std::printf(" o @ %d |", s);
  std::printf(" state @ %d |\n|---|---|", steps);
  for (size_t j = 0; j <= at.size(); ++j) std::printf("---:|");
  std::printf("\n");
  for (const ModeResult& r : results)
    for (int i = 0; i < kNumVariants; ++i) {
      std::printf("| %s, T = %lld | %s |", r.mode.name.c_str(), static_cast<long long>(r.mode.T), kVariants[i].name);
      for (int s : at) std::printf(" %.1e |", r.o_mean[i][sample_at(r, s)]);
      std::printf(" %.1e |\n", r.state[i][sample_at(r, steps)]);
    }
  for (const ModeResult& r : results)
    for (int i = 0; i < kNumVariants; ++i)
      if (kVariants[i].stochastic && !r.differs[i])
        std::printf("note: %s, %s left the same bits as %s: this backend ignores rounding_seed (rounds to nearest)\n",
                    r.mode.name.c_str(), kVariants[i].name, kVariants[i - 1].name);
}

nlohmann::json mode_json(const ModeResult& r) {
  nlohmann::json variants = nlohmann::json::array();
  for (int i = 0; i < kNumVariants; ++i)
    variants.push_back({{"name", kVariants[i].name},
                        {"state", state_name(kVariants[i].state)},
                        {"rounding", kVariants[i].stochastic ? "stochastic" : "nearest"},
                        {"differs_from_nearest", kVariants[i].stochastic ? nlohmann::json(r.differs[i]) : nlohmann::json()},
                        {"o", r.o[i]},
                        {"o_mean", r.o_mean[i]},
                        {"state_err", r.state[i]}});
  nlohmann::json g = {{"count", r.g.size()},
                      {"in_0.9_0.9999", std::count_if(r.g.begin(), r.g.end(), [](float x) { return x >= 0.9f && x <= 0.9999f; }) /
                                            static_cast<double>(r.g.size())}};
  for (double p : {0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99}) {
    char key[16];
    std::snprintf(key, sizeof(key), "p%g", 100 * p);
    g[key] = quantile(r.g, p);
  }
  return {{"mode", r.mode.name}, {"T", r.mode.T}, {"calls", r.calls}, {"seconds", r.seconds}, {"g", g},
          {"call", r.call}, {"tokens", r.tokens}, {"exact_o_rms", r.exact_o_rms},
          {"exact_state_rms", r.exact_state_rms}, {"variants", variants}};
}

int run(const Options& opt) {
  if (kH % opt.tp || kHV % opt.tp) {
    std::fprintf(stderr, "gdn drift: --tp %d must divide H = %d and HV = %d\n", opt.tp, kH, kHV);
    return 2;
  }
  const int64_t H = kH / opt.tp, HV = kHV / opt.tp;
#ifdef _OPENMP
  // The oracle's threads are the study's cost (exact_step); OpenMP's workers, spinning between
  // the backend's calls, would take their cores. The backend's bits do not depend on threads.
  omp_set_num_threads(1);
#endif
  std::vector<float> A_log, dt_bias;
  make_weights(HV, opt.seed, A_log, dt_bias);
  std::vector<Mode> modes;
  if (opt.mode != "verify") modes.push_back({"decode", 1});
  if (opt.mode != "decode") modes.push_back({"verify", opt.tokens});

  std::printf("gdn drift: Qwen3-Next (TP %d: H=%lld HV=%lld K=%d V=%d), B=%d, layout %s, %d accepted tokens, "
              "b ~ N(%g, 1), CPU backend against a float64 state; seed %llu\n",
              opt.tp, (long long)H, (long long)HV, kK, kV, opt.batch, opt.layout.c_str(), opt.steps, opt.b_mean,
              (unsigned long long)opt.seed);
  std::vector<ModeResult> results;
  for (const Mode& m : modes) {
    std::fprintf(stderr, "[drift] %s, T = %lld ...\n", m.name.c_str(), (long long)m.T);
    results.push_back(run_mode(opt, m, A_log, dt_bias));
    const ModeResult& r = results.back();
    std::printf("%s, T = %lld: %lld calls, %.0f s\n", m.name.c_str(), static_cast<long long>(m.T),
                static_cast<long long>(r.calls), r.seconds);
    std::fflush(stdout);
  }
  print_table(results, opt.steps);

  if (!opt.json.empty()) {
    nlohmann::json j;
    j["tool"] = "gdn drift";
    j["device"] = "cpu";
    j["cpu"] = cpu_name();
    j["commit"] = GDN_GIT_COMMIT;
    j["date"] = today();
    j["shape"] = {{"model", "qwen3-next"}, {"tp", opt.tp}, {"H", H}, {"HV", HV}, {"K", kK}, {"V", kV},
                  {"B", opt.batch}, {"layout", opt.layout}, {"inputs", "bf16"}, {"o", "fp32"},
                  {"use_qk_l2norm", true}, {"scale", 1.0 / std::sqrt(static_cast<double>(kK))}};
    j["inputs"] = {{"q, k, v", "N(0, 1), rounded to bf16"}, {"a", "N(0, 1), rounded to bf16"},
                   {"b", "N(b_mean, 1), rounded to bf16; beta = sigmoid(b)"}, {"b_mean", opt.b_mean},
                   {"A_log", "log(U(1, 16)) per value head"},
                   {"dt_bias", "softplus^-1(dt), dt log-uniform in [1e-4, 1e-2] per value head"},
                   {"initial_state", "zeros"}, {"A_log_values", A_log}, {"dt_bias_values", dt_bias}};
    j["steps"] = opt.steps;
    j["accept"] = opt.accept;
    j["seeds"] = {{"inputs", opt.seed}, {"rounding", "seed * 65536 + call (1-based)"}};
    j["samples"] = "8 per octave of accepted tokens (mean over rows); o: that call, o_mean: mean over the calls "
                   "since the previous sample; state_err: the rows' current states (the last accepted token's)";
    nlohmann::json ms = nlohmann::json::array();
    for (const ModeResult& r : results) ms.push_back(mode_json(r));
    j["modes"] = ms;
    std::ofstream f(opt.json);
    f << j.dump(1) << "\n";
    if (!f) throw std::runtime_error("cannot write " + opt.json);
  }
  return 0;
}

}  // namespace

void add_drift_command(CLI::App& app) {
  auto opt = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "drift", "how far fp32 / bf16 / fp16 states (round-to-nearest and stochastic) drift from the exact "
               "trajectory over chained calls (CPU backend against a float64 state)");
  cmd->add_option("--tp", opt->tp, "tensor-parallel degree (divides H = 16 and HV = 32)")
      ->check(CLI::Range(1, 32))->capture_default_str();
  cmd->add_option("--batch", opt->batch, "rows per call (each with its own random slots)")
      ->check(CLI::Range(1, 64))->capture_default_str();
  cmd->add_option("--steps", opt->steps, "accepted tokens per row to run for")->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--tokens", opt->tokens, "T of the verify mode")->check(CLI::Range(2, 16))->capture_default_str();
  cmd->add_option("--accept", opt->accept, "verify mode: probability that each draft token is accepted")
      ->check(CLI::Range(0.0, 1.0))->capture_default_str();
  cmd->add_option("--b-mean", opt->b_mean,
                  "mean of b ~ N(mean, 1), beta = sigmoid(b): negative means weak writes, where a decay near 1 "
                  "moves the state by less than half a 16-bit ulp per step")
      ->capture_default_str();
  cmd->add_option("--mode", opt->mode, "decode (T = 1) | verify (T = --tokens) | all")
      ->check(CLI::IsMember({"decode", "verify", "all"}))->capture_default_str();
  cmd->add_option("--layout", opt->layout, "state layout: VK (K-last) or KV (V-last)")
      ->check(CLI::IsMember({"VK", "KV"}))->capture_default_str();
  cmd->add_option("--seed", opt->seed, "seed of the inputs, weights, slots and rounding")->capture_default_str();
  cmd->add_option("--json", opt->json, "write the samples as JSON to this path");
  cmd->callback([opt]() {
    int rc;
    try {
      rc = run(*opt);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gdn drift: %s\n", e.what());
      rc = 1;
    }
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace gdn::tools
