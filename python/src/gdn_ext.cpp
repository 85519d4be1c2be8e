// gdn._C: the CPython side of gdn.decode, gdn.reference_decode and gdn.can_implement, and of
// gdn.fused_decode, gdn.reference_fused_decode and gdn.can_implement_fused.
//
// Every tensor argument becomes a gdn::TensorView that points into the caller's memory;
// nothing is copied, and strides are passed through as they are.
//
// Torch tensors are not read through DLPack: torch's __dlpack__ is Python code that costs
// microseconds per tensor (10 tensors would blow the per-call budget), and for CUDA
// tensors it records an event on the current stream and makes the legacy default stream
// wait on it, which is an error while a CUDA graph is being captured. gdn._C reads their
// attributes (data_ptr, shape, stride, dtype, device: ~1 us per tensor); gdn._C_torch, the
// same source built against torch's headers, reads the C++ tensor (torch_abi.cpp). Everything
// else (numpy, cupy, jax, ...) goes through nanobind's DLPack / buffer-protocol import.
//
// Each operation is described by a table (its tensor arguments in positional order, with
// the field of its gdn args struct each fills and whether the call writes it) and a traits
// struct (its extra scalars and the C++ functions it runs); the entry points are generic over
// that description. The functions are METH_FASTCALL and take every argument positionally in
// a fixed order (tensors, then the step scalars, then the operation's own scalars; the Python
// wrappers in gdn/__init__.py pass them): a keyword-argument parser would cost more than the
// rest of the call. An operation that shares the recurrence step (DecodeOp, FusedOp) is a
// table, a traits struct and its PyMethodDef entries.
//
// Argument errors raise TypeError for a wrong Python type (a list for a tensor, an int for a
// flag) and ValueError for a bad value (shapes, dtypes, strides, read-only memory), each naming
// the argument. Flags and streams are checked with exact type tests first: they are on the
// per-call path.
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "compare.h"
#include "gdn/gdn.h"
#include "gdn_reference.h"
#if defined(GDN_TORCH_ABI)
#include "torch_abi.h"
#endif

#ifndef GDN_MODULE_NAME
#define GDN_MODULE_NAME _C
#endif

namespace nb = nanobind;

