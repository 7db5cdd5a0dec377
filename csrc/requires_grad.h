// Whether any tensor of a list requires grad, read in one C pass: the public ops' leaf check
// (gradacc_ext/ops/_aliasing.py check_leaves), which runs on every call in grad mode.
//
// From Python, any(map(attrgetter("requires_grad"), tensors)) costs about 580 instructions per tensor,
// as much as a third of the compiled op's own host cost per tensor (callgrind). Of that, torch's getter
// is about 245 (its torch-function and warning-handler guards); the rest is the generic attribute lookup,
// attrgetter and map. Here a plain torch.Tensor's flag is read by calling the getter's C function itself,
// found once in torch._C.TensorBase's getset table (PyType_GetSlot, Py_tp_getset: the limited API reads a
// static type's slots from CPython 3.10 on), which also skips the descriptor's wrapper and its type check
// (about 45 per tensor). It is exactly what the attribute lookup calls for that type: each call checks that
// torch.Tensor finds TensorBase's own requires_grad descriptor. Any other object goes through the ordinary
// attribute lookup, as does every item where the getter is not found.
#pragma once

#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000  // as module.cpp: CPython's limited API (abi3)
#endif
#include <Python.h>

namespace gradacc {

// any_requires_grad(tensors: list, tensor_type: type, base: type) -> bool: tensor_type is torch.Tensor, base
// torch._C.TensorBase (the static type whose getset table holds the getter).
// None items are skipped (the op's validation names them); another object without requires_grad raises
// the attribute lookup's AttributeError.
PyObject* any_requires_grad(PyObject* self, PyObject* args);

}  // namespace gradacc
