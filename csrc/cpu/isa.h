// Runtime ISA dispatch of the CPU kernels.
//
// setup.py compiles each file of CPU_ISA_SOURCES once per ISA, every time
// with -DGRADACC_CPU_ISA=<namespace>: isa_default (the compiler's baseline,
// on every platform) and, on x86-64 only, isa_avx2 and isa_avx512 (their -m
// flags are in setup.py; -ffp-contract=off in all of them, so every variant
// computes exactly the shared element math). It then defines
// GRADACC_CPU_X86_VARIANTS for every file of the extension.
//
// A kernel file puts its entry points in namespace
// gradacc::cpu::GRADACC_CPU_ISA, and its header declares each one with
// GRADACC_CPU_KERNEL(name, Params): that declares `void name(const Params&)`
// in every ISA namespace and defines gradacc::cpu::name(params), which calls
// the variant picked once per process from ATen's CPU capability (the value
// torch.backends.cpu.get_cpu_capability() reports, handed in by the loader;
// ATEN_CPU_CAPABILITY=default or avx2 lowers it).
//
// A new kernel file joins with three one-line changes (csrc/cpu/optim_cpu.cpp
// did): list it in CPU_ISA_SOURCES in setup.py, open its namespace as
// `namespace gradacc::cpu::GRADACC_CPU_ISA {`, and declare each entry point in
// its header as GRADACC_CPU_KERNEL(optim_step, OptimParams).
//
// The baseline objects come first on the link line (setup.py), so where an
// inline function of a shared header is compiled in several variants the
// linker keeps the baseline copy; tests/test_cpu_isa.py checks the binary.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#ifndef GRADACC_CPU_ISA
#define GRADACC_CPU_ISA isa_default
#endif

namespace gradacc::cpu {

// Ordered: a CPU that runs one runs all below it.
enum class Isa : int8_t { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

// The variant the entry points call: chosen on first use, then cached.
Isa active_isa();
const char* isa_name(Isa isa);
// Every variant in this binary, lowest first.
std::vector<Isa> compiled_isas();
// The best compiled variant this CPU and ATen's capability allow; before
// init_capability, the baseline.
Isa supported_isa();
// Records torch.backends.cpu.get_cpu_capability() ("DEFAULT", "AVX2",
// "AVX512"), which the stable ABI cannot query; the loader calls it once.
void init_capability(const std::string& aten_capability);
// Picks the variant by name ("default", "avx2", "avx512") for tests and
// benchmarks; throws if it is not compiled in or above supported_isa().
void set_active_isa(const std::string& name);

}  // namespace gradacc::cpu

#define GRADACC_CPU_DECLARE_IN(ns, name, Params) \
  namespace ns {                                 \
  void name(const Params& p);                    \
  }

#if defined(GRADACC_CPU_X86_VARIANTS)
#define GRADACC_CPU_KERNEL(name, Params)                                 \
  GRADACC_CPU_DECLARE_IN(isa_default, name, Params)                      \
  GRADACC_CPU_DECLARE_IN(isa_avx2, name, Params)                         \
  GRADACC_CPU_DECLARE_IN(isa_avx512, name, Params)                       \
  inline void name(const Params& p) {                                    \
    switch (::gradacc::cpu::active_isa()) {                              \
      case ::gradacc::cpu::Isa::kAvx512: return isa_avx512::name(p);     \
      case ::gradacc::cpu::Isa::kAvx2: return isa_avx2::name(p);         \
      default: return isa_default::name(p);                              \
    }                                                                    \
  }
#else
#define GRADACC_CPU_KERNEL(name, Params)            \
  GRADACC_CPU_DECLARE_IN(isa_default, name, Params) \
  inline void name(const Params& p) { isa_default::name(p); }
#endif
