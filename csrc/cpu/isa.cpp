// The CPU variant choice (see isa.h). Compiled once, for the baseline.
#include "isa.h"

#include <algorithm>
#include <atomic>
#include <mutex>

#include "../stable.h"

namespace gradacc::cpu {
namespace {

constexpr int8_t kUnset = -1;
std::atomic<int8_t> g_active{kUnset};
// torch.backends.cpu.get_cpu_capability(), handed in by the loader (init_capability).
std::mutex g_capability_mutex;
std::string g_capability = "DEFAULT";

std::string capability() {
  const std::lock_guard<std::mutex> lock(g_capability_mutex);
  return g_capability;
}

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

void init_capability(const std::string& aten_capability) {
  const std::lock_guard<std::mutex> lock(g_capability_mutex);
  if (aten_capability == g_capability) return;  // a second load keeps the variant a test picked
  g_capability = aten_capability;
  g_active.store(kUnset, std::memory_order_relaxed);  // chosen again on next use
}

Isa supported_isa() {
  // ATen has already checked the CPU (and the OS's register state) for its
  // own AVX2 / AVX512 kernels; our variants use no extension beyond those
  // (setup.py), so its answer is ours. It honours ATEN_CPU_CAPABILITY. The
  // stable ABI cannot ask for it: Python hands it in (init_capability).
  const std::string aten = capability();
  Isa best = Isa::kDefault;
  if (aten == "AVX512") best = Isa::kAvx512;
  if (aten == "AVX2") best = Isa::kAvx2;
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
    GRADACC_CHECK(isa <= limit, "gradacc cpu isa: '", name, "' is compiled in but this CPU (ATen capability ",
                  capability(), ") supports at most '", isa_name(limit), "'");
    g_active.store(int8_t(isa), std::memory_order_relaxed);
    return;
  }
  std::string names;
  for (Isa isa : compiled_isas()) names += std::string(names.empty() ? "" : ", ") + isa_name(isa);
  fail("gradacc cpu isa: expected one of the compiled variants (", names, "), got '", name, "'");
}

}  // namespace gradacc::cpu
