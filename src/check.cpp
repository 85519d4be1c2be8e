// Host-side validation (docs/semantics.md section 4): every argument is checked before any
// backend touches memory, and the validated call is flattened into a detail::Problem (or a
// FusedProblem). can_implement, decode and fused_decode share these functions, so they always
// agree; both operations share the checks of the recurrence step (check_step).
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <string>

#include "check.h"
#include "overlap.h"

namespace gdn::detail {
namespace {

std::string dtype_name(DLDataType t) {
  std::string lanes;  // (built in steps: GCC 12 warns falsely on "x" + std::string)
  if (t.lanes != 1) lanes.append("x").append(std::to_string(t.lanes));
  switch (t.code) {
    case kDLFloat:
      return (t.bits == 32 ? "float32" : t.bits == 16 ? "float16" : t.bits == 64 ? "float64"
                                                                   : "float" + std::to_string(t.bits)) + lanes;
    case kDLBfloat: return "bfloat" + std::to_string(t.bits) + lanes;
    case kDLInt: return "int" + std::to_string(t.bits) + lanes;
    case kDLUInt: return "uint" + std::to_string(t.bits) + lanes;
    case kDLComplex: return "complex" + std::to_string(t.bits) + lanes;
    case 6: return "bool" + lanes;  // kDLBool in DLPack >= 0.8
    case kDLOpaqueHandle: return "an opaque or unsupported dtype";
    default: return "an unsupported dtype (DLPack type code " + std::to_string(t.code) + ", " +
                    std::to_string(t.bits) + " bits)";
  }
}

std::string shape_str(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

bool same(DLDataType a, DLDataType b) { return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes; }

// Maps an accepted DLPack dtype to the internal enum; false if not a float storage type.
bool float_dtype(DLDataType t, DType* out) {
  if (same(t, kFloat32)) { *out = DType::kF32; return true; }
  if (same(t, kBFloat16)) { *out = DType::kBF16; return true; }
  if (same(t, kFloat16)) { *out = DType::kF16; return true; }
  return false;
}

bool is_empty(const TensorView& t) {
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] == 0) return true;
  return false;
}

Status invalid(std::string msg) { return Status(StatusCode::kInvalidArgument, std::move(msg)); }

constexpr const char* kFloats = "bfloat16, float16 or float32";

// Collects the first failure; later checks are skipped once one fails.
struct Checker {
  Status status;
  bool ok() const { return status.ok(); }
  void fail(std::string msg) {
    if (ok()) status = invalid(std::move(msg));
  }

