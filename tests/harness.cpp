#include "harness.h"

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "compare.h"
#include "gdn_reference.h"
#include "host_dtype.h"

namespace gdn {
void PrintTo(StatusCode code, std::ostream* os) {
  switch (code) {
    case StatusCode::kOk: *os << "kOk"; return;
    case StatusCode::kInvalidArgument: *os << "kInvalidArgument"; return;
    case StatusCode::kNotSupported: *os << "kNotSupported"; return;
    case StatusCode::kCudaError: *os << "kCudaError"; return;
  }
  *os << "StatusCode(" << static_cast<int>(code) << ")";
}
}  // namespace gdn

namespace gdn::test {

size_t dtype_size(DLDataType t) { return static_cast<size_t>(t.bits) * t.lanes / 8; }

bool same_dtype(DLDataType x, DLDataType y) {
  return x.code == y.code && x.bits == y.bits && x.lanes == y.lanes;
}

bool is_float_dtype(DLDataType t) { return t.code == kDLFloat || t.code == kDLBfloat; }

std::string dtype_name(DLDataType t) {
  if (same_dtype(t, kFloat32)) return "f32";
  if (same_dtype(t, kBFloat16)) return "bf16";
  if (same_dtype(t, kFloat16)) return "f16";
  if (same_dtype(t, kInt32)) return "i32";
  if (same_dtype(t, kInt64)) return "i64";
  return "dtype" + std::to_string(t.code) + "x" + std::to_string(t.bits);
}

namespace {

// xoshiro256**: fast enough to fill pools of millions of elements in every test.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (auto& s : s_) {
      seed += 0x9e3779b97f4a7c15ull;
      uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      s = z ^ (z >> 31);
    }
  }
  uint64_t next() {
    const uint64_t r = std::rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = std::rotl(s_[3], 45);
    return r;
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u1;
    do u1 = uniform(); while (u1 <= 0.0);
    const double u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * M_PI * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * M_PI * u2);
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t s_[4];
  bool has_spare_ = false;
  double spare_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Storage
// ---------------------------------------------------------------------------------------
Storage::~Storage() {
  if (data_ == nullptr) return;
  if (sparse_)
    munmap(data_, bytes_);
  else
    std::free(data_);
}

std::shared_ptr<Storage> Storage::heap(size_t bytes, uint64_t seed) {
  std::shared_ptr<Storage> s(new Storage());
  const size_t rounded = std::max<size_t>(256, (bytes + 255) / 256 * 256);
  s->data_ = static_cast<std::byte*>(std::aligned_alloc(256, rounded));
  s->bytes_ = bytes;
  Rng rng(seed ^ 0x5a5a5a5a5a5a5a5aull);
  for (size_t i = 0; i < bytes; i += 8) {
    const uint64_t r = rng.next();
    std::memcpy(s->data_ + i, &r, std::min<size_t>(8, bytes - i));
  }
  return s;
}

std::shared_ptr<Storage> Storage::reserve(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) return nullptr;
  std::shared_ptr<Storage> s(new Storage());
  s->data_ = static_cast<std::byte*>(p);
  s->bytes_ = bytes;
  s->sparse_ = true;
  return s;
}

std::vector<std::pair<size_t, size_t>> Storage::ranges() const {
  if (!sparse_) return {{0, bytes_}};
  auto r = touched_;
  std::sort(r.begin(), r.end());
  std::vector<std::pair<size_t, size_t>> merged;
  for (const auto& x : r) {
    if (!merged.empty() && x.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, x.second);
    else
      merged.push_back(x);
  }
  return merged;
}

std::shared_ptr<Storage> Storage::clone() const {
  std::shared_ptr<Storage> s;
  if (sparse_) {
    s = reserve(bytes_);
    if (s == nullptr) return nullptr;
    s->touched_ = touched_;
  } else {
    s = heap(bytes_, 0);
  }
  for (const auto& [b, e] : ranges()) std::memcpy(s->data_ + b, data_ + b, e - b);
  return s;
}

bool Storage::same_bytes(const Storage& other) const {
  if (bytes_ != other.bytes_) return false;
  for (const auto& [b, e] : ranges())
    if (std::memcmp(data_ + b, other.data_ + b, e - b) != 0) return false;
  return true;
}

// ---------------------------------------------------------------------------------------
// HostTensor
// ---------------------------------------------------------------------------------------
int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

TensorView HostTensor::view() const {
  TensorView v;
  if (!defined()) return v;
  v.data = ptr();
  v.dtype = dtype;
  v.device = kCpu;
  v.ndim = ndim();
  for (int i = 0; i < ndim(); ++i) {
    v.shape[i] = shape[i];
    v.strides[i] = strides[i];
  }
  return v;
}

int64_t HostTensor::offset(const int64_t* idx) const {
  int64_t o = 0;
  for (int i = 0; i < ndim(); ++i) o += idx[i] * strides[i];
  return o;
}

double HostTensor::get(const int64_t* idx) const {
  const std::byte* p = ptr() + offset(idx) * static_cast<int64_t>(dtype_size(dtype));
  if (same_dtype(dtype, kFloat32)) {
    float x;
    std::memcpy(&x, p, 4);
    return x;
  }
  if (same_dtype(dtype, kBFloat16) || same_dtype(dtype, kFloat16)) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return dtype.code == kDLBfloat ? detail::bf16_bits_to_float(h) : detail::fp16_bits_to_float(h);
  }
  if (same_dtype(dtype, kInt32)) {
    int32_t x;
    std::memcpy(&x, p, 4);
    return x;
  }
  if (same_dtype(dtype, kInt64)) {
    int64_t x;
    std::memcpy(&x, p, 8);
    return static_cast<double>(x);
  }
  if (dtype.code == kDLFloat && dtype.bits == 64) {
    double x;
    std::memcpy(&x, p, 8);
    return x;
  }
  ADD_FAILURE() << "HostTensor::get: unsupported dtype " << dtype_name(dtype);
  return 0;
}

void HostTensor::set(const int64_t* idx, double x) const {
  std::byte* p = ptr() + offset(idx) * static_cast<int64_t>(dtype_size(dtype));
  if (same_dtype(dtype, kFloat32)) {
    const float f = static_cast<float>(x);
    std::memcpy(p, &f, 4);
  } else if (same_dtype(dtype, kBFloat16)) {
    const uint16_t h = detail::float_to_bf16_bits(static_cast<float>(x));
    std::memcpy(p, &h, 2);
  } else if (same_dtype(dtype, kFloat16)) {
    const uint16_t h = detail::float_to_fp16_bits(static_cast<float>(x));
    std::memcpy(p, &h, 2);
  } else if (same_dtype(dtype, kInt32)) {
    const int32_t i = static_cast<int32_t>(std::llround(x));
    std::memcpy(p, &i, 4);
  } else if (same_dtype(dtype, kInt64)) {
    const int64_t i = static_cast<int64_t>(std::llround(x));
    std::memcpy(p, &i, 8);
  } else if (dtype.code == kDLFloat && dtype.bits == 64) {
    std::memcpy(p, &x, 8);
  } else {
    ADD_FAILURE() << "HostTensor::set: unsupported dtype " << dtype_name(dtype);
  }
}

uint64_t HostTensor::bits(const int64_t* idx) const {
  const size_t sz = dtype_size(dtype);
  uint64_t b = 0;
  std::memcpy(&b, ptr() + offset(idx) * static_cast<int64_t>(sz), sz);
  return b;
}

void HostTensor::set_bits(const int64_t* idx, uint64_t b) const {
  const size_t sz = dtype_size(dtype);
  std::memcpy(ptr() + offset(idx) * static_cast<int64_t>(sz), &b, sz);
}

