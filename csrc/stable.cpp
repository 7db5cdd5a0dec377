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

bool is_non_overlapping_and_dense(const Shape& s) {
  const auto& sizes = s.sizes;
  const auto& strides = s.strides;
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

// torch's dtype, layout and device codes are fixed for a process: the ones
// the checks compare with are looked up once here, so each query costs one
// shim call, and only an unexpected code goes through the stable API's
// general conversion (one shim call per candidate), for its message.
namespace {

using torch::stable::detail::from;
using torch::stable::detail::to;

template <typename Enum>
int32_t shim_code(Enum value) {
  return to<int32_t>(from(value));
}

// The index of every CPU tensor's device: there is one CPU, and torch reports its tensors on it as "cpu"
// (index -1), however they were made (device="cpu:0" included). So a CPU tensor's index is not read.
constexpr int32_t kCpuIndex = -1;

// The codes the checks compare with, behind one static guard.
struct Codes {
  int32_t strided = shim_code(Layout::Strided);
  int32_t cpu = shim_code(torch::headeronly::DeviceType::CPU);
  int32_t cuda = shim_code(torch::headeronly::DeviceType::CUDA);
  std::pair<int32_t, ScalarType> dtypes[4] = {{shim_code(ScalarType::Float), ScalarType::Float},
                                              {shim_code(ScalarType::Half), ScalarType::Half},
                                              {shim_code(ScalarType::BFloat16), ScalarType::BFloat16},
                                              {shim_code(ScalarType::Double), ScalarType::Double}};
};

const Codes& codes() {
  static const Codes c;
  return c;
}

ScalarType dtype_from(const Codes& c, int32_t code) {
  for (const auto& [known, st] : c.dtypes) {
    if (known == code) return st;
  }
  return to<ScalarType>(from(code));  // not a float dtype: named for the message
}

torch::headeronly::DeviceType device_type_from(const Codes& c, int32_t type) {
  using torch::headeronly::DeviceType;
  return type == c.cpu ? DeviceType::CPU : type == c.cuda ? DeviceType::CUDA : to<DeviceType>(from(type));
}

}  // namespace

// The same shim reads as is_defined / is_strided / device_of / dtype_of / numel_of below, inlined on
// purpose: built from those helpers (tried), the checks cost 69 more instructions per tensor (callgrind,
// unscale_ over 2,000 tensors: 491 -> 560 in unscale_params), 3.5% of the whole raw call.
TensorFacts facts_of(TensorRef t, bool with_sizes) {
  const Codes& c = codes();
  const AtenTensorHandle h = t.get();
  TensorFacts f;
  TORCH_ERROR_CODE_CHECK(aoti_torch_is_defined(h, &f.defined));
  if (!f.defined) return f;
  int32_t layout = 0, type = 0, index = 0, dtype = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_layout(h, &layout));
  f.strided = layout == c.strided;
  if (!f.strided) return f;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(h, &type));
  f.device_type = device_type_from(c, type);
  if (type == c.cpu) {
    f.device_index = kCpuIndex;
  } else {
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(h, &index));
    f.device_index = torch::stable::DeviceIndex(index);
  }
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(h, &dtype));
  f.dtype = dtype_from(c, dtype);
  TORCH_ERROR_CODE_CHECK(aoti_torch_is_contiguous(h, &f.contiguous));
  if (with_sizes) {  // numel is their product: one shim call fewer where a pair check needs the sizes anyway
    int64_t dim = 0;
    int64_t* sizes = nullptr;
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(h, &dim));
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(h, &sizes));
    f.sizes = {sizes, size_t(dim)};
    f.numel = 1;
    for (int64_t d = 0; d < dim; ++d) f.numel *= sizes[d];
  } else {
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_numel(h, &f.numel));
  }
  return f;
}

bool is_defined(TensorRef t) {
  bool defined = false;
  TORCH_ERROR_CODE_CHECK(aoti_torch_is_defined(t.get(), &defined));
  return defined;
}

ScalarType dtype_of(TensorRef t) {
  int32_t code = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(t.get(), &code));
  return dtype_from(codes(), code);
}

bool is_strided(TensorRef t) {
  int32_t code = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_layout(t.get(), &code));
  return code == codes().strided;
}

Layout layout_of(TensorRef t) {
  int32_t code = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_layout(t.get(), &code));
  return to<Layout>(from(code));
}

Device device_of(TensorRef t) {
  int32_t type = 0, index = kCpuIndex;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(t.get(), &type));
  if (type != codes().cpu) TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(t.get(), &index));
  return Device(device_type_from(codes(), type), torch::stable::DeviceIndex(index));
}

void* data_of(TensorRef t) {
  void* data = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(t.get(), &data));
  return data;
}

Shape shape_of(TensorRef t) {
  int64_t dim = 0;
  int64_t *sizes = nullptr, *strides = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(t.get(), &dim));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(t.get(), &sizes));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(t.get(), &strides));
  return Shape{{sizes, size_t(dim)}, {strides, size_t(dim)}};
}

int64_t numel_of(TensorRef t) {
  int64_t numel = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_numel(t.get(), &numel));
  return numel;
}

}  // namespace gradacc
