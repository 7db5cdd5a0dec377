// Op schemas (namespace gradacc), the CPU registrations and the build's facts.
//
// The schemas are defined here alone, from the ops' descriptions: core_ops.h
// (the core ops) and kernels/optim_traits.cuh (the optimizer steps). CPU
// kernels in cpu/, CUDA kernels in kernels/ with their registration in
// cuda/register_cuda.cpp; fake kernels and the
// pure-PyTorch reference in gradacc_ext/ops/_fake.py and gradacc_ext/ops/reference.py.
// Everything goes through the LibTorch stable ABI (stable.h); module.cpp is
// the Python module, which only loads this library.
#include <string>
#include <tuple>

#include "binding.h"
#include "binding_optim.h"
#include "boxing.h"
#include "core_ops.h"
#include "cpu/isa.h"
#include "cpu/kernels_cpu.h"
#include "stable.h"
#ifdef GRADACC_WITH_CUDA
#include "cuda/stream.h"
#endif

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

void accumulate_cpu(const TensorList& bufs, const TensorList& grads, double alpha,
                    const std::optional<Tensor>& alpha_tensor, bool assign) {
  cpu::accumulate(binding::accumulate_params(op_label<AccumulateOp>(), bufs, grads, alpha, alpha_tensor, assign));
}

void accumulate_final_cpu(const TensorList& bufs, const TensorList& grads, double alpha,
                          const std::optional<Tensor>& alpha_tensor, bool assign, const Tensor& found_inf,
                          const Tensor& norm_acc, double norm_type) {
  cpu::accumulate(binding::accumulate_final_params(op_label<AccumulateFinalOp>(), bufs, grads, alpha, alpha_tensor,
                                                   assign, found_inf, norm_acc, norm_type));
}

std::tuple<Tensor, Tensor> global_norm_cpu(const TensorList& tensors, double norm_type, bool per_tensor) {
  auto p = binding::norm_params(op_label<GlobalNormOp>(), tensors, norm_type);
  auto [total, each] = binding::norm_outputs(tensors, per_tensor, p);
  cpu::norm(p);
  return {total, each};
}

void unscale_cpu(const TensorList& tensors, const Tensor& inv_scale, const Tensor& found_inf) {
  cpu::scale(binding::unscale_params(op_label<UnscaleOp>(), tensors, inv_scale, found_inf));
}

void clip_by_norm_cpu(const TensorList& tensors, const Tensor& total_norm, double max_norm, double eps) {
  cpu::scale(binding::clip_norm_params(op_label<ClipByNormOp>(), tensors, total_norm, max_norm, eps));
}

void clip_by_value_cpu(const TensorList& tensors, double clip_value) {
  cpu::scale(binding::clip_value_params(op_label<ClipByValueOp>(), tensors, clip_value));
}

std::string quoted(const std::string& s) { return "\"" + s + "\""; }

std::string compiled_info() {
  std::string isas;
  for (auto isa : cpu::compiled_isas()) isas += (isas.empty() ? "" : ", ") + quoted(cpu::isa_name(isa));
#ifdef GRADACC_WITH_CUDA
  const std::string cuda = "\"with_cuda\": true, \"cuda_stream\": " + quoted(cuda::stream_lookup_status());
#else
  const std::string cuda = "\"with_cuda\": false";
#endif
  return "{\"torch_version\": " + quoted(GRADACC_TORCH_VERSION) + ", \"cuda_version\": " +
         quoted(GRADACC_CUDA_VERSION) + ", \"arch_list\": " + quoted(GRADACC_ARCH_LIST) + ", " + cuda +
         ", \"cpu_isas\": [" + isas + "]}";
}

std::string cpu_isa() { return cpu::isa_name(cpu::active_isa()); }
std::string supported_cpu_isa() { return cpu::isa_name(cpu::supported_isa()); }
void set_cpu_isa(const std::string& name) { cpu::set_active_isa(name); }
void init_cpu_isa(const std::string& capability) { cpu::init_capability(capability); }

}  // namespace

STABLE_TORCH_LIBRARY(gradacc, m) {
  // The core ops (core_ops.h says what each does).
  for_each_core_op([&](auto op) { m.def(op_schema<decltype(op)>().c_str()); });
  // Fused optimizer steps (kernels/optim_traits.cuh holds their schemas): torch's AdamW, SGD, ... on
  // grads * grad_mult with lr * lr_tensor; all of it, step counts included, is skipped when
  // found_inf != 0. param_mode: 0 round to nearest, 1 fp32 master weights, 2 stochastic rounding (seed).
  binding::define_optim_ops(m);
  // What this binary was built with (a JSON object), read by gradacc_ext.build_info(); the CPU kernel
  // variant in use (csrc/cpu/isa.h), the best one this CPU allows, and a way to pick a lower one so
  // tests can compare every variant on one machine. init_cpu_isa hands in
  // torch.backends.cpu.get_cpu_capability(), which the stable ABI cannot ask for (the loader calls it once).
  m.def("compiled_info() -> str");
  m.def("cpu_isa() -> str");
  m.def("supported_cpu_isa() -> str");
  m.def("set_cpu_isa(str name) -> ()");
  m.def("init_cpu_isa(str capability) -> ()");
}

void register_cpu_impls(torch::stable::detail::StableLibrary& m) {
  impl_op<AccumulateOp, &accumulate_cpu>(m);
  impl_op<AccumulateFinalOp, &accumulate_final_cpu>(m);
  impl_op<GlobalNormOp, &global_norm_cpu>(m);
  impl_op<UnscaleOp, &unscale_cpu>(m);
  impl_op<ClipByNormOp, &clip_by_norm_cpu>(m);
  impl_op<ClipByValueOp, &clip_by_value_cpu>(m);
  binding::impl_optim_ops<binding::run_cpu_step>(m);
}

STABLE_TORCH_LIBRARY_IMPL(gradacc, CPU, m) { register_cpu_impls(m); }

// A sparse tensor anywhere in the arguments routes the call to these keys.
// These registrations never compute: the binding's layout check rejects the
// sparse tensor by name before anything is written, instead of the
// dispatcher's bare "could not run 'gradacc::...' with SparseCPU".
STABLE_TORCH_LIBRARY_IMPL(gradacc, SparseCPU, m) { register_cpu_impls(m); }
STABLE_TORCH_LIBRARY_IMPL(gradacc, SparseCsrCPU, m) { register_cpu_impls(m); }
STABLE_TORCH_LIBRARY_IMPL(gradacc, SparseCUDA, m) { register_cpu_impls(m); }
STABLE_TORCH_LIBRARY_IMPL(gradacc, SparseCsrCUDA, m) { register_cpu_impls(m); }

// The ops without tensor arguments run whatever the device.
STABLE_TORCH_LIBRARY_IMPL(gradacc, CompositeExplicitAutograd, m) {
  m.impl("compiled_info", box<&compiled_info>);
  m.impl("cpu_isa", box<&cpu_isa>);
  m.impl("supported_cpu_isa", box<&supported_cpu_isa>);
  m.impl("set_cpu_isa", box<&set_cpu_isa>);
  m.impl("init_cpu_isa", box<&init_cpu_isa>);
}

}  // namespace gradacc