  void required(const TensorView& t, const char* name, const char* why = "") {
    if (ok() && !t.defined()) fail(std::string(name) + " is required" + why + " but was not given");
  }
  void rank(const TensorView& t, const char* name, int r, const char* dims) {
    if (ok() && t.ndim != r)
      fail(std::string(name) + " must have rank " + std::to_string(r) + " " + dims + ", got rank " +
           std::to_string(t.ndim) + " " + shape_str(t));
  }
  void dim(const TensorView& t, const char* name, int i, int64_t want, const char* what) {
    if (ok() && t.ndim > i && t.shape[i] != want)
      fail(std::string(name) + ".shape[" + std::to_string(i) + "] must be " + what + " = " +
           std::to_string(want) + ", got " + std::to_string(t.shape[i]) + " (shape " + shape_str(t) + ")");
  }
  void nonneg(int64_t x, const std::string& what) {
    if (ok() && x < 0) fail(what + " must be >= 0, got " + std::to_string(x));
  }
  // Only the state, the intermediate caches and o must be contiguous along their last dim
  // (the backends store 16-byte vectors there); an empty view is exempt, whatever its strides.
  void inner_stride(const TensorView& t, const char* name, const char* why) {
    if (ok() && t.ndim > 0 && !is_empty(t) && t.strides[t.ndim - 1] != 1)
      fail(std::string(name) + ".stride[" + std::to_string(t.ndim - 1) + "] must be 1" + why + ", got " +
           std::to_string(t.strides[t.ndim - 1]));
  }
  void float_type(const TensorView& t, const char* name, DType* out, bool allow16, const char* allowed) {
    if (!ok()) return;
    DType d;
    if (!float_dtype(t.dtype, &d) || (!allow16 && d != DType::kF32))
      fail(std::string(name) + " dtype must be " + allowed + ", got " + dtype_name(t.dtype));
    else
      *out = d;
  }
  void index_type(const TensorView& t, const char* name, DType* out) {
    if (!ok()) return;
    if (same(t.dtype, kInt32)) *out = DType::kI32;
    else if (same(t.dtype, kInt64)) *out = DType::kI64;
    else fail(std::string(name) + " dtype must be int32 or int64, got " + dtype_name(t.dtype));
  }
  void device(const TensorView& t, const char* name, DLDevice want) {
    if (ok() && (t.device.device_type != want.device_type || t.device.device_id != want.device_id))
      fail(std::string(name) + " must be on the state's device (type " + std::to_string(want.device_type) +
           ", id " + std::to_string(want.device_id) + "), got type " + std::to_string(t.device.device_type) +
           ", id " + std::to_string(t.device.device_id));
  }
  void nonnull(const TensorView& t, const char* name) {
    if (ok() && t.data == nullptr && !is_empty(t)) fail(std::string(name) + " has a null data pointer");
  }
};

void copy_strides(const TensorView& t, Ptr* p, int n) {
  for (int i = 0; i < n && i < t.ndim; ++i) p->s[i] = t.strides[i];
}

bool supported_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }

// One tensor of the call for the memory checks.
struct Mem {
  const TensorView* t = nullptr;
  const char* name = "";
  bool written = false;
  bool first_only = false;  // only element 0 is ever touched (error_count)
};

// The tensors of one call, in a fixed array: a successful call allocates nothing.
struct MemList {
  static constexpr int kMax = 24;
  Mem m[kMax];
  int n = 0;
  void add(const TensorView& t, const char* name, bool written, bool first = false) {
    if (t.defined() && n < kMax) m[n++] = Mem{&t, name, written, first};
  }
};

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, reinterpret_cast<uintptr_t>(p));
  return buf;
}

const char* overlap_why(Overlap o) {
  return o == Overlap::kYes ? " (their memory shares bytes)"
                            : " (their byte ranges intersect and the layouts are too irregular to prove "
                              "them disjoint)";
}

// Alignment, representable byte ranges, and the overlap rules: a written tensor shares no byte
// with any other tensor of the call, and no two of its elements share a byte.
Status check_memory(const MemList& all) {
  Footprint fp[MemList::kMax];
  for (int i = 0; i < all.n; ++i) {
    const TensorView& t = *all.m[i].t;
    const int64_t es = t.dtype.bits / 8;
    if (is_empty(t)) {
      fp[i] = Footprint{};
      fp[i].empty = true;
      continue;
    }
    if (reinterpret_cast<uintptr_t>(t.data) % static_cast<uintptr_t>(es) != 0)
      return invalid(std::string(all.m[i].name) + " data pointer must be aligned to its element size (" +
                     std::to_string(es) + " bytes), got address " + hex(t.data));
    if (all.m[i].first_only) {
      fp[i] = first_element(t, es);
    } else if (!footprint(t, es, &fp[i])) {
      return invalid(std::string(all.m[i].name) + " shape " + shape_str(t) +
                     " with its strides reaches outside the address space (past 2^57 bytes, or size arithmetic that overflows 64 bits)");
    }
  }
  for (int i = 0; i < all.n; ++i) {
    if (!all.m[i].written) continue;
    if (const Overlap o = self_overlaps(fp[i]); o != Overlap::kNo)
      return invalid(std::string(all.m[i].name) + " must not overlap itself: two of its elements may not share "
                     "bytes, since gdn writes it" + overlap_why(o));
    for (int j = 0; j < all.n; ++j) {
      if (j == i || (all.m[j].written && j < i)) continue;  // each written pair once
      if (const Overlap o = overlaps(fp[i], fp[j]); o != Overlap::kNo)
        return invalid(std::string(all.m[i].name) + " must not overlap " + all.m[j].name + overlap_why(o));
    }
  }
  return Status::Ok();
}

