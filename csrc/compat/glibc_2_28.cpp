// What the C++ CPU kernels and libstdc++'s headers would take from a glibc newer than 2.28 (glibc_pin.h).
#include "glibc_pin.h"

// GLIBC_2.29 dropped the SVID error-handling wrappers; the GLIBC_2.2.5 versions run the same code behind
// them, so the values are the same (errno / matherr differ only on domain errors, which nothing reads).
GRADACC_PIN_GLIBC(exp, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(log, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pow, "GLIBC_2.2.5");

// gcc 12's libstdc++ headers read glibc 2.32's __libc_single_threaded to skip the atomic instructions of a
// shared_ptr's reference count while the process has one thread. _C defines its own, hidden (so every
// reference in _C binds here and none reaches glibc), and 0, "perhaps several threads": the atomic path
// is always correct, only not skipped. torch runs its own threads anyway.
extern "C" {
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;
}
