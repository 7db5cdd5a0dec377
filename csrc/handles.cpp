// See handles.h. Python's limited API (abi3), as module.cpp.
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#include <Python.h>

#include "handles.h"

namespace gradacc {
namespace {

// One tensor gains nothing from the outer hold: torch's own acquire costs the same.
constexpr size_t kMinBatch = 2;

void delete_each(const AtenTensorHandle* handles, size_t count) noexcept {
  // A failed delete cannot be reported from a destructor; it would only leak the handle.
  for (size_t i = 0; i < count; ++i) aoti_torch_delete_tensor_object(handles[i]);
}

}  // namespace

void delete_tensor_handles(const AtenTensorHandle* handles, size_t count) noexcept {
  // A thread without a Python thread state never ran Python: its tensors may have no Python objects,
  // and taking the GIL there could only wait on another thread. Such a thread deletes as torch would.
  if (count < kMinBatch || !Py_IsInitialized() || PyGILState_GetThisThreadState() == nullptr) {
    delete_each(handles, count);
    return;
  }
  const PyGILState_STATE state = PyGILState_Ensure();  // re-entrant: a caller holding the GIL keeps it
  delete_each(handles, count);
  PyGILState_Release(state);
}

}  // namespace gradacc
