// The Python module gradacc_ext._C, on CPython's limited API (abi3).
// Importing it loads this library, whose static initialisers register the
// gradacc ops through the LibTorch stable ABI (ops.cpp); Python then reaches
// them as torch.ops.gradacc.* (gradacc_ext/ops/_native.py). Its one function
// is the public ops' requires_grad pass (requires_grad.h), which needs Python
// objects, not tensors.
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000  // CPython 3.10: one binary for 3.10 and later
#endif
#include <Python.h>

#include "requires_grad.h"

namespace {
PyMethodDef g_methods[] = {
    {"any_requires_grad", gradacc::any_requires_grad, METH_VARARGS,
     "any_requires_grad(tensors: list, tensor_type: type, base: type) -> bool"},
    {nullptr, nullptr, 0, nullptr}};
PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "_C", "gradacc ops, registered with torch.ops.gradacc", -1, g_methods,
                        nullptr, nullptr, nullptr, nullptr};
}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&g_module); }
