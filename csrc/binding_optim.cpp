// Checks of the fused optimizer steps and their CPU registration.
// gradacc_ext/ops/_checks_optim.py mirrors these rule for rule; the per-tensor
// checks are binding.h's (Use::kStep), shared with the other ops.
#include "binding_optim.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <string>

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

void check_option(bool ok, const char* op, const char* what, double value) {
  TORCH_CHECK_VALUE(ok, op, ": Invalid ", what, ": ", value);
}

// Everything both steps share: params, grads, masters, steps, the scalars.
OptimParams common_params(const char* op, at::TensorList params, at::TensorList grads, at::TensorList master_params,
                          at::TensorList steps, bool steps_required, const StepScalars& s, double weight_decay,
                          bool maximize, int64_t mode, int64_t seed) {
  check_option(std::isfinite(s.lr) && s.lr >= 0.0, op, "learning rate", s.lr);
  check_option(std::isfinite(weight_decay) && weight_decay >= 0.0, op, "weight_decay value", weight_decay);
  TORCH_CHECK_VALUE(mode >= 0 && mode <= 2, op, ": mode must be 0 (nearest), 1 (master) or 2 (stochastic), got ",
                    mode);
  OptimParams p;
  const at::Device device = list_device(params, s.found_inf ? &*s.found_inf : nullptr);
  p.params = check_list(op, "params", params, device, Use::kStep);
  p.grads = check_companions(op, "grads", grads, params, p.params, false, "the param's dtype or float32",
                             [](DType param, DType grad) { return grad == param || grad == DType::kFloat32; });
  p.mode = ParamMode(mode);
  p.masters = check_companions(op, "master_params", master_params, params, p.params, true,
                               "float32 (master weights of a float16 or bfloat16 param)", [](DType param, DType m) {
                                 return m == DType::kFloat32 && (param == DType::kFloat16 || param == DType::kBFloat16);
                               });
  TORCH_CHECK_VALUE((p.mode == ParamMode::kMaster) == !p.masters.empty() || params.empty(), op,
                    ": master_params must be given exactly when mode is 1 (master), got ", master_params.size(),
                    " tensors with mode ", mode);

  TORCH_CHECK_VALUE(steps.size() == 1 || steps.size() == params.size() || (!steps_required && steps.empty()), op,
                    ": steps must hold one tensor per param (", params.size(), ") or one shared by all",
                    steps_required ? "" : " (or none)", ", got ", steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    check_scalar(op, ("steps[" + std::to_string(i) + "]").c_str(), steps[i], device);
    p.steps.push_back(steps[i].data_ptr<float>());
  }
  if (s.lr_tensor) {
    check_scalar(op, "lr_tensor", *s.lr_tensor, device);
    p.lr_ptr = s.lr_tensor->data_ptr<float>();
  }
  if (s.grad_mult) {
    check_scalar(op, "grad_mult", *s.grad_mult, device);
    p.grad_mult_ptr = s.grad_mult->data_ptr<float>();
  }
  if (s.found_inf) {
    check_scalar(op, "found_inf", *s.found_inf, device);
    p.found_inf = s.found_inf->data_ptr<float>();
  }
  p.scalars.lr = s.lr;
  p.scalars.weight_decay = weight_decay;
  p.scalars.maximize = maximize;
  p.seed = seed;
  return p;
}

}  // namespace

OptimParams adamw_params(const char* op, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList master_params,
                         at::TensorList steps, const StepScalars& scalars, double beta1, double beta2, double eps,
                         double weight_decay, bool maximize, int64_t mode, int64_t seed) {
  check_option(std::isfinite(eps) && eps >= 0.0, op, "epsilon value", eps);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, op, ": Invalid beta parameter at index 0: ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, op, ": Invalid beta parameter at index 1: ", beta2);
  OptimParams p = common_params(op, params, grads, master_params, steps, true, scalars, weight_decay, maximize, mode,
                                seed);
  p.kind = OptimKind::kAdamW;
  const char* state = "float32 (float64 for a float64 param)";
  p.state[0] = check_companions(op, "exp_avgs", exp_avgs, params, p.params, false, state, is_state_dtype);
  p.state[1] = check_companions(op, "exp_avg_sqs", exp_avg_sqs, params, p.params, false, state, is_state_dtype);
  p.state[2] = check_companions(op, "max_exp_avg_sqs", max_exp_avg_sqs, params, p.params, true, state,
                                is_state_dtype);
  p.scalars.beta1 = beta1;
  p.scalars.beta2 = beta2;
  p.scalars.eps = eps;
  return p;
}

