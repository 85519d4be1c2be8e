// gdn: Gated DeltaNet decode steps (T = 1 decode and T = 2..16 speculative verify)
// over a pool of recurrent states, on the CPU or on CUDA GPUs.
//
// This header is framework-free: it depends only on DLPack's C header. Tensors are
// non-owning strided views (`TensorView`); one entry point, `decode`, runs one call in
// any addressing mode of docs/semantics.md (dense, pool, split pool, per-token slots,
// accepted-token continuation); `can_implement` runs the same checks without touching
// memory. Nothing here aborts, prints, allocates on success, or synchronizes a stream.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

namespace gdn {

// ---------------------------------------------------------------------------------
// Status: CUB-style return value; never an exception, never an abort.
// ---------------------------------------------------------------------------------
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // shapes, dtypes, strides, devices or options disagree
  kNotSupported = 2,     // a valid request this build cannot run (e.g. CUDA tensor, CPU-only build)
  kCudaError = 3,        // the CUDA runtime reported an error at launch
};

class Status {
 public:
  Status() = default;  // OK; holds no string, so success never allocates
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  // Names the argument, what was expected and what was given, e.g.
  // "state.stride[3] must be 1 for layout VK, got 128". Empty when ok().
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// ---------------------------------------------------------------------------------
// TensorView: pointer, dtype, device, shape and strides (in elements, int64).
// Shape and strides are stored inline, so a view never dangles on the caller's arrays.
// A default-constructed view (ndim == 0) means "absent" for optional arguments.
// ---------------------------------------------------------------------------------
constexpr int kMaxRank = 5;

struct TensorView {
  void* data = nullptr;  // address of element [0, 0, ...] (DLPack byte_offset already applied)
  DLDataType dtype{kDLFloat, 32, 1};
  DLDevice device{kDLCPU, 0};
  int ndim = 0;
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};

  bool defined() const { return ndim > 0; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
};

// DLPack dtypes accepted by gdn.
inline constexpr DLDataType kFloat32{kDLFloat, 32, 1};
inline constexpr DLDataType kFloat16{kDLFloat, 16, 1};
inline constexpr DLDataType kBFloat16{kDLBfloat, 16, 1};
inline constexpr DLDataType kInt32{kDLInt, 32, 1};
inline constexpr DLDataType kInt64{kDLInt, 64, 1};

inline constexpr DLDevice kCpu{kDLCPU, 0};
inline DLDevice cuda_device(int id) { return DLDevice{kDLCUDA, id}; }

// Builds a view. Empty `strides` means compact row-major. Rank must be 1..kMaxRank;
// a larger rank yields an absent view, which the checks then report.
TensorView make_view(void* data, DLDataType dtype, DLDevice device,
                     std::initializer_list<int64_t> shape,
                     std::initializer_list<int64_t> strides = {});

// Wraps a DLPack tensor without copying: applies byte_offset, fills compact
// row-major strides when `strides` is null (DLPack's convention).
TensorView from_dlpack(const DLTensor& t);

// ---------------------------------------------------------------------------------
// One decode call. Shapes use the field's names (docs/semantics.md section 1):
//   B rows (requests), T tokens per row, H q/k heads, HV value heads (HV % H == 0, GVA),
//   K, V head dims (each of 64, 128, 256), P slots in the state pool.
// ---------------------------------------------------------------------------------
enum class StateLayout : int {
  kVK = 0,  // "K-last" (FlashInfer pretranspose, FLA state_v_first): [P, HV, V, K], K contiguous
  kKV = 1,  // "V-last" (FlashInfer nontranspose, HF transformers):   [P, HV, K, V], V contiguous
};

// What `decode` and `fused_decode` share: the gates, the recurrent state and its addressing,
// the output and the options of the recurrence step (docs/semantics.md sections 2-3).
//
// Memory rules for every tensor (docs/semantics.md section 4): data pointers aligned to the
// element size; a tensor the call writes (o, the state when updated, inter, error_count, and
// in fused_decode the conv state when updated and conv_inter) overlaps no other tensor of the
// call, and no two of its own elements share a byte (exact test on the strided views, so
// disjoint interleaved views of one buffer are fine); empty tensors (B = 0) are valid whatever
// their strides.
struct StepArgs {
  // Gates, raw form (FlashInfer, SGLang, vLLM packed decode): g and beta computed in the
  // call as g = exp(-exp(A_log) * softplus(a + dt_bias)), beta = sigmoid(b).
  TensorView a;        // [B, T, HV]  bf16 | fp16 | fp32, any strides
  TensorView b;        // [B, T, HV]  bf16 | fp16 | fp32, any strides
  TensorView A_log;    // [HV] fp32, any stride
  TensorView dt_bias;  // [HV] fp32 | bf16 | fp16, any stride
  // Gates, precomputed form (FLA, vLLM fused_recurrent, HF, llama.cpp). Exactly one form is given.
  TensorView g;     // [B, T, HV] fp32, log-space decay: the step uses exp(g); any strides
  TensorView beta;  // [B, T, HV] fp32 | bf16 | fp16, used as given; any strides

