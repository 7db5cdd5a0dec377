// The LibTorch stable-ABI vocabulary of the binding layer (issue 22).
//
// Every file that sees a tensor includes this instead of ATen: the stable
// Tensor, GRADACC_CHECK, and the names the error messages print, spelled as
// Python spells them (torch.float64, cuda:0, [2, 3]) so that both backends'
// messages match gradacc_ext/ops/_checks.py. Built with TORCH_TARGET_VERSION
// = 2.11 (setup.py), so nothing newer than torch 2.11's stable surface links.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/Layout.h>
#include <torch/headeronly/core/ScalarType.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace gradacc {

using Tensor = torch::stable::Tensor;
using Device = torch::stable::Device;
using ScalarType = torch::headeronly::ScalarType;
using Layout = torch::headeronly::Layout;

// The stable ABI carries one error type across the shim: every failure
// surfaces in Python as RuntimeError with this message; ops/api.py re-runs
// the Python checks to raise the contract's ValueError / TypeError.
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  throw std::runtime_error(s.str());
}

#define GRADACC_CHECK(cond, ...)                   \
  do {                                             \
    if (!(cond)) ::gradacc::fail(__VA_ARGS__);     \
  } while (0)

std::string dtype_name(ScalarType st);
std::string layout_name(Layout layout);
std::string device_name(const Device& device);
// "[2, 3]", as torch prints a size or stride list.
std::string shape_str(torch::headeronly::IntHeaderOnlyArrayRef dims);

// A tensor the binding borrows for one call: an item of a TensorList
// (boxing.h) or a Tensor argument. The checks read it through the C shim
// directly, one call per fact; torch::stable::Tensor's getters do the same
// but need an owning Tensor, and some (scalar_type, layout, device) convert
// torch's code by calling one shim function per candidate enum value.
class TensorRef {
 public:
  TensorRef(AtenTensorHandle handle) : handle_(handle) {}  // NOLINT(google-explicit-constructor)
  TensorRef(const Tensor& t) : handle_(t.get()) {}         // NOLINT(google-explicit-constructor)
  AtenTensorHandle get() const { return handle_; }

 private:
  AtenTensorHandle handle_;
};

bool is_defined(TensorRef t);
ScalarType dtype_of(TensorRef t);
bool is_strided(TensorRef t);
Layout layout_of(TensorRef t);
Device device_of(TensorRef t);
void* data_of(TensorRef t);
int64_t numel_of(TensorRef t);

// Sizes and strides, read in place (pointers into the TensorImpl, no copy;
// valid while the tensor lives).
struct Shape {
  torch::headeronly::IntHeaderOnlyArrayRef sizes, strides;
};
Shape shape_of(TensorRef t);
// c10's is_non_overlapping_and_dense, which the stable Tensor lacks.
bool is_non_overlapping_and_dense(const Shape& s);

// What the per-tensor checks of a list item read, each fact by one shim
// call, in one pass: the layout only of a defined tensor, the rest only of a
// strided one (a sparse tensor has no strides to read), the device index only
// off the CPU, and the sizes only `with_sizes` (for the pair checks; numel is
// then their product). Contiguity is torch's own (one call, fewer than sizes
// and strides plus our loops), and so is numel without the sizes.
struct TensorFacts {
  bool defined = false, strided = false, contiguous = false;
  // Not a torch::stable::Device member: its namespace has hidden visibility.
  torch::headeronly::DeviceType device_type = torch::headeronly::DeviceType::CPU;
  torch::stable::DeviceIndex device_index = -1;
  ScalarType dtype = ScalarType::Undefined;
  int64_t numel = 0;
  torch::headeronly::IntHeaderOnlyArrayRef sizes;

  Device device() const { return Device(device_type, device_index); }
};
TensorFacts facts_of(TensorRef t, bool with_sizes);

}  // namespace gradacc