// The tensors of StepArgs for the memory checks (absent ones are skipped).
void step_memory(const StepArgs& a, MemList& m) {
  m.add(a.o, "o", true);
  m.add(a.state, "state", a.update_state);
  m.add(a.inter, "inter", true);
  m.add(a.error_count, "error_count", true, true);
  m.add(a.rounding_seed, "rounding_seed", false, true);
  m.add(a.a, "a", false);
  m.add(a.b, "b", false);
  m.add(a.A_log, "A_log", false);
  m.add(a.dt_bias, "dt_bias", false);
  m.add(a.g, "g", false);
  m.add(a.beta, "beta", false);
  m.add(a.read_slots, "read_slots", false);
  m.add(a.write_slots, "write_slots", false);
  m.add(a.token_slots, "token_slots", false);
  m.add(a.num_accepted, "num_accepted", false);
}

// Checks of the recurrence step shared by decode and fused_decode: everything of StepArgs.
// The caller has set p.B, p.T, p.H, p.HV, p.K, p.V (from q and v, or from mixed_qkv and the
// state) and checked the state's rank; this fills the rest of `p` except q, k, v.
void check_step(const StepArgs& args, Problem& p, Checker& c) {
  const bool kv = *args.layout == StateLayout::kKV;
  p.P = args.state.shape[0];
  c.nonneg(p.P, "state.shape[0] (P)");
  c.dim(args.o, "o", 0, p.B, "B");
  c.dim(args.o, "o", 1, p.T, "T");
  c.dim(args.o, "o", 2, p.HV, "HV");
  c.dim(args.o, "o", 3, p.V, "V");
  p.layout_kv = kv;
  p.rows = kv ? p.K : p.V;
  p.cols = kv ? p.V : p.K;
  c.dim(args.state, "state", 1, p.HV, "HV");
  c.dim(args.state, "state", 2, p.rows, kv ? "K" : "V");
  c.dim(args.state, "state", 3, p.cols, kv ? "V" : "K");

  c.float_type(args.state, "state", &p.state.dtype, true, "float32, bfloat16 or float16");
  c.float_type(args.o, "o", &p.o.dtype, true, "float32, bfloat16 or float16");
  c.inner_stride(args.o, "o", "");
  c.inner_stride(args.state, "state", kv ? " for layout KV" : " for layout VK");

  // Gates: exactly one form.
  const bool raw_any = args.a.defined() || args.b.defined() || args.A_log.defined() || args.dt_bias.defined();
  const bool pre_any = args.g.defined() || args.beta.defined();
  if (c.ok() && raw_any && pre_any)
    c.fail("give gates either raw (a, b, A_log, dt_bias) or precomputed (g, beta), not both");
  if (c.ok() && !raw_any && !pre_any)
    c.fail("gates are required: raw (a, b, A_log, dt_bias) or precomputed (g, beta)");
  p.raw_gates = raw_any;
  auto gate3 = [&](const TensorView& t, const char* name, Ptr* dst, bool allow16, const char* allowed) {
    if (c.ok() && !t.defined()) c.fail(std::string(name) + " is required with the " +
                                       (raw_any ? "raw" : "precomputed") + " gate form but was not given");
    c.rank(t, name, 3, "[B, T, HV]");
    c.dim(t, name, 0, p.B, "B");
    c.dim(t, name, 1, p.T, "T");
    c.dim(t, name, 2, p.HV, "HV");
    c.float_type(t, name, &dst->dtype, allow16, allowed);
    dst->data = t.data;
    copy_strides(t, dst, 3);
  };
  auto head_vec = [&](const TensorView& t, const char* name, Ptr* dst, bool allow16, const char* allowed) {
    if (c.ok() && !t.defined()) c.fail(std::string(name) + " is required with the raw gate form but was not given");
    c.rank(t, name, 1, "[HV]");
    c.dim(t, name, 0, p.HV, "HV");
    c.float_type(t, name, &dst->dtype, allow16, allowed);
    dst->data = t.data;
    copy_strides(t, dst, 1);
  };
  if (raw_any) {
    gate3(args.a, "a", &p.a, true, kFloats);
    gate3(args.b, "b", &p.b, true, kFloats);
    head_vec(args.A_log, "A_log", &p.A_log, false, "float32");
    head_vec(args.dt_bias, "dt_bias", &p.dt_bias, true, "float32, bfloat16 or float16");
  } else {
    gate3(args.g, "g", &p.g, false, "float32");
    gate3(args.beta, "beta", &p.beta, true, "float32, bfloat16 or float16");
  }

  // Addressing.
  const bool has_read = args.read_slots.defined(), has_write = args.write_slots.defined();
  const bool has_token = args.token_slots.defined(), has_acc = args.num_accepted.defined();
  if (c.ok() && has_write && !has_read)
    c.fail("write_slots needs read_slots (dense mode reads and writes slot n)");
  if (c.ok() && has_write && has_token)
    c.fail("write_slots cannot be combined with token_slots: per-token slots name every write");
  if (c.ok() && has_acc && !has_token) c.fail("num_accepted needs token_slots [B, T]");
  if (c.ok() && has_acc && has_read)
    c.fail("num_accepted cannot be combined with read_slots: the row reads token_slots[n, num_accepted[n] - 1]");
  auto slots1 = [&](const TensorView& t, const char* name, Ptr* dst) {
    if (!t.defined()) return;
    c.rank(t, name, 1, "[B]");
    c.dim(t, name, 0, p.B, "B");
    c.index_type(t, name, &dst->dtype);
    dst->data = t.data;
    copy_strides(t, dst, 1);
  };
  slots1(args.read_slots, "read_slots", &p.read_slots);
  slots1(args.write_slots, "write_slots", &p.write_slots);
  slots1(args.num_accepted, "num_accepted", &p.num_accepted);
  if (has_token) {
    c.rank(args.token_slots, "token_slots", 2, "[B, T]");
    c.dim(args.token_slots, "token_slots", 0, p.B, "B");
    c.dim(args.token_slots, "token_slots", 1, p.T, "T");
    c.index_type(args.token_slots, "token_slots", &p.token_slots.dtype);
    p.token_slots.data = args.token_slots.data;
    copy_strides(args.token_slots, &p.token_slots, 2);
  }
  if (c.ok() && !has_read && !has_token && p.P != p.B)
    c.fail("state.shape[0] must be B = " + std::to_string(p.B) +
           " in dense mode (no read_slots or token_slots), got " + std::to_string(p.P));

  // Intermediate cache.
  if (args.inter.defined()) {
    c.rank(args.inter, "inter", 5, kv ? "[B, T, HV, K, V]" : "[B, T, HV, V, K]");
    c.dim(args.inter, "inter", 0, p.B, "B");
    c.dim(args.inter, "inter", 1, p.T, "T");
    c.dim(args.inter, "inter", 2, p.HV, "HV");
    c.dim(args.inter, "inter", 3, p.rows, kv ? "K" : "V");
    c.dim(args.inter, "inter", 4, p.cols, kv ? "V" : "K");
    if (c.ok() && !same(args.inter.dtype, args.state.dtype))
      c.fail("inter dtype must match the state dtype " + dtype_name(args.state.dtype) + ", got " +
             dtype_name(args.inter.dtype));
    c.inner_stride(args.inter, "inter", "");
  }

  if (args.error_count.defined()) {
    c.rank(args.error_count, "error_count", 1, "[1]");
    if (c.ok() && args.error_count.shape[0] < 1) c.fail("error_count must hold at least one element");
    if (c.ok() && !same(args.error_count.dtype, kInt32))
      c.fail("error_count dtype must be int32, got " + dtype_name(args.error_count.dtype));
  }

  if (args.rounding_seed.defined()) {
    c.rank(args.rounding_seed, "rounding_seed", 1, "[1]");
    if (c.ok() && args.rounding_seed.shape[0] != 1)
      c.fail("rounding_seed must hold exactly one element, got shape " + shape_str(args.rounding_seed));
    if (c.ok() && !same(args.rounding_seed.dtype, kInt64))
      c.fail("rounding_seed dtype must be int64, got " + dtype_name(args.rounding_seed.dtype));
  }

  if (c.ok() && args.scale.has_value() && !std::isfinite(*args.scale))
    c.fail("scale must be finite, got " + std::to_string(*args.scale));
  if (!c.ok()) return;

  p.scale = args.scale.has_value() ? *args.scale : 1.0f / std::sqrt(static_cast<float>(p.K));
  p.o.data = args.o.data;
  copy_strides(args.o, &p.o, 3);
  p.state.data = args.state.data;
  copy_strides(args.state, &p.state, 3);
  if (args.inter.defined()) {
    p.inter.data = args.inter.data;
    p.inter.dtype = p.state.dtype;
    copy_strides(args.inter, &p.inter, 4);
  }
  p.error_count = args.error_count.defined() ? static_cast<int*>(args.error_count.data) : nullptr;
  if (args.rounding_seed.defined() && p.state.dtype != DType::kF32)
    p.rounding_seed = static_cast<const int64_t*>(args.rounding_seed.data);
  p.device_id = args.state.device.device_id;
  p.use_qk_l2norm = args.use_qk_l2norm;
  p.update_state = args.update_state;
  p.check_duplicate_writes = args.check_duplicate_writes;
}