void HostTensor::for_each(const std::function<void(const int64_t*)>& f) const {
  const int nd = ndim();
  if (numel() == 0) return;
  std::vector<int64_t> idx(std::max(nd, 1), 0);
  while (true) {
    f(idx.data());
    int d = nd - 1;
    while (d >= 0 && ++idx[d] == shape[d]) idx[d--] = 0;
    if (d < 0) break;
  }
}

std::pair<size_t, size_t> HostTensor::byte_span() const {
  int64_t last = 0;
  for (int i = 0; i < ndim(); ++i) last += (shape[i] - 1) * strides[i];
  const size_t sz = dtype_size(dtype);
  return {byte_offset, byte_offset + static_cast<size_t>(last + 1) * sz};
}

std::vector<int64_t> compact_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * shape[i + 1];
  return s;
}

namespace {
int64_t span_elems(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  int64_t last = 0;
  for (size_t i = 0; i < shape.size(); ++i) last += (shape[i] - 1) * strides[i];
  return last + 1;
}
}  // namespace

HostTensor make_tensor(DLDataType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides,
                       uint64_t seed, int64_t lead_elems) {
  if (strides.empty()) strides = compact_strides(shape);
  const int64_t n = lead_elems + span_elems(shape, strides);
  HostTensor t;
  t.storage = Storage::heap(static_cast<size_t>(n) * dtype_size(dtype), seed);
  t.byte_offset = static_cast<size_t>(lead_elems) * dtype_size(dtype);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.strides = std::move(strides);
  return t;
}

HostTensor view_into(const std::shared_ptr<Storage>& storage, int64_t elem_offset, DLDataType dtype,
                     std::vector<int64_t> shape, std::vector<int64_t> strides) {
  HostTensor t;
  t.storage = storage;
  t.byte_offset = static_cast<size_t>(elem_offset) * dtype_size(dtype);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.strides = std::move(strides);
  return t;
}

void poison(const HostTensor& t) {
  if (!t.defined()) return;
  uint64_t nan = 0;
  if (same_dtype(t.dtype, kFloat32))
    nan = 0x7fc00000u;
  else if (same_dtype(t.dtype, kBFloat16))
    nan = 0x7fc0u;
  else if (same_dtype(t.dtype, kFloat16))
    nan = 0x7e00u;
  else
    return;
  t.for_each([&](const int64_t* idx) { t.set_bits(idx, nan); });
}

// ---------------------------------------------------------------------------------------
// Case
// ---------------------------------------------------------------------------------------
const char* arg_name(Arg a) {
  static const char* names[kNumArgs] = {"q",     "k",          "v",           "a",           "b",
                                        "A_log", "dt_bias",    "g",           "beta",        "state",
                                        "read_slots", "write_slots", "token_slots", "num_accepted",
                                        "inter", "o",          "error_count", "rounding_seed", "mixed_qkv", "conv_weight",
                                        "conv_bias", "conv_state", "conv_inter", "z", "norm_weight"};
  return names[static_cast<int>(a)];
}

namespace {
// Where edits of an argument the call has no place for go.
TensorView& scratch_view() {
  static thread_local TensorView v;
  v = TensorView{};
  return v;
}

TensorView& step_view(StepArgs& args, Arg a) {
  switch (a) {
    case Arg::kA: return args.a;
    case Arg::kB: return args.b;
    case Arg::kALog: return args.A_log;
    case Arg::kDtBias: return args.dt_bias;
    case Arg::kG: return args.g;
    case Arg::kBeta: return args.beta;
    case Arg::kState: return args.state;
    case Arg::kReadSlots: return args.read_slots;
    case Arg::kWriteSlots: return args.write_slots;
    case Arg::kTokenSlots: return args.token_slots;
    case Arg::kNumAccepted: return args.num_accepted;
    case Arg::kInter: return args.inter;
    case Arg::kO: return args.o;
    case Arg::kErrorCount: return args.error_count;
    case Arg::kRoundingSeed: return args.rounding_seed;
    default: break;
  }
  return scratch_view();
}
}  // namespace

TensorView& arg_view(DecodeArgs& args, Arg a) {
  switch (a) {
    case Arg::kQ: return args.q;
    case Arg::kK: return args.k;
    case Arg::kV: return args.v;
    default: return step_view(args, a);
  }
}

TensorView& arg_view(FusedDecodeArgs& args, Arg a) {
  switch (a) {
    case Arg::kMixedQkv: return args.mixed_qkv;
    case Arg::kConvWeight: return args.conv_weight;
    case Arg::kConvBias: return args.conv_bias;
    case Arg::kConvState: return args.conv_state;
    case Arg::kConvInter: return args.conv_inter;
    case Arg::kZ: return args.z;
    case Arg::kNormWeight: return args.norm_weight;
    default: return step_view(args, a);
  }
}

const TensorView& arg_view(const DecodeArgs& args, Arg a) {
  return arg_view(const_cast<DecodeArgs&>(args), a);
}

std::string Config::name() const {
  std::ostringstream s;
  s << "B" << B << "_T" << T << "_H" << H << "x" << HV << "_K" << K << "_V" << V << "_"
    << (layout == StateLayout::kVK ? "VK" : "KV") << "_s" << dtype_name(state_dtype) << "_in"
    << dtype_name(input_dtype) << "_o" << dtype_name(out_dtype) << "_"
    << (gates == GateForm::kRaw ? "raw" : "pre") << dtype_name(gate_dtype) << (l2norm ? "_l2" : "_nol2")
    << (scale ? "_scl" : "");
  switch (addressing) {
    case Addressing::kDense: s << "_dense"; break;
    case Addressing::kPool: s << "_pool"; break;
    case Addressing::kSplit: s << "_split"; break;
    case Addressing::kPerToken: s << "_pertok"; break;
    case Addressing::kPerTokenFromFirst: s << "_pertok0"; break;
    case Addressing::kAccepted: s << "_accepted"; break;
  }
  if (addressing != Addressing::kDense) s << dtype_name(slot_dtype);
  if (padding) s << "_pad";
  if (inter == InterMode::kCompact) s << "_inter";
  if (inter == InterMode::kStrided) s << "_interS";
  if (strides == StrideMode::kPage) s << "_page";
  if (strides == StrideMode::kOdd) s << "_odd";
  if (!update_state) s << "_noupd";
  if (rounding_seed) s << "_sr";
  if (fused)
    s << "_fused_W" << W << "L" << conv_L << "_c" << dtype_name(conv_dtype) << "_w" << dtype_name(weight_dtype)
      << (conv_bias ? "_bias" : "") << (conv_inter ? "_cinter" : "") << (conv_transposed ? "_cT" : "")
      << (norm ? (gate_z ? "_gnorm" : "_norm") : "");
  return sanitize(s.str());
}

namespace {
void set_options(const Case& c, StepArgs& a) {
  a.layout = c.cfg.layout;
  a.scale = c.cfg.scale;
  a.use_qk_l2norm = c.cfg.l2norm;
  a.update_state = c.cfg.update_state;
  a.check_duplicate_writes = c.check_duplicate_writes;
}
}  // namespace

DecodeArgs Case::args() const {
  DecodeArgs a;
  for (int i = 0; i < kNumArgs; ++i) arg_view(a, static_cast<Arg>(i)) = t[i].view();
  set_options(*this, a);
  return a;
}

FusedDecodeArgs Case::fused_args() const {
  FusedDecodeArgs a;
  for (int i = 0; i < kNumArgs; ++i) arg_view(a, static_cast<Arg>(i)) = t[i].view();
  set_options(*this, a);
  a.norm_eps = cfg.norm_eps;
  return a;
}

std::vector<std::shared_ptr<Storage>> Case::storages() const {
  std::vector<std::shared_ptr<Storage>> out;
  for (const auto& x : t)
    if (x.defined() && std::find(out.begin(), out.end(), x.storage) == out.end()) out.push_back(x.storage);
  return out;
}

