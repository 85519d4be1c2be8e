// Test infrastructure for gdn: host tensors with arbitrary strides over shared storages,
// random problems per SPEC section 6, the backends the suite runs on, and the comparators
// (docs/semantics.md section 5, judged by reference/compare.h, never loosened here).
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gdn/gdn.h"

namespace gdn {
// Readable status codes in gtest messages (found by argument-dependent lookup).
void PrintTo(StatusCode code, std::ostream* os);
}  // namespace gdn

namespace gdn::test {

// ---------------------------------------------------------------------------------------
// Dtypes. Scalar conversions are src/host_dtype.h's (gdn::detail), ulp distances and
// tolerances reference/compare.h's: one definition each.
// ---------------------------------------------------------------------------------------
size_t dtype_size(DLDataType t);
std::string dtype_name(DLDataType t);
bool same_dtype(DLDataType x, DLDataType y);
bool is_float_dtype(DLDataType t);

// ---------------------------------------------------------------------------------------
// Storage: one byte buffer that several tensors may view (packed qkv, interleaved pools).
// A sparse storage is an address-space reservation (mmap MAP_NORESERVE) of which only
// `touched` byte ranges are ever read, written, copied or compared.
// ---------------------------------------------------------------------------------------
class Storage {
 public:
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  // Heap bytes filled with a random pattern, so a stray write of zeros is visible.
  static std::shared_ptr<Storage> heap(size_t bytes, uint64_t seed);
  // nullptr when the address space cannot be reserved.
  static std::shared_ptr<Storage> reserve(size_t bytes);

  std::byte* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  bool sparse() const { return sparse_; }
  // Byte ranges [begin, end) that hold data; the whole buffer unless sparse.
  std::vector<std::pair<size_t, size_t>> ranges() const;
  void touch(size_t begin, size_t end) { touched_.emplace_back(begin, end); }

  std::shared_ptr<Storage> clone() const;
  bool same_bytes(const Storage& other) const;  // over ranges()

 private:
  Storage() = default;
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
  bool sparse_ = false;
  std::vector<std::pair<size_t, size_t>> touched_;
};

// ---------------------------------------------------------------------------------------
// HostTensor: dtype, shape and strides (elements) over a byte offset into a Storage.
// ---------------------------------------------------------------------------------------
struct HostTensor {
  std::shared_ptr<Storage> storage;
  size_t byte_offset = 0;
  DLDataType dtype = kFloat32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;

  bool defined() const { return storage != nullptr; }
  int ndim() const { return static_cast<int>(shape.size()); }
  int64_t numel() const;
  std::byte* ptr() const { return storage->data() + byte_offset; }
  TensorView view() const;  // on the host; an absent view when undefined

  int64_t offset(const int64_t* idx) const;  // elements from ptr()
  int64_t offset(std::initializer_list<int64_t> idx) const { return offset(idx.begin()); }
  double get(const int64_t* idx) const;
  double get(std::initializer_list<int64_t> idx) const { return get(idx.begin()); }
  void set(const int64_t* idx, double x) const;  // rounds to the dtype
  void set(std::initializer_list<int64_t> idx, double x) const { set(idx.begin(), x); }
  uint64_t bits(const int64_t* idx) const;
  void set_bits(const int64_t* idx, uint64_t bits) const;

