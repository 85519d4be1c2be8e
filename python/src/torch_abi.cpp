// Reads a torch.Tensor's pointer, dtype, device, sizes and strides straight from its C++
// at::Tensor: a few loads instead of five Python calls, which is most of the per-call
// overhead budget for ten tensors. Compiled only into gdn._C_torch, against the headers of
// the torch found at build time (gdn._torch refuses the module under any other torch
// version, whose THPVariable layout may differ).
//
// This translation unit sees torch's headers (and their pybind11) but not nanobind, and
// is compiled with torch's _GLIBCXX_USE_CXX11_ABI; only C types cross into gdn_ext.cpp.
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdio>
#include <exception>

#include "torch_abi.h"

namespace {

// The dtypes gdn's checks can name; keep in step with try_init_torch() in gdn_ext.cpp.
bool dl_dtype(c10::ScalarType s, DLDataType* out) {
  switch (s) {
    case c10::ScalarType::Float: *out = {kDLFloat, 32, 1}; return true;
    case c10::ScalarType::BFloat16: *out = {kDLBfloat, 16, 1}; return true;
    case c10::ScalarType::Half: *out = {kDLFloat, 16, 1}; return true;
    case c10::ScalarType::Int: *out = {kDLInt, 32, 1}; return true;
    case c10::ScalarType::Long: *out = {kDLInt, 64, 1}; return true;
    case c10::ScalarType::Double: *out = {kDLFloat, 64, 1}; return true;
    case c10::ScalarType::Short: *out = {kDLInt, 16, 1}; return true;
    case c10::ScalarType::Char: *out = {kDLInt, 8, 1}; return true;
    case c10::ScalarType::Byte: *out = {kDLUInt, 8, 1}; return true;
    case c10::ScalarType::UInt16: *out = {kDLUInt, 16, 1}; return true;
    case c10::ScalarType::UInt32: *out = {kDLUInt, 32, 1}; return true;
    case c10::ScalarType::UInt64: *out = {kDLUInt, 64, 1}; return true;
    case c10::ScalarType::Bool: *out = {6 /* kDLBool in DLPack >= 0.8 */, 8, 1}; return true;
    case c10::ScalarType::ComplexFloat: *out = {kDLComplex, 64, 1}; return true;
    case c10::ScalarType::ComplexDouble: *out = {kDLComplex, 128, 1}; return true;
    default: return false;
  }
}

}  // namespace

extern "C" int gdn_torch_abi_view(PyObject* obj, const char* name, gdn::TensorView* v, char* err, int err_len) {
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    const c10::Device d = t.device();
    if (d.is_cuda()) {
      v->device = DLDevice{kDLCUDA, static_cast<int32_t>(d.index())};
    } else if (d.is_cpu()) {
      v->device = DLDevice{kDLCPU, 0};
    } else {
      std::snprintf(err, err_len, "%s must be on the CPU or a CUDA device, got torch device '%s'", name,
                    d.str().c_str());
      return 1;
    }
    if (!dl_dtype(t.scalar_type(), &v->dtype)) return GDN_TORCH_ABI_UNSUPPORTED_DTYPE;
    // gdn has no backward: refuse rather than return results autograd knows nothing about.
    // Under no_grad / inference_mode, parameters that require grad are fine.
    if (t.requires_grad() && c10::GradMode::is_enabled()) {
      std::snprintf(err, err_len,
                    "%s requires grad, but gdn is inference-only (it has no backward): call it under "
                    "torch.no_grad() or torch.inference_mode(), or pass %s.detach()",
                    name, name);
      return 1;
    }
    const auto sizes = t.sizes();
    const auto strides = t.strides();
    const int64_t ndim = static_cast<int64_t>(sizes.size());
    if (ndim == 0) {
      std::snprintf(err, err_len, "%s must have rank >= 1, got a 0-d tensor", name);
      return 1;
    }
    if (ndim > gdn::kMaxRank) {
      std::snprintf(err, err_len, "%s has rank %lld, but gdn tensors have rank <= %d", name,
                    static_cast<long long>(ndim), gdn::kMaxRank);
      return 1;
    }
    v->ndim = static_cast<int>(ndim);
    for (int64_t i = 0; i < ndim; ++i) {
      v->shape[i] = sizes[i];
      v->strides[i] = strides[i];
    }
    // Element [0, ...] including the storage offset, as torch's own data_ptr() reports.
    v->data = const_cast<void*>(t.const_data_ptr());
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s: %s", name, e.what());
    return 1;
  }
}
