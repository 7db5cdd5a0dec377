// Checks of the fused optimizer steps and their CPU registration: one boxed
// kernel per optimizer of kernels/optim_traits.cuh, which reads the op's
// arguments by their kinds in step_args<T>() (optim_args.h), the very list
// its schema is made from, so no op's signature is restated here. A stable
// boxed kernel sees no schema: the list is compile-time data.
// gradacc_ext/ops/_checks_optim.py mirrors these rules in their order; the
// per-tensor checks are binding.h's (Use::kStep), shared with the other ops.
#include "binding_optim.h"

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "aliasing.h"
#include "binding.h"
#include "cpu/optim_cpu.h"
#include "kernels/quant_maps.h"
#include "optim_args.h"

namespace gradacc::binding {
namespace {

// `list` must have params' length (or, if `optional`, be empty): one tensor
// per param, of params' shape, of dtype `want(param dtype)`.
template <typename Want>
std::vector<Span> check_companions(const char* op, const char* arg, const TensorList& list, const TensorList& params,
                                   const std::vector<Span>& param_spans,
                                   const std::vector<torch::headeronly::IntHeaderOnlyArrayRef>& param_sizes,
                                   const Device& device, bool optional, const char* expected, Want&& want,
                                   Use use = Use::kStep) {
  if (optional && list.empty()) return {};
  GRADACC_CHECK(list.size() == params.size(), op, ": ", arg, " must have one tensor per param (",
                params.size(), optional ? ") or none" : ")", ", got ", list.size());
  std::vector<Span> spans;
  spans.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    // params[i] is on `device` (checked first).
    torch::headeronly::IntHeaderOnlyArrayRef sizes;
    spans.push_back(check_tensor(op, arg, int64_t(i), list[i], device, use, &sizes));
    check_same_shape(op, arg, int64_t(i), sizes, "params", param_sizes[i]);
    check_pair_dtype(want(param_spans[i].dtype, spans.back().dtype), op, arg, int64_t(i), list[i], "params",
                     params[i], expected);
  }
  return spans;
}

// A state tensor's dtype: float64 for a float64 param (fp32 storage only), else float32, bfloat16 or uint8.
bool is_state_dtype(DType param, DType state) {
  if (param == DType::kFloat64) return state == DType::kFloat64;
  return state == DType::kFloat32 || state == DType::kBFloat16 || state == DType::kUInt8;
}

StateStorage storage_of(DType state) {
  if (state == DType::kBFloat16) return StateStorage::kBFloat16;
  return state == DType::kUInt8 ? StateStorage::kInt8 : StateStorage::kFloat;
}

int64_t num_blocks(int64_t numel) { return (numel + kQuantBlock - 1) / kQuantBlock; }

// The traits' option rules, thrown with the op's name (torch.optim's wording).
struct Rules {
  const char* op;
  void invalid(bool ok, const char* what, double value) const {
    GRADACC_CHECK(ok, op, ": Invalid ", what, ": ", value);
  }
  void require(bool ok, const char* message) const { GRADACC_CHECK(ok, op, ": ", message); }
};

// The arguments of one call of optimizer T, read from the stack by kind.
template <typename T>
struct StepArgs {
  TensorList params, grads, masters, steps, state[T::kSlots], scales[T::kSlots];
  std::optional<Tensor> lr_tensor, grad_mult, found_inf;
  OptimScalars scalars;
  int64_t mode = 0, seed = 0;

