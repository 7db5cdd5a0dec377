// The CPU variant choice (see isa.h). Compiled once, for the baseline.
#include "isa.h"

#include <ATen/Version.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>

namespace gradacc::cpu {
namespace {

constexpr int8_t kUnset = -1;
std::atomic<int8_t> g_active{kUnset};

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "default";
  }
}

std::vector<Isa> compiled_isas() {
#if defined(GRADACC_CPU_X86_VARIANTS)
  return {Isa::kDefault, Isa::kAvx2, Isa::kAvx512};
#else
  return {Isa::kDefault};
#endif
}

Isa supported_isa() {
  // ATen has already checked the CPU (and the OS's register state) for its
  // own AVX2 / AVX512 kernels; our variants use no extension beyond those
  // (setup.py), so its answer is ours. It honours ATEN_CPU_CAPABILITY.
  const std::string capability = at::get_cpu_capability();
  Isa best = Isa::kDefault;
  if (capability == "AVX512") best = Isa::kAvx512;
  if (capability == "AVX2") best = Isa::kAvx2;
  return std::min(best, compiled_isas().back());
}

Isa active_isa() {
  int8_t isa = g_active.load(std::memory_order_relaxed);
  if (isa == kUnset) {
    isa = int8_t(supported_isa());
    g_active.store(isa, std::memory_order_relaxed);
  }
  return Isa(isa);
}

void set_active_isa(const std::string& name) {
  const Isa limit = supported_isa();
  for (Isa isa : compiled_isas()) {
    if (name != isa_name(isa)) continue;
    TORCH_CHECK_VALUE(isa <= limit, "gradacc cpu isa: '", name, "' is compiled in but this CPU (ATen capability ",
                      at::get_cpu_capability(), ") supports at most '", isa_name(limit), "'");
    g_active.store(int8_t(isa), std::memory_order_relaxed);
    return;
  }
  std::string names;
  for (Isa isa : compiled_isas()) names += std::string(names.empty() ? "" : ", ") + isa_name(isa);
  TORCH_CHECK_VALUE(false, "gradacc cpu isa: expected one of the compiled variants (", names, "), got '", name, "'");
}

}  // namespace gradacc::cpu
