// The core ops, each described once in C++: its name, its arguments (schema
// type and name, in schema order) and what it returns. From the description
// follow ops.cpp's schemas (op_schema<T>()), the name every registration uses
// and every error message starts with (op_label<T>()), and a compile-time
// check that each kernel registered for the op (impl_op<T, Fn>, in ops.cpp
// and cuda/register_cuda.cpp) takes exactly these arguments, one C++
// parameter per schema argument of the matching type.
// gradacc_ext/ops/core_args.py is the Python description (tests/ops/
// test_core_args.py holds both equal to the compiled schemas); the optimizer
// ops are described in kernels/optim_traits.cuh.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <type_traits>

#include "boxing.h"
#include "stable.h"

namespace gradacc {

// One argument of a schema: its type as the schema spells it, and its name.
struct ArgDecl {
  const char* type;
  const char* name;
};

// bufs[i] = (assign ? 0 : bufs[i]) + alpha * alpha_tensor * grads[i]
struct AccumulateOp {
  static constexpr const char* kName = "accumulate_";
  static constexpr ArgDecl kArgs[] = {
      {"Tensor(a!)[]", "bufs"}, {"Tensor[]", "grads"}, {"float", "alpha"}, {"Tensor?", "alpha_tensor"},
      {"bool", "assign"}};
  static constexpr const char* kReturns = "()";
};

// A bucket of the window's last fold, in one pass: accumulate, raise found_inf
// on a non-finite result, and ADD the results' sum of squares (norm_type 2) or
// max |x| (inf) into norm_acc. The results stay scaled (the window end
// multiplies the norm by inv_scale once).
struct AccumulateFinalOp {
  static constexpr const char* kName = "accumulate_final_";
  static constexpr ArgDecl kArgs[] = {
      {"Tensor(a!)[]", "bufs"},      {"Tensor[]", "grads"},         {"float", "alpha"},
      {"Tensor?", "alpha_tensor"},   {"bool", "assign"},            {"Tensor(b!)", "found_inf"},
      {"Tensor(c!)", "norm_acc"},    {"float", "norm_type"}};
  static constexpr const char* kReturns = "()";
};

// (total norm, per-tensor norms or an empty tensor), float32 (float64 for a
// list holding float64), deterministic.
struct GlobalNormOp {
  static constexpr const char* kName = "global_norm";
  static constexpr ArgDecl kArgs[] = {{"Tensor[]", "tensors"}, {"float", "norm_type"}, {"bool", "per_tensor"}};
  static constexpr const char* kReturns = "(Tensor, Tensor)";
};

// tensors *= inv_scale; found_inf = 1 if any input is non-finite.
struct UnscaleOp {
  static constexpr const char* kName = "unscale_";
  static constexpr ArgDecl kArgs[] = {
      {"Tensor(a!)[]", "tensors"}, {"Tensor", "inv_scale"}, {"Tensor(b!)", "found_inf"}};
  static constexpr const char* kReturns = "()";
};

// tensors *= min(1, max_norm / (total_norm + eps)), computed on the device.
struct ClipByNormOp {
  static constexpr const char* kName = "clip_by_norm_";
  static constexpr ArgDecl kArgs[] = {
      {"Tensor(a!)[]", "tensors"}, {"Tensor", "total_norm"}, {"float", "max_norm"}, {"float", "eps"}};
  static constexpr const char* kReturns = "()";
};

// tensors = clamp(tensors, -clip_value, clip_value)
struct ClipByValueOp {
  static constexpr const char* kName = "clip_by_value_";
  static constexpr ArgDecl kArgs[] = {{"Tensor(a!)[]", "tensors"}, {"float", "clip_value"}};
  static constexpr const char* kReturns = "()";
};

template <typename... T>
struct CoreOpList {};
using CoreOps = CoreOpList<AccumulateOp, AccumulateFinalOp, GlobalNormOp, UnscaleOp, ClipByNormOp, ClipByValueOp>;

// Calls f(T{}) for every core op.
template <typename F, typename... Ts>
void for_each_core_op_in(F&& f, CoreOpList<Ts...>) {
  (f(Ts{}), ...);
}
template <typename F>
void for_each_core_op(F&& f) {
  for_each_core_op_in(f, CoreOps{});
}

// "name(type arg, ...) -> returns", the schema ops.cpp defines.
template <typename T>
std::string op_schema() {
  std::string s = std::string(T::kName) + "(";
  for (const ArgDecl& a : T::kArgs) s += std::string(s.back() == '(' ? "" : ", ") + a.type + " " + a.name;
  return s + ") -> " + T::kReturns;
}

// "gradacc.<name>": the op as every error message names it.
template <typename T>
const char* op_label() {
  static const std::string label = std::string("gradacc.") + T::kName;
  return label.c_str();
}

namespace detail {

constexpr bool same_text(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) ++a, ++b;
  return *a == *b;
}
constexpr bool has_suffix(const char* s, char c) {
  char last = '\0';
  while (*s != '\0') last = *s++;
  return last == c;
}
constexpr bool has_prefix(const char* s, const char* prefix) {
  while (*prefix != '\0') {
    if (*s++ != *prefix++) return false;
  }
  return true;
}

// Whether a kernel parameter of type P takes a schema argument of `type`.
template <typename P>
constexpr bool takes(const char* type) {
  using B = std::remove_cv_t<std::remove_reference_t<P>>;
  if constexpr (std::is_same_v<B, TensorList>) return has_prefix(type, "Tensor") && has_suffix(type, ']');
  else if constexpr (std::is_same_v<B, std::optional<Tensor>>) return same_text(type, "Tensor?");
  else if constexpr (std::is_same_v<B, Tensor>)
    return has_prefix(type, "Tensor") && !has_suffix(type, ']') && !has_suffix(type, '?');
  else if constexpr (std::is_same_v<B, double>) return same_text(type, "float");
  else if constexpr (std::is_same_v<B, bool>) return same_text(type, "bool");
  else if constexpr (std::is_same_v<B, int64_t>) return same_text(type, "int");
  else return false;
}

template <typename T, typename R, typename... P>
constexpr bool kernel_takes_args(R (*)(P...)) {
  if (sizeof...(P) != std::size(T::kArgs)) return false;
  std::size_t i = 0;
  return (takes<P>(T::kArgs[i++].type) && ...);
}

}  // namespace detail

// Registers `Fn` as op T's kernel for m's dispatch key; it must take T's
// arguments, in order, one parameter each.
template <typename T, auto Fn>
void impl_op(torch::stable::detail::StableLibrary& m) {
  static_assert(detail::kernel_takes_args<T>(Fn), "the kernel's parameters are not the op's schema arguments");
  m.impl(T::kName, box<Fn>);
}

}  // namespace gradacc
