// torch's current CUDA stream, through the stable ABI of torch 2.11.
//
// torch::stable's Stream::nativeHandle() needs torch 2.13, so the target (2.11) leaves the C shim's
// aoti_torch_get_current_cuda_stream. That function lives in libtorch_cuda.so, which this module does
// not link: the same _C then builds against a CPU torch's headers (no CUDA torch on the build machine)
// and loads beside a CPU torch too (its CPU kernels work there). Beside a CUDA torch, libtorch_cuda.so
// is already loaded, but RTLD_LOCAL, so plain symbol lookup would not see it: look it up by name in the
// copy torch loaded (RTLD_NOLOAD never loads a second one), once per process. torch loads it before _C
// (the Python loader imports torch first), so the answer cannot change later.
#include <dlfcn.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "stream.h"

namespace gradacc::cuda {
namespace {

using GetStream = decltype(&aoti_torch_get_current_cuda_stream);

struct StreamLookup {
  GetStream get_stream = nullptr;
  std::string error;  // why get_stream is null
};

StreamLookup find_get_stream() {
  void* lib = dlopen("libtorch_cuda.so", RTLD_NOLOAD | RTLD_LAZY | RTLD_LOCAL);
  if (lib == nullptr) {
    return {nullptr, "libtorch_cuda.so is not loaded in this process (a CPU-only torch): the CUDA kernels need a "
                     "CUDA build of torch"};
  }
  void* fn = dlsym(lib, "aoti_torch_get_current_cuda_stream");
  if (fn == nullptr) return {nullptr, "libtorch_cuda.so has no aoti_torch_get_current_cuda_stream"};
  return {reinterpret_cast<GetStream>(fn), ""};
}

const StreamLookup& stream_lookup() {
  static const StreamLookup found = find_get_stream();
  return found;
}

}  // namespace

cudaStream_t current_stream(int32_t device_index) {
  const StreamLookup& lookup = stream_lookup();
  GRADACC_CHECK(lookup.get_stream != nullptr, lookup.error);
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(lookup.get_stream(device_index, &stream));
  return static_cast<cudaStream_t>(stream);
}

std::string stream_lookup_status() {
  const StreamLookup& lookup = stream_lookup();
  return lookup.get_stream ? "ok" : lookup.error;
}

}  // namespace gradacc::cuda
