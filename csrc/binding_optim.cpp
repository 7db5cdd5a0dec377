// Checks of the fused optimizer steps and their CPU registration: one boxed
// kernel per optimizer of kernels/optim_traits.cuh, which reads the op's
// arguments by the names in its schema, so no op's signature is restated here.
// A stable boxed kernel sees no schema: the names come from the very string
// define_optim_ops registers (optim_schema<T>()), parsed once per optimizer.
// gradacc_ext/ops/_checks_optim.py mirrors these rules in their order; the
// per-tensor checks are binding.h's (Use::kStep), shared with the other ops.
#include "binding_optim.h"

#include <cmath>
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "aliasing.h"
#include "binding.h"
#include "cpu/optim_cpu.h"

namespace gradacc::binding {
namespace {

// `list` must have params' length (or, if `optional`, be empty): one tensor
// per param, of params' shape, of dtype `want(param dtype)`.
template <typename Want>
std::vector<Span> check_companions(const char* op, const char* arg, const TensorList& list, const TensorList& params,
                                   const std::vector<Span>& param_spans,
                                   const std::vector<torch::headeronly::IntHeaderOnlyArrayRef>& param_sizes,
                                   const Device& device, bool optional, const char* expected, Want&& want) {
  if (optional && list.empty()) return {};
  GRADACC_CHECK(list.size() == params.size(), op, ": ", arg, " must have one tensor per param (",
                params.size(), optional ? ") or none" : ")", ", got ", list.size());
  std::vector<Span> spans;
  spans.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    // params[i] is on `device` (checked first).
    torch::headeronly::IntHeaderOnlyArrayRef sizes;
    spans.push_back(check_tensor(op, arg, int64_t(i), list[i], device, Use::kStep, &sizes));
    check_same_shape(op, arg, int64_t(i), sizes, "params", param_sizes[i]);
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
    GRADACC_CHECK(ok, op, ": Invalid ", what, ": ", value);
  }
  void require(bool ok, const char* message) const { GRADACC_CHECK(ok, op, ": ", message); }
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
  TensorList params, grads, masters, steps, state[T::kSlots];
  std::optional<Tensor> lr_tensor, grad_mult, found_inf;
  OptimScalars scalars;
  int64_t mode = 0, seed = 0;