Case Case::clone() const {
  Case c = *this;
  const auto mine = storages();
  for (const auto& s : mine) {
    auto copy = s->clone();
    for (auto& x : c.t)
      if (x.storage == s) x.storage = copy;
  }
  return c;
}

namespace {

void fill_normal(const HostTensor& t, Rng& rng, double sigma) {
  if (!t.defined()) return;
  t.for_each([&](const int64_t* idx) { t.set(idx, sigma * rng.normal()); });
}

double softplus(double x) { return x <= 20 ? std::log1p(std::exp(x)) : x; }

// Unit-norm keys per (n, t, h), rounded to k's dtype; see Config::normalize_keys_without_l2norm.
void normalize_keys(const HostTensor& k) {
  for (int64_t n = 0; n < k.shape[0]; ++n)
    for (int64_t t = 0; t < k.shape[1]; ++t)
      for (int64_t h = 0; h < k.shape[2]; ++h) {
        double ss = 0;
        for (int64_t i = 0; i < k.shape[3]; ++i) ss += std::pow(k.get({n, t, h, i}), 2);
        const double inv = 1.0 / std::sqrt(ss);
        for (int64_t i = 0; i < k.shape[3]; ++i) k.set({n, t, h, i}, k.get({n, t, h, i}) * inv);
      }
}

}  // namespace

void fill_state_slot(const Case& c, int64_t slot, std::mt19937_64& seed_rng) {
  Rng rng(seed_rng());
  const HostTensor& s = c[Arg::kState];
  const size_t sz = dtype_size(s.dtype);
  for (int64_t h = 0; h < s.shape[1]; ++h)
    for (int64_t r = 0; r < s.shape[2]; ++r) {
      const int64_t base[4] = {slot, h, r, 0};
      if (s.storage->sparse()) {
        const size_t b = s.byte_offset + static_cast<size_t>(s.offset(base)) * sz;
        s.storage->touch(b, b + static_cast<size_t>(s.shape[3]) * sz);
      }
      for (int64_t col = 0; col < s.shape[3]; ++col) {
        const int64_t idx[4] = {slot, h, r, col};
        s.set(idx, 0.1 * rng.normal());
      }
    }
}

void fill_inputs(Case& c, uint64_t seed) {
  Rng rng(seed * 0x2545f4914f6cdd1dull + 17);
  const Config& cfg = c.cfg;
  fill_normal(c[Arg::kQ], rng, 1.0);
  fill_normal(c[Arg::kK], rng, 1.0);
  fill_normal(c[Arg::kV], rng, 1.0);
  fill_normal(c[Arg::kMixedQkv], rng, 1.0);
  fill_normal(c[Arg::kZ], rng, 1.0);
  if (!cfg.l2norm && cfg.normalize_keys_without_l2norm) normalize_keys(c[Arg::kK]);
  if (cfg.gates == GateForm::kRaw) {
    fill_normal(c[Arg::kA], rng, 1.0);
    fill_normal(c[Arg::kB], rng, 1.0);
  } else {
    // A realistic log-decay: what the raw form would produce from N(0,1) a and these A_log.
    const HostTensor& g = c[Arg::kG];
    const HostTensor& beta = c[Arg::kBeta];
    g.for_each([&](const int64_t* idx) {
      const double A = std::exp(std::log(1.0 + 15.0 * rng.uniform()));
      g.set(idx, -A * softplus(rng.normal() + 0.1 * rng.normal()));
    });
    beta.for_each([&](const int64_t* idx) { beta.set(idx, 1.0 / (1.0 + std::exp(-rng.normal()))); });
  }
}

