// Checks of the fused optimizer steps and their CPU registration: one boxed
// kernel per optimizer of kernels/optim_traits.cuh, which reads the op's
// arguments by the names in its schema, so no op's signature is restated here.
// gradacc_ext/ops/_checks_optim.py mirrors these rules in their order; the
// per-tensor checks are binding.h's (Use::kStep), shared with the other ops.
#include "binding_optim.h"

#include <ATen/ATen.h>
#include <ATen/core/stack.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "binding.h"
#include "cpu/optim_cpu.h"

namespace gradacc::binding {
namespace {

// `list` must have params' length (or, if `optional`, be empty): one tensor
// per param, of params' shape, of dtype `want(param dtype)`.
template <typename Want>
std::vector<Span> check_companions(const char* op, const char* arg, at::TensorList list, at::TensorList params,
                                   const std::vector<Span>& param_spans, bool optional, const char* expected,
                                   Want&& want) {
  if (optional && list.empty()) return {};
  TORCH_CHECK_VALUE(list.size() == params.size(), op, ": ", arg, " must have one tensor per param (",
                    params.size(), optional ? ") or none" : ")", ", got ", list.size());
  std::vector<Span> spans;
  spans.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    spans.push_back(check_tensor(op, arg, int64_t(i), list[i], params[i].device(), Use::kStep));
    check_same_shape(op, arg, int64_t(i), list[i], "params", params[i]);
    check_pair_dtype(want(param_spans[i].dtype, spans.back().dtype), op, arg, int64_t(i), list[i], "params",
                     params[i], expected);
  }
  return spans;
}

bool is_state_dtype(DType param, DType state) {
  return state == (param == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32);
}

// The traits' option rules, thrown with the op's name (torch.optim's wording).
struct Rules {
  const char* op;
  void invalid(bool ok, const char* what, double value) const {
    TORCH_CHECK_VALUE(ok, op, ": Invalid ", what, ": ", value);
  }
  void require(bool ok, const char* message) const { TORCH_CHECK_VALUE(ok, op, ": ", message); }
};

int index_of(const char* const* names, int count, const std::string& name) {
  for (int i = 0; i < count; ++i) {
    if (name == names[i]) return i;
  }
  return -1;
}

// The arguments of one call of optimizer T, read from the stack by name.
template <typename T>
struct StepArgs {
  std::vector<at::Tensor> params, grads, masters, steps, state[T::kSlots];
  std::optional<at::Tensor> lr_tensor, grad_mult, found_inf;
  OptimScalars scalars;
  int64_t mode = 0, seed = 0;

  StepArgs(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
    const auto& args = schema.arguments();
    const size_t first = stack.size() - args.size();
    constexpr int kNumOptions = int(sizeof(T::kOptions) / sizeof(T::kOptions[0]));
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& name = args[i].name();
      const c10::IValue& v = stack[first + i];
      const int slot = index_of(T::kState, T::kSlots, name), option = index_of(T::kOptions, kNumOptions, name);
      if (slot >= 0) state[slot] = v.toTensorVector();
      else if (option >= 0) scalars.option[option] = v.isBool() ? double(v.toBool()) : v.toDouble();
      else if (name == "params") params = v.toTensorVector();
      else if (name == "grads") grads = v.toTensorVector();
      else if (name == "master_params") masters = v.toTensorVector();
      else if (name == "steps") steps = v.toTensorVector();
      else if (name == "lr") scalars.lr = v.toDouble();
      else if (name == "lr_tensor") lr_tensor = v.toOptional<at::Tensor>();
      else if (name == "grad_mult") grad_mult = v.toOptional<at::Tensor>();
      else if (name == "found_inf") found_inf = v.toOptional<at::Tensor>();
      else if (name == "maximize") scalars.maximize = v.toBool();
      else if (name == "param_mode") mode = v.toInt();
      else if (name == "seed") seed = v.toInt();
      else TORCH_INTERNAL_ASSERT(false, T::kName, ": argument ", name, " is not in its optimizer traits");
    }
  }
};