  // Calls f(idx) for every index in row-major order.
  void for_each(const std::function<void(const int64_t*)>& f) const;
  // Byte range [first, last + 1) spanned by the elements; strides must be >= 0.
  std::pair<size_t, size_t> byte_span() const;
};

std::vector<int64_t> compact_strides(const std::vector<int64_t>& shape);
// A tensor alone in a fresh heap storage; `strides` empty = compact. `lead_elems` leaves
// that many elements before element 0 (misaligns it when odd).
HostTensor make_tensor(DLDataType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides = {},
                       uint64_t seed = 1, int64_t lead_elems = 0);
// A view into an existing storage at `elem_offset` elements of `dtype`.
HostTensor view_into(const std::shared_ptr<Storage>& storage, int64_t elem_offset, DLDataType dtype,
                     std::vector<int64_t> shape, std::vector<int64_t> strides);

// NaN in the tensor's own dtype, so "o was written" and "o is finite" are one check.
void poison(const HostTensor& t);

// ---------------------------------------------------------------------------------------
// Problems. A Case is one decode call's tensors plus the options; cloning it deep-copies
// every storage and keeps the aliasing between views.
// ---------------------------------------------------------------------------------------
enum class Arg : int {
  kQ, kK, kV, kA, kB, kALog, kDtBias, kG, kBeta, kState,
  kReadSlots, kWriteSlots, kTokenSlots, kNumAccepted, kInter, kO, kErrorCount, kRoundingSeed,
  // The fused step's own tensors (gdn::FusedDecodeArgs); a fused case has no q, k, v.
  kMixedQkv, kConvWeight, kConvBias, kConvState, kConvInter, kZ, kNormWeight, kCount
};
constexpr int kNumArgs = static_cast<int>(Arg::kCount);
const char* arg_name(Arg a);
// The view of `a` in the call's arguments; for an argument the struct does not have (q in a
// fused call, conv_state in a decode call) a scratch view whose edits go nowhere.
TensorView& arg_view(DecodeArgs& args, Arg a);
const TensorView& arg_view(const DecodeArgs& args, Arg a);
TensorView& arg_view(FusedDecodeArgs& args, Arg a);

enum class GateForm { kRaw, kPrecomputed };
enum class Addressing {
  kDense,            // state [B, ...], row n uses slot n
  kPool,             // read_slots, write = read
  kSplit,            // read_slots and disjoint write_slots
  kPerToken,         // read_slots + token_slots [B, T]
  kPerTokenFromFirst,  // token_slots only: row n reads token_slots[n, 0]
  kAccepted,         // token_slots + num_accepted
};
enum class InterMode { kNone, kCompact, kStrided };
enum class StrideMode {
  kCompact,  // every tensor alone and compact
  kPage,     // packed qkv/ab buffers, interleaved page-padded pool, padded o/inter: aligned
  kOdd,      // like kPage with odd paddings and base offsets: nothing is vector-aligned
};

struct Config {
  int64_t B = 1, T = 1, H = 1, HV = 1, K = 64, V = 64;
  StateLayout layout = StateLayout::kVK;
  DLDataType state_dtype = kFloat32;
  DLDataType input_dtype = kBFloat16;  // q, k, v
  DLDataType gate_dtype = kFloat32;    // a, b, dt_bias (raw) or beta (precomputed)
  DLDataType out_dtype = kFloat32;
  GateForm gates = GateForm::kRaw;
  bool l2norm = true;
  // Keys of unit norm when l2norm is off: the delta rule with raw N(0,1) keys has the
  // eigenvalue 1 - beta*|k|^2 ~ -K/2 and blows up over T tokens, which no caller does.
  bool normalize_keys_without_l2norm = true;
  std::optional<float> scale;
  Addressing addressing = Addressing::kDense;
  DLDataType slot_dtype = kInt32;
  bool padding = false;  // about 20% of rows (at least one) get read slot -1
  InterMode inter = InterMode::kNone;
  StrideMode strides = StrideMode::kCompact;
  bool update_state = true;
  bool error_count = true;
  int64_t extra_slots = 3;  // pool slots beyond what the rows need
  // StepArgs::rounding_seed: an int64 [1] tensor holding this value (stochastic rounding of
  // 16-bit state stores); absent when empty.
  std::optional<int64_t> rounding_seed;
  int oversize = 1;         // storages this many times larger (error tests: safe if a bad
                            // dtype or shape slipped through and were read)

  // The fused layer step (gdn::fused_decode): q, k, v come from a causal conv over mixed_qkv
  // [B, T, D] (input_dtype, like z); StrideMode kPage interleaves the conv pool with the state
  // pool slot by slot (vLLM's hybrid cache), kOdd gives mixed_qkv an innermost stride of 2.
  bool fused = false;
  int64_t W = 4;                         // conv taps
  int64_t conv_L = 3;                    // conv-state columns (vLLM: W - 1; transformers: W)
  DLDataType conv_dtype = kBFloat16;     // conv_state, conv_inter
  DLDataType weight_dtype = kBFloat16;   // conv_weight, conv_bias, norm_weight
  bool conv_bias = false;
  bool conv_inter = false;
  bool conv_transposed = true;  // conv_state as [P, L, D] memory viewed as [P, D, L] (vLLM)
  bool norm = true;             // norm_weight: the gated RMSNorm
  bool gate_z = true;           // z (needs norm)
  float norm_eps = 1e-6f;
  int64_t D() const { return 2 * H * K + HV * V; }

  int64_t rows() const { return layout == StateLayout::kVK ? V : K; }
  int64_t cols() const { return layout == StateLayout::kVK ? K : V; }
  std::string name() const;
  // Qwen3-Next's GDN heads: H = 16, HV = 32, K = V = 128.
  Config& qwen3_next_heads() {
    H = 16;
    HV = 32;
    K = V = 128;
    return *this;
  }
};

struct Case {
  Config cfg;
  uint64_t seed = 0;
  int64_t P = 0;
  std::array<HostTensor, kNumArgs> t;
  bool check_duplicate_writes = false;

