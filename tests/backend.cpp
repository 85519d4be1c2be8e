// Runs gdn::decode on a backend. The CUDA path mirrors every storage of a Case on the
// device (same sizes, so every view keeps its strides and relative offsets), runs there on
// the default stream, and copies every storage back, so the comparators see device results
// exactly as they see host ones.
#include <cstring>
#include <string>
#include <vector>

#include "harness.h"

#if defined(GDN_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace gdn::test {

std::string backend_name(Backend b) { return b == Backend::kCpu ? "cpu" : "cuda"; }

#if defined(GDN_WITH_CUDA)

namespace {

std::string cuda_error(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// Device copies of a set of host storages, freed on scope exit.
class Mirror {
 public:
  explicit Mirror(std::vector<std::shared_ptr<Storage>> host) : host_(std::move(host)) {}
  ~Mirror() {
    for (void* p : dev_)
      if (p != nullptr) cudaFree(p);
  }

  std::string upload() {
    dev_.assign(host_.size(), nullptr);
    for (size_t i = 0; i < host_.size(); ++i) {
      if (cudaError_t e = cudaMalloc(&dev_[i], std::max<size_t>(host_[i]->bytes(), 1)); e != cudaSuccess)
        return cuda_error("cudaMalloc", e);
      for (const auto& [b, end] : host_[i]->ranges())
        if (cudaError_t e = cudaMemcpy(static_cast<std::byte*>(dev_[i]) + b, host_[i]->data() + b, end - b,
                                       cudaMemcpyHostToDevice);
            e != cudaSuccess)
          return cuda_error("cudaMemcpy to device", e);
    }
    return {};
  }

  std::string download() {
    for (size_t i = 0; i < host_.size(); ++i)
      for (const auto& [b, end] : host_[i]->ranges())
        if (cudaError_t e = cudaMemcpy(host_[i]->data() + b, static_cast<std::byte*>(dev_[i]) + b, end - b,
                                       cudaMemcpyDeviceToHost);
            e != cudaSuccess)
          return cuda_error("cudaMemcpy to host", e);
    return {};
  }

  // Re-points a host view at the device copy of its storage.
  void translate(TensorView& v, int device) const {
    if (v.data == nullptr) return;
    const auto* p = static_cast<const std::byte*>(v.data);
    for (size_t i = 0; i < host_.size(); ++i) {
      const std::byte* base = host_[i]->data();
      if (p >= base && p < base + std::max<size_t>(host_[i]->bytes(), 1)) {
        v.data = static_cast<std::byte*>(dev_[i]) + (p - base);
        v.device = cuda_device(device);
        return;
      }
    }
  }

 private:
  std::vector<std::shared_ptr<Storage>> host_;
  std::vector<void*> dev_;
};

}  // namespace

std::string backend_unavailable(Backend b) {
  if (b == Backend::kCpu) return {};
  if (!gdn::cuda_available()) return "no CUDA device visible: gdn::cuda_available() is false";
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess)
    return "no CUDA device visible: " + cuda_error("cudaGetDeviceCount", e);
  if (n == 0) return "no CUDA device visible: cudaGetDeviceCount() is 0";
  return {};
}

bool device_can_allocate(Backend b, size_t bytes, std::string* why) {
  if (b == Backend::kCpu) return true;
  size_t free_bytes = 0, total = 0;
  if (cudaError_t e = cudaMemGetInfo(&free_bytes, &total); e != cudaSuccess) {
    *why = cuda_error("cudaMemGetInfo", e);
    return false;
  }
  // Leave room for the other (small) buffers of the case and the runtime.
  if (bytes + (size_t{512} << 20) > free_bytes) {
    *why = "needs " + std::to_string(bytes >> 20) + " MiB of device memory, " + std::to_string(free_bytes >> 20) +
           " MiB free";
    return false;
  }
  return true;
}


#else  // no CUDA in this build

std::string backend_unavailable(Backend b) {
  if (b == Backend::kCpu) return {};
  return "no CUDA device visible: this build of gdn has no CUDA backend (GDN_WITH_CUDA is off)";
}

bool device_can_allocate(Backend b, size_t, std::string* why) {
  if (b == Backend::kCpu) return true;
  *why = "no CUDA in this build";
  return false;
}

#endif

namespace {

// One call of `step` (decode or fused_decode) on `args` built from the case's host storage: on
// the CPU as is; on CUDA (builds with it) on device mirrors of every tensor, downloaded afterwards. `fixup` edits
// the arguments after the translation (so a test can break a device pointer).
template <typename Args, typename Step>
Status run_step(Backend backend, const Case& c, Args args, const std::function<void(Args&)>& fixup,
                Status* can_implement_status, Step step, const char* name) {
  if (backend == Backend::kCpu) {
    if (fixup) fixup(args);
    if (can_implement_status) *can_implement_status = can_implement(args);
    return step(args, nullptr);
  }
#if defined(GDN_WITH_CUDA)
  Mirror mirror(c.storages());
  if (std::string err = mirror.upload(); !err.empty()) return Status(StatusCode::kCudaError, "test harness: " + err);
  int device = 0;
  cudaGetDevice(&device);
  for (int i = 0; i < kNumArgs; ++i) mirror.translate(arg_view(args, static_cast<Arg>(i)), device);
  if (fixup) fixup(args);
  if (can_implement_status) *can_implement_status = can_implement(args);
  const Status st = step(args, nullptr);
  // A launch error surfaces here even if the call reported success.
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess)
    return Status(StatusCode::kCudaError,
                  "test harness: " + cuda_error((std::string("cudaDeviceSynchronize after ") + name).c_str(), e));
  if (std::string err = mirror.download(); !err.empty()) return Status(StatusCode::kCudaError, "test harness: " + err);
  return st;
#else
  (void)c, (void)name;
  return Status(StatusCode::kNotSupported, "test harness: no CUDA in this build");
#endif
}

}  // namespace

Status run_decode(Backend backend, const Case& c, const std::function<void(DecodeArgs&)>& fixup,
                  Status* can_implement_status) {
  return run_step(backend, c, c.args(), fixup, can_implement_status,
                  [](const DecodeArgs& a, void* stream) { return decode(a, stream); }, "decode");
}

Status run_fused(Backend backend, const Case& c, const std::function<void(FusedDecodeArgs&)>& fixup,
                 Status* can_implement_status) {
  return run_step(backend, c, c.fused_args(), fixup, can_implement_status,
                  [](const FusedDecodeArgs& a, void* stream) { return fused_decode(a, stream); }, "fused_decode");
}

}  // namespace gdn::test