// Devices and null pointers of the StepArgs tensors plus `extra` (e.g. q, k, v).
void check_devices(const StepArgs& args, const MemList& extra, Checker& c) {
  const DLDevice dev = args.state.device;
  const struct { const TensorView* t; const char* name; } all[] = {
      {&args.o, "o"}, {&args.a, "a"}, {&args.b, "b"}, {&args.A_log, "A_log"}, {&args.dt_bias, "dt_bias"},
      {&args.g, "g"}, {&args.beta, "beta"}, {&args.read_slots, "read_slots"}, {&args.write_slots, "write_slots"},
      {&args.token_slots, "token_slots"}, {&args.num_accepted, "num_accepted"}, {&args.inter, "inter"},
      {&args.error_count, "error_count"}, {&args.rounding_seed, "rounding_seed"}};
  for (int i = 0; i < extra.n; ++i) {
    c.device(*extra.m[i].t, extra.m[i].name, dev);
    c.nonnull(*extra.m[i].t, extra.m[i].name);
  }
  for (auto& a : all)
    if (a.t->defined()) {
      c.device(*a.t, a.name, dev);
      c.nonnull(*a.t, a.name);
    }
  c.nonnull(args.state, "state");
}

// The common opening: required tensors, the layout, the state's device and rank.
void check_opening(const StepArgs& args, Checker& c) {
  c.required(args.state, "state");
  c.required(args.o, "o");
  if (c.ok() && !args.layout.has_value())
    c.fail("layout is required: StateLayout::kVK ([P, HV, V, K], K contiguous) or StateLayout::kKV "
           "([P, HV, K, V], V contiguous); the two have the same shape when K == V, so gdn never guesses");
  if (c.ok() && *args.layout != StateLayout::kVK && *args.layout != StateLayout::kKV)
    c.fail("layout must be StateLayout::kVK or StateLayout::kKV, got " + std::to_string(static_cast<int>(*args.layout)));
  if (!c.ok()) return;
  const DLDevice dev = args.state.device;
  if (dev.device_type != kDLCPU && dev.device_type != kDLCUDA)
    c.fail("state must be on a CPU (kDLCPU) or CUDA (kDLCUDA) device, got device type " +
           std::to_string(dev.device_type));
  const bool kv = *args.layout == StateLayout::kKV;
  c.rank(args.o, "o", 4, "[B, T, HV, V]");
  c.rank(args.state, "state", 4, kv ? "[P, HV, K, V] (layout KV)" : "[P, HV, V, K] (layout VK)");
}

