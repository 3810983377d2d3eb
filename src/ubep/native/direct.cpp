// The shm direct path's one-worker dispatch and combine as one C++ entry each: the Python
// glue around its numba kernels (result arrays, the recv_x view, the combine output, the
// result objects, two or three kernel entries) was ~25 µs of a ~48 µs batch-1
// dispatch+combine in one process; here the kernels run as numba cfuncs called by address
// (`runtime/shm/direct/entries.py`), with no Python in between. The protocol is entirely
// theirs: this file only allocates, passes pointers and makes the results.
//
// Each entry returns early, with what it made so far, when a wait is needed (counts or rows
// not all in after the kernels' inline spins, tokens not all summed): the Python path then
// waits with its deadlines and named errors as on its own path.
#include "native.h"

#include <numpy/arrayobject.h>

namespace {

using namespace ubep_layout;
using ubep_native::names;
using ubep_native::now_us;
using ubep_native::Obj;
using ubep_native::ref;
using ubep_native::deferred_stats;
using ubep_native::instance;
using ubep_native::results;
using ubep_native::tuple_steal;

// ST_* words of the path's kept state and D_* / C_* of one call's block: `layout`'s

using Kernel = void (*)(int64_t*, int64_t*);

// run kernel `which` on (st, c) without the GIL, as the numba entries of the Python path do
// (they are nogil): other threads of this process run while rows move; the kernels touch
// only memory whose owners this call holds
inline void run(int64_t* st, St which, int64_t* c) {
  Kernel k = reinterpret_cast<Kernel>(static_cast<intptr_t>(st[which]));
  Py_BEGIN_ALLOW_THREADS
  k(st, c);
  Py_END_ALLOW_THREADS
}

// false with a TypeError unless every one of `objs` is a tensor
bool tensors(std::initializer_list<PyObject*> objs) {
  for (PyObject* o : objs)
    if (!THPVariable_Check(o)) {
      PyErr_Format(PyExc_TypeError, "expected a torch.Tensor, got %s", Py_TYPE(o)->tp_name);
      return false;
    }
  return true;
}

PyObject* np_empty(int nd, npy_intp* dims, int type) {
  return PyArray_EMPTY(nd, dims, type, 0);
}

// `[n, hidden]` rows at the start of `v` (a kept `[rows, hidden]` view of shared memory),
// sharing its storage: the storage's use count is how the owned path knows an area is held
// (`DirectPath._free_area`), so the view must hold the storage itself, as `as_strided` does
at::Tensor rows_of(const at::Tensor& v, int64_t n) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(v.storage()), v.key_set(),
                                                   v.dtype());
  impl->set_storage_offset(v.storage_offset());
  impl->set_sizes_contiguous({n, v.size(1)});
  return at::Tensor(std::move(impl));
}

PyObject* times(double t0, double t1, double t2) {
  return tuple_steal({PyFloat_FromDouble(t0), PyFloat_FromDouble(t1), PyFloat_FromDouble(t2)});
}

}  // namespace

