// gdn._C: the CPython side of gdn.decode, gdn.reference_decode and gdn.can_implement.
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
// The three entry points are METH_FASTCALL functions taking 23 positional arguments in a
// fixed order (see kArgNames and the Python wrapper in gdn/__init__.py): a generic
// keyword-argument dispatcher would cost more than the rest of the call.
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
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

// Tensor arguments, in the positional order of the _C functions.
enum TensorArg : int {
  kQ, kK, kV, kState, kO, kA, kB, kALog, kDtBias, kG, kBeta,
  kReadSlots, kWriteSlots, kTokenSlots, kNumAccepted, kInter, kErrorCount,
  kNumTensors
};
const char* const kArgNames[kNumTensors] = {
    "q", "k", "v", "state", "o", "a", "b", "A_log", "dt_bias", "g", "beta",
    "read_slots", "write_slots", "token_slots", "num_accepted", "inter", "error_count"};
// Arguments gdn writes: imported as writable so a read-only numpy array is refused
// up front instead of being written through.
constexpr bool kWritten[kNumTensors] = {false, false, false, true,  true,  false,
                                        false, false, false, false, false, false,
                                        false, false, false, true,  true};
// Scalars that follow the tensors.
enum ScalarArg : int {
  kLayout = kNumTensors, kScale, kUseQkL2norm, kUpdateState, kCheckDuplicateWrites, kStream,
  kNumArgs
};

// Interned attribute names, created once at import.
PyObject* s_data_ptr;
PyObject* s_shape;
PyObject* s_stride;
PyObject* s_dtype;
PyObject* s_get_device;
PyObject* s_is_cpu;
PyObject* s_device;

// What gdn needs from torch, looked up once torch has been imported by someone else
// (gdn never imports torch). These references are deliberately never released: releasing
// them from a static destructor would run after the interpreter has shut down.
struct TorchApi {
  bool ready = false;
  PyTypeObject* tensor_type = nullptr;
  static constexpr int kMaxDtypes = 12;
  int n_dtypes = 0;
  PyObject* dtype_obj[kMaxDtypes] = {};
  DLDataType dtype_dl[kMaxDtypes] = {};
  PyObject* raw_stream = nullptr;      // torch._C._cuda_getCurrentRawStream(device) -> int
  PyObject* current_stream = nullptr;  // torch.cuda.current_stream, if the above is missing
};
TorchApi g_torch;