namespace {

// ---------------------------------------------------------------------------------------
// Argument tables
// ---------------------------------------------------------------------------------------

// Whether a call writes a tensor, which decides how a DLPack/buffer import asks for it: a
// written one must be writable (a read-only numpy array is refused up front instead of being
// written through); one the call only reads may be read-only.
enum class Access : uint8_t {
  kRead,
  kWrite,
  kWriteIfUpdate,  // written unless update_state is false (the state pools)
};

template <class Args>
struct TensorParam {
  const char* name;
  gdn::TensorView Args::*field;
  Access access;
};

// The scalars every operation takes right after its tensors, in this order: what the
// recurrence step shares (gdn::StepArgs) plus the stream.
enum StepScalar : int {
  kLayout, kScale, kUseQkL2norm, kUpdateState, kCheckDuplicateWrites, kStream, kNumStepScalars
};

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

// Interned attribute names, created once at import.
PyObject* s_data_ptr;
PyObject* s_shape;
PyObject* s_stride;
PyObject* s_dtype;
PyObject* s_get_device;
PyObject* s_is_cpu;
PyObject* s_device;
PyObject* s_requires_grad;
PyObject* s_cuda_stream;
PyObject* s_ptr;
PyObject* s_dlpack;

nb::object steal_or_throw(PyObject* o) {
  if (o == nullptr) throw nb::python_error();
  return nb::steal(o);
}

// str(o) or repr(o) for error messages; never throws (a failing __repr__ is replaced).
std::string to_string(PyObject* o, bool repr) {
  PyObject* s = repr ? PyObject_Repr(o) : PyObject_Str(o);
  if (s == nullptr) {
    PyErr_Clear();
    return std::string("<") + Py_TYPE(o)->tp_name + ">";
  }
  const char* c = PyUnicode_AsUTF8(s);
  std::string r = c ? c : "?";
  if (c == nullptr) PyErr_Clear();
  Py_DECREF(s);
  return r;
}

// "int (1)", "str ('no')", "NoneType": the given value in a message about a scalar.
std::string describe(PyObject* o) {
  if (o == Py_None) return "None";
  std::string r = to_string(o, true);
  if (r.size() > 40) r = r.substr(0, 37) + "...";
  return std::string(Py_TYPE(o)->tp_name) + " (" + r + ")";
}

[[noreturn]] void throw_value_error(const std::string& msg) { throw nb::value_error(msg.c_str()); }
[[noreturn]] void throw_type_error(const std::string& msg) { throw nb::type_error(msg.c_str()); }

// ---------------------------------------------------------------------------------------
// torch, looked up once someone else has imported it
// ---------------------------------------------------------------------------------------

// What gdn needs from torch, looked up once torch has been imported by someone else
// (gdn never imports torch). These references are deliberately never released: releasing
// them from a static destructor would run after the interpreter has shut down.
struct TorchApi {
  bool ready = false;
  PyTypeObject* tensor_type = nullptr;
  static constexpr int kMaxDtypes = 16;
  int n_dtypes = 0;
  PyObject* dtype_obj[kMaxDtypes] = {};
  DLDataType dtype_dl[kMaxDtypes] = {};
  PyObject* is_grad_enabled = nullptr;  // torch.is_grad_enabled
  PyObject* raw_stream = nullptr;       // torch._C._cuda_getCurrentRawStream(device) -> int
  PyObject* current_stream = nullptr;   // torch.cuda.current_stream, if the above is missing
};
TorchApi g_torch;

// DLPack has no bool code before 0.8; the checks name code 6 "bool".
constexpr uint8_t kDLBoolCode = 6;

void try_init_torch() {
  PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
  if (torch == nullptr) return;
  PyObject* tensor = PyObject_GetAttrString(torch, "Tensor");
  if (tensor == nullptr || !PyType_Check(tensor)) {  // torch is half-way through its own import
    Py_XDECREF(tensor);
    PyErr_Clear();
    return;
  }
  // Dtypes the checks can name; any other torch dtype is reported by the binding under
  // torch's own name. Keep in step with dl_dtype() in torch_abi.cpp.
  static const struct {
    const char* name;
    DLDataType dt;
  } kDtypes[] = {
      {"float32", {kDLFloat, 32, 1}},    {"bfloat16", {kDLBfloat, 16, 1}},   {"float16", {kDLFloat, 16, 1}},
      {"int32", {kDLInt, 32, 1}},        {"int64", {kDLInt, 64, 1}},         {"float64", {kDLFloat, 64, 1}},
      {"int16", {kDLInt, 16, 1}},        {"int8", {kDLInt, 8, 1}},           {"uint8", {kDLUInt, 8, 1}},
      {"uint16", {kDLUInt, 16, 1}},      {"uint32", {kDLUInt, 32, 1}},       {"uint64", {kDLUInt, 64, 1}},
      {"bool", {kDLBoolCode, 8, 1}},     {"complex64", {kDLComplex, 64, 1}}, {"complex128", {kDLComplex, 128, 1}},
  };
  for (const auto& d : kDtypes) {
    PyObject* obj = PyObject_GetAttrString(torch, d.name);
    if (obj == nullptr) {
      PyErr_Clear();
      continue;
    }
    g_torch.dtype_obj[g_torch.n_dtypes] = obj;
    g_torch.dtype_dl[g_torch.n_dtypes] = d.dt;
    ++g_torch.n_dtypes;
  }
  g_torch.is_grad_enabled = PyObject_GetAttrString(torch, "is_grad_enabled");
  PyErr_Clear();
  if (PyObject* c = PyObject_GetAttrString(torch, "_C")) {
    g_torch.raw_stream = PyObject_GetAttrString(c, "_cuda_getCurrentRawStream");
    Py_DECREF(c);
  }
  PyErr_Clear();
  if (g_torch.raw_stream == nullptr) {
    if (PyObject* cuda = PyObject_GetAttrString(torch, "cuda")) {
      g_torch.current_stream = PyObject_GetAttrString(cuda, "current_stream");
      Py_DECREF(cuda);
    }
    PyErr_Clear();
  }
  g_torch.tensor_type = reinterpret_cast<PyTypeObject*>(tensor);
  g_torch.ready = true;
}

bool is_torch_tensor(PyObject* o) { return g_torch.ready && PyObject_TypeCheck(o, g_torch.tensor_type); }

#if !defined(GDN_TORCH_ABI)  // gdn._C_torch reads these from the C++ tensor (torch_abi.cpp)
std::string requires_grad_message(const char* name) {
  return std::string(name) + " requires grad, but gdn is inference-only (it has no backward): call it under "
         "torch.no_grad() or torch.inference_mode(), or pass " + name + ".detach()";
}
#endif

[[noreturn]] void throw_unsupported_torch_dtype(PyObject* o, const char* name) {
  PyObject* dt = PyObject_GetAttr(o, s_dtype);
  const std::string dname = dt ? to_string(dt, false) : "an unknown dtype";
  Py_XDECREF(dt);
  PyErr_Clear();
  throw_value_error(std::string(name) + " dtype " + dname +
                    " is not supported by gdn (it takes bfloat16, float16 or float32 data and int32 or int64 "
                    "indices)");
}

// ---------------------------------------------------------------------------------------
// Scalars
// ---------------------------------------------------------------------------------------

bool truthy(PyObject* o) {
  const int r = PyObject_IsTrue(o);
  if (r < 0) throw nb::python_error();
  return r != 0;
}

// numpy's scalar types, recognised by name so that gdn never imports numpy.
bool is_numpy_scalar(PyObject* o) {
  const char* n = Py_TYPE(o)->tp_name;
  return std::strncmp(n, "numpy.", 6) == 0 && std::strcmp(n, "numpy.ndarray") != 0;
}
bool is_numpy_bool(PyObject* o) {
  const char* n = Py_TYPE(o)->tp_name;
  return std::strcmp(n, "numpy.bool") == 0 || std::strcmp(n, "numpy.bool_") == 0;
}

// A flag is a bool (or numpy.bool_): None, 0/1 and strings such as "false" are refused
// rather than read by truthiness, which would make "no" mean yes.
bool parse_flag(PyObject* o, const char* name) {
  if (o == Py_True) return true;
  if (o == Py_False) return false;
  if (is_numpy_bool(o)) return truthy(o);
  throw_type_error(std::string(name) + " must be a bool (True or False), got " + describe(o));
}

PyObject* numbers_real() {
  static PyObject* real = [] {
    PyObject* numbers = PyImport_ImportModule("numbers");
    PyObject* r = numbers ? PyObject_GetAttrString(numbers, "Real") : nullptr;
    Py_XDECREF(numbers);
    PyErr_Clear();
    return r;  // kept for the life of the process
  }();
  return real;
}

// A real number (float, int, or a numpy/other numbers.Real scalar; not a bool), finite and
// representable as float32. None returns nullopt (the caller's default).
std::optional<float> parse_real(PyObject* o, const char* name) {
  if (o == Py_None) return std::nullopt;
  double x;
  if (PyFloat_CheckExact(o)) {
    x = PyFloat_AS_DOUBLE(o);
  } else {
    PyObject* real = numbers_real();
    const bool is_real =
        !PyBool_Check(o) && !is_numpy_bool(o) && !is_torch_tensor(o) &&
        (PyFloat_Check(o) || PyLong_Check(o) || (real != nullptr && PyObject_IsInstance(o, real) == 1));
    PyErr_Clear();
    if (!is_real) throw_type_error(std::string(name) + " must be a real number (float or int), got " + describe(o));
    x = PyFloat_AsDouble(o);
    if (x == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      throw_value_error(std::string(name) + " must be a finite float32 value, got " + describe(o));
    }
  }
  if (!std::isfinite(x) || std::fabs(x) > static_cast<double>(FLT_MAX))
    throw_value_error(std::string(name) + " must be a finite float32 value, got " + to_string(o, true));
  return static_cast<float>(x);
}

gdn::StateLayout parse_layout(PyObject* o) {
  if (PyUnicode_Check(o)) {
    if (PyUnicode_CompareWithASCIIString(o, "VK") == 0) return gdn::StateLayout::kVK;
    if (PyUnicode_CompareWithASCIIString(o, "KV") == 0) return gdn::StateLayout::kKV;
    throw_value_error("layout must be 'VK' ([P, HV, V, K], K contiguous) or 'KV' ([P, HV, K, V], V contiguous), got " +
                      to_string(o, true));
  }
  if (o == Py_None)
    throw_type_error(
        "layout is required (it has no default: the two layouts have the same shape when K == V): "
        "'VK' = [P, HV, V, K], K contiguous (FlashInfer pretranspose, FLA state_v_first), or "
        "'KV' = [P, HV, K, V], V contiguous (FLA, HF transformers, vLLM)");
  throw_type_error("layout must be a str, 'VK' or 'KV', got " + describe(o));
}

// An int handle (a cudaStream_t as an integer), or a framework stream object: torch's has
// .cuda_stream, cupy's .ptr. nullopt when None (the default stream rule applies).
std::optional<void*> parse_stream(PyObject* o) {
  if (o == Py_None) return std::nullopt;
  PyObject* handle = o;
  nb::object attr;
  if (!PyLong_CheckExact(o)) {
    if (PyBool_Check(o) || is_numpy_bool(o))
      throw_type_error("stream must be an int handle or a stream object, got " + describe(o));
    const bool int_like = PyLong_Check(o) || (is_numpy_scalar(o) && PyIndex_Check(o));
    if (!int_like) {
      const char* via = nullptr;
      for (PyObject* name : {s_cuda_stream, s_ptr}) {
        PyObject* h = PyObject_GetAttr(o, name);
        if (h != nullptr) {
          attr = nb::steal(h);
          via = name == s_cuda_stream ? "stream.cuda_stream" : "stream.ptr";
          break;
        }
        PyErr_Clear();
      }
      if (!attr.is_valid())
        throw_type_error("stream must be an int handle (a cudaStream_t), a torch.cuda.Stream (.cuda_stream) or a "
                         "cupy stream (.ptr), or None; got " + describe(o));
      if (!PyLong_Check(attr.ptr()) || PyBool_Check(attr.ptr()))
        throw_type_error(std::string(via) + " must be an int handle, got " + describe(attr.ptr()));
      handle = attr.ptr();
    }
  }
  PyObject* idx = PyNumber_Index(handle);
  if (idx == nullptr) {
    PyErr_Clear();
    throw_type_error("stream must be an int handle (a cudaStream_t), got " + describe(handle));
  }
  nb::object index = nb::steal(idx);
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  if (overflow != 0 || v < 0)
    throw_value_error("stream must be a cudaStream_t handle: a non-negative integer that fits a pointer, got " +
                      to_string(handle, true));
  return reinterpret_cast<void*>(static_cast<uintptr_t>(v));
}

// The scalars every operation shares; the stream is returned (nullopt: none given).
std::optional<void*> parse_step_scalars(PyObject* const* s, gdn::StepArgs& d) {
  d.layout = parse_layout(s[kLayout]);
  d.scale = parse_real(s[kScale], "scale");
  d.use_qk_l2norm = parse_flag(s[kUseQkL2norm], "use_qk_l2norm");
  d.update_state = parse_flag(s[kUpdateState], "update_state");
  d.check_duplicate_writes = parse_flag(s[kCheckDuplicateWrites], "check_duplicate_writes");
  return parse_stream(s[kStream]);
}

// fused_decode's norm_eps: a real number like scale, but required (the op's schema has a
// float default, not an optional), and >= 0. Checked here rather than left to the C++ checks
// so that torch.compile's fake implementation, which never reaches them, refuses it alike.
float parse_norm_eps(PyObject* o) {
  if (o == Py_None) throw_type_error("norm_eps must be a real number (float or int), got None");
  const float eps = *parse_real(o, "norm_eps");
  if (!(eps >= 0.f)) throw_value_error("norm_eps must be finite and >= 0, got " + to_string(o, true));
  return eps;
}

// ---------------------------------------------------------------------------------------
// Tensors
// ---------------------------------------------------------------------------------------

#if !defined(GDN_TORCH_ABI)
int64_t as_int64(PyObject* o) {
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  return static_cast<int64_t>(v);
}

// Fills shape or strides from a tuple (torch.Size is a tuple subclass).
int fill_dims(PyObject* tup, int64_t* out, const char* name, const char* what) {
  if (!PyTuple_Check(tup)) throw_value_error(std::string(name) + ": torch returned a non-tuple " + what);
  const Py_ssize_t n = PyTuple_GET_SIZE(tup);
  if (n > gdn::kMaxRank)
    throw_value_error(std::string(name) + " has rank " + std::to_string(n) + ", but gdn tensors have rank <= " +
                      std::to_string(gdn::kMaxRank));
  for (Py_ssize_t i = 0; i < n; ++i) out[i] = as_int64(PyTuple_GET_ITEM(tup, i));
  return static_cast<int>(n);
}
#endif

// The per-call conversion state: keeps DLPack imports alive until the call returns and
// remembers the CUDA device of torch tensors, whose current stream is the default.
template <int N>
struct Converter {
  nb::ndarray<nb::ro> in[N];
  nb::ndarray<> out[N];
  int torch_cuda_device = -1;
  int grad_enabled = -1;  // torch.is_grad_enabled(), asked at the first torch tensor
};

template <class Cv>
bool grad_enabled(Cv& cv) {
  if (cv.grad_enabled < 0) {
    if (g_torch.is_grad_enabled == nullptr) return true;
    nb::object r = steal_or_throw(PyObject_CallNoArgs(g_torch.is_grad_enabled));
    cv.grad_enabled = r.ptr() == Py_True;
  }
  return cv.grad_enabled != 0;
}

template <class Cv>
void torch_view(PyObject* o, const char* name, gdn::TensorView& v, Cv& cv) {
#if defined(GDN_TORCH_ABI)
  char err[320];
  const int r = gdn_torch_abi_view(o, name, &v, err, sizeof err);
  if (r == GDN_TORCH_ABI_UNSUPPORTED_DTYPE) throw_unsupported_torch_dtype(o, name);
  if (r != 0) throw_value_error(err);
  if (v.device.device_type == kDLCUDA && cv.torch_cuda_device < 0) cv.torch_cuda_device = v.device.device_id;
#else
  // Device first: data_ptr() of a meta or fake tensor is meaningless or raises.
  nb::object dev = steal_or_throw(PyObject_CallMethodNoArgs(o, s_get_device));
  const int64_t device = as_int64(dev.ptr());
  if (device >= 0) {
    v.device = DLDevice{kDLCUDA, static_cast<int32_t>(device)};
    if (cv.torch_cuda_device < 0) cv.torch_cuda_device = static_cast<int>(device);
  } else {
    nb::object is_cpu = steal_or_throw(PyObject_GetAttr(o, s_is_cpu));
    if (is_cpu.ptr() != Py_True) {
      nb::object d = steal_or_throw(PyObject_GetAttr(o, s_device));
      throw_value_error(std::string(name) + " must be on the CPU or a CUDA device, got torch device '" +
                        to_string(d.ptr(), false) + "'");
    }
    v.device = DLDevice{kDLCPU, 0};
  }

  nb::object dt = steal_or_throw(PyObject_GetAttr(o, s_dtype));
  int i = 0;
  while (i < g_torch.n_dtypes && g_torch.dtype_obj[i] != dt.ptr()) ++i;
  if (i == g_torch.n_dtypes) throw_unsupported_torch_dtype(o, name);
  v.dtype = g_torch.dtype_dl[i];

  // Grad mode is asked once per call, so that serving code (no_grad, inference_mode) pays
  // nothing per tensor for the inference-only check.
  if (grad_enabled(cv)) {
    nb::object rg = steal_or_throw(PyObject_GetAttr(o, s_requires_grad));
    if (rg.ptr() == Py_True) throw_value_error(requires_grad_message(name));
  }

  nb::object ptr = steal_or_throw(PyObject_CallMethodNoArgs(o, s_data_ptr));
  v.data = PyLong_AsVoidPtr(ptr.ptr());
  if (v.data == nullptr && PyErr_Occurred()) throw nb::python_error();

  nb::object shape = steal_or_throw(PyObject_GetAttr(o, s_shape));
  nb::object strides = steal_or_throw(PyObject_CallMethodNoArgs(o, s_stride));
  v.ndim = fill_dims(shape.ptr(), v.shape, name, "shape");
  if (fill_dims(strides.ptr(), v.strides, name, "stride") != v.ndim)
    throw_value_error(std::string(name) + ": torch returned strides of a different rank than the shape");
  if (v.ndim == 0) throw_value_error(std::string(name) + " must have rank >= 1, got a 0-d tensor");
#endif
}

template <typename Array>
void fill_from_ndarray(const Array& a, gdn::TensorView& v, const char* name) {
  const size_t ndim = a.ndim();
  if (ndim == 0) throw_value_error(std::string(name) + " must have rank >= 1, got a 0-d array");
  if (ndim > static_cast<size_t>(gdn::kMaxRank))
    throw_value_error(std::string(name) + " has rank " + std::to_string(ndim) + ", but gdn tensors have rank <= " +
                      std::to_string(gdn::kMaxRank));
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  const auto dt = a.dtype();
  v.dtype = DLDataType{dt.code, dt.bits, dt.lanes};
  v.device = DLDevice{static_cast<DLDeviceType>(a.device_type()), a.device_id()};
  v.ndim = static_cast<int>(ndim);
  for (size_t d = 0; d < ndim; ++d) {
    v.shape[d] = static_cast<int64_t>(a.shape(d));
    v.strides[d] = a.stride(d);
  }
}

// numpy arrays of ml_dtypes.bfloat16 export neither DLPack nor a buffer format nanobind
// knows; they are imported as their uint16 bit patterns and relabelled. Returns the view
// object to import instead, or null when `o` is not such an array.
nb::object bfloat16_bits(PyObject* o) {
  PyObject* dt = PyObject_GetAttr(o, s_dtype);
  if (dt == nullptr) {
    PyErr_Clear();
    return {};
  }
  nb::object dtype = nb::steal(dt);
  PyObject* nm = PyObject_GetAttrString(dtype.ptr(), "name");
  if (nm == nullptr) {
    PyErr_Clear();
    return {};
  }
  nb::object name = nb::steal(nm);
  if (!PyUnicode_Check(name.ptr()) || PyUnicode_CompareWithASCIIString(name.ptr(), "bfloat16") != 0) return {};
  PyObject* view = PyObject_CallMethod(o, "view", "s", "uint16");
  if (view == nullptr) {
    PyErr_Clear();
    return {};
  }
  return nb::steal(view);
}

// Why an object could not be imported: an array of a dtype nanobind cannot represent
// (numpy object, datetime64, longdouble, strings) is a bad value; anything else a bad type.
[[noreturn]] void throw_not_a_tensor(PyObject* o, const char* name, bool written) {
  PyObject* dt = PyObject_GetAttr(o, s_dtype);
  const bool array_like = dt != nullptr && (PyObject_CheckBuffer(o) || PyObject_HasAttr(o, s_dlpack));
  PyErr_Clear();
  if (array_like) {
    const std::string dname = to_string(dt, false);
    Py_DECREF(dt);
    throw_value_error(std::string(name) + " dtype " + dname +
                      " is not supported by gdn (it takes bfloat16, float16 or float32 data and int32 or int64 "
                      "indices)");
  }
  Py_XDECREF(dt);
  // A seed given as a Python int is refused with the form to use instead: the value must live
  // in device memory so that a captured CUDA graph reads it at replay (an int would be baked
  // into the graph, or cost a host-to-device copy per call), and the caller advances it there.
  if (std::strcmp(name, "rounding_seed") == 0 && PyLong_Check(o) && !PyBool_Check(o))
    throw_type_error("rounding_seed must be an int64 tensor of shape [1] on the state's device, got int (" +
                     to_string(o, true) + "): e.g. torch.tensor([" + to_string(o, true) +
                     "], device=state.device), advanced in place between steps (seed += 1), which a CUDA graph "
                     "can capture");
  throw_type_error(std::string(name) + " must be a " + (written ? "writable " : "") +
                   "tensor that supports DLPack or the buffer protocol (torch, numpy, cupy, jax, ...), got " +
                   (o == Py_None ? std::string("None") : std::string(Py_TYPE(o)->tp_name)));
}

template <class Cv>
void to_view(PyObject* o, int idx, const char* name, Access access, bool written, gdn::TensorView& v, Cv& cv) {
  if (o == Py_None) return;  // absent; the checks say whether it was required
  if (is_torch_tensor(o)) return torch_view(o, name, v, cv);
  bool ok = written ? nb::try_cast(nb::handle(o), cv.out[idx], false) : nb::try_cast(nb::handle(o), cv.in[idx], false);
  bool bf16 = false;
  if (!ok) {
    PyErr_Clear();
    if (nb::object bits = bfloat16_bits(o); bits.is_valid()) {
      ok = written ? nb::try_cast(bits, cv.out[idx], false) : nb::try_cast(bits, cv.in[idx], false);
      bf16 = ok;
    }
  }
  if (!ok) {
    PyErr_Clear();
    if (written && nb::try_cast(nb::handle(o), cv.in[idx], false))
      throw_value_error(std::string(name) + " is read-only, but gdn writes it in place" +
                        (access == Access::kWriteIfUpdate ? " (pass update_state=False to only read it)" : ""));
    PyErr_Clear();
    throw_not_a_tensor(o, name, written);
  }
  if (written) fill_from_ndarray(cv.out[idx], v, name);
  else fill_from_ndarray(cv.in[idx], v, name);
  if (bf16) v.dtype = gdn::kBFloat16;
}

bool is_written(Access a, bool update_state) {
  return a == Access::kWrite || (a == Access::kWriteIfUpdate && update_state);
}

// ---------------------------------------------------------------------------------------
// The operations
// ---------------------------------------------------------------------------------------

// The tensors of the recurrence step (gdn::StepArgs), in their positional order; every
// operation lists them after its own.
template <class Args>
constexpr std::array<TensorParam<Args>, 15> step_tensors() {
  return {{
      {"state", &Args::state, Access::kWriteIfUpdate},
      {"o", &Args::o, Access::kWrite},
      {"a", &Args::a, Access::kRead},
      {"b", &Args::b, Access::kRead},
      {"A_log", &Args::A_log, Access::kRead},
      {"dt_bias", &Args::dt_bias, Access::kRead},
      {"g", &Args::g, Access::kRead},
      {"beta", &Args::beta, Access::kRead},
      {"read_slots", &Args::read_slots, Access::kRead},
      {"write_slots", &Args::write_slots, Access::kRead},
      {"token_slots", &Args::token_slots, Access::kRead},
      {"num_accepted", &Args::num_accepted, Access::kRead},
      {"inter", &Args::inter, Access::kWrite},
      {"error_count", &Args::error_count, Access::kWrite},
      {"rounding_seed", &Args::rounding_seed, Access::kRead},
  }};
}

template <class T, size_t N, size_t M>
constexpr std::array<T, N + M> concat(const std::array<T, N>& x, const std::array<T, M>& y) {
  std::array<T, N + M> r{};
  for (size_t i = 0; i < N; ++i) r[i] = x[i];
  for (size_t i = 0; i < M; ++i) r[N + i] = y[i];
  return r;
}

// gdn.decode: q, k, v, then the step's tensors; no scalars of its own.
struct DecodeOp {
  using Args = gdn::DecodeArgs;
  static constexpr auto kTensors = concat(std::array<TensorParam<Args>, 3>{{
                                              {"q", &Args::q, Access::kRead},
                                              {"k", &Args::k, Access::kRead},
                                              {"v", &Args::v, Access::kRead},
                                          }},
                                          step_tensors<Args>());
  static constexpr int kNumTensors = static_cast<int>(kTensors.size());
  static constexpr int kNumExtraScalars = 0;
  static void parse_extra(PyObject* const*, Args&) {}
  static gdn::Status check(const Args& a) { return gdn::can_implement(a); }
  static gdn::Status run(const Args& a, void* stream) { return gdn::decode(a, stream); }
  static gdn::Status reference(const Args& a) { return gdn::reference::decode(a); }
};

// gdn.fused_decode: the conv inputs, the conv pool and caches, the norm's tensors, then the
// step's tensors; one scalar of its own, norm_eps, after the step scalars.
struct FusedOp {
  using Args = gdn::FusedDecodeArgs;
  static constexpr auto kTensors = concat(std::array<TensorParam<Args>, 7>{{
                                              {"mixed_qkv", &Args::mixed_qkv, Access::kRead},
                                              {"conv_weight", &Args::conv_weight, Access::kRead},
                                              {"conv_state", &Args::conv_state, Access::kWriteIfUpdate},
                                              {"conv_bias", &Args::conv_bias, Access::kRead},
                                              {"conv_inter", &Args::conv_inter, Access::kWrite},
                                              {"norm_weight", &Args::norm_weight, Access::kRead},
                                              {"z", &Args::z, Access::kRead},
                                          }},
                                          step_tensors<Args>());
  static constexpr int kNumTensors = static_cast<int>(kTensors.size());
  static constexpr int kNumExtraScalars = 1;
  static void parse_extra(PyObject* const* s, Args& d) { d.norm_eps = parse_norm_eps(s[0]); }
  static gdn::Status check(const Args& a) { return gdn::can_implement(a); }
  static gdn::Status run(const Args& a, void* stream) { return gdn::fused_decode(a, stream); }
  static gdn::Status reference(const Args& a) { return gdn::reference::fused_decode(a); }
};

// An operation is added as a traits struct like DecodeOp (its own tensors concatenated with
// step_tensors(), its own scalars parsed in parse_extra, its C++ functions) and three
// PyMethodDef entries below. The C++ memory checks hold up to 24 tensors of one call.
static_assert(DecodeOp::kNumTensors <= 24);
static_assert(FusedOp::kNumTensors <= 24);

// ---------------------------------------------------------------------------------------
// Entry points, generic over the operation
// ---------------------------------------------------------------------------------------

enum class Mode { kRun, kReference, kCheck };

// torch's current stream on the tensors' device: what torch itself would launch on, and
// the capturing stream inside torch.cuda.graph.
void* torch_current_stream(int device) {
  nb::object dev = steal_or_throw(PyLong_FromLong(device));
  void* stream = nullptr;
  if (g_torch.raw_stream != nullptr) {
    nb::object s = steal_or_throw(PyObject_CallOneArg(g_torch.raw_stream, dev.ptr()));
    stream = PyLong_AsVoidPtr(s.ptr());
  } else if (g_torch.current_stream != nullptr) {
    nb::object st = steal_or_throw(PyObject_CallOneArg(g_torch.current_stream, dev.ptr()));
    nb::object s = steal_or_throw(PyObject_GetAttr(st.ptr(), s_cuda_stream));
    stream = PyLong_AsVoidPtr(s.ptr());
  }
  if (stream == nullptr && PyErr_Occurred()) throw nb::python_error();
  return stream;
}

template <class Op>
constexpr int num_args() {
  return Op::kNumTensors + kNumStepScalars + Op::kNumExtraScalars;
}

template <class Op>
gdn::Status run(Mode mode, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != num_args<Op>())
    throw_type_error("gdn._C expects " + std::to_string(num_args<Op>()) + " positional arguments, got " +
                     std::to_string(nargs));
  if (!g_torch.ready) try_init_torch();

