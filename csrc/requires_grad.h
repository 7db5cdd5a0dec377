// Whether any tensor of a list requires grad, read in one C pass: the public ops' leaf check
// (gradacc_ext/ops/_aliasing.py check_leaves), which runs on every call in grad mode.
//
// From Python, any(map(attrgetter("requires_grad"), tensors)) costs about 580 instructions per tensor,
// as much as a third of the compiled op's own host cost per tensor (callgrind). Of that, torch's getter
// is about 245 (its torch-function and warning-handler guards); the rest is the generic attribute lookup,
// attrgetter and map. Here a plain torch.Tensor's flag is read by calling the getter's descriptor
// directly (exactly what the attribute lookup finds for that type: torch.Tensor does not override it);
// any other object goes through the ordinary attribute lookup.
#pragma once

#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000  // as module.cpp: CPython's limited API (abi3)
#endif
#include <Python.h>

namespace gradacc {

// any_requires_grad(tensors: list, tensor_type: type, requires_grad: getset descriptor) -> bool.
// None items are skipped (the op's validation names them); another object without requires_grad raises
// the attribute lookup's AttributeError.
PyObject* any_requires_grad(PyObject* self, PyObject* args);

}  // namespace gradacc