// H, HV, K, V once they are known: the GVA rule and the supported head dims.
void check_heads(const Problem& p, Checker& c, const char* hsrc, const char* ksrc, const char* vsrc) {
  if (c.ok() && (p.H < 1 || p.HV < 1 || p.HV % p.H != 0))
    c.fail(std::string("v.shape[2] (HV = ") + std::to_string(p.HV) + ") must be a positive multiple of " + hsrc +
           " (H = " + std::to_string(p.H) + ")");
  if (c.ok() && !supported_dim(p.K))
    c.fail(std::string(ksrc) + " (K) must be 64, 128 or 256, got " + std::to_string(p.K));
  if (c.ok() && !supported_dim(p.V))
    c.fail(std::string(vsrc) + " (V) must be 64, 128 or 256, got " + std::to_string(p.V));
}

}  // namespace

Status build_problem(const DecodeArgs& args, Problem* out) {
  Checker c;
  Problem p;
  c.required(args.q, "q");
  c.required(args.k, "k");
  c.required(args.v, "v");
  check_opening(args, c);
  c.rank(args.q, "q", 4, "[B, T, H, K]");
  c.rank(args.k, "k", 4, "[B, T, H, K]");
  c.rank(args.v, "v", 4, "[B, T, HV, V]");
  if (!c.ok()) return c.status;

  // Shapes: q fixes B, T, H, K; v fixes HV, V.
  p.B = args.q.shape[0];
  p.T = args.q.shape[1];
  p.H = args.q.shape[2];
  p.K = args.q.shape[3];
  p.HV = args.v.shape[2];
  p.V = args.v.shape[3];
  c.nonneg(p.B, "q.shape[0] (B)");
  for (int i = 0; i < 4; ++i) {
    static const char* kQk[] = {"B", "T", "H", "K"};
    c.dim(args.k, "k", i, args.q.shape[i], kQk[i]);
  }
  c.dim(args.v, "v", 0, p.B, "B");
  c.dim(args.v, "v", 1, p.T, "T");
  if (c.ok() && p.T < 1) c.fail("q.shape[1] (T) must be >= 1, got " + std::to_string(p.T));
  check_heads(p, c, "q.shape[2]", "q.shape[3]", "v.shape[3]");
  if (!c.ok()) return c.status;

  c.float_type(args.q, "q", &p.q.dtype, true, kFloats);
  c.float_type(args.k, "k", &p.k.dtype, true, kFloats);
  c.float_type(args.v, "v", &p.v.dtype, true, kFloats);
  if (c.ok() && (p.k.dtype != p.q.dtype || p.v.dtype != p.q.dtype))
    c.fail("q, k and v must share one dtype, got q " + dtype_name(args.q.dtype) + ", k " + dtype_name(args.k.dtype) +
           ", v " + dtype_name(args.v.dtype));
  check_step(args, p, c);
  MemList qkv;
  qkv.add(args.q, "q", false);
  qkv.add(args.k, "k", false);
  qkv.add(args.v, "v", false);
  check_devices(args, qkv, c);
  if (!c.ok()) return c.status;

  MemList mem;
  step_memory(args, mem);
  for (int i = 0; i < qkv.n; ++i) mem.m[mem.n++] = qkv.m[i];
  if (Status s = check_memory(mem); !s.ok()) return s;

  p.q.data = args.q.data;
  copy_strides(args.q, &p.q, 4);
  p.k.data = args.k.data;
  copy_strides(args.k, &p.k, 4);
  p.v.data = args.v.data;
  copy_strides(args.v, &p.v, 4);
  *out = p;
  return Status::Ok();
}

