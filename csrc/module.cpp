// The Python module gradacc_ext._C, on CPython's limited API (abi3): it holds
// nothing. Importing it loads this library, whose static initialisers
// register the gradacc ops through the LibTorch stable ABI (ops.cpp); Python
// then reaches everything as torch.ops.gradacc.* (gradacc_ext/ops/_native.py).
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000  // CPython 3.10: one binary for 3.10 and later
#endif
#include <Python.h>

namespace {
PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "_C", "gradacc ops, registered with torch.ops.gradacc", -1, nullptr,
                        nullptr, nullptr, nullptr, nullptr};
}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&g_module); }