namespace ubep_native {

// a tuple of new references (stolen); nullptr, every item released, if any is nullptr
PyObject* tuple_steal(std::initializer_list<PyObject*> items) {
  bool ok = true;
  for (PyObject* o : items) ok = ok && o;
  PyObject* t = ok ? PyTuple_New(static_cast<Py_ssize_t>(items.size())) : nullptr;
  if (!t) {
    for (PyObject* o : items) Py_XDECREF(o);
    return nullptr;
  }
  Py_ssize_t i = 0;
  for (PyObject* o : items) PyTuple_SET_ITEM(t, i++, o);
  return t;
}

// The Python classes a call's results are made of, and their fields' names: `set_result_types`
// (ubep.handle's DispatchHandle, DispatchResult, CombineResult; ubep.stats' DeferredStats).
// Made as `ubep.handle.new_handle` / `new_dispatch_result` / `new_combine_result` and
// `DeferredStats.of` make them (the instance dict filled directly); tests/test_native.py
// checks both make the same objects.
Results results;
PyObject* names[N_LEN] = {};

// an instance of `type` made by object.__new__ whose dict maps the names to the values
// (new references, stolen); nullptr with the error set if any value is nullptr
PyObject* instance(PyObject* type, std::initializer_list<std::pair<PyObject*, PyObject*>> kv) {
  bool ok = true;
  for (auto& p : kv) ok = ok && p.first && p.second;
  PyObject* o = nullptr;
  PyObject* d = nullptr;
  if (ok) {
    PyObject* empty = PyTuple_New(0);
    o = empty ? PyBaseObject_Type.tp_new(reinterpret_cast<PyTypeObject*>(type), empty, nullptr)
              : nullptr;
    Py_XDECREF(empty);
    d = o ? PyObject_GenericGetDict(o, nullptr) : nullptr;
  }
  for (auto& p : kv) {
    if (d && PyDict_SetItem(d, p.first, p.second) < 0) {
      Py_CLEAR(d);
      Py_CLEAR(o);
    }
    Py_XDECREF(p.second);
  }
  if (!d) {
    Py_XDECREF(o);
    return nullptr;
  }
  Py_DECREF(d);
  return o;
}

// DeferredStats.of(build, *args)
PyObject* deferred_stats(PyObject* build, PyObject* args) {
  Py_INCREF(build);
  return instance(results.stats, {{names[N_PENDING], tuple_steal({build, args})}});
}

int64_t* state_words(PyObject* arr) { return static_cast<int64_t*>(np_data(arr)); }


PyObject* np_words(int64_t n) {
  npy_intp dims[1] = {n};
  return PyArray_EMPTY(1, dims, NPY_INT64, 0);
}

void* np_data(PyObject* arr) { return PyArray_DATA(reinterpret_cast<PyArrayObject*>(arr)); }

PyObject* np_view(PyObject* base, void* data, int nd, const int64_t* dims, bool f32) {
  npy_intp d[2] = {static_cast<npy_intp>(dims[0]), nd > 1 ? static_cast<npy_intp>(dims[1]) : 0};
  PyObject* v = PyArray_New(&PyArray_Type, nd, d, f32 ? NPY_FLOAT32 : NPY_INT64, nullptr, data,
                            0, NPY_ARRAY_CARRAY, nullptr);
  if (!v) return nullptr;
  if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(v), ref(base)) < 0) {
    Py_DECREF(v);
    return nullptr;
  }
  return v;
}

bool is_handle(PyObject* o) {
  return results.handle && Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(results.handle);
}

int combine_handle(PyObject* handle, PyObject* rows, PyObject* weighted_arg,
                   int64_t buffer_id, int64_t* hv, int& weighted) {
  if (!is_handle(handle)) return 0;
  if (!get_int(handle, names[N_BUFFER_ID], hv[0]) || !get_int(handle, names[N_NUM_RECV], hv[1])
      || !get_int(handle, names[N_HIDDEN], hv[2]) || !get_int(handle, names[N_NUM_TOKENS], hv[3]))
    return -1;
  if (hv[0] != buffer_id || !passes(combine_ready, &rows, hv + 1)) return 0;
  weighted = PyObject_IsTrue(weighted_arg);
  return weighted < 0 ? -1 : 1;
}

int64_t array_addr(PyObject* arr) {
  return reinterpret_cast<intptr_t>(PyArray_DATA(reinterpret_cast<PyArrayObject*>(arr)));
}

bool origins_ok(PyObject* o) {
  PyArrayObject* a = reinterpret_cast<PyArrayObject*>(o);
  return PyArray_Check(o) && PyArray_TYPE(a) == NPY_INT64 && PyArray_NDIM(a) == 2
      && PyArray_IS_C_CONTIGUOUS(a) && PyArray_DIM(a, 0) == 3;
}

bool init_direct() {
  import_array1(false);
  return true;
}