OptimParams sgd_params(const char* op, at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                       at::TensorList master_params, at::TensorList steps, const StepScalars& scalars,
                       double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                       int64_t mode, int64_t seed) {
  check_option(std::isfinite(momentum) && momentum >= 0.0, op, "momentum value", momentum);
  check_option(std::isfinite(dampening), op, "dampening value", dampening);
  TORCH_CHECK_VALUE(!nesterov || (momentum > 0.0 && dampening == 0.0), op,
                    ": Nesterov momentum requires a momentum and zero dampening");
  // The first step is told by its count: momentum needs one, and stochastic
  // rounding draws a fresh stream per step.
  const bool steps_required = momentum != 0.0 || mode == int64_t(ParamMode::kStochastic);
  OptimParams p = common_params(op, params, grads, master_params, steps, steps_required, scalars, weight_decay,
                                maximize, mode, seed);
  p.kind = OptimKind::kSgd;
  const char* state = "float32 (float64 for a float64 param)";
  p.state[0] = check_companions(op, "momentum_buffers", momentum_buffers, params, p.params, true, state,
                                is_state_dtype);
  TORCH_CHECK_VALUE(momentum == 0.0 || !p.state[0].empty() || params.empty(), op,
                    ": momentum_buffers must be given when momentum != 0");
  if (momentum == 0.0) p.state[0].clear();  // no momentum: buffers are neither read nor written
  p.scalars.momentum = momentum;
  p.scalars.dampening = dampening;
  p.scalars.nesterov = nesterov;
  return p;
}

}  // namespace gradacc::binding

namespace gradacc {
namespace {

void adamw_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList master_params, at::TensorList steps, double lr,
                    const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_mult,
                    const std::optional<at::Tensor>& found_inf, double beta1, double beta2, double eps,
                    double weight_decay, bool maximize, int64_t mode, int64_t seed) {
  cpu::optim_step(binding::adamw_params("gradacc.adamw_step_", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                        master_params, steps, {lr, lr_tensor, grad_mult, found_inf}, beta1, beta2,
                                        eps, weight_decay, maximize, mode, seed));
}

void sgd_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                  at::TensorList master_params, at::TensorList steps, double lr,
                  const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_mult,
                  const std::optional<at::Tensor>& found_inf, double momentum, double dampening, double weight_decay,
                  bool nesterov, bool maximize, int64_t mode, int64_t seed) {
  cpu::optim_step(binding::sgd_params("gradacc.sgd_step_", params, grads, momentum_buffers, master_params, steps,
                                      {lr, lr_tensor, grad_mult, found_inf}, momentum, dampening, weight_decay,
                                      nesterov, maximize, mode, seed));
}

void register_cpu_optim(torch::Library& m) {
  m.impl("adamw_step_", &adamw_step_cpu);
  m.impl("sgd_step_", &sgd_step_cpu);
}

}  // namespace

TORCH_LIBRARY_IMPL(gradacc, CPU, m) { register_cpu_optim(m); }
// Sparse grads route here; the checks reject them by name (see ops.cpp).
TORCH_LIBRARY_IMPL(gradacc, SparseCPU, m) { register_cpu_optim(m); }
TORCH_LIBRARY_IMPL(gradacc, SparseCsrCPU, m) { register_cpu_optim(m); }
TORCH_LIBRARY_IMPL(gradacc, SparseCUDA, m) { register_cpu_optim(m); }
TORCH_LIBRARY_IMPL(gradacc, SparseCsrCUDA, m) { register_cpu_optim(m); }

}  // namespace gradacc