  // Recurrent state. Dense mode: [B, HV, ...] and row n uses slot n. Otherwise a pool [P, HV, ...].
  // fp32 | bf16 | fp16; innermost stride 1; slot, head and row strides are free (page-padded
  // and interleaved pools work). Updated in place unless update_state is false.
  TensorView state;
  // Required, with no default: VK and KV have one shape when K == V, so a forgotten layout
  // would silently compute garbage. An absent layout is an kInvalidArgument error.
  std::optional<StateLayout> layout;

  // Addressing (docs/semantics.md section 3). All int32 | int64, any stride, on the state's device.
  TensorView read_slots;    // [B]: row n reads slot read_slots[n]; absent = dense (unless token_slots)
  TensorView write_slots;   // [B]: row n writes its final state there; absent = read_slots
  TensorView token_slots;   // [B, T]: state after token t of row n goes to token_slots[n, t];
                            // row n reads read_slots[n] if given, else token_slots[n, 0]
  TensorView num_accepted;  // [B], needs token_slots: row n reads token_slots[n, num_accepted[n] - 1]

  // Optional intermediate cache, indexed by batch row (never by slot): [B, T, HV, <layout>],
  // state dtype, innermost stride 1; entry (n, t) = state after token t.
  TensorView inter;

  // Output: [B, T, HV, V] bf16 | fp16 | fp32, innermost stride 1.
  TensorView o;

  // Optional int32 [1] counter on the state's device (element 0 is used). Each call adds the
  // number of rows it treated as padding because a slot the row names was >= P (or
  // num_accepted was outside 1..T), plus, with check_duplicate_writes, the number of rows
  // whose write slot another row also writes. Readable without a host sync; never reset by gdn.
  TensorView error_count;

  // Optional stochastic rounding of 16-bit state stores (docs/semantics.md section 2): int64 [1]
  // on the state's device, read by the call (on the device for CUDA, so a captured graph sees
  // the value at replay). Given, every bf16 / fp16 state store (pool and inter) rounds up with
  // probability equal to the value's fraction of the way to the next representable number,
  // instead of to nearest even; the random bits are a counter-based hash of (this seed value,
  // the row's read slot, the head, the token, the element's index in the head's matrix), so a
  // run is reproducible bit for bit and no generator state is kept. The same value on the same
  // slot repeats the same bits: advance it between steps (e.g. one add per decode step).
  // No effect on fp32 states, o, or the fused step's conv state.
  TensorView rounding_seed;

