// TensorView construction from raw pointers and from DLPack.
#include "gdn/gdn.h"

namespace gdn {

TensorView make_view(void* data, DLDataType dtype, DLDevice device, std::initializer_list<int64_t> shape,
                     std::initializer_list<int64_t> strides) {
  TensorView t;
  const int n = static_cast<int>(shape.size());
  if (n < 1 || n > kMaxRank || (strides.size() != 0 && static_cast<int>(strides.size()) != n)) return t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = n;
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  if (strides.size() == 0) {
    int64_t stride = 1;
    for (int d = n - 1; d >= 0; --d) {
      t.strides[d] = stride;
      stride *= t.shape[d];
    }
  } else {
    i = 0;
    for (int64_t s : strides) t.strides[i++] = s;
  }
  return t;
}

TensorView from_dlpack(const DLTensor& d) {
  TensorView t;
  if (d.ndim < 1 || d.ndim > kMaxRank) return t;
  t.data = static_cast<char*>(d.data) + d.byte_offset;
  t.dtype = d.dtype;
  t.device = d.device;
  t.ndim = d.ndim;
  int64_t stride = 1;
  for (int i = d.ndim - 1; i >= 0; --i) {
    t.shape[i] = d.shape[i];
    t.strides[i] = d.strides ? d.strides[i] : stride;
    stride *= d.shape[i];
  }
  return t;
}

}  // namespace gdn