  typename Op::Args d;
  // Scalars first: whether the state is written (update_state) decides how it is imported.
  PyObject* const* scalars = args + Op::kNumTensors;
  const std::optional<void*> given_stream = parse_step_scalars(scalars, d);
  Op::parse_extra(scalars + kNumStepScalars, d);

  Converter<Op::kNumTensors> cv;
  for (int i = 0; i < Op::kNumTensors; ++i) {
    const TensorParam<typename Op::Args>& p = Op::kTensors[i];
    to_view(args[i], i, p.name, p.access, is_written(p.access, d.update_state), d.*(p.field), cv);
  }

  if (mode == Mode::kCheck) return Op::check(d);
  if (mode == Mode::kReference) {
    nb::gil_scoped_release nogil;
    return Op::reference(d);
  }
  void* stream = nullptr;
  if (given_stream.has_value()) stream = *given_stream;
  else if (cv.torch_cuda_device >= 0 && d.state.device.device_type == kDLCUDA)
    stream = torch_current_stream(cv.torch_cuda_device);
  if (d.state.device.device_type == kDLCPU) {
    // The CPU backend runs to completion on its own threads; let other Python threads run.
    nb::gil_scoped_release nogil;
    return Op::run(d, stream);
  }
  return Op::run(d, stream);
}

