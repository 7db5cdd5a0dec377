// Names and layout facts the stable Tensor does not offer (see stable.h).
#include "stable.h"

#include <algorithm>
#include <numeric>
#include <utility>

namespace gradacc {

std::string dtype_name(ScalarType st) {
  // torch.<name> of every dtype a user may pass by mistake; the rest by their C++ name.
  switch (st) {
    case ScalarType::Byte: return "torch.uint8";
    case ScalarType::Char: return "torch.int8";
    case ScalarType::Short: return "torch.int16";
    case ScalarType::Int: return "torch.int32";
    case ScalarType::Long: return "torch.int64";
    case ScalarType::Half: return "torch.float16";
    case ScalarType::Float: return "torch.float32";
    case ScalarType::Double: return "torch.float64";
    case ScalarType::ComplexHalf: return "torch.complex32";
    case ScalarType::ComplexFloat: return "torch.complex64";
    case ScalarType::ComplexDouble: return "torch.complex128";
    case ScalarType::Bool: return "torch.bool";
    case ScalarType::BFloat16: return "torch.bfloat16";
    case ScalarType::Float8_e5m2: return "torch.float8_e5m2";
    case ScalarType::Float8_e4m3fn: return "torch.float8_e4m3fn";
    case ScalarType::UInt16: return "torch.uint16";
    case ScalarType::UInt32: return "torch.uint32";
    case ScalarType::UInt64: return "torch.uint64";
    default: return std::string("torch.") + torch::headeronly::toString(st);
  }
}

std::string layout_name(Layout layout) {
  switch (layout) {
    case Layout::Strided: return "torch.strided";
    case Layout::Sparse: return "torch.sparse_coo";
    case Layout::SparseCsr: return "torch.sparse_csr";
    case Layout::SparseCsc: return "torch.sparse_csc";
    case Layout::SparseBsr: return "torch.sparse_bsr";
    case Layout::SparseBsc: return "torch.sparse_bsc";
    case Layout::Mkldnn: return "torch._mkldnn";
    case Layout::Jagged: return "torch.jagged";
    default: return "layout " + std::to_string(int(layout));
  }
}

std::string device_name(const Device& device) {
  using torch::headeronly::DeviceType;
  std::string name;
  switch (device.type()) {
    case DeviceType::CPU: name = "cpu"; break;
    case DeviceType::CUDA: name = "cuda"; break;
    case DeviceType::Meta: name = "meta"; break;
    case DeviceType::XPU: name = "xpu"; break;
    case DeviceType::MPS: name = "mps"; break;
    default: name = "device type " + std::to_string(int(device.type()));
  }
  return device.has_index() ? name + ":" + std::to_string(int(device.index())) : name;
}

std::string shape_str(torch::headeronly::IntHeaderOnlyArrayRef dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

bool is_non_overlapping_and_dense(const Tensor& t) {
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  const int64_t dim = int64_t(sizes.size());
  if (dim == 1) return sizes[0] < 2 || strides[0] == 1;
  // c10::TensorImpl's rule: visit the dims by increasing stride (size-1 dims
  // last, as they never matter); each stride must be the product of the
  // sizes before it.
  std::vector<int64_t> perm(static_cast<size_t>(dim));
  std::iota(perm.begin(), perm.end(), 0);
  std::sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
    if (sizes[a] < 2) return false;
    if (sizes[b] < 2) return true;
    return strides[a] < strides[b];
  });
  int64_t require = 1;
  for (int64_t d : perm) {
    if (sizes[d] < 2) return true;
    if (strides[d] != require) return false;
    require *= sizes[d];
  }
  return true;
}

// The stable Tensor's scalar_type(), layout() and device() turn torch's code
// into the enum by calling one shim function per candidate (7 calls for
// float32, 13 for bfloat16). The codes are fixed for a process, so they are
// looked up once here, and each query costs one shim call.
namespace {

template <typename Enum>
int32_t shim_code(Enum value) {
  return torch::stable::detail::to<int32_t>(torch::stable::detail::from(value));
}

}  // namespace

ScalarType dtype_of(const Tensor& t) {
  static const std::vector<std::pair<int32_t, ScalarType>> codes = [] {
    std::vector<std::pair<int32_t, ScalarType>> out;
    for (ScalarType st : {ScalarType::Float, ScalarType::Half, ScalarType::BFloat16, ScalarType::Double}) {
      out.emplace_back(shim_code(st), st);
    }
    return out;
  }();
  int32_t code = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(t.get(), &code));
  for (const auto& [c, st] : codes) {
    if (c == code) return st;
  }
  return t.scalar_type();  // not a float dtype: torch's own conversion names it
}

bool is_strided(const Tensor& t) {
  static const int32_t strided = shim_code(Layout::Strided);
  int32_t code = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_layout(t.get(), &code));
  return code == strided;
}

Device device_of(const Tensor& t) {
  using torch::headeronly::DeviceType;
  static const int32_t cpu = shim_code(DeviceType::CPU), cuda = shim_code(DeviceType::CUDA);
  int32_t type = 0, index = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(t.get(), &type));
  if (type != cpu && type != cuda) return t.device();
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(t.get(), &index));
  return Device(type == cpu ? DeviceType::CPU : DeviceType::CUDA, torch::stable::DeviceIndex(index));
}

}  // namespace gradacc