  HostTensor& operator[](Arg a) { return t[static_cast<int>(a)]; }
  const HostTensor& operator[](Arg a) const { return t[static_cast<int>(a)]; }
  DecodeArgs args() const;
  FusedDecodeArgs fused_args() const;  // cfg.fused cases
  std::vector<std::shared_ptr<Storage>> storages() const;  // distinct, in a fixed order
  Case clone() const;
};

// Builds every tensor of `cfg`, fills inputs and state per SPEC section 6, chooses slots,
// poisons o and inter, sets error_count to a nonzero start.
Case make_case(const Config& cfg, uint64_t seed);
// Redraws q, k, v and the gates (multi-step tests), deterministic in `seed`.
void fill_inputs(Case& c, uint64_t seed);
void fill_state_slot(const Case& c, int64_t slot, std::mt19937_64& rng);

// Seed for the running test: FNV-1a of its full name, mixed with $GDN_TEST_SEED if set.
uint64_t test_seed();

// ---------------------------------------------------------------------------------------
// Backends. The oracle always runs on the host; a CUDA run mirrors every storage on the
// device, runs there with the same strides, and copies every storage back.
// ---------------------------------------------------------------------------------------
enum class Backend { kCpu, kCuda };
std::string backend_name(Backend b);
// Empty when the backend can run in this process, else why not (for GTEST_SKIP).
std::string backend_unavailable(Backend b);
// Whether the device can hold `bytes` more (big-pool tests); reason in *why when not.
bool device_can_allocate(Backend b, size_t bytes, std::string* why);

// A suite parameterized by backend: skips, saying why, where the backend cannot run here.
class BackendTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (std::string why = backend_unavailable(GetParam()); !why.empty()) GTEST_SKIP() << why;
  }
  Backend backend() const { return GetParam(); }
};

// The running test's seed (test_seed), named in every failure message under it.
#define GDN_SEED()                   \
  const uint64_t seed = test_seed(); \
  SCOPED_TRACE("seed=" + std::to_string(seed))

// Runs gdn::decode on `backend` over the case's views. `fixup` may edit the device-side
// arguments (mixed-device error tests). `can_implement_status`, if given, receives
// can_implement() of exactly the arguments decode saw.
Status run_decode(Backend backend, const Case& c,
                  const std::function<void(DecodeArgs&)>& fixup = {},
                  Status* can_implement_status = nullptr);
// The same for gdn::fused_decode (cfg.fused cases).
Status run_fused(Backend backend, const Case& c, const std::function<void(FusedDecodeArgs&)>& fixup = {},
                 Status* can_implement_status = nullptr);
// run_decode or run_fused, by c.cfg.fused.
Status run_case(Backend backend, const Case& c);
// The oracle (reference::decode, or reference::fused_decode for fused cases).
Status run_reference(const Case& c);

// ---------------------------------------------------------------------------------------
// What a call must do, derived from SPEC section 3 independently of src/problem.h.
// ---------------------------------------------------------------------------------------
enum class RowKind { kValid, kPadding, kInvalid };
struct RowEffect {
  RowKind kind = RowKind::kValid;
  int64_t read = -1;
  std::vector<std::pair<int64_t, int64_t>> writes;  // (t, slot): state after token t
};
struct Expected {
  std::vector<RowEffect> rows;
  int64_t error_delta = 0;
  std::vector<bool> written;  // per slot in [0, P) (empty when the pool is sparse)
  std::vector<int64_t> written_slots;  // sorted, distinct
  std::vector<int64_t> duplicated_slots;  // written by more than one row
};
Expected expected_effects(const Case& c);
// Slots whose content the comparators inspect: all of [0, P), or for a sparse pool the
// slots the call names.
std::vector<int64_t> slots_to_check(const Case& c);

// ---------------------------------------------------------------------------------------
// Comparators (docs/semantics.md section 5).
// ---------------------------------------------------------------------------------------
// Which bound of docs/semantics.md section 5 applies; reference::compare_vectors judges.
struct Tolerance {
  bool many_steps = false;  // 16-bit storage: relative Frobenius <= 1e-2 instead of the ulp bounds
};
Tolerance one_call_tolerance();
Tolerance many_steps_tolerance(DLDataType dtype);  // fp32: 1e-5; bf16/fp16: rel Frobenius 1e-2

// Checks everything the call may and may not have done, for `got` (a backend's result)
// against `want` (the oracle's) and `before` (the inputs): o, inter and written slots within
// tolerance; padding rows zero; unwritten slots, inputs and every byte outside the views
// bit-identical; error_count exact; no NaN anywhere it was written. Reports with gtest.
void expect_matches(const Case& before, const Case& want, const Case& got, const Tolerance& tol,
                    const std::string& what);
// Multi-step form: the oracle's and the backend's states have diverged (within tolerance),
// so each result is checked against its own previous state.
void expect_matches(const Case& before_want, const Case& want, const Case& before_got, const Case& got,
                    const Tolerance& tol, const std::string& what);
// Same checks of `want` alone against the semantics (the oracle's addressing).
void expect_oracle_consistent(const Case& before, const Case& want);

// Bit equality of every storage, with the first differing tensor element named.
::testing::AssertionResult same_bits(const Case& x, const Case& y);

// One full check: oracle and backend on clones of `before`, compared.
void run_and_compare(Backend backend, const Case& before, const Tolerance& tol = one_call_tolerance());

// Parameter name for gtest: only [A-Za-z0-9_].
std::string sanitize(const std::string& s);

}  // namespace gdn::test
