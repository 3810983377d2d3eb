// Shared by ubep's compiled entries (checks.cpp, direct.cpp; module.cpp lists them).
#pragma once

#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

namespace ubep_native {

// `n` positional arguments, or a TypeError naming the count expected
inline bool arity(Py_ssize_t got, Py_ssize_t want) {
  if (got == want) return true;
  PyErr_Format(PyExc_TypeError, "expected %zd positional arguments, got %zd", want, got);
  return false;
}

// Python ints a[0..n) into out; false with the TypeError/OverflowError set
inline bool ints(PyObject* const* a, Py_ssize_t n, int64_t* out) {
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(a[i]);
    if (out[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

PyObject* dispatch_inputs_ready(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* combine_inputs_ready(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* direct_dispatch(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* direct_combine(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* set_result_types(PyObject*, PyObject* const*, Py_ssize_t);
bool init_direct();     // numpy's C API, once at import

}  // namespace ubep_native
