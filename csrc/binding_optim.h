// Binding layer of the fused optimizer steps: every tensor and option check
// of gradacc::adamw_step_ and gradacc::sgd_step_ (schemas in ops.cpp), then
// the raw-pointer OptimParams. A bad argument throws a c10::Error naming it
// before any kernel runs, so nothing is written on an error path.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/optim_params.h"

namespace gradacc::binding {

// The optional one-element float32 scalars both steps take.
struct StepScalars {
  double lr;
  const std::optional<at::Tensor>& lr_tensor;
  const std::optional<at::Tensor>& grad_mult;
  const std::optional<at::Tensor>& found_inf;
};

OptimParams adamw_params(const char* op, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList master_params,
                         at::TensorList steps, const StepScalars& scalars, double beta1, double beta2, double eps,
                         double weight_decay, bool maximize, int64_t mode, int64_t seed);

OptimParams sgd_params(const char* op, at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                       at::TensorList master_params, at::TensorList steps, const StepScalars& scalars,
                       double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                       int64_t mode, int64_t seed);

}  // namespace gradacc::binding
