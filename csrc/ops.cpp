// Op schemas (namespace gradacc), the CPU registrations and the Python module.
//
// Schemas live here alone; CPU kernels in cpu/, CUDA kernels in kernels/ with
// their registration in cuda/register_cuda.cpp; fake kernels and the
// pure-PyTorch reference in gradacc_ext/ops/_fake.py and gradacc_ext/ops/reference.py.
#include <ATen/ATen.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "binding.h"
#include "binding_optim.h"
#include "cpu/kernels_cpu.h"

#ifndef GRADACC_TORCH_VERSION
#define GRADACC_TORCH_VERSION "unknown"
#endif
#ifndef GRADACC_CUDA_VERSION
#define GRADACC_CUDA_VERSION ""
#endif
#ifndef GRADACC_ARCH_LIST
#define GRADACC_ARCH_LIST ""
#endif

namespace gradacc {
namespace {

void accumulate_cpu(at::TensorList bufs, at::TensorList grads, double alpha,
                    const std::optional<at::Tensor>& alpha_tensor, bool assign) {
  cpu::accumulate(binding::accumulate_params("gradacc.accumulate_", bufs, grads, alpha, alpha_tensor, assign));
}

void accumulate_final_cpu(at::TensorList bufs, at::TensorList grads, double alpha,
                          const std::optional<at::Tensor>& alpha_tensor, bool assign,
                          const std::optional<at::Tensor>& inv_scale, const at::Tensor& found_inf,
                          const at::Tensor& norm_out, double norm_type) {
  cpu::accumulate(binding::accumulate_final_params("gradacc.accumulate_final_", bufs, grads, alpha, alpha_tensor,
                                                   assign, inv_scale, found_inf, norm_out, norm_type));
}

std::tuple<at::Tensor, at::Tensor> global_norm_cpu(at::TensorList tensors, double norm_type, bool per_tensor) {
  auto p = binding::norm_params("gradacc.global_norm", tensors, norm_type);
  auto [total, each] = binding::norm_outputs(tensors, per_tensor, p);
  cpu::norm(p);
  return {total, each};
}

void unscale_cpu(at::TensorList tensors, const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  cpu::scale(binding::unscale_params("gradacc.unscale_", tensors, inv_scale, found_inf));
}

void clip_by_norm_cpu(at::TensorList tensors, const at::Tensor& total_norm, double max_norm, double eps) {
  cpu::scale(binding::clip_norm_params("gradacc.clip_by_norm_", tensors, total_norm, max_norm, eps));
}

void clip_by_value_cpu(at::TensorList tensors, double clip_value) {
  cpu::scale(binding::clip_value_params("gradacc.clip_by_value_", tensors, clip_value));
}

}  // namespace

TORCH_LIBRARY(gradacc, m) {
  // bufs[i] = (assign ? 0 : bufs[i]) + alpha * alpha_tensor * grads[i]
  m.def("accumulate_(Tensor(a!)[] bufs, Tensor[] grads, float alpha, Tensor? alpha_tensor, bool assign) -> ()");
  // The final micro-step in one pass: accumulate, multiply by inv_scale, raise
  // found_inf on a non-finite result, and write the results' norm to norm_out.
  m.def(
      "accumulate_final_(Tensor(a!)[] bufs, Tensor[] grads, float alpha, Tensor? alpha_tensor, bool assign, "
      "Tensor? inv_scale, Tensor(b!) found_inf, Tensor(c!) norm_out, float norm_type) -> ()");
  // (total norm, per-tensor norms or an empty tensor), float32, deterministic.
  m.def("global_norm(Tensor[] tensors, float norm_type, bool per_tensor) -> (Tensor, Tensor)");
  // tensors *= inv_scale; found_inf = 1 if any input is non-finite.
  m.def("unscale_(Tensor(a!)[] tensors, Tensor inv_scale, Tensor(b!) found_inf) -> ()");
  // tensors *= min(1, max_norm / (total_norm + eps)), computed on the device.
  m.def("clip_by_norm_(Tensor(a!)[] tensors, Tensor total_norm, float max_norm, float eps) -> ()");
  // tensors = clamp(tensors, -clip_value, clip_value)
  m.def("clip_by_value_(Tensor(a!)[] tensors, float clip_value) -> ()");
  // Fused optimizer steps (kernels/optim_traits.cuh holds their schemas): torch's AdamW, SGD, ... on
  // grads * grad_mult with lr * lr_tensor; all of it, step counts included, is skipped when
  // found_inf != 0. param_mode: 0 round to nearest, 1 fp32 master weights, 2 stochastic rounding (seed).
  binding::define_optim_ops(m);
}

void register_cpu_impls(torch::Library& m) {
  m.impl("accumulate_", &accumulate_cpu);
  m.impl("accumulate_final_", &accumulate_final_cpu);
  m.impl("global_norm", &global_norm_cpu);
  m.impl("unscale_", &unscale_cpu);
  m.impl("clip_by_norm_", &clip_by_norm_cpu);
  m.impl("clip_by_value_", &clip_by_value_cpu);
}

TORCH_LIBRARY_IMPL(gradacc, CPU, m) { register_cpu_impls(m); }

// A sparse tensor anywhere in the arguments routes the call to these keys.
// These registrations never compute: the binding's layout check rejects the
// sparse tensor by name before anything is written, instead of the
// dispatcher's bare "could not run 'gradacc::...' with SparseCPU".
TORCH_LIBRARY_IMPL(gradacc, SparseCPU, m) { register_cpu_impls(m); }
TORCH_LIBRARY_IMPL(gradacc, SparseCsrCPU, m) { register_cpu_impls(m); }
TORCH_LIBRARY_IMPL(gradacc, SparseCUDA, m) { register_cpu_impls(m); }
TORCH_LIBRARY_IMPL(gradacc, SparseCsrCUDA, m) { register_cpu_impls(m); }

}  // namespace gradacc

// What this binary was built with, read by gradacc_ext.build_info().
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("compiled_info", [] {
    pybind11::dict d;
    d["torch_version"] = GRADACC_TORCH_VERSION;
    d["cuda_version"] = GRADACC_CUDA_VERSION;
    d["arch_list"] = GRADACC_ARCH_LIST;
#ifdef GRADACC_WITH_CUDA
    d["with_cuda"] = true;
#else
    d["with_cuda"] = false;
#endif
    pybind11::list isas;
    for (auto isa : gradacc::cpu::compiled_isas()) isas.append(gradacc::cpu::isa_name(isa));
    d["cpu_isas"] = isas;
    return d;
  });
  // The CPU kernel variant in use (csrc/cpu/isa.h), and a way to pick a lower
  // one so tests can compare every variant on one machine.
  m.def("cpu_isa", [] { return std::string(gradacc::cpu::isa_name(gradacc::cpu::active_isa())); });
  m.def("supported_cpu_isa", [] { return std::string(gradacc::cpu::isa_name(gradacc::cpu::supported_isa())); });
  m.def("set_cpu_isa", &gradacc::cpu::set_active_isa, pybind11::arg("name"));
}