Case make_case(const Config& cfg, uint64_t seed) {
  Case c;
  c.cfg = cfg;
  c.seed = seed;
  const int64_t B = cfg.B, T = cfg.T, H = cfg.H, HV = cfg.HV, K = cfg.K, V = cfg.V;
  const int64_t rows = cfg.rows(), cols = cfg.cols();
  const bool odd = cfg.strides == StrideMode::kOdd;
  const bool odd_state = odd && !cfg.fused;
  const bool packed = cfg.strides != StrideMode::kCompact;
  const int64_t lead = odd ? 1 : 0;
  const int64_t over = cfg.oversize;
  uint64_t sseed = seed;
  const auto next_seed = [&] { return ++sseed * 0x9e3779b97f4a7c15ull; };
  // Allocates `elems` (times oversize) of dtype in a fresh storage.
  const auto storage_for = [&](DLDataType dt, int64_t elems) {
    return Storage::heap(static_cast<size_t>(elems * over) * dtype_size(dt), next_seed());
  };
  const auto tensor = [&](DLDataType dt, std::vector<int64_t> shape, std::vector<int64_t> strides,
                          int64_t lead_elems) {
    if (strides.empty()) strides = compact_strides(shape);
    auto st = storage_for(dt, lead_elems + span_elems(shape, strides));
    return view_into(st, lead_elems, dt, std::move(shape), std::move(strides));
  };

  // q, k, v: separate compact tensors, or views into one packed qkv buffer. Fused: mixed_qkv
  // [B, T, D] instead (with z packed behind it in the padded modes, as a qkvz projection).
  if (cfg.fused) {
    const int64_t D = cfg.D();
    if (!packed) {
      c[Arg::kMixedQkv] = tensor(cfg.input_dtype, {B, T, D}, {}, 0);
      if (cfg.gate_z) c[Arg::kZ] = tensor(cfg.input_dtype, {B, T, HV, V}, {}, 0);
    } else {
      const int64_t xi = odd ? 2 : 1;  // odd: mixed_qkv walks its channels with stride 2
      const int64_t row = xi * D + HV * V + (odd ? 3 : 64);
      auto st = storage_for(cfg.input_dtype, lead + B * T * row);
      c[Arg::kMixedQkv] = view_into(st, lead, cfg.input_dtype, {B, T, D}, {T * row, row, xi});
      if (cfg.gate_z)
        c[Arg::kZ] = view_into(st, lead + xi * D, cfg.input_dtype, {B, T, HV, V}, {T * row, row, V, 1});
    }
  } else if (!packed) {
    c[Arg::kQ] = tensor(cfg.input_dtype, {B, T, H, K}, {}, 0);
    c[Arg::kK] = tensor(cfg.input_dtype, {B, T, H, K}, {}, 0);
    c[Arg::kV] = tensor(cfg.input_dtype, {B, T, HV, V}, {}, 0);
  } else {
    // Odd: v also walks its last dim with stride 2 (transformers hands over v as a view with a
    // non-unit innermost stride), so the element-strided input path runs on every backend.
    const int64_t vi = odd ? 2 : 1;
    const int64_t qh = K + (odd ? 1 : 0), vh = vi * V + (odd ? 1 : 0);
    const int64_t L = 2 * H * qh + HV * vh + (odd ? 3 : 64);
    auto st = storage_for(cfg.input_dtype, lead + B * T * L);
    c[Arg::kQ] = view_into(st, lead, cfg.input_dtype, {B, T, H, K}, {T * L, L, qh, 1});
    c[Arg::kK] = view_into(st, lead + H * qh, cfg.input_dtype, {B, T, H, K}, {T * L, L, qh, 1});
    c[Arg::kV] = view_into(st, lead + 2 * H * qh, cfg.input_dtype, {B, T, HV, V}, {T * L, L, vh, vi});
  }

  // Gates.
  if (cfg.gates == GateForm::kRaw) {
    if (!packed) {
      c[Arg::kA] = tensor(cfg.gate_dtype, {B, T, HV}, {}, 0);
      c[Arg::kB] = tensor(cfg.gate_dtype, {B, T, HV}, {}, 0);
    } else {
      // vLLM-style packed gates: a and b interleaved (odd) or side by side (page) in one buffer.
      const int64_t L = 2 * HV + (odd ? 1 : 8);
      auto st = storage_for(cfg.gate_dtype, lead + B * T * L);
      if (odd) {
        c[Arg::kA] = view_into(st, lead, cfg.gate_dtype, {B, T, HV}, {T * L, L, 2});
        c[Arg::kB] = view_into(st, lead + 1, cfg.gate_dtype, {B, T, HV}, {T * L, L, 2});
      } else {
        c[Arg::kA] = view_into(st, 0, cfg.gate_dtype, {B, T, HV}, {T * L, L, 1});
        c[Arg::kB] = view_into(st, HV, cfg.gate_dtype, {B, T, HV}, {T * L, L, 1});
      }
    }
    c[Arg::kALog] = tensor(kFloat32, {HV}, {packed ? 2 : 1}, lead);
    c[Arg::kDtBias] = tensor(cfg.gate_dtype, {HV}, {packed ? 3 : 1}, lead);
  } else {
    const int64_t hs = odd ? 3 : 1, L = HV * hs + (packed ? 5 : 0);
    c[Arg::kG] = tensor(kFloat32, {B, T, HV}, {T * L, L, hs}, lead);
    c[Arg::kBeta] = tensor(cfg.gate_dtype, {B, T, HV}, {T * L, L, hs}, lead);
  }

  // Pool size: several times what the rows name, so slots are scattered.
  const bool per_token = cfg.addressing == Addressing::kPerToken ||
                         cfg.addressing == Addressing::kPerTokenFromFirst ||
                         cfg.addressing == Addressing::kAccepted;
  if (cfg.addressing == Addressing::kDense)
    c.P = B;
  else if (per_token)
    c.P = 2 * B * (T + 1) + cfg.extra_slots;
  else
    c.P = 4 * B + cfg.extra_slots;
  const int64_t P = c.P;

  // The fused step's conv pool [P, D, L]: compact, or [P, L, D] memory seen transposed (vLLM);
  // in page mode it shares each slot's page with the state, in front of it (vLLM's hybrid
  // cache: two strided views of one buffer that the overlap checks must accept).
  const int64_t D = cfg.D(), Lc = cfg.conv_L;
  const auto conv_strides = [&](int64_t slot_stride) -> std::vector<int64_t> {
    return cfg.conv_transposed ? std::vector<int64_t>{slot_stride, 1, D} : std::vector<int64_t>{slot_stride, Lc, 1};
  };
  // State pool: compact; page-padded and interleaved with another per-slot buffer (a
  // conv state, as in engines' hybrid caches) in front; or odd paddings everywhere.
  if (cfg.fused && cfg.strides == StrideMode::kPage) {
    const size_t ses = dtype_size(cfg.state_dtype), ces = dtype_size(cfg.conv_dtype);
    const size_t conv_bytes = (static_cast<size_t>(D * Lc) * ces + 255) / 256 * 256;
    const int64_t rs = cols + 32, hs = rows * rs + 64;
    const size_t page = (conv_bytes + static_cast<size_t>(HV * hs) * ses + 4095) / 4096 * 4096;
    auto st = Storage::heap(page * static_cast<size_t>(P) * over, next_seed());
    c[Arg::kConvState] = view_into(st, 0, cfg.conv_dtype, {P, D, Lc}, conv_strides(static_cast<int64_t>(page / ces)));
    c[Arg::kState] = view_into(st, static_cast<int64_t>(conv_bytes / ses), cfg.state_dtype, {P, HV, rows, cols},
                               {static_cast<int64_t>(page / ses), hs, rs, 1});
  } else if (!packed) {
    c[Arg::kState] = tensor(cfg.state_dtype, {P, HV, rows, cols}, {}, 0);
  } else {
    // The fused step's CUDA path takes 16-byte aligned pools only (fused_cuda_status), so its
    // odd cases keep the state and inter aligned and misalign everything else.
    const bool odd = odd_state;
    const int64_t conv = odd ? 7 : 256;
    const int64_t rs = cols + (odd ? 1 : 32);
    const int64_t hs = rows * rs + (odd ? 3 : 64);
    int64_t ss = conv + HV * hs + (odd ? 5 : 0);
    if (!odd) ss = (ss + 4095) / 4096 * 4096;
    auto st = storage_for(cfg.state_dtype, P * ss);
    c[Arg::kState] = view_into(st, conv, cfg.state_dtype, {P, HV, rows, cols}, {ss, hs, rs, 1});
  }

  if (cfg.inter != InterMode::kNone) {
    if (cfg.inter == InterMode::kCompact) {
      c[Arg::kInter] = tensor(cfg.state_dtype, {B, T, HV, rows, cols}, {}, 0);
    } else {
      const int64_t rs = cols + (odd_state ? 1 : 0);
      const int64_t hs = rows * rs + 32 + (odd_state ? 1 : 0);
      const int64_t ts = HV * hs + 64;
      const int64_t bs = T * ts + (cfg.fused ? 8 : 7);  // decode: a batch stride off the 16-byte grid
      c[Arg::kInter] = tensor(cfg.state_dtype, {B, T, HV, rows, cols}, {bs, ts, hs, rs, 1}, odd_state ? lead : 0);
    }
  }

  if (!packed) {
    c[Arg::kO] = tensor(cfg.out_dtype, {B, T, HV, V}, {}, 0);
  } else {
    const int64_t hs = V + (odd ? 1 : 32), ts = HV * hs + (odd ? 3 : 64), bs = T * ts + (odd ? 5 : 128);
    c[Arg::kO] = tensor(cfg.out_dtype, {B, T, HV, V}, {bs, ts, hs, 1}, lead);
  }

  if (cfg.fused) {
    if (!c[Arg::kConvState].defined()) {
      if (odd) {  // odd padding between slots and channels
        const int64_t cs = cfg.conv_transposed ? Lc * (D + 1) + 3 : D * (Lc + 1) + 3;
        const std::vector<int64_t> st = cfg.conv_transposed ? std::vector<int64_t>{cs, 1, D + 1}
                                                            : std::vector<int64_t>{cs, Lc + 1, 1};
        c[Arg::kConvState] = tensor(cfg.conv_dtype, {P, D, Lc}, st, lead);
      } else {
        c[Arg::kConvState] = tensor(cfg.conv_dtype, {P, D, Lc}, conv_strides(D * Lc), 0);
      }
    }
    // conv_weight: torch's [D, 1, W] memory, or (odd) a transposed [W, D] buffer.
    c[Arg::kConvWeight] = odd ? tensor(cfg.weight_dtype, {D, cfg.W}, {1, D}, lead)
                              : tensor(cfg.weight_dtype, {D, cfg.W}, {}, 0);
    if (cfg.conv_bias) c[Arg::kConvBias] = tensor(cfg.weight_dtype, {D}, {packed ? 3 : 1}, lead);
    if (cfg.conv_inter)
      c[Arg::kConvInter] = packed ? tensor(cfg.conv_dtype, {B, T, D, Lc}, {T * D * (Lc + 2) + 5, D * (Lc + 2), 1, D + 1}, lead)
                                  : tensor(cfg.conv_dtype, {B, T, D, Lc}, {}, 0);
    if (cfg.norm) c[Arg::kNormWeight] = tensor(cfg.weight_dtype, {V}, {packed ? 2 : 1}, lead);
  }

  if (cfg.error_count) {
    c[Arg::kErrorCount] = tensor(kInt32, {1}, {}, 0);
    c[Arg::kErrorCount].set({0}, 3);  // nonzero: gdn adds, never resets
  }
  if (cfg.rounding_seed) {
    c[Arg::kRoundingSeed] = tensor(kInt64, {1}, {}, 0);
    const int64_t zero = 0;
    c[Arg::kRoundingSeed].set_bits(&zero, static_cast<uint64_t>(*cfg.rounding_seed));
  }

  // Slots: a permutation of the pool, with the top slot and slot 0 (an ordinary slot) in use.
  std::mt19937_64 srng(seed ^ 0xa0761d6478bd642full);
  std::vector<int64_t> perm(P);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), srng);
  const auto put_first = [&](size_t pos, int64_t slot) {
    if (pos >= perm.size()) return;
    std::iter_swap(perm.begin() + pos, std::find(perm.begin(), perm.end(), slot));
  };
  put_first(0, P - 1);
  put_first(1, 0);
  const int64_t ss = packed ? (odd ? 3 : 2) : 1;
  const auto slot_vec = [&](int64_t n) { return tensor(cfg.slot_dtype, {n}, {ss}, lead); };
  const auto slot_mat = [&] {
    // Column-major in the padded modes: "any stride" includes a transposed index matrix.
    return packed ? tensor(cfg.slot_dtype, {B, T}, {1, B + (odd ? 1 : 0)}, lead)
                  : tensor(cfg.slot_dtype, {B, T}, {}, 0);
  };
  std::vector<int64_t> acc(B, T);
  switch (cfg.addressing) {
    case Addressing::kDense: break;
    case Addressing::kPool:
      c[Arg::kReadSlots] = slot_vec(B);
      for (int64_t n = 0; n < B; ++n) c[Arg::kReadSlots].set({n}, perm[n]);
      break;
    case Addressing::kSplit:
      c[Arg::kReadSlots] = slot_vec(B);
      c[Arg::kWriteSlots] = slot_vec(B);
      for (int64_t n = 0; n < B; ++n) {
        c[Arg::kReadSlots].set({n}, perm[n]);
        c[Arg::kWriteSlots].set({n}, perm[B + n]);
      }
      break;
    case Addressing::kPerToken:
      c[Arg::kReadSlots] = slot_vec(B);
      c[Arg::kTokenSlots] = slot_mat();
      for (int64_t n = 0; n < B; ++n) {
        c[Arg::kReadSlots].set({n}, perm[n]);
        for (int64_t t = 0; t < T; ++t) c[Arg::kTokenSlots].set({n, t}, perm[B + n * T + t]);
      }
      break;
    case Addressing::kPerTokenFromFirst:
    case Addressing::kAccepted:
      c[Arg::kTokenSlots] = slot_mat();
      for (int64_t n = 0; n < B; ++n)
        for (int64_t t = 0; t < T; ++t) c[Arg::kTokenSlots].set({n, t}, perm[n * T + t]);
      if (cfg.addressing == Addressing::kAccepted) {
        c[Arg::kNumAccepted] = slot_vec(B);
        for (int64_t n = 0; n < B; ++n) {
          acc[n] = 1 + static_cast<int64_t>(srng() % static_cast<uint64_t>(T));
          c[Arg::kNumAccepted].set({n}, acc[n]);
        }
      }
      break;
  }

  if (cfg.padding && cfg.addressing != Addressing::kDense) {
    std::vector<int64_t> rows_idx(B);
    std::iota(rows_idx.begin(), rows_idx.end(), 0);
    std::shuffle(rows_idx.begin(), rows_idx.end(), srng);
    const int64_t npad = std::max<int64_t>(1, B / 5);
    for (int64_t i = 0; i < npad; ++i) {
      const int64_t n = rows_idx[i];
      // Only the slot the row reads becomes -1: its other slots stay valid and must not be
      // written anyway.
      if (cfg.addressing == Addressing::kPerTokenFromFirst)
        c[Arg::kTokenSlots].set({n, 0}, -1);
      else if (cfg.addressing == Addressing::kAccepted)
        c[Arg::kTokenSlots].set({n, acc[n] - 1}, -1);
      else
        c[Arg::kReadSlots].set({n}, -1);
    }
  }

  // Values.
  {
    Rng rng(seed + 0x1234567);
    if (cfg.gates == GateForm::kRaw) {
      const HostTensor& A_log = c[Arg::kALog];
      A_log.for_each([&](const int64_t* idx) { A_log.set(idx, std::log(1.0 + 15.0 * rng.uniform())); });
      fill_normal(c[Arg::kDtBias], rng, 0.1);
    }
    for (int64_t p = 0; p < P; ++p) fill_state_slot(c, p, srng);
    if (cfg.fused) {
      // Conv weights of a trained layer's scale (|sum_w| ~ 1), past inputs like the new ones.
      fill_normal(c[Arg::kConvWeight], rng, 0.5);
      fill_normal(c[Arg::kConvBias], rng, 0.1);
      fill_normal(c[Arg::kConvState], rng, 1.0);
      const HostTensor& w = c[Arg::kNormWeight];
      if (w.defined()) w.for_each([&](const int64_t* idx) { w.set(idx, 1.0 + 0.2 * rng.normal()); });
    }
  }
  fill_inputs(c, seed);
  poison(c[Arg::kO]);
  poison(c[Arg::kInter]);
  poison(c[Arg::kConvInter]);
  return c;
}