// Maps a failed Status to the Python exception the docs promise.
PyObject* raise_status(const gdn::Status& s) {
  PyObject* type = s.code() == gdn::StatusCode::kCudaError ? PyExc_RuntimeError : PyExc_ValueError;
  PyErr_SetString(type, s.message().empty() ? "gdn: unknown error" : s.message().c_str());
  return nullptr;
}

template <class Op, Mode mode>
PyObject* entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    const gdn::Status s = run<Op>(mode, args, nargs);
    if (mode == Mode::kCheck) {
      if (s.ok()) Py_RETURN_NONE;
      return Py_BuildValue("(is)", static_cast<int>(s.code()), s.message().c_str());
    }
    if (!s.ok()) return raise_status(s);
    Py_RETURN_NONE;
  } catch (nb::python_error& e) {
    e.restore();
  } catch (nb::builtin_exception& e) {
    const char* what = e.what();
    PyErr_SetString(e.type() == nb::exception_type::value_error ? PyExc_ValueError : PyExc_TypeError, what);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// An operation's scalars alone (layout, scale, the flags, stream, then its own), for
// torch.compile's fake implementations of the ops: the graph is traced without data, but a bad
// scalar should fail there with the message an eager call gives.
template <class Op>
PyObject* check_scalars(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    constexpr int n = kNumStepScalars + Op::kNumExtraScalars;
    if (nargs != n) throw_type_error("gdn._C: the scalar check expects " + std::to_string(n) + " arguments");
    if (!g_torch.ready) try_init_torch();
    typename Op::Args d;
    parse_step_scalars(args, d);
    Op::parse_extra(args + kNumStepScalars, d);
    Py_RETURN_NONE;
  } catch (nb::python_error& e) {
    e.restore();
  } catch (nb::builtin_exception& e) {
    PyErr_SetString(e.type() == nb::exception_type::value_error ? PyExc_ValueError : PyExc_TypeError, e.what());
  }
  return nullptr;
}

