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
using TensorList = std::vector<Tensor>;
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
// t.scalar_type(), t.layout() == Strided and t.device() in one or two shim
// calls each, for the checks every tensor of every list goes through.
ScalarType dtype_of(const Tensor& t);
bool is_strided(const Tensor& t);
Device device_of(const Tensor& t);
// c10's is_non_overlapping_and_dense, which the stable Tensor lacks,
// computed from sizes() and strides().
bool is_non_overlapping_and_dense(const Tensor& t);

}  // namespace gradacc
