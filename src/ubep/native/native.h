// Shared by ubep's compiled entries (checks.cpp, direct.cpp, door.cpp, staged.cpp,
// torch_path.cpp; module.cpp lists them).
#pragma once

#include <Python.h>
#include <time.h>
#include <torch/csrc/autograd/python_variable.h>

#include <initializer_list>
#include <utility>

// every layout shared with Python: generated from ubep/native/layout.py at build
#include "ubep_layout.h"

namespace ubep_native {

using namespace ubep_layout;

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

// `time.perf_counter()`'s clock in µs (`ubep.runtime.shm.waits.now_us`)
inline double now_us() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

// the names C++ uses on Python objects (`layout.NAMES`, by N_* index), given by
// `set_result_types` when the extension loads; no C++ source spells one
extern PyObject* names[N_LEN];

// `o` with its count raised: a new reference to hand on
inline PyObject* ref(PyObject* o) {
  Py_INCREF(o);
  return o;
}

// one owned reference, released on scope exit unless handed on
class Obj {
 public:
  explicit Obj(PyObject* p = nullptr) : p_(p) {}
  Obj(const Obj&) = delete;
  Obj& operator=(Obj&& o) noexcept { std::swap(p_, o.p_); return *this; }
  ~Obj() { Py_XDECREF(p_); }
  static Obj none() { Py_INCREF(Py_None); return Obj(Py_None); }
  explicit operator bool() const { return p_ != nullptr; }
  PyObject* get() const { return p_; }
  PyObject* release() { PyObject* p = p_; p_ = nullptr; return p; }
  PyObject* share() const { Py_XINCREF(p_); return p_; }   // a new reference, kept too
 private:
  PyObject* p_;
};

// -- the Buffer's side of a door (door.cpp, staged.cpp, torch_path.cpp): as `Buffer`'s Python
// path does it. A door shares state with the Buffer and its path through int64 arrays both
// hold (`layout`'s BW_* / DW_* / SW_* / TW_* words), never through their attributes; an error
// it raises is recorded by `Buffer` (`_failed`), as the Python path's errors are.

inline PyObject* not_taken() { Py_RETURN_NOTIMPLEMENTED; }

// the words of a state array (a C-contiguous int64 numpy array the door tuple holds)
int64_t* state_words(PyObject* arr);

// A door tuple read once per call: its first `Objs` words objects (borrowed from the tuple),
// the rest ints, in the order `layout`'s door tuple names them. `parse` is false with a
// TypeError naming `maker` if `t` is not such a tuple.
template <int64_t Len, int64_t Objs>
struct DoorWords {
  PyObject* o[Objs];
  int64_t v[Len];                          // v[Objs..] used
  bool parse(PyObject* t, const char* maker) {
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != Len) {
      PyErr_Format(PyExc_TypeError, "door must be the tuple %s made", maker);
      return false;
    }
    for (Py_ssize_t i = 0; i < Objs; ++i) o[i] = PyTuple_GET_ITEM(t, i);
    return ints(&PyTuple_GET_ITEM(t, 0) + Objs, Len - Objs, v + Objs);
  }
};

// the Buffer's lock held for the scope (`lock.acquire()`, which waits without the GIL);
// released on every way out, an error set meanwhile kept
class Locked {
 public:
  explicit Locked(PyObject* lock) : lock_(lock) {
    static PyObject* acquire = PyUnicode_InternFromString("acquire");   // threading.Lock's
    PyObject* r = PyObject_CallMethodNoArgs(lock_, acquire);
    ok_ = r != nullptr;
    Py_XDECREF(r);
  }
  ~Locked() {
    if (!ok_) return;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    static PyObject* release = PyUnicode_InternFromString("release");
    PyObject* r = PyObject_CallMethodNoArgs(lock_, release);
    if (r) Py_DECREF(r); else PyErr_Clear();
    PyErr_Restore(t, v, tb);
  }
  bool ok() const { return ok_; }
 private:
  PyObject* lock_;
  bool ok_;
};

// an int attribute of `o` (a result or handle, `name` from `names`); false with the error set
// if it is missing or not an int
inline bool get_int(PyObject* o, PyObject* name, int64_t& out) {
  PyObject* v = PyObject_GetAttr(o, name);
  if (!v) return false;
  out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return !(out == -1 && PyErr_Occurred());
}

