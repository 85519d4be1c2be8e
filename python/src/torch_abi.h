// The one function gdn._C_torch adds to gdn._C (see torch_abi.cpp). Plain C types only:
// the two sides may be compiled with different _GLIBCXX_USE_CXX11_ABI settings.
#pragma once

#include <Python.h>

#include "gdn/gdn.h"

// Returned for a dtype gdn has no DLPack code for (float8, quantized, ...): the caller names
// it through Python, where torch's own name for it is at hand.
#define GDN_TORCH_ABI_UNSUPPORTED_DTYPE 2

// Fills `v` from the torch.Tensor (or subclass) `obj`. Returns 0; GDN_TORCH_ABI_UNSUPPORTED_DTYPE;
// or 1 with a message naming `name` in `err` (a tensor on a device other than CPU/CUDA, a 0-d
// or too-high rank, a tensor without storage, a tensor that requires grad while grad mode is on).
extern "C" int gdn_torch_abi_view(PyObject* obj, const char* name, gdn::TensorView* v, char* err, int err_len);
