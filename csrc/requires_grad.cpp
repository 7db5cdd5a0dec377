// See requires_grad.h.
#include "requires_grad.h"

namespace gradacc {
namespace {

// 1 if `item` requires grad, 0 if not, -1 with Python's exception set. `name` is the attribute's name, made on
// first use (a plain torch.Tensor never needs it).
int requires_grad(PyObject* item, PyObject* tensor_type, PyObject* descriptor, descrgetfunc get, PyObject*& name) {
  PyObject* flag = nullptr;
  if (Py_TYPE(item) == reinterpret_cast<PyTypeObject*>(tensor_type)) {
    flag = get(descriptor, item, tensor_type);
  } else {
    if (name == nullptr && (name = PyUnicode_InternFromString("requires_grad")) == nullptr) return -1;
    flag = PyObject_GetAttr(item, name);
  }
  if (flag == nullptr) return -1;
  const int truth = flag == Py_False ? 0 : flag == Py_True ? 1 : PyObject_IsTrue(flag);
  Py_DECREF(flag);
  return truth;
}

}  // namespace

PyObject* any_requires_grad(PyObject* /*self*/, PyObject* args) {
  PyObject *tensors = nullptr, *tensor_type = nullptr, *descriptor = nullptr;
  if (!PyArg_UnpackTuple(args, "any_requires_grad", 3, 3, &tensors, &tensor_type, &descriptor)) return nullptr;
  const auto get = reinterpret_cast<descrgetfunc>(PyType_GetSlot(Py_TYPE(descriptor), Py_tp_descr_get));
  if (!PyList_Check(tensors) || !PyType_Check(tensor_type) || get == nullptr) {
    PyErr_SetString(PyExc_TypeError, "any_requires_grad(tensors: list, tensor_type: type, descriptor)");
    return nullptr;
  }
  PyObject* name = nullptr;
  int found = 0;
  // As a list iterator walks: the size is read again each step, and each item is held while its flag is read
  // (a __torch_function__ override may run Python that changes the list).
  for (Py_ssize_t i = 0; found == 0 && i < PyList_Size(tensors); ++i) {
    PyObject* item = PyList_GetItem(tensors, i);
    if (item == Py_None) continue;
    Py_INCREF(item);
    found = requires_grad(item, tensor_type, descriptor, get, name);
    Py_DECREF(item);
  }
  Py_XDECREF(name);
  if (found < 0) return nullptr;
  return PyBool_FromLong(found);
}

}  // namespace gradacc