// set_result_types(DispatchHandle, DispatchResult, CombineResult, DeferredStats, NAMES)
PyObject* set_result_types(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!arity(nargs, 5)) return nullptr;
  for (int i = 0; i < 4; ++i)
    if (!PyType_Check(a[i])) {
      PyErr_SetString(PyExc_TypeError, "set_result_types takes four classes and the names");
      return nullptr;
    }
  if (!PyTuple_Check(a[4]) || PyTuple_GET_SIZE(a[4]) != N_LEN) {
    PyErr_Format(PyExc_TypeError, "names must be layout.NAMES, a tuple of %d strings",
                 static_cast<int>(N_LEN));
    return nullptr;
  }
  for (int i = 0; i < N_LEN; ++i) {
    PyObject* n = PyTuple_GET_ITEM(a[4], i);
    if (!PyUnicode_Check(n)) {
      PyErr_SetString(PyExc_TypeError, "names must be strings");
      return nullptr;
    }
    Py_INCREF(n);
    PyUnicode_InternInPlace(&n);
    Py_XSETREF(names[i], n);
  }
  PyObject** slots[4] = {&results.handle, &results.dispatch, &results.combine, &results.stats};
  for (int i = 0; i < 4; ++i) {
    Py_INCREF(a[i]);
    Py_XSETREF(*slots[i], a[i]);
  }
  Py_RETURN_NONE;
}

// direct_dispatch(st_addr, x, topk_idx, topk_weights, epoch, code, roff, owned, view, call,
//                 buffer_id, t0, build) -> DispatchResult, or
//   (left, n, missing, tpe, ints, wts, state, recv_x, t1) when the call is not complete
// The DispatchResult (its handle and DeferredStats(build, ...) too) when every row arrived
// and `build` (the path's stats builder) is not None.
// `left` > 0: some ranks' counts are not in yet (mine are published; nothing after that
// ran). Else `n` rows (n < 0: rank `missing` dispatches another dtype), `missing` of them not
// arrived yet; `recv_x` `[n, hidden]` on `view`. `state` is the handle's: (idx address,
// weights address, K, epoch, pos address, pos (owned: a fresh array, else None), ints).
PyObject* direct_dispatch(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!arity(nargs, 13)) return nullptr;
  int64_t v[6];                               // st_addr, epoch, code, roff, call, buffer_id
  PyObject* ia[6] = {a[0], a[4], a[5], a[6], a[9], a[10]};
  if (!ints(ia, 6, v)) return nullptr;
  const double t0 = PyFloat_AsDouble(a[11]);
  if (t0 == -1.0 && PyErr_Occurred()) return nullptr;
  int owned = PyObject_IsTrue(a[7]);
  if (owned < 0 || !tensors({a[1], a[2], a[3]})) return nullptr;
  if (a[8] != Py_None && !tensors({a[8]})) return nullptr;
  return dispatch_call(reinterpret_cast<int64_t*>(static_cast<intptr_t>(v[0])), a[1], a[2],
                       a[3], v[1], v[2], v[3], owned, a[8], v[4], v[5], t0, a[12]);
}