  std::optional<float> scale;  // multiplies q; default 1/sqrt(K); must be finite
  bool use_qk_l2norm = true;   // q, k <- x * rsqrt(sum(x^2) + 1e-6) before use
  bool update_state = true;    // false: the pools are read, never written (the caches still are)
  bool check_duplicate_writes = false;  // checking mode: count rows that write the same slot
};

// One decode call: the recurrence of docs/semantics.md section 2 on given q, k, v.
struct DecodeArgs : StepArgs {
  // Inputs, any strides (the innermost too: stride 1 is the fast path, anything else is read
  // element by element, never copied). Packed qkv views and conv-buffer views work as they are.
  TensorView q;  // [B, T, H, K]  bf16 | fp16 | fp32 (q, k, v share one dtype)
  TensorView k;  // [B, T, H, K]
  TensorView v;  // [B, T, HV, V]
};

// Validates `args` exactly as `decode` does (docs/semantics.md section 4) without reading or
// writing any tensor data. Returns kInvalidArgument or kNotSupported with a message, or Ok.
Status can_implement(const DecodeArgs& args);

// Runs one decode call. The tensors' device picks the backend: kDLCPU runs the threaded
// CPU backend synchronously (stream ignored); kDLCUDA enqueues on `stream` (a cudaStream_t,
// nullptr = the legacy default stream) and returns without waiting. On any error nothing is
// launched or written. No allocation, no host sync: safe inside CUDA-graph capture.
Status decode(const DecodeArgs& args, void* stream = nullptr);

// ---------------------------------------------------------------------------------
// The fused GDN layer decode step (docs/semantics.md section 6): everything between the
// layer's input projection and its output projection, in one call.
//   1. causal depthwise conv update of mixed_qkv over the conv-state pool, then SiLU;
//   2. the split of the conv output y [D] into q [H, K] | k [H, K] | v [HV, V];
//   3. the recurrence of `decode` (every gate form, layout and addressing mode of StepArgs);
//   4. optionally, the gated RMSNorm of Qwen3-Next (norm before gate) on the output.
// The conv pool follows the recurrent state's slots: it is read from the row's read slot and
// written to its write slot(s); padding and out-of-range rows touch neither pool;
// update_state covers both pools. All math in fp32; rounding only at stores.
// ---------------------------------------------------------------------------------
struct FusedDecodeArgs : StepArgs {
  // [B, T, D], D = 2*H*K + HV*V in the order q | k | v; bf16 | fp16 | fp32; any strides.
  // HV, K, V come from the state's shape; H = (D - HV*V) / (2*K) must divide HV.
  TensorView mixed_qkv;
  TensorView conv_weight;  // [D, W], W in 2..4 (Qwen3-Next: 4); bf16 | fp16 | fp32; any strides
  TensorView conv_bias;    // optional [D]; bf16 | fp16 | fp32; any stride
  // [P, D, L], W - 1 <= L <= 16, same P (and dense/pool mode) as the state; bf16 | fp16 | fp32; any
  // strides (vLLM's [P, L, D] memory as a transposed view; transformers' L = W). Column L - 1
  // is the newest input. Read from the row's read slot; the last L inputs (old columns, then
  // the T new ones) are written to the write slot (per token with token_slots).
  TensorView conv_state;
  // Optional [B, T, D, L], conv_state's dtype, any strides: entry (n, t) = the conv state after
  // token t (the conv counterpart of `inter`).
  TensorView conv_inter;

  // Optional gated RMSNorm: o = o * rsqrt(mean_V(o^2) + norm_eps) * norm_weight * silu(z).
  TensorView norm_weight;  // [V] bf16 | fp16 | fp32; absent: o is the raw recurrence output
  TensorView z;            // [B, T, HV, V] bf16 | fp16 | fp32, any strides; needs norm_weight
  float norm_eps = 1e-6f;  // must be finite and >= 0
};

// Validates `args` exactly as `fused_decode` does, without touching tensor data.
Status can_implement(const FusedDecodeArgs& args);

// Runs one fused step; backend, stream, error and allocation rules as `decode`. One kernel
// per call on CUDA (plus the duplicate-write counter in checking mode). T in 1..16.
Status fused_decode(const FusedDecodeArgs& args, void* stream = nullptr);

// True when this build has the CUDA backend compiled in.
bool cuda_available();

}  // namespace gdn