template <class Op, Mode mode>
PyCFunction fastcall() {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&entry<Op, mode>));
}

PyMethodDef kMethods[] = {
    {"decode", fastcall<DecodeOp, Mode::kRun>(), METH_FASTCALL,
     "decode(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots, token_slots, "
     "num_accepted, inter, error_count, rounding_seed, layout, scale, use_qk_l2norm, update_state, "
     "check_duplicate_writes, stream) -> None: raw binding of gdn::decode; use gdn.decode."},
    {"reference_decode", fastcall<DecodeOp, Mode::kReference>(), METH_FASTCALL,
     "Same arguments as decode; runs the float64 oracle (host tensors only). Use gdn.reference_decode."},
    {"can_implement", fastcall<DecodeOp, Mode::kCheck>(), METH_FASTCALL,
     "Same arguments as decode; returns None when the call is valid, else (status code, message)."},
    {"fused_decode", fastcall<FusedOp, Mode::kRun>(), METH_FASTCALL,
     "fused_decode(mixed_qkv, conv_weight, conv_state, conv_bias, conv_inter, norm_weight, z, state, o, a, b, "
     "A_log, dt_bias, g, beta, read_slots, write_slots, token_slots, num_accepted, inter, error_count, rounding_seed, "
     "layout, scale, use_qk_l2norm, update_state, check_duplicate_writes, stream, norm_eps) -> None: raw binding of "
     "gdn::fused_decode; use gdn.fused_decode."},
    {"reference_fused_decode", fastcall<FusedOp, Mode::kReference>(), METH_FASTCALL,
     "Same arguments as fused_decode; runs the float64 oracle (host tensors only). Use gdn.reference_fused_decode."},
    {"can_implement_fused", fastcall<FusedOp, Mode::kCheck>(), METH_FASTCALL,
     "Same arguments as fused_decode; returns None when the call is valid, else (status code, message)."},
    {"_check_step_scalars",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&check_scalars<DecodeOp>)), METH_FASTCALL,
     "_check_step_scalars(layout, scale, use_qk_l2norm, update_state, check_duplicate_writes, stream) -> None: "
     "raises as decode would for a bad scalar."},
    {"_check_fused_scalars",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&check_scalars<FusedOp>)), METH_FASTCALL,
     "_check_fused_scalars(layout, scale, use_qk_l2norm, update_state, check_duplicate_writes, stream, norm_eps) "
     "-> None: raises as fused_decode would for a bad scalar."},
    {nullptr, nullptr, 0, nullptr}};