PyObject* dispatch_call(int64_t* st, PyObject* x_obj, PyObject* idx_obj, PyObject* w_obj,
                        int64_t epoch, int64_t code, int64_t roff, bool owned, PyObject* view,
                        int64_t call, int64_t buffer_id, double t0, PyObject* build) {
  try {
    const at::Tensor& x = THPVariable_Unpack(x_obj);
    const at::Tensor& idx = THPVariable_Unpack(idx_obj);
    const at::Tensor& w = THPVariable_Unpack(w_obj);
    const int64_t t_n = idx.size(0), k_n = idx.size(1);
    int64_t c[D_LEN] = {};
    c[D_EPOCH] = epoch;
    c[D_CODE] = code;
    c[D_ROFF] = roff;
    c[D_IDX] = reinterpret_cast<intptr_t>(idx.const_data_ptr());
    c[D_W] = reinterpret_cast<intptr_t>(w.const_data_ptr());
    c[D_T] = t_n;
    c[D_K] = k_n;
    Obj keep = Obj::none();
    if (owned) {
      npy_intp dk = t_n * k_n;
      keep = Obj(np_empty(1, &dk, NPY_INT64));
      if (!keep) return nullptr;
      c[D_POS] = array_addr(keep.get());
    } else {
      c[D_POS] = st[ST_POS];
    }
    run(st, ST_BEGIN, c);
    const double t1 = now_us();
    Obj tpe = Obj::none(), origins = Obj::none(), wts = Obj::none(), recv_x = Obj::none();
    if (c[D_LEFT] > 0) {
      c[D_N] = -1;
    } else {
      const int64_t n = c[D_N];
      npy_intp d_el = st[ST_EL], d_ints[2] = {3, n}, d_n = n;
      tpe = Obj(np_empty(1, &d_el, NPY_INT64));
      origins = Obj(np_empty(2, d_ints, NPY_INT64));
      wts = Obj(np_empty(1, &d_n, NPY_FLOAT32));
      if (!tpe || !origins || !wts) return nullptr;
      c[D_TPE] = array_addr(tpe.get());
      c[D_INTS] = array_addr(origins.get());
      c[D_WTS] = array_addr(wts.get());
      c[D_X] = reinterpret_cast<intptr_t>(x.const_data_ptr());
      c[D_RB] = x.size(1) * static_cast<int64_t>(x.element_size());
      c[D_DST] = 0;
      run(st, ST_ROWS, c);
      if (c[D_N] >= 0 && view != Py_None) {
        recv_x = Obj(THPVariable_Wrap(rows_of(THPVariable_Unpack(view), c[D_N])));
        if (!recv_x) return nullptr;
      }
    }
    Obj state(tuple_steal({PyLong_FromLongLong(c[D_IDX]), PyLong_FromLongLong(c[D_W]),
                           PyLong_FromLongLong(k_n), PyLong_FromLongLong(c[D_EPOCH]),
                           PyLong_FromLongLong(c[D_POS]), keep.release(), origins.share()}));
    if (!state) return nullptr;
    if (c[D_LEFT] == 0 && c[D_N] >= 0 && c[D_MISSING] == 0 && build != Py_None
        && results.dispatch) {
      const int64_t n = c[D_N];
      PyObject* handle = instance(results.handle, {
          {names[N_BUFFER_ID], PyLong_FromLongLong(buffer_id)},
          {names[N_CALL], PyLong_FromLongLong(call)},
          {names[N_NUM_TOKENS], PyLong_FromLongLong(t_n)},
          {names[N_NUM_RECV], PyLong_FromLongLong(n)},
          {names[N_HIDDEN], PyLong_FromLongLong(st[ST_HIDDEN])}, {names[N_TOPK_IDX], ref(idx_obj)},
          {names[N_TOPK_WEIGHTS], ref(w_obj)}, {names[N_ORIGINS], origins.share()},
          {names[N_STATE], state.release()}});
      if (!handle) return nullptr;
      PyObject* stats = deferred_stats(build, tuple_steal({
          times(t0, t1, now_us()), ref(Py_None), ref(idx_obj), PyLong_FromLongLong(n),
          PyLong_FromLongLong(c[D_RB]), PyLong_FromLongLong(c[D_EPOCH])}));
      return instance(results.dispatch, {
          {names[N_RECV_X], recv_x.release()}, {names[N_WEIGHTS], wts.release()},
          {names[N_TPE], tpe.release()},
          {names[N_HANDLE], handle}, {names[N_STATS], stats}});
    }
    return tuple_steal({PyLong_FromLongLong(c[D_LEFT]), PyLong_FromLongLong(c[D_N]),
                        PyLong_FromLongLong(c[D_MISSING]), tpe.release(), origins.release(),
                        wts.release(), state.release(), recv_x.release(),
                        PyFloat_FromDouble(t1)});
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// direct_combine(st_addr, epoch, code, ecode, offset, copy_src, copy_n, ints, idx_addr,
//                w_addr, t_n, k_n, weighted, pos_addr, out, kind, t0, build, copied,
//                topk_idx) -> CombineResult, or (left, waiting, out, t1) when not complete
// The CombineResult (and DeferredStats(build, ...)) when every token is summed and every rank
// done reading mine, and `build` (the path's stats builder) is not None.
// `ints` `[3, N]` int64 numpy: the handle's row origins (row 0: each row's source rank).
// Sums fp32 (`kind` 0), bf16 (1) or fp16 (2) rows into `out` `[t_n, hidden]` of that dtype
// (a new tensor when None): fp32 sums land there as they are, 16-bit ones rounded token by
// token (`DirectPath._OUT_KIND`). `left` tokens not summed yet (or -(r + 1): rank
// r published another dtype); `waiting` ranks not done reading mine (-1: not told yet).
PyObject* direct_combine(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!arity(nargs, 20)) return nullptr;
  const double t0 = PyFloat_AsDouble(a[16]);
  if (t0 == -1.0 && PyErr_Occurred()) return nullptr;
  int64_t v[15];                  // v[7] (src_rank) is an array, not an int
  if (!ints(a, 7, v) || !ints(a + 8, 6, v + 8)) return nullptr;
  if (!origins_ok(a[7])) {
    PyErr_SetString(PyExc_TypeError, "ints must be a C-contiguous [3, N] int64 numpy array");
    return nullptr;
  }
  const int64_t kind = PyLong_AsLongLong(a[15]);
  if (kind == -1 && PyErr_Occurred()) return nullptr;
  if (kind < 0 || kind > 2) {
    PyErr_Format(PyExc_ValueError, "kind must be 0 (fp32), 1 (bf16) or 2 (fp16), got %lld",
                 static_cast<long long>(kind));
    return nullptr;
  }
  if (a[14] != Py_None && !tensors({a[14]})) return nullptr;
  static constexpr at::ScalarType kinds[3] = {at::kFloat, at::kBFloat16, at::kHalf};
  return combine_call(reinterpret_cast<int64_t*>(static_cast<intptr_t>(v[0])), v, a[7], a[14],
                      kinds[kind], t0, a[17], a[18], a[19]);
}

PyObject* combine_call(int64_t* st, const int64_t* v, PyObject* origins_obj, PyObject* out_arg,
                       at::ScalarType dtype, double t0, PyObject* build, PyObject* copied,
                       PyObject* topk_idx) {
  PyArrayObject* origins = reinterpret_cast<PyArrayObject*>(origins_obj);
  try {
    const int64_t t_n = v[10], hidden = st[ST_HIDDEN];
    Obj out_obj;
    at::Tensor out;
    if (out_arg == Py_None) {
      out = at::empty({t_n, hidden}, at::TensorOptions().dtype(dtype));
      out_obj = Obj(THPVariable_Wrap(out));
      if (!out_obj) return nullptr;
    } else {
      out = THPVariable_Unpack(out_arg);
      out_obj = Obj(ref(out_arg));
    }
    const bool rounded = dtype != at::kFloat;      // 16-bit: rounded from fp32 sums
    const int64_t es = rounded ? 2 : 4;
    int64_t c[C_LEN] = {};
    c[C_EPOCH] = v[1];
    c[C_CODE] = v[2];
    c[C_ECODE] = v[3];
    c[C_OFFSET] = v[4];
    c[C_COPY_SRC] = v[5];
    c[C_COPY_N] = v[6];
    c[C_SRC] = array_addr(origins_obj);         // row 0
    c[C_N] = PyArray_DIM(origins, 1);
    c[C_IDX] = v[8];
    c[C_W] = v[9];
    c[C_T] = t_n;
    c[C_K] = v[11];
    c[C_WEIGHTED] = v[12];
    c[C_POS] = v[13];
    c[C_RB] = hidden * es;
    c[C_ES] = es;
    const int64_t o = reinterpret_cast<intptr_t>(out.data_ptr());
    c[C_Y] = rounded ? st[ST_Y] : o;
    c[C_OUT] = rounded ? o : 0;
    run(st, ST_COMBINE, c);
    double t1 = now_us();
    if (c[C_LEFT] == 0 && c[C_WAITING] == 0 && build != Py_None && results.combine) {
      PyObject* stats = deferred_stats(build, tuple_steal({
          times(t0, t1, now_us()), ref(Py_None), ref(copied), ref(topk_idx),
          PyLong_FromLongLong(c[C_RB]),
          PyLong_FromLongLong(c[C_EPOCH])}));
      return instance(results.combine, {{names[N_Y], out_obj.release()}, {names[N_STATS], stats}});
    }
    return tuple_steal({PyLong_FromLongLong(c[C_LEFT]), PyLong_FromLongLong(c[C_WAITING]),
                        out_obj.release(), PyFloat_FromDouble(t1)});
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

}  // namespace ubep_native
