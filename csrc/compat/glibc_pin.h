// Binds a glibc function to an older symbol version, so that the wheels need glibc 2.28 at most
// (manylinux_2_28, torch's own tag; docs/install.md, "The manylinux tag").
//
// A binary linked on a newer glibc takes each function's newest version: dlopen@GLIBC_2.34 where glibc
// moved libdl and libpthread into libc, exp@GLIBC_2.29 where it dropped the SVID error wrappers. The old
// versions are still exported, for old binaries, by every glibc since. GRADACC_PIN_GLIBC(name, version)
// defines __wrap_<name>, a jump to <name>@<version>; setup.py links with -Wl,--wrap=<name> for each pin it
// finds in a source file (GLIBC_PIN_SOURCES), so every reference to <name> in the link, those of the
// static CUDA runtime's archive included, goes through it. A jump, not a call: the arguments and the
// result pass through untouched whatever the signature. x86-64 only (the `jmp`; the versions are x86-64's).
#pragma once

#if !defined(__x86_64__) || !defined(__linux__)
#error "glibc_pin.h: the pins are for x86-64 Linux; setup.py builds them only there"
#endif

#define GRADACC_PIN_GLIBC(name, version)                            \
  __asm__(".symver gradacc_pinned_" #name ", " #name "@" version "\n" \
          ".pushsection .text\n"                                    \
          ".globl __wrap_" #name "\n"                               \
          ".hidden __wrap_" #name "\n"                              \
          ".type __wrap_" #name ", @function\n"                     \
          "__wrap_" #name ":\n"                                     \
          "  jmp gradacc_pinned_" #name "@PLT\n"                    \
          ".size __wrap_" #name ", . - __wrap_" #name "\n"          \
          ".popsection\n")
