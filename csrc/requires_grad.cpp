// See requires_grad.h.
#include "requires_grad.h"

#include <cstring>

namespace gradacc {
namespace {

// The base type's requires_grad getter, found once per base type (a static type, which lives as long as the
// process): its PyGetSetDef entry, whose function the attribute lookup would reach through the descriptor.
struct Getter {
  PyTypeObject* base = nullptr;
  const PyGetSetDef* def = nullptr;  // null: none found, every item takes the attribute lookup
};

const PyGetSetDef* find_getter(PyTypeObject* base) {
  // PyType_GetSlot reads a static type's slots from CPython 3.10 on (the limited API this module targets).
  const auto* defs = static_cast<const PyGetSetDef*>(PyType_GetSlot(base, Py_tp_getset));
  if (defs == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  for (const PyGetSetDef* def = defs; def->name != nullptr; ++def) {
    if (std::strcmp(def->name, "requires_grad") == 0) return def->get != nullptr ? def : nullptr;
  }
  return nullptr;
}

// The getter to call directly on instances of exactly `tensor_type` or `base`, or null where the attribute lookup
// must decide: `tensor_type` must derive from `base` and find the very descriptor `base` holds (a subclass could
// override requires_grad, or torch.Tensor's be patched). -1 with Python's exception set on a failed lookup.
int direct_getter(PyTypeObject* tensor_type, PyTypeObject* base, PyObject* name, const PyGetSetDef*& out) {
  static Getter cache;
  out = nullptr;
  if (cache.base != base) cache = {base, find_getter(base)};
  if (cache.def == nullptr || !PyType_IsSubtype(tensor_type, base)) return 0;
  PyObject* own = PyObject_GetAttr(reinterpret_cast<PyObject*>(base), name);  // a getset descriptor, read on a type
  if (own == nullptr) return -1;
  PyObject* found = PyObject_GetAttr(reinterpret_cast<PyObject*>(tensor_type), name);
  if (found != nullptr && found == own) out = cache.def;
  Py_DECREF(own);
  if (found == nullptr) return -1;
  Py_DECREF(found);
  return 0;
}

// 1 if `flag` (a new reference, or null with Python's exception set) is true, 0 if not, -1 on an error.
int truth_of(PyObject* flag) {
  if (flag == nullptr) return -1;
  const int truth = flag == Py_False ? 0 : flag == Py_True ? 1 : PyObject_IsTrue(flag);
  Py_DECREF(flag);
  return truth;
}

int any_in(PyObject* tensors, PyTypeObject* tensor_type, PyTypeObject* base, PyObject* name) {
  const PyGetSetDef* def = nullptr;
  if (direct_getter(tensor_type, base, name, def) < 0) return -1;
  // Without a direct getter no item's type matches: every item takes the attribute lookup.
  PyTypeObject* const direct_a = def != nullptr ? tensor_type : nullptr;
  PyTypeObject* const direct_b = def != nullptr ? base : nullptr;
  getter get = def != nullptr ? def->get : nullptr;
  void* const closure = def != nullptr ? def->closure : nullptr;
  // As a list iterator walks, each item is held while its flag is read, and the pass stops where the list ends
  // now: a __torch_function__ override or mode may run Python that changes the list. The size is read once and
  // again only on reaching it; a list that shrank ends the pass at the first index past its end (IndexError).
  Py_ssize_t size = PyList_Size(tensors);
  for (Py_ssize_t i = 0;; ++i) {
    if (i >= size && i >= (size = PyList_Size(tensors))) return 0;
    PyObject* item = PyList_GetItem(tensors, i);
    if (item == nullptr) {
      PyErr_Clear();
      return 0;
    }
    PyTypeObject* type = Py_TYPE(item);
    Py_INCREF(item);
    PyObject* flag;
    if (type == direct_a || type == direct_b) {
      flag = get(item, closure);  // the common case: a plain tensor, read without the attribute lookup
      if (flag == Py_False) {  // a bool: immortal only from CPython 3.12, so its reference is still returned
        Py_DECREF(flag);
        Py_DECREF(item);
        continue;
      }
    } else if (item == Py_None) {
      Py_DECREF(item);
      continue;
    } else {
      flag = PyObject_GetAttr(item, name);
    }
    Py_DECREF(item);
    const int found = truth_of(flag);
    if (found != 0) return found;
  }
}

}  // namespace

PyObject* any_requires_grad(PyObject* /*self*/, PyObject* args) {
  PyObject *tensors = nullptr, *tensor_type = nullptr, *base = nullptr;
  if (!PyArg_UnpackTuple(args, "any_requires_grad", 3, 3, &tensors, &tensor_type, &base)) return nullptr;
  if (!PyList_Check(tensors) || !PyType_Check(tensor_type) || !PyType_Check(base)) {
    PyErr_SetString(PyExc_TypeError, "any_requires_grad(tensors: list, tensor_type: type, base: type)");
    return nullptr;
  }
  static PyObject* name = nullptr;  // made once, kept for the process
  if (name == nullptr && (name = PyUnicode_InternFromString("requires_grad")) == nullptr) return nullptr;
  const int found = any_in(tensors, reinterpret_cast<PyTypeObject*>(tensor_type), reinterpret_cast<PyTypeObject*>(base),
                           name);
  if (found < 0) return nullptr;
  return PyBool_FromLong(found);
}

}  // namespace gradacc