// Every check of one step of T, in the order of _checks_optim.check_step; the
// pointers of the returned params stay valid while `a` lives.
template <typename T>
OptimParams checked_params(const char* op, const StepArgs<T>& a) {
  const Rules rules{op};
  const double* o = a.scalars.option;
  T::check_options(o, rules);
  rules.invalid(std::isfinite(a.scalars.lr) && a.scalars.lr >= 0.0, "learning rate", a.scalars.lr);
  const double wd = o[T::kWeightDecay];
  rules.invalid(std::isfinite(wd) && wd >= 0.0, "weight_decay value", wd);
  TORCH_CHECK_VALUE(a.mode >= 0 && a.mode <= 2, op, ": mode must be 0 (nearest), 1 (master) or 2 (stochastic), got ",
                    a.mode);
  OptimParams p;
  p.kind = kKindOf<T>;
  const at::TensorList params = a.params;
  const at::Device device = list_device(params, a.found_inf ? &*a.found_inf : nullptr);
  p.params = check_list(op, "params", params, device, Use::kStep);
  p.grads = check_companions(op, "grads", a.grads, params, p.params, false, "the param's dtype or float32",
                             [](DType param, DType grad) { return grad == param || grad == DType::kFloat32; });
  p.mode = ParamMode(a.mode);
  p.masters = check_companions(op, "master_params", a.masters, params, p.params, true,
                               "float32 (master weights of a float16 or bfloat16 param)", [](DType param, DType m) {
                                 return m == DType::kFloat32 && (param == DType::kFloat16 || param == DType::kBFloat16);
                               });
  TORCH_CHECK_VALUE((p.mode == ParamMode::kMaster) == !p.masters.empty() || params.empty(), op,
                    ": master_params must be given exactly when mode is 1 (master), got ", a.masters.size(),
                    " tensors with mode ", a.mode);
  const bool steps_required = T::steps_required(o, int(a.mode));
  const size_t num_steps = a.steps.size();
  TORCH_CHECK_VALUE(num_steps == 1 || num_steps == params.size() || (!steps_required && a.steps.empty()), op,
                    ": steps must hold one tensor per param (", params.size(), ") or one shared by all",
                    steps_required ? "" : " (or none)", ", got ", num_steps);
  for (size_t i = 0; i < num_steps; ++i) {
    check_scalar(op, ("steps[" + std::to_string(i) + "]").c_str(), a.steps[i], device);
    p.steps.push_back(a.steps[i].template data_ptr<float>());
  }
  const std::pair<const char*, const std::optional<at::Tensor>*> scalars[] = {
      {"lr_tensor", &a.lr_tensor}, {"grad_mult", &a.grad_mult}, {"found_inf", &a.found_inf}};
  const float** pointers[] = {&p.lr_ptr, &p.grad_mult_ptr, &p.found_inf};
  for (int i = 0; i < 3; ++i) {
    if (!scalars[i].second->has_value()) continue;
    check_scalar(op, scalars[i].first, **scalars[i].second, device);
    *pointers[i] = (*scalars[i].second)->template data_ptr<float>();
  }
  bool has[kMaxStateSlots] = {};
  for (int s = 0; s < T::kSlots; ++s) {
    p.state[s] = check_companions(op, T::kState[s], a.state[s], params, p.params, T::kStateOptional[s],
                                  "float32 (float64 for a float64 param)", is_state_dtype);
    has[s] = !p.state[s].empty();
  }
  T::check_state(o, has, params.size(), rules);
  p.scalars = a.scalars;
  p.seed = a.seed;
  return p;
}

// The kernel of optimizer T on one dispatch key: read, check, run, pop.
template <typename T>
struct StepKernel final : c10::OperatorKernel {
  explicit StepKernel(OptimRunner run) : run(run) {}
  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const c10::FunctionSchema& schema = handle.schema();
    const std::string op = "gradacc." + std::string(T::kName);
    const StepArgs<T> args(schema, *stack);
    const OptimParams p = checked_params<T>(op.c_str(), args);
    if (!args.params.empty()) run(p, args.params[0].device());
    torch::jit::drop(*stack, schema.arguments().size());
  }
  OptimRunner run;
};

void run_cpu(const OptimParams& p, c10::Device) { cpu::optim_step(p); }

void register_cpu_optim(torch::Library& m) { impl_optim_ops(m, &run_cpu); }

}  // namespace

void define_optim_ops(torch::Library& m) {
  for_each_optimizer([&](auto traits) {
    using T = decltype(traits);
    m.def(optim_schema<T>().c_str());
  });
}

void impl_optim_ops(torch::Library& m, OptimRunner run) {
  for_each_optimizer([&](auto traits) {
    using T = decltype(traits);
    m.impl(T::kName, torch::CppFunction::makeFromBoxedFunctor(std::make_unique<StepKernel<T>>(run)));
  });
}

}  // namespace gradacc::binding

namespace gradacc {

TORCH_LIBRARY_IMPL(gradacc, CPU, m) { binding::register_cpu_optim(m); }
// Sparse grads route here; the checks reject them by name (see ops.cpp).
TORCH_LIBRARY_IMPL(gradacc, SparseCPU, m) { binding::register_cpu_optim(m); }
TORCH_LIBRARY_IMPL(gradacc, SparseCsrCPU, m) { binding::register_cpu_optim(m); }
TORCH_LIBRARY_IMPL(gradacc, SparseCUDA, m) { binding::register_cpu_optim(m); }
TORCH_LIBRARY_IMPL(gradacc, SparseCsrCUDA, m) { binding::register_cpu_optim(m); }

}  // namespace gradacc