  StepArgs(const std::vector<std::string>& names, StableIValue* stack) {
    using torch::stable::detail::to;
    constexpr int kNumOptions = int(sizeof(T::kOptions) / sizeof(T::kOptions[0]));
    for (size_t i = 0; i < names.size(); ++i) {
      const std::string& name = names[i];
      const StableIValue v = stack[i];
      const int slot = index_of(T::kState, T::kSlots, name), option = index_of(T::kOptions, kNumOptions, name);
      if (slot >= 0) state[slot] = TensorList(v);
      else if (option >= 0) scalars.option[option] = (T::kBoolOptions >> option) & 1 ? to<bool>(v) : to<double>(v);
      else if (name == "params") params = TensorList(v);
      else if (name == "grads") grads = TensorList(v);
      else if (name == "master_params") masters = TensorList(v);
      else if (name == "steps") steps = TensorList(v);
      else if (name == "lr") scalars.lr = to<double>(v);
      else if (name == "lr_tensor") lr_tensor = to<std::optional<Tensor>>(v);
      else if (name == "grad_mult") grad_mult = to<std::optional<Tensor>>(v);
      else if (name == "found_inf") found_inf = to<std::optional<Tensor>>(v);
      else if (name == "maximize") scalars.maximize = to<bool>(v);
      else if (name == "param_mode") mode = to<int64_t>(v);
      else if (name == "seed") seed = to<int64_t>(v);
      else fail(T::kName, ": argument ", name, " is not in its optimizer traits");
    }
  }
};

// The argument names of optimizer T's schema, in order: the last word of
// each comma-separated declaration between the parentheses.
template <typename T>
const std::vector<std::string>& argument_names() {
  static const std::vector<std::string> names = [] {
    const std::string schema = optim_schema<T>();
    const size_t open = schema.find('('), close = schema.find(") ->");
    std::vector<std::string> out;
    size_t start = open + 1;
    while (start < close) {
      size_t end = std::min(schema.find(',', start), close);
      const std::string decl = schema.substr(start, end - start);
      out.push_back(decl.substr(decl.rfind(' ') + 1));
      start = end + 1;
    }
    return out;
  }();
  return names;
}

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
  GRADACC_CHECK(a.mode >= 0 && a.mode <= 2, op, ": mode must be 0 (nearest), 1 (master) or 2 (stochastic), got ",
                a.mode);
  OptimParams p;
  p.kind = kKindOf<T>;
  const TensorList& params = a.params;
  const Device device = list_device(params, a.found_inf ? &*a.found_inf : nullptr);
  std::vector<torch::headeronly::IntHeaderOnlyArrayRef> sizes;
  p.params = check_list(op, "params", params, device, Use::kStep, &sizes);
  p.grads = check_companions(op, "grads", a.grads, params, p.params, sizes, device, false,
                             "the param's dtype or float32",
                             [](DType param, DType grad) { return grad == param || grad == DType::kFloat32; });
  p.mode = ParamMode(a.mode);
  p.masters = check_companions(op, "master_params", a.masters, params, p.params, sizes, device, true,
                               "float32 (master weights of a float16 or bfloat16 param)", [](DType param, DType m) {
                                 return m == DType::kFloat32 && (param == DType::kFloat16 || param == DType::kBFloat16);
                               });
  GRADACC_CHECK((p.mode == ParamMode::kMaster) == !p.masters.empty() || params.empty(), op,
                ": master_params must be given exactly when mode is 1 (master), got ", a.masters.size(),
                " tensors with mode ", a.mode);
  const bool steps_required = T::steps_required(o, int(a.mode));
  const size_t num_steps = a.steps.size();
  GRADACC_CHECK(num_steps == 1 || num_steps == params.size() || (!steps_required && a.steps.empty()), op,
                ": steps must hold one tensor per param (", params.size(), ") or one shared by all",
                steps_required ? "" : " (or none)", ", got ", num_steps);
  for (size_t i = 0; i < num_steps; ++i) {
    check_scalar(op, ("steps[" + std::to_string(i) + "]").c_str(), a.steps[i], device);
    p.steps.push_back(static_cast<float*>(data_of(a.steps[i])));  // float32: checked
  }
  const std::pair<const char*, const std::optional<Tensor>*> scalars[] = {
      {"lr_tensor", &a.lr_tensor}, {"grad_mult", &a.grad_mult}, {"found_inf", &a.found_inf}};
  const float** pointers[] = {&p.lr_ptr, &p.grad_mult_ptr, &p.found_inf};
  for (int i = 0; i < 3; ++i) {
    if (!scalars[i].second->has_value()) continue;
    check_scalar(op, scalars[i].first, **scalars[i].second, device);
    *pointers[i] = (*scalars[i].second)->template mutable_data_ptr<float>();
  }
  bool has[kMaxStateSlots] = {};
  for (int s = 0; s < T::kSlots; ++s) {
    p.state[s] = check_companions(op, T::kState[s], a.state[s], params, p.params, sizes, device, T::kStateOptional[s],
                                  "float32 (float64 for a float64 param)", is_state_dtype);
    has[s] = !p.state[s].empty();
  }
  T::check_state(o, has, params.size(), rules);
  // Outputs in the order of _checks_optim's record (params, state, master_params, steps), then the inputs:
  // no input may be an output here, not even its own pair (the reference applies weight decay to params[i]
  // before it reads grads[i], the kernels read it first: they would differ).
  std::vector<Span> step_spans;  // the step counts are written too (one float32 each)
  for (float* step : p.steps) step_spans.push_back(Span{step, 1, DType::kFloat32});
  std::vector<MemoryArg> outputs{{"params", &p.params}};
  for (int s = 0; s < T::kSlots; ++s) outputs.push_back({T::kState[s], &p.state[s]});
  outputs.push_back({"master_params", &p.masters});
  outputs.push_back({"steps", &step_spans});
  const std::vector<Span> lr = scalar_span(p.lr_ptr), mult = scalar_span(p.grad_mult_ptr),
                          found = scalar_span(p.found_inf);
  const std::vector<MemoryArg> inputs{{"grads", &p.grads}, scalar_arg("lr_tensor", lr), scalar_arg("grad_mult", mult),
                                      scalar_arg("found_inf", found)};
  check_disjoint(op, outputs, inputs);
  check_scalars_disjoint(op, outputs, inputs);
  p.scalars = a.scalars;
  p.seed = a.seed;
  return p;
}

// One call of optimizer T: read, check, run.
template <typename T>
void step(OptimRunner run, StableIValue* stack, uint64_t num_args) {
  const std::vector<std::string>& names = argument_names<T>();
  GRADACC_CHECK(num_args == names.size(), "gradacc.", T::kName, ": the schema has ", names.size(),
                " arguments but the call passed ", num_args);
  const std::string op = "gradacc." + std::string(T::kName);
  const StepArgs<T> args(names, stack);
  const OptimParams p = checked_params<T>(op.c_str(), args);
  if (!args.params.empty()) run(p, device_of(args.params[0]));
}

}  // namespace

void define_optim_ops(torch::stable::detail::StableLibrary& m) {
  for_each_optimizer([&](auto traits) {
    using T = decltype(traits);
    m.def(optim_schema<T>().c_str());
  });
}

void run_step(int kind, OptimRunner run, StableIValue* stack, uint64_t num_args) {
  for_each_optimizer([&](auto traits) {
    using T = decltype(traits);
    if (kKindOf<T> == kind) step<T>(run, stack, num_args);
  });
}

void run_cpu_step(const OptimParams& p, const Device& /*device*/) { cpu::optim_step(p); }

}  // namespace gradacc::binding
