// The binding layer: every tensor check of every op lives here.
//
// Each function validates the op's arguments completely, then converts them
// to the raw-pointer params of csrc/kernels/params.h. A bad argument throws
// (GRADACC_CHECK) a message that names it before any kernel runs, so nothing
// is written on an error path. The CPU (ops.cpp) and CUDA (cuda/register_cuda.cpp)
// registrations call these and then hand the params to their kernels.
#pragma once

#include <optional>
#include <vector>

#include "boxing.h"
#include "kernels/params.h"
#include "stable.h"

namespace gradacc::binding {

AccumulateParams accumulate_params(const char* op, const TensorList& bufs, const TensorList& grads, double alpha,
                                   const std::optional<Tensor>& alpha_tensor, bool assign);

// accumulate_params plus a last-fold bucket's found-inf flag and running norm partial (added to).
AccumulateParams accumulate_final_params(const char* op, const TensorList& bufs, const TensorList& grads, double alpha,
                                         const std::optional<Tensor>& alpha_tensor, bool assign,
                                         const Tensor& found_inf, const Tensor& norm_acc, double norm_type);

// Checks the list and the norm type; the outputs are allocated by the caller
// afterwards with norm_outputs().
NormParams norm_params(const char* op, const TensorList& tensors, double norm_type);

// Allocates (total, per_tensor) outputs on the list's device, float32, or
// float64 when the list holds a float64 tensor (params.wide), and
// points the params at them. per_tensor is empty unless requested.
std::pair<Tensor, Tensor> norm_outputs(const TensorList& tensors, bool per_tensor, NormParams& params);

ScaleParams unscale_params(const char* op, const TensorList& tensors, const Tensor& inv_scale,
                           const Tensor& found_inf);
ScaleParams clip_norm_params(const char* op, const TensorList& tensors, const Tensor& total_norm, double max_norm,
                             double eps);
ScaleParams clip_value_params(const char* op, const TensorList& tensors, double clip_value);

// ---- The per-tensor checks, shared by every op here and the optimizer
// steps (binding_optim.cpp); gradacc_ext/ops/_checks.py has the same ones
// under the same names, with the same messages.

// Which tensors a list accepts. kPaired (accumulate, unscale_): contiguous
// fp32/fp16/bf16, as the accumulate ops pair two lists element by element.
// kSingleList (norms, clips): float64 too (computed in double), and any dense
// non-overlapping tensor (channels_last, any permutation), visited in storage
// order. kStep (the fused optimizer steps): contiguous, float64 too. kStepState
// (their state lists): kStep's and uint8 (int8 state codes).
enum class Use { kPaired, kSingleList, kStep, kStepState };

// `arg`[i], a tensor the kernels read or write as one flat block of storage
// on `device` (every tensor of every list must be there). Each fact is read
// once, through one shim call; `sizes`, when given, receives the tensor's
// sizes for the pair checks that follow.
Span check_tensor(const char* op, const char* arg, int64_t i, TensorRef t, const Device& device, Use use,
                  torch::headeronly::IntHeaderOnlyArrayRef* sizes = nullptr);
// check_tensor of each item; `sizes`, when given, receives each item's sizes.
std::vector<Span> check_list(const char* op, const char* arg, const TensorList& list, const Device& device, Use use,
                             std::vector<torch::headeronly::IntHeaderOnlyArrayRef>* sizes = nullptr);
// `arg`[i] (of `shape`) pairs element by element with `ref_arg`[i] (of `ref_shape`).
void check_same_shape(const char* op, const char* arg, int64_t i, torch::headeronly::IntHeaderOnlyArrayRef shape,
                      const char* ref_arg, torch::headeronly::IntHeaderOnlyArrayRef ref_shape);
// `ok`: whether `arg`[i]'s dtype goes with `ref_arg`[i]'s; `expected` says which would.
void check_pair_dtype(bool ok, const char* op, const char* arg, int64_t i, TensorRef t, const char* ref_arg,
                      TensorRef ref, const char* expected);
// A one-element float32 tensor (a scale, flag, norm or step count) on `device`.
void check_scalar(const char* op, const char* arg, TensorRef t, const Device& device);
// The device of the list's first defined tensor; `fallback`'s (an output
// tensor; else the CPU) when there is none.
Device list_device(const TensorList& list, const Tensor* fallback);

}  // namespace gradacc::binding