// Testing helper: reference::compare_vectors, the one implementation of the tolerance rule
// of docs/semantics.md section 5, on host arrays (float32, float16, or uint16 holding bf16
// bits), read as contiguous vectors of `len` elements.
using HostArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;
nb::dict agreement(const HostArray& got, const HostArray& want, int64_t len, bool many_steps) {
  const auto storage_of = [](const HostArray& a) -> DLDataType {
    const nb::dlpack::dtype t = a.dtype();
    if (t.lanes == 1 && t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && (t.bits == 32 || t.bits == 16))
      return t.bits == 32 ? gdn::kFloat32 : gdn::kFloat16;
    if (t.lanes == 1 && t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt) && t.bits == 16)
      return gdn::kBFloat16;  // bf16 bit patterns
    throw nb::type_error("_agreement: arrays must be float32, float16, or uint16 holding bfloat16 bits");
  };
  const DLDataType storage = storage_of(got);
  const DLDataType w = storage_of(want);
  if (w.code != storage.code || w.bits != storage.bits || got.size() != want.size())
    throw nb::value_error("_agreement: got and want differ in dtype or size");
  if (len <= 0 || got.size() % static_cast<size_t>(len) != 0)
    throw nb::value_error("_agreement: len must divide the number of elements");
  gdn::reference::Agreement a;
  gdn::reference::compare_vectors(got.data(), want.data(), storage, static_cast<int64_t>(got.size()) / len, len, &a,
                                  many_steps);
  nb::dict r;
  r["ok"] = a.ok();
  const std::string summary = a.summary(), worst = a.worst_summary();
  r["summary"] = nb::str(summary.c_str(), summary.size());
  r["worst_summary"] = nb::str(worst.c_str(), worst.size());
  r["elements"] = a.elements;
  r["vectors"] = a.vectors;
  r["nan"] = a.nan;
  r["over_1ulp"] = a.over_1ulp;
  r["over_2ulp"] = a.over_2ulp;
  r["strict_over_2ulp"] = a.strict_over_2ulp;
  r["max_rel_frob"] = a.max_rel_frob;
  r["zero_mismatch"] = a.zero_mismatch;
  r["failing_vectors"] = a.failing_vectors;
  r["tensor_rms"] = a.tensor_rms;
  r["vector_floor"] = a.vector_floor;
  r["worst_vector"] = a.worst.vector;
  r["worst_element"] = a.worst.element;
  r["worst_got"] = a.worst.got;
  r["worst_want"] = a.worst.want;
  r["worst_error"] = a.worst.error;
  return r;
}

}  // namespace

