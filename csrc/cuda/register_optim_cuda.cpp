// CUDA registrations of the fused optimizer steps (schemas in csrc/ops.cpp):
// binding_optim.cpp checks every argument, then the launcher runs on the
// params' device and the current stream. No host synchronisation.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../binding_optim.h"
#include "optim_launch.h"

namespace gradacc {
namespace {

void run_step(const OptimParams& p, at::TensorList params) {
  if (p.params.empty()) return;  // nothing to write (and no step counted), as on the CPU path via the API
  const c10::cuda::CUDAGuard guard(params[0].device());
  C10_CUDA_CHECK(cuda::launch_optim_step(p, c10::cuda::getCurrentCUDAStream().stream()));
}

void adamw_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList master_params,
                     at::TensorList steps, double lr, const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& grad_mult, const std::optional<at::Tensor>& found_inf,
                     double beta1, double beta2, double eps, double weight_decay, bool maximize, int64_t mode,
                     int64_t seed) {
  run_step(binding::adamw_params("gradacc.adamw_step_", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                 master_params, steps, {lr, lr_tensor, grad_mult, found_inf}, beta1, beta2, eps,
                                 weight_decay, maximize, mode, seed),
           params);
}

void sgd_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                   at::TensorList master_params, at::TensorList steps, double lr,
                   const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_mult,
                   const std::optional<at::Tensor>& found_inf, double momentum, double dampening,
                   double weight_decay, bool nesterov, bool maximize, int64_t mode, int64_t seed) {
  run_step(binding::sgd_params("gradacc.sgd_step_", params, grads, momentum_buffers, master_params, steps,
                               {lr, lr_tensor, grad_mult, found_inf}, momentum, dampening, weight_decay, nesterov,
                               maximize, mode, seed),
           params);
}

}  // namespace

TORCH_LIBRARY_IMPL(gradacc, CUDA, m) {
  m.impl("adamw_step_", &adamw_step_cuda);
  m.impl("sgd_step_", &sgd_step_cuda);
}

}  // namespace gradacc