uint64_t test_seed() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "none";
  uint64_t h = 0xcbf29ce484222325ull;
  for (char ch : name) h = (h ^ static_cast<uint8_t>(ch)) * 0x100000001b3ull;
  if (const char* env = std::getenv("GDN_TEST_SEED")) h ^= std::strtoull(env, nullptr, 0) * 0x9e3779b97f4a7c15ull;
  return h;
}

std::string sanitize(const std::string& s) {
  std::string r = s;
  for (char& ch : r)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_') ch = '_';
  return r;
}

Status run_reference(const Case& c) {
  return c.cfg.fused ? reference::fused_decode(c.fused_args()) : reference::decode(c.args());
}

Status run_case(Backend backend, const Case& c) {
  return c.cfg.fused ? run_fused(backend, c) : run_decode(backend, c);
}

// ---------------------------------------------------------------------------------------
// Expected effects
// ---------------------------------------------------------------------------------------
Expected expected_effects(const Case& c) {
  Expected e;
  const int64_t B = c.cfg.B, T = c.cfg.T, P = c.P;
  const HostTensor& rs = c[Arg::kReadSlots];
  const HostTensor& ws = c[Arg::kWriteSlots];
  const HostTensor& ts = c[Arg::kTokenSlots];
  const HostTensor& na = c[Arg::kNumAccepted];
  const auto idx = [](const HostTensor& t, std::initializer_list<int64_t> i) {
    return static_cast<int64_t>(t.get(i));
  };
  e.rows.resize(B);
  for (int64_t n = 0; n < B; ++n) {
    RowEffect& r = e.rows[n];
    int64_t read;
    if (na.defined()) {
      const int64_t a = idx(na, {n});
      if (a < 1 || a > T) {
        r.kind = RowKind::kInvalid;
        continue;
      }
      read = idx(ts, {n, a - 1});
    } else if (rs.defined()) {
      read = idx(rs, {n});
    } else if (ts.defined()) {
      read = idx(ts, {n, 0});
    } else {
      read = n;
    }
    // Every slot the row names is range-checked, a padding row's too (semantics section 3).
    bool bad = read >= P;
    if (ts.defined()) {
      for (int64_t t = 0; t < T; ++t) bad |= idx(ts, {n, t}) >= P;
    } else {
      bad |= (ws.defined() ? idx(ws, {n}) : read) >= P;
    }
    if (bad) {
      r.kind = RowKind::kInvalid;
      continue;
    }
    if (read < 0) {
      r.kind = RowKind::kPadding;
      continue;
    }
    r.read = read;
    if (ts.defined()) {
      if (c.cfg.update_state)
        for (int64_t t = 0; t < T; ++t)
          if (idx(ts, {n, t}) >= 0) r.writes.emplace_back(t, idx(ts, {n, t}));
    } else {
      const int64_t w = ws.defined() ? idx(ws, {n}) : read;
      if (w >= 0 && c.cfg.update_state) r.writes.emplace_back(T - 1, w);
    }
  }
  std::map<int64_t, int> writers;
  for (const auto& r : e.rows) {
    if (r.kind == RowKind::kInvalid) ++e.error_delta;
    std::set<int64_t> mine;
    for (const auto& [t, s] : r.writes) mine.insert(s);
    for (int64_t s : mine) ++writers[s];
  }
  for (const auto& [s, n] : writers) {
    e.written_slots.push_back(s);
    if (n > 1) e.duplicated_slots.push_back(s);
  }
  if (c.check_duplicate_writes) {
    for (const auto& r : e.rows) {
      bool dup = false;
      for (const auto& [t, s] : r.writes) dup |= writers[s] > 1;
      e.error_delta += dup;
    }
  }
  if (!c[Arg::kState].storage->sparse()) {
    e.written.assign(P, false);
    for (int64_t s : e.written_slots) e.written[s] = true;
  }
  return e;
}

