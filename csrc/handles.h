// Deleting the tensor handles a call was handed (boxing.h's TensorList), with the GIL held once for all
// of them instead of once per tensor.
//
// The dispatcher moves each Tensor[] item into a new handle, so deleting that handle drops the tensor's
// last reference besides its Python object's. torch then releases its hold on the Python object
// (TensorImpl::decref_pyobject), which takes the GIL for a Py_DECREF; the op runs with the GIL released
// (torch.ops releases it), so each tensor paid a GIL acquire and release: 1,144 of an accumulate_ pair's
// ~4,000 instructions (callgrind; docs/stable-abi.md, "Host cost per tensor"). Holding the GIL across the
// loop makes each of those a re-entrant acquire.
#pragma once

#include <cstddef>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

namespace gradacc {

// Deletes every handle; the GIL is taken once around them where this thread runs Python (it has a
// Python thread state: the op was called from Python), else each delete does what torch does.
void delete_tensor_handles(const AtenTensorHandle* handles, size_t count) noexcept;

}  // namespace gradacc