// a fast check's rule (`dispatch_ready` / `combine_ready`) as a door asks it: a torch error
// inside it is "not sure", as in the Python check
inline bool passes(bool (*rule)(PyObject* const*, const int64_t*), PyObject* const* a,
                   const int64_t* lim) {
  try {
    return rule(a, lim);
  } catch (const std::exception&) {
    return false;
  }
}

// borrowed `dict[key]` or nullptr (no error: a missing key is "not taken")
inline PyObject* lookup(PyObject* dict, PyObject* k) {
  PyObject* v = PyDict_GetItemWithError(dict, k);
  if (!v) PyErr_Clear();
  return v;
}

// the fast checks' rules (checks.cpp): (x, topk_idx, topk_weights) against (hidden,
// num_experts, max_tokens, max_top_k); (expert_out) against (num_recv, hidden)
bool dispatch_ready(PyObject* const* a, const int64_t* lim);
bool combine_ready(PyObject* const* a, const int64_t* lim);
// combine's `out` as a door takes it: None, or a plain contiguous CPU tensor `[num_tokens,
// hidden]` of the (checked) rows' dtype, not requiring grad, sharing no byte with the rows
// nor with [avoid, avoid + avoid_len); anything else is the Python path's (which checks it
// and names the error)
bool out_ready(PyObject* out, PyObject* rows, int64_t num_tokens, int64_t avoid = 0,
               int64_t avoid_len = 0);

// the direct path's calls once their arguments are parsed (direct.cpp; `direct_dispatch` and
// `direct_combine` document them); `v`: direct_combine's ints in its argument order
PyObject* dispatch_call(int64_t* st, PyObject* x, PyObject* idx, PyObject* w, int64_t epoch,
                        int64_t code, int64_t roff, bool owned, PyObject* view, int64_t call,
                        int64_t buffer_id, double t0, PyObject* build);
PyObject* combine_call(int64_t* st, const int64_t* v, PyObject* origins, PyObject* out,
                       at::ScalarType dtype, double t0, PyObject* build, PyObject* copied,
                       PyObject* topk_idx);
// the result classes `set_result_types` gave (direct.cpp)
struct Results {
  PyObject *handle = nullptr, *dispatch = nullptr, *combine = nullptr, *stats = nullptr;
};
extern Results results;
// a tuple of new references (stolen); nullptr, every item released, if any is nullptr
PyObject* tuple_steal(std::initializer_list<PyObject*> items);
// an instance of `type` (object.__new__) whose dict maps the names to the values (stolen)
PyObject* instance(PyObject* type, std::initializer_list<std::pair<PyObject*, PyObject*>> kv);
// DeferredStats.of(build, *args) (args stolen)
PyObject* deferred_stats(PyObject* build, PyObject* args);
// numpy, for files without its C API: a new int64 array of n words; an array's data; a C-order
// int64 (or float32) view of `nd` <= 2 dims at `data` that keeps `base` alive
PyObject* np_words(int64_t n);
void* np_data(PyObject* arr);
PyObject* np_view(PyObject* base, void* data, int nd, const int64_t* dims, bool f32);
// `o` is a DispatchHandle (set_result_types); `o` is a handle's row origins array
bool is_handle(PyObject* o);
bool origins_ok(PyObject* o);
// the data address of numpy array `arr` (a kernel's argument word)
int64_t array_addr(PyObject* arr);
// What every door's combine checks first, before its lock: `handle` is a Handle of the Buffer
// `buffer_id`, `rows` passes `combine_ready` against its num_recv and hidden, `weighted_arg`
// has a truth value. 1: go on, hv[4] = (buffer_id, num_recv, hidden, num_tokens) and
// `weighted` set; 0: not the door's call (Python takes it, naming what is wrong); -1: a
// Python error is set.
int combine_handle(PyObject* handle, PyObject* rows, PyObject* weighted_arg,
                   int64_t buffer_id, int64_t* hv, int& weighted);

PyObject* dispatch_inputs_ready(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* combine_inputs_ready(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* direct_dispatch(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* direct_combine(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* set_result_types(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* door_dispatch(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* door_combine(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* torch_group(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* torch_dispatch(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* torch_combine(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* torch_door_dispatch(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* torch_door_combine(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* staged_door_dispatch(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* staged_door_combine(PyObject*, PyObject* const*, Py_ssize_t);
bool init_direct();     // numpy's C API, once at import
bool init_staged();     // the same for staged.cpp

}  // namespace ubep_native