Status build_fused_problem(const FusedDecodeArgs& args, FusedProblem* out) {
  Checker c;
  FusedProblem f;
  Problem& p = f.step;
  c.required(args.mixed_qkv, "mixed_qkv");
  c.required(args.conv_weight, "conv_weight");
  c.required(args.conv_state, "conv_state");
  check_opening(args, c);
  c.rank(args.mixed_qkv, "mixed_qkv", 3, "[B, T, D]");
  c.rank(args.conv_weight, "conv_weight", 2, "[D, W]");
  c.rank(args.conv_state, "conv_state", 3, "[P, D, L]");
  if (!c.ok()) return c.status;

  // B, T from mixed_qkv; HV, K, V from the state; H from D.
  const bool kv = *args.layout == StateLayout::kKV;
  p.B = args.mixed_qkv.shape[0];
  p.T = args.mixed_qkv.shape[1];
  f.D = args.mixed_qkv.shape[2];
  p.HV = args.state.shape[1];
  p.K = args.state.shape[kv ? 2 : 3];
  p.V = args.state.shape[kv ? 3 : 2];
  c.nonneg(p.B, "mixed_qkv.shape[0] (B)");
  if (c.ok() && (p.T < 1 || p.T > 16))
    c.fail("mixed_qkv.shape[1] (T) must be in 1..16 for fused_decode, got " + std::to_string(p.T));
  if (c.ok() && !supported_dim(p.K))
    c.fail(std::string("state.shape[") + (kv ? "2" : "3") + "] (K) must be 64, 128 or 256, got " +
           std::to_string(p.K));
  if (c.ok() && !supported_dim(p.V))
    c.fail(std::string("state.shape[") + (kv ? "3" : "2") + "] (V) must be 64, 128 or 256, got " +
           std::to_string(p.V));
  if (c.ok() && p.HV < 1) c.fail("state.shape[1] (HV) must be >= 1, got " + std::to_string(p.HV));
  if (c.ok()) {
    const int64_t qk = f.D - p.HV * p.V;  // 2*H*K
    p.H = qk > 0 && qk % (2 * p.K) == 0 ? qk / (2 * p.K) : 0;
    if (p.H < 1 || p.HV % p.H != 0)
      c.fail("mixed_qkv.shape[2] (D = " + std::to_string(f.D) + ") must be 2*H*K + HV*V with HV = " +
             std::to_string(p.HV) + ", K = " + std::to_string(p.K) + ", V = " + std::to_string(p.V) +
             " (from the state) and H >= 1 dividing HV; D - HV*V = " + std::to_string(qk) + " is not");
  }
  if (!c.ok()) return c.status;

  c.float_type(args.mixed_qkv, "mixed_qkv", &f.x.dtype, true, kFloats);
  p.q.dtype = p.k.dtype = p.v.dtype = f.x.dtype;
  c.float_type(args.conv_weight, "conv_weight", &f.conv_weight.dtype, true, kFloats);
  f.W = args.conv_weight.shape[1];
  c.dim(args.conv_weight, "conv_weight", 0, f.D, "D");
  if (c.ok() && (f.W < 2 || f.W > 4))
    c.fail("conv_weight.shape[1] (W) must be in 2..4, got " + std::to_string(f.W));
  if (args.conv_bias.defined()) {
    c.rank(args.conv_bias, "conv_bias", 1, "[D]");
    c.dim(args.conv_bias, "conv_bias", 0, f.D, "D");
    c.float_type(args.conv_bias, "conv_bias", &f.conv_bias.dtype, true, kFloats);
  }
  c.dim(args.conv_state, "conv_state", 0, args.state.shape[0], "P (the state's slots)");
  c.dim(args.conv_state, "conv_state", 1, f.D, "D");
  f.L = args.conv_state.shape[2];
  if (c.ok() && (f.L < f.W - 1 || f.L > 16))
    c.fail("conv_state.shape[2] (L) must be in W - 1 = " + std::to_string(f.W - 1) + " .. 16, got " +
           std::to_string(f.L));
  c.float_type(args.conv_state, "conv_state", &f.conv_state.dtype, true, kFloats);
  if (args.conv_inter.defined()) {
    c.rank(args.conv_inter, "conv_inter", 4, "[B, T, D, L]");
    c.dim(args.conv_inter, "conv_inter", 0, p.B, "B");
    c.dim(args.conv_inter, "conv_inter", 1, p.T, "T");
    c.dim(args.conv_inter, "conv_inter", 2, f.D, "D");
    c.dim(args.conv_inter, "conv_inter", 3, f.L, "L");
    if (c.ok() && !same(args.conv_inter.dtype, args.conv_state.dtype))
      c.fail("conv_inter dtype must match the conv_state dtype " + dtype_name(args.conv_state.dtype) + ", got " +
             dtype_name(args.conv_inter.dtype));
  }
  if (args.norm_weight.defined()) {
    c.rank(args.norm_weight, "norm_weight", 1, "[V]");
    c.dim(args.norm_weight, "norm_weight", 0, p.V, "V");
    c.float_type(args.norm_weight, "norm_weight", &f.norm_weight.dtype, true, kFloats);
  }
  if (args.z.defined()) {
    if (c.ok() && !args.norm_weight.defined())
      c.fail("z needs norm_weight: the gate silu(z) is part of the gated RMSNorm");
    c.rank(args.z, "z", 4, "[B, T, HV, V]");
    c.dim(args.z, "z", 0, p.B, "B");
    c.dim(args.z, "z", 1, p.T, "T");
    c.dim(args.z, "z", 2, p.HV, "HV");
    c.dim(args.z, "z", 3, p.V, "V");
    c.float_type(args.z, "z", &f.z.dtype, true, kFloats);
  }
  if (c.ok() && !(std::isfinite(args.norm_eps) && args.norm_eps >= 0.f))
    c.fail("norm_eps must be finite and >= 0, got " + std::to_string(args.norm_eps));
  if (!c.ok()) return c.status;

  check_step(args, p, c);
  MemList conv;
  conv.add(args.mixed_qkv, "mixed_qkv", false);
  conv.add(args.conv_weight, "conv_weight", false);
  conv.add(args.conv_bias, "conv_bias", false);
  conv.add(args.conv_state, "conv_state", args.update_state);
  conv.add(args.conv_inter, "conv_inter", true);
  conv.add(args.norm_weight, "norm_weight", false);
  conv.add(args.z, "z", false);
  check_devices(args, conv, c);
  if (!c.ok()) return c.status;
  MemList mem;
  step_memory(args, mem);
  for (int i = 0; i < conv.n; ++i) mem.m[mem.n++] = conv.m[i];
  if (Status s = check_memory(mem); !s.ok()) return s;

  // The step's q, k, v name mixed_qkv's parts: [B, T, H, K] and [B, T, HV, V] views.
  const TensorView& x = args.mixed_qkv;
  const int64_t es = x.dtype.bits / 8;
  f.x.data = x.data;
  copy_strides(x, &f.x, 3);
  const auto part = [&](Ptr& dst, int64_t first, int64_t dim) {
    dst.data = static_cast<char*>(x.data) + first * x.strides[2] * es;
    dst.s[0] = x.strides[0];
    dst.s[1] = x.strides[1];
    dst.s[2] = dim * x.strides[2];
    dst.s[3] = x.strides[2];
  };
  part(p.q, 0, p.K);
  part(p.k, p.H * p.K, p.K);
  part(p.v, 2 * p.H * p.K, p.V);
  const auto take = [](const TensorView& t, Ptr& dst, int n) {
    if (!t.defined()) return;
    dst.data = t.data;
    copy_strides(t, &dst, n);
  };
  take(args.conv_weight, f.conv_weight, 2);
  take(args.conv_bias, f.conv_bias, 1);
  take(args.conv_state, f.conv_state, 3);
  take(args.conv_inter, f.conv_inter, 4);
  f.conv_inter.dtype = f.conv_state.dtype;
  take(args.norm_weight, f.norm_weight, 1);
  take(args.z, f.z, 4);
  f.norm_eps = args.norm_eps;
  *out = f;
  return Status::Ok();
}

}  // namespace gdn::detail