void try_init_torch() {
  PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
  if (torch == nullptr) return;
  PyObject* tensor = PyObject_GetAttrString(torch, "Tensor");
  if (tensor == nullptr || !PyType_Check(tensor)) {  // torch is half-way through its own import
    Py_XDECREF(tensor);
    PyErr_Clear();
    return;
  }
  static const struct {
    const char* name;
    DLDataType dt;
  } kDtypes[] = {
      {"float32", {kDLFloat, 32, 1}}, {"bfloat16", {kDLBfloat, 16, 1}},
      {"float16", {kDLFloat, 16, 1}}, {"int32", {kDLInt, 32, 1}},
      {"int64", {kDLInt, 64, 1}},     {"float64", {kDLFloat, 64, 1}},
      {"int16", {kDLInt, 16, 1}},     {"int8", {kDLInt, 8, 1}},
      {"uint8", {kDLUInt, 8, 1}},     {"bool", {6 /* kDLBool in DLPack >= 0.8 */, 8, 1}},
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

nb::object steal_or_throw(PyObject* o) {
  if (o == nullptr) throw nb::python_error();
  return nb::steal(o);
}

// str(o) or repr(o) for error messages.
std::string to_string(PyObject* o, bool repr) {
  nb::object s = steal_or_throw(repr ? PyObject_Repr(o) : PyObject_Str(o));
  const char* c = PyUnicode_AsUTF8(s.ptr());
  if (c == nullptr) throw nb::python_error();
  return c;
}

[[noreturn]] void throw_value_error(const std::string& msg) { throw nb::value_error(msg.c_str()); }

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

// The per-call conversion state: keeps DLPack imports alive until the call returns and
// remembers the CUDA device of torch tensors, whose current stream is the default.
struct Converter {
  nb::ndarray<nb::ro> in[kNumTensors];
  nb::ndarray<> out[kNumTensors];
  int torch_cuda_device = -1;
};

void torch_view(PyObject* o, int idx, gdn::TensorView& v, Converter& cv) {
  const char* name = kArgNames[idx];
#if defined(GDN_TORCH_ABI)
  char err[256];
  if (gdn_torch_abi_view(o, name, &v, err, sizeof err) != 0) throw_value_error(err);
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

  nb::object ptr = steal_or_throw(PyObject_CallMethodNoArgs(o, s_data_ptr));
  v.data = PyLong_AsVoidPtr(ptr.ptr());
  if (v.data == nullptr && PyErr_Occurred()) throw nb::python_error();

  nb::object dt = steal_or_throw(PyObject_GetAttr(o, s_dtype));
  int i = 0;
  while (i < g_torch.n_dtypes && g_torch.dtype_obj[i] != dt.ptr()) ++i;
  // An unlisted dtype gets an opaque code, which the checks report by name.
  v.dtype = i < g_torch.n_dtypes ? g_torch.dtype_dl[i] : DLDataType{kDLOpaqueHandle, 0, 1};

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

void to_view(PyObject* o, int idx, gdn::TensorView& v, Converter& cv) {
  if (o == Py_None) return;  // absent
  if (g_torch.ready && PyObject_TypeCheck(o, g_torch.tensor_type)) return torch_view(o, idx, v, cv);
  const char* name = kArgNames[idx];
  bool ok = kWritten[idx] ? nb::try_cast(nb::handle(o), cv.out[idx], false)
                          : nb::try_cast(nb::handle(o), cv.in[idx], false);
  bool bf16 = false;
  if (!ok) {
    PyErr_Clear();
    if (nb::object bits = bfloat16_bits(o); bits.is_valid()) {
      ok = kWritten[idx] ? nb::try_cast(bits, cv.out[idx], false) : nb::try_cast(bits, cv.in[idx], false);
      bf16 = ok;
    }
  }
  if (!ok) {
    PyErr_Clear();
    if (kWritten[idx] && nb::try_cast(nb::handle(o), cv.in[idx], false))
      throw_value_error(std::string(name) + " is read-only, but gdn writes it in place");
    PyErr_Clear();
    throw_value_error(std::string(name) + " must be a " + (kWritten[idx] ? "writable " : "") +
                      "tensor that supports DLPack or the buffer protocol (torch, numpy, cupy, jax, ...), got " +
                      Py_TYPE(o)->tp_name);
  }
  if (kWritten[idx]) fill_from_ndarray(cv.out[idx], v, name);
  else fill_from_ndarray(cv.in[idx], v, name);
  if (bf16) v.dtype = gdn::kBFloat16;
}

enum class Mode { kRun, kReference, kCheck };

bool truthy(PyObject* o) {
  const int r = PyObject_IsTrue(o);
  if (r < 0) throw nb::python_error();
  return r != 0;
}

gdn::Status run(Mode mode, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != kNumArgs)
    throw nb::type_error(("gdn._C expects " + std::to_string(kNumArgs) + " positional arguments, got " +
                          std::to_string(nargs))
                             .c_str());
  if (!g_torch.ready) try_init_torch();

  Converter cv;
  gdn::DecodeArgs d;
  gdn::TensorView* views[kNumTensors] = {
      &d.q, &d.k, &d.v, &d.state, &d.o, &d.a, &d.b, &d.A_log, &d.dt_bias, &d.g, &d.beta,
      &d.read_slots, &d.write_slots, &d.token_slots, &d.num_accepted, &d.inter, &d.error_count};
  for (int i = 0; i < kNumTensors; ++i) to_view(args[i], i, *views[i], cv);

  PyObject* layout = args[kLayout];
  if (PyUnicode_Check(layout) && PyUnicode_CompareWithASCIIString(layout, "VK") == 0) {
    d.layout = gdn::StateLayout::kVK;
  } else if (PyUnicode_Check(layout) && PyUnicode_CompareWithASCIIString(layout, "KV") == 0) {
    d.layout = gdn::StateLayout::kKV;
  } else {
    throw_value_error("layout must be 'VK' ([P, HV, V, K], K contiguous) or 'KV' ([P, HV, K, V], V contiguous), got " +
                      to_string(layout, true));
  }
  if (args[kScale] != Py_None) {
    const double s = PyFloat_AsDouble(args[kScale]);
    if (s == -1.0 && PyErr_Occurred()) throw nb::python_error();
    d.scale = static_cast<float>(s);
  }
  d.use_qk_l2norm = truthy(args[kUseQkL2norm]);
  d.update_state = truthy(args[kUpdateState]);
  d.check_duplicate_writes = truthy(args[kCheckDuplicateWrites]);

  if (mode == Mode::kCheck) return gdn::can_implement(d);
  if (mode == Mode::kReference) {
    nb::gil_scoped_release nogil;
    return gdn::reference::decode(d);
  }

  void* stream = nullptr;
  if (args[kStream] != Py_None) {
    stream = PyLong_AsVoidPtr(args[kStream]);
    if (stream == nullptr && PyErr_Occurred()) throw nb::python_error();
  } else if (cv.torch_cuda_device >= 0 && d.state.device.device_type == kDLCUDA) {
    // torch's current stream on the tensors' device: what torch itself would launch on,
    // and the capturing stream inside torch.cuda.graph.
    nb::object dev = steal_or_throw(PyLong_FromLong(cv.torch_cuda_device));
    if (g_torch.raw_stream != nullptr) {
      nb::object s = steal_or_throw(PyObject_CallOneArg(g_torch.raw_stream, dev.ptr()));
      stream = PyLong_AsVoidPtr(s.ptr());
    } else if (g_torch.current_stream != nullptr) {
      nb::object st = steal_or_throw(PyObject_CallOneArg(g_torch.current_stream, dev.ptr()));
      nb::object s = steal_or_throw(PyObject_GetAttrString(st.ptr(), "cuda_stream"));
      stream = PyLong_AsVoidPtr(s.ptr());
    }
    if (stream == nullptr && PyErr_Occurred()) throw nb::python_error();
  }
  if (d.state.device.device_type == kDLCPU) {
    // The CPU backend runs to completion on its own threads; let other Python threads run.
    nb::gil_scoped_release nogil;
    return gdn::decode(d, stream);
  }
  return gdn::decode(d, stream);
}

// Maps a failed Status to the Python exception the docs promise.
PyObject* raise_status(const gdn::Status& s) {
  PyObject* type = s.code() == gdn::StatusCode::kCudaError ? PyExc_RuntimeError : PyExc_ValueError;
  PyErr_SetString(type, s.message().empty() ? "gdn: unknown error" : s.message().c_str());
  return nullptr;
}

template <Mode mode>
PyObject* entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    const gdn::Status s = run(mode, args, nargs);
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

PyMethodDef kMethods[] = {
    {"decode", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&entry<Mode::kRun>)), METH_FASTCALL,
     "decode(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots, token_slots, "
     "num_accepted, inter, error_count, layout, scale, use_qk_l2norm, update_state, check_duplicate_writes, "
     "stream) -> None: raw binding of gdn::decode; use gdn.decode."},
    {"reference_decode",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&entry<Mode::kReference>)), METH_FASTCALL,
     "Same arguments as decode; runs the float64 oracle (host tensors only). Use gdn.reference_decode."},
    {"can_implement", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&entry<Mode::kCheck>)),
     METH_FASTCALL,
     "Same arguments as decode; returns None when the call is valid, else (status code, message)."},
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
  if (PyModule_AddFunctions(m.ptr(), kMethods) != 0) throw nb::python_error();
  m.def("cuda_available", &gdn::cuda_available, "True when this build has the CUDA backend compiled in.");
  m.def("_agreement", &agreement, nb::arg("got"), nb::arg("want"), nb::arg("len"), nb::arg("many_steps") = false,
        "Testing helper: judges got against want (the oracle's) by docs/semantics.md section 5 as "
        "contiguous vectors of len elements; float32, float16 or uint16 (bf16 bits) host arrays. "
        "Returns a dict of the counts, 'ok' and the worst element.");
  m.attr("NUM_ARGS") = static_cast<int>(kNumArgs);
#if defined(GDN_TORCH_ABI)
  m.attr("TORCH_VERSION") = GDN_TORCH_VERSION;  // the torch whose headers this was built with
#endif
  m.attr("STATUS_INVALID_ARGUMENT") = static_cast<int>(gdn::StatusCode::kInvalidArgument);
  m.attr("STATUS_NOT_SUPPORTED") = static_cast<int>(gdn::StatusCode::kNotSupported);
  m.attr("STATUS_CUDA_ERROR") = static_cast<int>(gdn::StatusCode::kCudaError);
}