std::vector<int64_t> slots_to_check(const Case& c) {
  std::vector<int64_t> s;
  if (!c[Arg::kState].storage->sparse()) {
    s.resize(c.P);
    std::iota(s.begin(), s.end(), 0);
    return s;
  }
  std::set<int64_t> named;
  for (Arg a : {Arg::kReadSlots, Arg::kWriteSlots, Arg::kTokenSlots}) {
    const HostTensor& t = c[a];
    if (!t.defined()) continue;
    t.for_each([&](const int64_t* i) {
      const int64_t x = static_cast<int64_t>(t.get(i));
      if (x >= 0 && x < c.P) named.insert(x);
    });
  }
  if (!c[Arg::kReadSlots].defined() && !c[Arg::kTokenSlots].defined())
    for (int64_t n = 0; n < std::min(c.cfg.B, c.P); ++n) named.insert(n);
  return {named.begin(), named.end()};
}

// ---------------------------------------------------------------------------------------
// Comparators
// ---------------------------------------------------------------------------------------
Tolerance one_call_tolerance() { return Tolerance{false}; }

// fp32 keeps its one-call bound after many steps; the rule knows that from the dtype.
Tolerance many_steps_tolerance(DLDataType) { return Tolerance{true}; }

namespace {

constexpr int kMaxReports = 6;

// One kind of compared values (o, inter or state) over a call: the vectors are gathered
// into contiguous buffers of the storage dtype and judged at finish() by
// reference::compare_vectors, the one implementation of docs/semantics.md section 5, as one
// tensor (its cancellation floors are relative to everything gathered).
class Comparison {
 public:
  Comparison(std::string what, DLDataType dtype, Tolerance tol)
      : what_(std::move(what)), dtype_(dtype), tol_(tol) {}

  // One vector (an o row, or a stored state row): `got` and `want` have the same layout,
  // so the same element offsets address both. All vectors of a Comparison have one length.
  void block(const HostTensor& got, const HostTensor& want, const std::vector<int64_t>& offsets,
             std::string where) {
    if (labels_.empty()) len_ = static_cast<int64_t>(offsets.size());
    if (static_cast<int64_t>(offsets.size()) != len_) {
      ADD_FAILURE() << what_ << ": vectors of different lengths in one comparison (" << where << ")";
      return;
    }
    labels_.push_back(std::move(where));
    const size_t sz = dtype_size(dtype_);
    for (int64_t off : offsets) {
      got_.insert(got_.end(), got.ptr() + off * sz, got.ptr() + (off + 1) * sz);
      want_.insert(want_.end(), want.ptr() + off * sz, want.ptr() + (off + 1) * sz);
    }
  }

  void finish() const {
    if (labels_.empty()) return;
    reference::Agreement a;
    reference::compare_vectors(got_.data(), want_.data(), dtype_, static_cast<int64_t>(labels_.size()), len_, &a,
                               tol_.many_steps);
    if (a.ok()) return;
    ADD_FAILURE() << what_ << " (" << dtype_name(dtype_) << (tol_.many_steps ? ", many steps" : "")
                  << "): " << a.summary() << "; " << a.failing_vectors << " of " << a.vectors
                  << " vectors out of tolerance; worst at "
                  << a.worst_summary(a.worst.vector >= 0 ? labels_[a.worst.vector] : "");
  }

 private:
  std::string what_;
  DLDataType dtype_;
  Tolerance tol_;
  int64_t len_ = 0;
  std::vector<std::byte> got_, want_;
  std::vector<std::string> labels_;
};

// A state matrix is judged row by stored row (its contiguous vectors).
void add_rows(Comparison& c, const HostTensor& got, const HostTensor& want, const std::vector<int64_t>& matrix,
              const std::string& where) {
  const int64_t C = got.shape[got.ndim() - 1];
  for (size_t r = 0; r * C < matrix.size(); ++r)
    c.block(got, want, std::vector<int64_t>(matrix.begin() + r * C, matrix.begin() + (r + 1) * C),
            where + " row " + std::to_string(r));
}

std::vector<int64_t> o_offsets(const HostTensor& o, int64_t n, int64_t t, int64_t h) {
  std::vector<int64_t> off(o.shape[3]);
  for (int64_t r = 0; r < o.shape[3]; ++r) off[r] = n * o.strides[0] + t * o.strides[1] + h * o.strides[2] + r;
  return off;
}

// Offsets of the matrix at leading indices `lead` (all but the last two dims).
std::vector<int64_t> matrix_offsets(const HostTensor& x, std::initializer_list<int64_t> lead) {
  const int nd = x.ndim();
  int64_t base = 0;
  int i = 0;
  for (int64_t l : lead) base += l * x.strides[i++];
  const int64_t R = x.shape[nd - 2], C = x.shape[nd - 1];
  std::vector<int64_t> off(R * C);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t col = 0; col < C; ++col) off[r * C + col] = base + r * x.strides[nd - 2] + col;
  return off;
}

// Offsets of every element of the sub-tensor of x at leading indices `lead`, any strides.
std::vector<int64_t> all_offsets(const HostTensor& x, std::initializer_list<int64_t> lead) {
  const int nd = x.ndim(), nl = static_cast<int>(lead.size());
  int64_t base = 0;
  int i = 0;
  for (int64_t l : lead) base += l * x.strides[i++];
  std::vector<int64_t> off{base};
  for (int d = nl; d < nd; ++d) {
    std::vector<int64_t> next;
    next.reserve(off.size() * x.shape[d]);
    for (int64_t o : off)
      for (int64_t j = 0; j < x.shape[d]; ++j) next.push_back(o + j * x.strides[d]);
    off.swap(next);
  }
  return off;
}

bool same_elements(const HostTensor& x, const HostTensor& y, const std::vector<int64_t>& offsets) {
  const size_t sz = dtype_size(x.dtype);
  for (int64_t off : offsets)
    if (std::memcmp(x.ptr() + off * sz, y.ptr() + off * sz, sz) != 0) return false;
  return true;
}

bool all_zero(const HostTensor& x, const std::vector<int64_t>& offsets) {
  const size_t sz = dtype_size(x.dtype);
  for (int64_t off : offsets) {
    uint32_t b = 0;
    std::memcpy(&b, x.ptr() + off * sz, sz);
    // +0 or -0 in the tensor's format.
    if ((b & (sz == 4 ? 0x7fffffffu : 0x7fffu)) != 0) return false;
  }
  return true;
}

std::string slot_where(int64_t slot, int64_t h) {
  return "state[slot " + std::to_string(slot) + ", head " + std::to_string(h) + "]";
}

// Byte ranges of `after` that the call may have written; everything else must be unchanged.
void mark(std::vector<uint8_t>& mask, const HostTensor& t, const std::vector<int64_t>& offsets) {
  const size_t sz = dtype_size(t.dtype);
  for (int64_t off : offsets) {
    const size_t b = t.byte_offset + static_cast<size_t>(off) * sz;
    std::fill(mask.begin() + b, mask.begin() + b + sz, 1);
  }
}