// NB_MODULE pastes its argument; the indirection expands GDN_MODULE_NAME first.
#define GDN_NB_MODULE(name, m) NB_MODULE(name, m)
GDN_NB_MODULE(GDN_MODULE_NAME, m) {
  s_data_ptr = PyUnicode_InternFromString("data_ptr");
  s_shape = PyUnicode_InternFromString("shape");
  s_stride = PyUnicode_InternFromString("stride");
  s_dtype = PyUnicode_InternFromString("dtype");
  s_get_device = PyUnicode_InternFromString("get_device");
  s_is_cpu = PyUnicode_InternFromString("is_cpu");
  s_device = PyUnicode_InternFromString("device");
  s_requires_grad = PyUnicode_InternFromString("requires_grad");
  s_cuda_stream = PyUnicode_InternFromString("cuda_stream");
  s_ptr = PyUnicode_InternFromString("ptr");
  s_dlpack = PyUnicode_InternFromString("__dlpack__");
  if (PyModule_AddFunctions(m.ptr(), kMethods) != 0) throw nb::python_error();
  m.def("cuda_available", &gdn::cuda_available, "True when this build has the CUDA backend compiled in.");
  m.def("_agreement", &agreement, nb::arg("got"), nb::arg("want"), nb::arg("len"), nb::arg("many_steps") = false,
        "Testing helper: judges got against want (the oracle's) by docs/semantics.md section 5 as "
        "contiguous vectors of len elements; float32, float16 or uint16 (bf16 bits) host arrays. "
        "Returns a dict of the counts, 'ok' and the worst element.");
  m.attr("NUM_ARGS") = num_args<DecodeOp>();
  m.attr("FUSED_NUM_ARGS") = num_args<FusedOp>();
#if defined(GDN_TORCH_ABI)
  m.attr("TORCH_VERSION") = GDN_TORCH_VERSION;  // the torch whose headers this was built with
#endif
  m.attr("STATUS_INVALID_ARGUMENT") = static_cast<int>(gdn::StatusCode::kInvalidArgument);
  m.attr("STATUS_NOT_SUPPORTED") = static_cast<int>(gdn::StatusCode::kNotSupported);
  m.attr("STATUS_CUDA_ERROR") = static_cast<int>(gdn::StatusCode::kCudaError);
}
