// See requires_grad.h.
#include "requires_grad.h"

namespace gradacc {
namespace {

// 1 if `item` requires grad, 0 if not, -1 with Python's exception set.
int requires_grad(PyObject* item, PyObject* tensor_type, PyObject* descriptor, descrgetfunc get) {
  static PyObject* const name = PyUnicode_InternFromString("requires_grad");
  PyObject* flag = Py_TYPE(item) == reinterpret_cast<PyTypeObject*>(tensor_type)
                       ? get(descriptor, item, tensor_type)
                       : PyObject_GetAttr(item, name);
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
  const Py_ssize_t count = PyList_Size(tensors);
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = PyList_GetItem(tensors, i);  // borrowed; the list holds it
    if (item == Py_None) continue;
    const int truth = requires_grad(item, tensor_type, descriptor, get);
    if (truth < 0) return nullptr;
    if (truth) Py_RETURN_TRUE;
  }
  Py_RETURN_FALSE;
}

}  // namespace gradacc