  explicit StepArgs(StableIValue* stack) {
    using torch::stable::detail::to;
    constexpr auto kArgs = step_args<T>();
    for (size_t i = 0; i < kArgs.size(); ++i) {
      const StableIValue v = stack[i];
      const int k = kArgs[i].index;
      switch (kArgs[i].what) {
        case StepArg::kParams: params = TensorList(v); break;
        case StepArg::kGrads: grads = TensorList(v); break;
        case StepArg::kState: state[k] = TensorList(v); break;
        case StepArg::kScales: scales[k] = TensorList(v); break;
        case StepArg::kMasters: masters = TensorList(v); break;
        case StepArg::kSteps: steps = TensorList(v); break;
        case StepArg::kLr: scalars.lr = to<double>(v); break;
        case StepArg::kLrTensor: lr_tensor = to<std::optional<Tensor>>(v); break;
        case StepArg::kGradMult: grad_mult = to<std::optional<Tensor>>(v); break;
        case StepArg::kFoundInf: found_inf = to<std::optional<Tensor>>(v); break;
        case StepArg::kOption: scalars.option[k] = (T::kBoolOptions >> k) & 1 ? to<bool>(v) : to<double>(v); break;
        case StepArg::kMaximize: scalars.maximize = to<bool>(v); break;
        case StepArg::kParamMode: mode = to<int64_t>(v); break;
        case StepArg::kSeed: seed = to<int64_t>(v); break;
      }
    }
  }
};

// The call's one storage, that of the first given state tensor (slot order): every other must share it.
template <typename T>
StateStorage checked_storage(const char* op, const StepArgs<T>& a, const std::vector<Span>* state) {
  int first = -1;
  for (int s = 0; s < T::kSlots && first < 0; ++s) first = state[s].empty() ? -1 : s;
  if (first < 0) return StateStorage::kFloat;
  const StateStorage storage = storage_of(state[first][0].dtype);
  for (int s = first; s < T::kSlots; ++s) {
    for (size_t i = 0; i < state[s].size(); ++i) {
      GRADACC_CHECK(storage_of(state[s][i].dtype) == storage, op, ": ", T::kState[s], "[", i, "] has dtype ",
                    dtype_name(dtype_of(a.state[s][i])), " but ", T::kState[first], "[0] has dtype ",
                    dtype_name(dtype_of(a.state[first][0])), "; all state lists must share one storage");
    }
  }
  return storage;
}

// The int8 rules: the slots T refuses as int8, then the scales lists, given exactly for int8 state lists:
// one contiguous 1-D float32 tensor per param of one absmax per kQuantBlock elements.
template <typename T>
void check_scales(const char* op, const StepArgs<T>& a, OptimParams& p, const Device& device) {
  const bool int8 = p.storage == StateStorage::kInt8;
  for (int s = 0; s < T::kSlots; ++s) {
    const char* why = T::kNoInt8[s];
    GRADACC_CHECK(!int8 || p.state[s].empty() || why == nullptr, op, ": ", T::kState[s],
                  " is uint8 (int8 states), which ", why, " does not support; use bf16 or fp32 states for ", why);
  }
  for (int s = 0; s < T::kSlots; ++s) {
    const char* name = ScalesNames<T>::kNames[s].data();
    const TensorList& list = a.scales[s];
    if (!int8 || p.state[s].empty()) {
      GRADACC_CHECK(list.empty(), op, ": ", name, " must be empty unless ", T::kState[s],
                    " is int8 (uint8 codes), got ", list.size(), " tensors");
      continue;
    }
    GRADACC_CHECK(list.size() == p.params.size(), op, ": ", name, " must have one tensor per param (",
                  p.params.size(), ") as ", T::kState[s], " is int8 (uint8 codes), got ", list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      torch::headeronly::IntHeaderOnlyArrayRef shape;
      const Span span = check_tensor(op, name, int64_t(i), list[i], device, Use::kStep, &shape);
      GRADACC_CHECK(span.dtype == DType::kFloat32, op, ": ", name, "[", i, "] has dtype ",
                    dtype_name(dtype_of(list[i])), "; expected float32");
      const int64_t blocks = num_blocks(p.params[i].numel);
      GRADACC_CHECK(shape.size() == 1 && shape[0] == blocks, op, ": ", name, "[", i, "] has shape ", shape_str(shape),
                    "; expected [", blocks, "] (one float32 absmax per ", kQuantBlock, " elements of params[", i,
                    "])");
      p.scales[s].push_back(span);
    }
  }
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
                                  "float32, bfloat16 or uint8 (float64 for a float64 param)", is_state_dtype,
                                  Use::kStepState);
    has[s] = !p.state[s].empty();
  }
  p.storage = checked_storage<T>(op, a, p.state);
  GRADACC_CHECK(p.storage != StateStorage::kBFloat16 || !p.steps.empty() || params.empty(), op,
                ": steps must be given for bfloat16 states (their stochastic rounding draws a fresh stream per step)");
  T::check_state(o, has, params.size(), rules);
  check_scales<T>(op, a, p, device);
  // Outputs in the order of optim_api._step (params, state, their scales, master_params, steps), then the inputs:
  // no input may be an output here, not even its own pair (the reference applies weight decay to params[i]
  // before it reads grads[i], the kernels read it first: they would differ).
  std::vector<Span> step_spans;  // the step counts are written too (one float32 each)
  for (float* step : p.steps) step_spans.push_back(Span{step, 1, DType::kFloat32});
  std::vector<MemoryArg> outputs{{"params", &p.params}};
  for (int s = 0; s < T::kSlots; ++s) outputs.push_back({T::kState[s], &p.state[s]});
  for (int s = 0; s < T::kSlots; ++s) outputs.push_back({ScalesNames<T>::kNames[s].data(), &p.scales[s]});
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
  GRADACC_CHECK(num_args == uint64_t(kNumStepArgs<T>), "gradacc.", T::kName, ": the schema has ", kNumStepArgs<T>,
                " arguments but the call passed ", num_args);
  const std::string op = "gradacc." + std::string(T::kName);
  const StepArgs<T> args(stack);
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