std::string which_views(const Case& c, const Storage* s, size_t byte) {
  std::string r;
  for (int i = 0; i < kNumArgs; ++i) {
    const HostTensor& t = c.t[i];
    if (!t.defined() || t.storage.get() != s) continue;
    const auto [b, e] = t.byte_span();
    if (byte >= b && byte < e) r += std::string(r.empty() ? "" : ", ") + arg_name(static_cast<Arg>(i));
  }
  return r.empty() ? "no view (padding bytes)" : "the span of " + r;
}

// The non-numeric obligations of one result `after` (backend or oracle).
void check_effects(const Case& before, const Case& after, const Expected& e, const std::string& who) {
  const Config& cfg = before.cfg;
  const int64_t B = cfg.B, T = cfg.T, HV = cfg.HV;
  int reports = 0;
  const auto report = [&](const std::string& msg) {
    if (++reports <= kMaxReports) ADD_FAILURE() << who << ": " << msg;
  };

  if (before[Arg::kErrorCount].defined()) {
    const int64_t b0 = static_cast<int64_t>(before[Arg::kErrorCount].get({0}));
    const int64_t a0 = static_cast<int64_t>(after[Arg::kErrorCount].get({0}));
    if (a0 != b0 + e.error_delta)
      report("error_count is " + std::to_string(a0) + ", want " + std::to_string(b0) + " + " +
             std::to_string(e.error_delta) + " (rows with a slot >= P or num_accepted out of 1..T" +
             std::string(before.check_duplicate_writes ? ", plus rows writing a duplicated slot)" : ")"));
  }

  const HostTensor& o = after[Arg::kO];
  const HostTensor& inter = after[Arg::kInter];
  for (int64_t n = 0; n < B; ++n) {
    if (e.rows[n].kind == RowKind::kValid) continue;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < HV; ++h) {
        if (!all_zero(o, o_offsets(o, n, t, h)))
          report("o[" + std::to_string(n) + ", " + std::to_string(t) + ", " + std::to_string(h) +
                 "] of a padding/invalid row is not exactly zero");
        if (inter.defined() && !same_elements(inter, before[Arg::kInter], matrix_offsets(inter, {n, t, h})))
          report("inter[" + std::to_string(n) + ", " + std::to_string(t) + ", " + std::to_string(h) +
                 "] of a padding/invalid row was written");
      }
  }

  const HostTensor& st = after[Arg::kState];
  const std::set<int64_t> dups(e.duplicated_slots.begin(), e.duplicated_slots.end());
  const std::set<int64_t> written(e.written_slots.begin(), e.written_slots.end());
  for (int64_t slot : slots_to_check(before)) {
    for (int64_t h = 0; h < HV; ++h) {
      const auto off = matrix_offsets(st, {slot, h});
      const bool same = same_elements(st, before[Arg::kState], off);
      if (written.count(slot)) {
        if (!dups.count(slot) && same) report(slot_where(slot, h) + " should have been written but is unchanged");
      } else if (!same) {
        report(slot_where(slot, h) + " is not named for writing by the call but changed");
      }
    }
  }

  // A written slot holds exactly what the cache holds for the same (row, token): both are
  // one rounding of the same carried state.
  if (before[Arg::kInter].defined()) {
    std::map<int64_t, int> times_written;
    for (const auto& r : e.rows)
      for (const auto& [t, s] : r.writes) ++times_written[s];
    for (int64_t n = 0; n < B; ++n)
      for (const auto& [t, slot] : e.rows[n].writes) {
        if (times_written[slot] != 1) continue;
        for (int64_t h = 0; h < HV; ++h) {
          const auto so = matrix_offsets(st, {slot, h});
          const auto io = matrix_offsets(inter, {n, t, h});
          const size_t sz = dtype_size(st.dtype);
          for (size_t i = 0; i < so.size(); ++i)
            if (std::memcmp(st.ptr() + so[i] * sz, inter.ptr() + io[i] * sz, sz) != 0) {
              report(slot_where(slot, h) + " differs from inter[" + std::to_string(n) + ", " + std::to_string(t) +
                     ", " + std::to_string(h) + "] at element " + std::to_string(i));
              break;
            }
        }
      }
  }

  // The fused step's conv pool follows the state's slots; conv_inter follows inter.
  if (cfg.fused) {
    const HostTensor& cs = after[Arg::kConvState];
    const HostTensor& ci = after[Arg::kConvInter];
    for (int64_t slot : slots_to_check(before)) {
      const bool same = same_elements(cs, before[Arg::kConvState], all_offsets(cs, {slot}));
      if (written.count(slot)) {
        if (!dups.count(slot) && same) report("conv_state[slot " + std::to_string(slot) + "] should have been written but is unchanged");
      } else if (!same) {
        report("conv_state[slot " + std::to_string(slot) + "] is not named for writing by the call but changed");
      }
    }
    if (ci.defined())
      for (int64_t n = 0; n < B; ++n) {
        if (e.rows[n].kind != RowKind::kValid)
          for (int64_t t = 0; t < T; ++t)
            if (!same_elements(ci, before[Arg::kConvInter], all_offsets(ci, {n, t})))
              report("conv_inter[" + std::to_string(n) + ", " + std::to_string(t) + "] of a padding/invalid row was written");
      }
    if (ci.defined()) {
      std::map<int64_t, int> times_written;
      for (const auto& r : e.rows)
        for (const auto& [t, slot] : r.writes) ++times_written[slot];
      for (int64_t n = 0; n < B; ++n)
        for (const auto& [t, slot] : e.rows[n].writes) {
          if (times_written[slot] != 1) continue;
          const auto so = all_offsets(cs, {slot});
          const auto io = all_offsets(ci, {n, t});
          const size_t sz = dtype_size(cs.dtype);
          for (size_t i = 0; i < so.size(); ++i)
            if (std::memcmp(cs.ptr() + so[i] * sz, ci.ptr() + io[i] * sz, sz) != 0) {
              report("conv_state[slot " + std::to_string(slot) + "] differs from conv_inter[" + std::to_string(n) +
                     ", " + std::to_string(t) + "] at element " + std::to_string(i));
              break;
            }
        }
    }
  }

  // Every byte outside o, inter, error_count and the written slots: inputs, unwritten
  // slots, the other half of an interleaved pool, all padding between elements.
  const auto sb = before.storages();
  const auto sa = after.storages();
  for (size_t i = 0; i < sb.size(); ++i) {
    if (sb[i]->sparse()) continue;  // only its named slots exist; compared above
    std::vector<uint8_t> mask(sb[i]->bytes(), 0);
    for (Arg a : {Arg::kO, Arg::kInter, Arg::kErrorCount, Arg::kConvInter}) {
      const HostTensor& t = after[a];
      if (!t.defined() || t.storage != sa[i]) continue;
      std::vector<int64_t> off;
      t.for_each([&](const int64_t* idx) { off.push_back(t.offset(idx)); });
      mark(mask, t, off);
    }
    if (st.storage == sa[i])
      for (int64_t slot : e.written_slots)
        for (int64_t h = 0; h < HV; ++h) mark(mask, st, matrix_offsets(st, {slot, h}));
    const HostTensor& cst = after[Arg::kConvState];
    if (cst.defined() && cst.storage == sa[i])
      for (int64_t slot : e.written_slots) mark(mask, cst, all_offsets(cst, {slot}));
    const std::byte* x = sb[i]->data();
    const std::byte* y = sa[i]->data();
    for (size_t b = 0; b < sb[i]->bytes(); ++b) {
      if (!mask[b] && x[b] != y[b]) {
        report("byte " + std::to_string(b) + " of storage " + std::to_string(i) + " (" +
               which_views(after, sa[i].get(), b) + ") changed, but the call may not write it");
        break;
      }
    }
  }
  if (reports > kMaxReports) ADD_FAILURE() << who << ": " << reports << " violations in total";
}

}  // namespace

