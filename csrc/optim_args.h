// The arguments of the fused optimizer ops, as compile-time data: the ones
// every step takes, written once here, with each optimizer's own (its traits'
// state lists and options, kernels/optim_traits.cuh) in their place. Both the
// schema ops.cpp defines (optim_schema<T>()) and the binding's reading of a
// call (binding_optim.cpp, by each argument's kind) follow from step_args<T>(),
// so no name is written twice and no schema string is parsed back.
// gradacc_ext/ops/optim_args.py is the Python description (OptimStep's
// schema_order; tests/ops/test_ops_optim.py holds it equal to the schemas).
#pragma once

#include <array>
#include <iterator>
#include <string>

#include "kernels/optim_traits.cuh"

namespace gradacc {

// What an argument of a step is. kState, kScales and kOption stand for the
// optimizer's own state lists, their int8 scales lists (<state>_scales) and
// options, in their slot and option order.
enum class StepArg {
  kParams,
  kGrads,
  kState,
  kScales,
  kMasters,
  kSteps,
  kLr,
  kLrTensor,
  kGradMult,
  kFoundInf,
  kOption,
  kMaximize,
  kParamMode,
  kSeed
};

// One argument of an optimizer op: its kind, its state slot or option index
// (kState, kScales, kOption), its schema type and its name.
struct StepArgDecl {
  StepArg what;
  int index;
  const char* type;
  const char* name;
};

// The arguments every optimizer op takes, in schema order, with the places of
// the optimizer's own. Every list but grads is written in place.
inline constexpr StepArgDecl kCommonStepArgs[] = {
    {StepArg::kParams, 0, "Tensor(a!)[]", "params"},
    {StepArg::kGrads, 0, "Tensor[]", "grads"},
    {StepArg::kState, 0, nullptr, nullptr},
    {StepArg::kScales, 0, nullptr, nullptr},
    {StepArg::kMasters, 0, "Tensor(e!)[]", "master_params"},
    {StepArg::kSteps, 0, "Tensor(f!)[]", "steps"},
    {StepArg::kLr, 0, "float", "lr"},
    {StepArg::kLrTensor, 0, "Tensor?", "lr_tensor"},
    {StepArg::kGradMult, 0, "Tensor?", "grad_mult"},
    {StepArg::kFoundInf, 0, "Tensor?", "found_inf"},
    {StepArg::kOption, 0, nullptr, nullptr},
    {StepArg::kMaximize, 0, "bool", "maximize"},
    {StepArg::kParamMode, 0, "int", "param_mode"},
    {StepArg::kSeed, 0, "int", "seed"},
};
// The state lists' types: their alias sets are b, c and d (e and f are master_params and steps);
// their scales lists' are g, h and i.
inline constexpr const char* kStateTypes[kMaxStateSlots] = {"Tensor(b!)[]", "Tensor(c!)[]", "Tensor(d!)[]"};
inline constexpr const char* kScalesTypes[kMaxStateSlots] = {"Tensor(g!)[]", "Tensor(h!)[]", "Tensor(i!)[]"};

// The names of optimizer T's scales lists, "<state>_scales", made at compile time from T::kState.
constexpr size_t kMaxArgName = 48;
template <typename T>
struct ScalesNames {
  static constexpr std::array<std::array<char, kMaxArgName>, kMaxStateSlots> kNames = [] {
    constexpr char kSuffix[] = "_scales";
    std::array<std::array<char, kMaxArgName>, kMaxStateSlots> out{};
    for (int s = 0; s < T::kSlots; ++s) {
      size_t n = 0;
      for (const char* c = T::kState[s]; *c != 0; ++c) out[s][n++] = *c;
      for (const char* c = kSuffix; *c != 0; ++c) out[s][n++] = *c;
      if (n >= kMaxArgName) throw "a state list's name is too long for its scales list";  // a compile error
    }
    return out;
  }();
};

template <typename T>
constexpr int kNumOptions = int(std::size(T::kOptions));
template <typename T>
constexpr int kNumStepArgs = int(std::size(kCommonStepArgs)) - 3 + 2 * T::kSlots + kNumOptions<T>;

// Optimizer T's arguments, in schema order.
template <typename T>
constexpr std::array<StepArgDecl, kNumStepArgs<T>> step_args() {
  static_assert(T::kSlots <= kMaxStateSlots && kNumOptions<T> <= kMaxOptions);
  std::array<StepArgDecl, kNumStepArgs<T>> out{};
  int n = 0;
  for (const StepArgDecl& a : kCommonStepArgs) {
    if (a.what == StepArg::kState) {
      for (int s = 0; s < T::kSlots; ++s) out[n++] = {a.what, s, kStateTypes[s], T::kState[s]};
    } else if (a.what == StepArg::kScales) {
      for (int s = 0; s < T::kSlots; ++s) out[n++] = {a.what, s, kScalesTypes[s], ScalesNames<T>::kNames[s].data()};
    } else if (a.what == StepArg::kOption) {
      for (int o = 0; o < kNumOptions<T>; ++o) {
        out[n++] = {a.what, o, (T::kBoolOptions >> o) & 1 ? "bool" : "float", T::kOptions[o]};
      }
    } else {
      out[n++] = a;
    }
  }
  return out;
}

// The schema of optimizer T's op.
template <typename T>
std::string optim_schema() {
  std::string s = std::string(T::kName) + "(";
  for (const StepArgDecl& a : step_args<T>()) s += std::string(s.back() == '(' ? "" : ", ") + a.type + " " + a.name;
  return s + ") -> ()";
}

}  // namespace gradacc