void expect_oracle_consistent(const Case& before, const Case& want) {
  const Expected e = expected_effects(before);
  check_effects(before, want, e, "oracle");
}

void expect_matches(const Case& before, const Case& want, const Case& got, const Tolerance& tol,
                    const std::string& what) {
  expect_matches(before, want, before, got, tol, what);
}

void expect_matches(const Case& before_want, const Case& want, const Case& before_got, const Case& got,
                    const Tolerance& tol, const std::string& what) {
  const Case& before = before_want;
  const Expected e = expected_effects(before);
  check_effects(before_want, want, e, "oracle");
  check_effects(before_got, got, e, what);

  const Config& cfg = before.cfg;
  const int64_t B = cfg.B, T = cfg.T, HV = cfg.HV;
  const HostTensor& go = got[Arg::kO];
  const HostTensor& wo = want[Arg::kO];
  Comparison co(what + " o", go.dtype, tol);
  for (int64_t n = 0; n < B; ++n) {
    if (e.rows[n].kind != RowKind::kValid) continue;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < HV; ++h)
        co.block(go, wo, o_offsets(go, n, t, h),
                 "o[" + std::to_string(n) + ", " + std::to_string(t) + ", " + std::to_string(h) + "]");
  }
  co.finish();

  if (got[Arg::kInter].defined()) {
    const HostTensor& gi = got[Arg::kInter];
    Comparison ci(what + " inter", gi.dtype, tol);
    for (int64_t n = 0; n < B; ++n) {
      if (e.rows[n].kind != RowKind::kValid) continue;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < HV; ++h)
          add_rows(ci, gi, want[Arg::kInter], matrix_offsets(gi, {n, t, h}),
                   "inter[" + std::to_string(n) + ", " + std::to_string(t) + ", " + std::to_string(h) + "]");
    }
    ci.finish();
  }

  const HostTensor& gs = got[Arg::kState];
  Comparison cs(what + " state", gs.dtype, tol);
  const std::set<int64_t> dups(e.duplicated_slots.begin(), e.duplicated_slots.end());
  for (int64_t slot : e.written_slots) {
    if (dups.count(slot)) continue;  // two writers: the content is the caller's error
    for (int64_t h = 0; h < HV; ++h)
      add_rows(cs, gs, want[Arg::kState], matrix_offsets(gs, {slot, h}), slot_where(slot, h));
  }
  cs.finish();

  // The conv pool and conv_inter hold copies of inputs (rounded to their dtype once): exact.
  if (cfg.fused) {
    const HostTensor& gc = got[Arg::kConvState];
    int reports = 0;
    for (int64_t slot : e.written_slots) {
      if (dups.count(slot)) continue;
      if (!same_elements(gc, want[Arg::kConvState], all_offsets(gc, {slot})) && ++reports <= kMaxReports)
        ADD_FAILURE() << what << ": conv_state[slot " << slot << "] differs from the oracle's";
    }
    const HostTensor& gi = got[Arg::kConvInter];
    if (gi.defined())
      for (int64_t n = 0; n < B; ++n) {
        if (e.rows[n].kind != RowKind::kValid) continue;
        for (int64_t t = 0; t < T; ++t)
          if (!same_elements(gi, want[Arg::kConvInter], all_offsets(gi, {n, t})) && ++reports <= kMaxReports)
            ADD_FAILURE() << what << ": conv_inter[" << n << ", " << t << "] differs from the oracle's";
      }
  }
}

::testing::AssertionResult same_bits(const Case& x, const Case& y) {
  const auto sx = x.storages();
  const auto sy = y.storages();
  if (sx.size() != sy.size()) return ::testing::AssertionFailure() << "different storage sets";
  for (size_t i = 0; i < sx.size(); ++i) {
    if (sx[i]->same_bytes(*sy[i])) continue;
    for (int a = 0; a < kNumArgs; ++a) {
      const HostTensor& tx = x.t[a];
      const HostTensor& ty = y.t[a];
      if (!tx.defined() || tx.storage != sx[i]) continue;
      std::string where;
      tx.for_each([&](const int64_t* idx) {
        if (where.empty() && tx.bits(idx) != ty.bits(idx)) {
          where = std::string(arg_name(static_cast<Arg>(a))) + "[";
          for (int d = 0; d < tx.ndim(); ++d) where += (d ? ", " : "") + std::to_string(idx[d]);
          where += "]: " + std::to_string(tx.get(idx)) + " vs " + std::to_string(ty.get(idx));
        }
      });
      if (!where.empty()) return ::testing::AssertionFailure() << "first difference at " << where;
    }
    return ::testing::AssertionFailure() << "storage " << i << " differs outside every view";
  }
  return ::testing::AssertionSuccess();
}

namespace {

// The fused call of `c` without its gated RMSNorm, o in fp32: the recurrence's raw output.
Case without_norm(const Case& c) {
  Case r = c.clone();
  r.cfg.norm = r.cfg.gate_z = false;
  r.cfg.out_dtype = kFloat32;
  r[Arg::kNormWeight] = HostTensor{};
  r[Arg::kZ] = HostTensor{};
  const HostTensor& o = c[Arg::kO];
  r[Arg::kO] = make_tensor(kFloat32, o.shape, {}, c.seed + 77);
  poison(r[Arg::kO]);
  return r;
}

// want's o <- the gated RMSNorm of `raw`'s o (a backend's raw fp32 output), in float64, rounded
// once to o's dtype: what a backend must produce from its own raw output.
void norm_of(const Case& before, const Case& raw, Case& want) {
  const Config& cfg = before.cfg;
  const Expected e = expected_effects(before);
  const HostTensor &ro = raw[Arg::kO], &w = before[Arg::kNormWeight], &z = before[Arg::kZ];
  for (int64_t n = 0; n < cfg.B; ++n) {
    if (e.rows[n].kind != RowKind::kValid) continue;
    for (int64_t t = 0; t < cfg.T; ++t)
      for (int64_t h = 0; h < cfg.HV; ++h) {
        double ss = 0;
        for (int64_t i = 0; i < cfg.V; ++i) ss += std::pow(ro.get({n, t, h, i}), 2);
        const double f = 1.0 / std::sqrt(ss / static_cast<double>(cfg.V) + cfg.norm_eps);
        for (int64_t i = 0; i < cfg.V; ++i) {
          double x = ro.get({n, t, h, i}) * f * w.get({i});
          if (z.defined()) {
            const double zi = z.get({n, t, h, i});
            x *= zi / (1.0 + std::exp(-zi));
          }
          want[Arg::kO].set({n, t, h, i}, x);
        }
      }
  }
}

}  // namespace

void run_and_compare(Backend backend, const Case& before, const Tolerance& tol) {
  Case want = before.clone();
  const Status rs = run_reference(want);
  ASSERT_TRUE(rs.ok()) << "oracle rejected a valid call: " << rs.message();
  Case got = before.clone();
  const Status st = run_case(backend, got);
  ASSERT_TRUE(st.ok()) << backend_name(backend) << " rejected a valid call: " << st.message();
  if (before.cfg.fused && before.cfg.norm) {
    // The norm divides by the output's RMS, so it multiplies the fp32 rounding of a raw output
    // vector that is small against its operands (a cancellation) by their ratio: no fp32
    // evaluation of the composition meets the per-vector bound on such vectors. Each stage is
    // held to the full bound instead (docs/semantics.md section 6): the raw recurrence output
    // against the oracle, and the output against the exact norm of the backend's own raw output.
    const Case raw = without_norm(before);
    run_and_compare(backend, raw, tol);
    Case raw_got = raw.clone();
    ASSERT_TRUE(run_case(backend, raw_got).ok());
    norm_of(before, raw_got, want);
  }
  expect_matches(before, want, got, tol, backend_name(backend));
}

}  // namespace gdn::test
