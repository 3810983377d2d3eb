// The door of the one-worker staged path (`SinglePath`: mode "ubep" or "bsp", direct=False):
// `Buffer.dispatch` / `Buffer.combine`'s common call in one C++ call each, as door.cpp does
// for the direct path: the inputs' fast check, the Buffer's lock and state, the path's
// kernels (numba cfuncs by address, `runtime/shm/staged/entries.py`) and the results.
//
// Why: with its kernels at ~10 µs, a batch-1 dispatch+combine of this path spent ~20 µs in
// the Python between them in one process (result arrays, outputs, result objects, entries
// that unbox their arguments). The Python path stays the definition: a call this file does
// not take whole (a wait, a peer's dtype to check, an sp abort) goes on in Python from where
// it stopped (`SinglePath.dispatch_resume` / `combine_resume`, through the door's `resume`),
// the lock still held. State moves through the Buffer's and the path's words (BW_*, SW_*).
// Outputs of 256 KiB and more come from the path's pool, as there.
#include "native.h"

#include <numpy/arrayobject.h>

namespace {

using ubep_native::deferred_stats;
using ubep_native::instance;
using namespace ubep_layout;
using ubep_native::names;
using ubep_native::now_us;
using ubep_native::Obj;
using ubep_native::ref;
using ubep_native::results;
using ubep_native::tuple_steal;

// the door's words: `layout.STAGED_DOOR` (SD_*); one call's block: `layout`'s S_* words
using Door = ubep_native::DoorWords<SD_LEN, SD_INTS>;

// run the kernel at `entry` on block `c` without the GIL (the numba entries are nogil)
inline void run(int64_t entry, int64_t* c) {
  auto k = reinterpret_cast<void (*)(int64_t*)>(static_cast<intptr_t>(entry));
  Py_BEGIN_ALLOW_THREADS
  k(c);
  Py_END_ALLOW_THREADS
}

PyObject* pyint(int64_t v) { return PyLong_FromLongLong(v); }

// a new `[rows, cols]` tensor of `like`'s dtype (`dtype`, its Python object) for an output:
// lent by the path's pool (`OutputPool.empty`, `SD_LEND`) from `SD_MIN_LENT` bytes on, as
// the Python path takes it (no page faults on kept memory), else `at::empty`; empty Obj
// with the error set on failure
Obj output(const Door& d, int64_t rows, int64_t cols, const at::Tensor& like,
           PyObject* dtype) {
  const int64_t nbytes = rows * cols * static_cast<int64_t>(like.element_size());
  if (nbytes == 0 || nbytes < d.v[SD_MIN_LENT])
    return Obj(THPVariable_Wrap(at::empty({rows, cols}, like.options())));
  Obj t(PyObject_CallFunction(d.o[SD_LEND], "LLO", static_cast<long long>(rows),
                              static_cast<long long>(cols), dtype));
  if (t && !THPVariable_Check(t.get())) {
    PyErr_SetString(PyExc_TypeError, "the output pool lent something not a tensor");
    return Obj();
  }
  return Obj(t.release());
}

}  // namespace

namespace ubep_native {

bool init_staged() {
  import_array1(false);
  return true;
}

// staged_door_dispatch(door, x, topk_idx, topk_weights) -> DispatchResult or NotImplemented
PyObject* staged_door_dispatch(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!arity(nargs, 4)) return nullptr;
  Door d;
  if (!d.parse(a[0], "SinglePath.door")) return nullptr;
  if (!passes(dispatch_ready, a + 1, d.v + SD_HIDDEN)) return not_taken();
  Locked locked(d.o[SD_LOCK]);
  if (!locked.ok()) return nullptr;
  int64_t *bw = state_words(d.o[SD_BUFFER_WORDS]), *pw = state_words(d.o[SD_PATH_WORDS]);
  if (!bw[BW_USABLE]) return not_taken();     // closed or broken: Python names why
  const at::Tensor& x = THPVariable_Unpack(a[1]);
  const at::Tensor& idx = THPVariable_Unpack(a[2]);
  const at::Tensor& w = THPVariable_Unpack(a[3]);
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(x.scalar_type()));
  PyObject* code = lookup(d.o[SD_CODES], dtype);
  if (!code) return not_taken();
  const int64_t elem = PyLong_AsLongLong(code);
  if (elem == -1 && PyErr_Occurred()) return nullptr;
  // the call: from here on its state moves (as `_dispatch_checked` and the path move it;
  // `region.next_epoch`: the last one + 1)
  const int64_t call = ++bw[BW_CALLS];
  const double t0 = now_us();
  const int64_t epoch = ++pw[SW_D_EPOCH];
  PyObject* r = nullptr;
  try {
    const int64_t t_n = x.size(0), hidden = x.size(1), k_n = idx.size(1);
    const int64_t rb = hidden * static_cast<int64_t>(x.element_size());
    npy_intp d_el = d.v[SD_EL];
    Obj tpe(PyArray_EMPTY(1, &d_el, NPY_INT64, 0));
    if (!tpe) return nullptr;
    int64_t c[S_LEN] = {};
    c[S_STATE] = d.v[SD_STATE];
    c[S_WORLD] = d.v[SD_WORLD];
    c[S_EL] = d.v[SD_EL];
    c[S_EPOCH] = epoch;
    c[S_ELEM] = elem;
    c[S_X] = reinterpret_cast<intptr_t>(x.const_data_ptr());
    c[S_T] = t_n;
    c[S_RB] = rb;
    c[S_IDX] = reinterpret_cast<intptr_t>(idx.const_data_ptr());
    c[S_K] = k_n;
    c[S_W] = reinterpret_cast<intptr_t>(w.const_data_ptr());
    c[S_TPE] = array_addr(tpe.get());
    c[S_SPINS] = d.v[SD_SPINS];
    run(d.v[SD_BEGIN], c);
    const int64_t n = c[S_RECV];
    if (c[S_LEFT] || c[S_SENDS] < 0 || c[S_META]) {
      // counts missing, an sp abort, a peer's dtype to name
      r = tuple_steal({tpe.release(), pyint(c[S_LEFT])});
    } else {
      Obj recv_x = output(d, n, hidden, x, dtype);
      if (!recv_x) return nullptr;
      const at::Tensor& recv = THPVariable_Unpack(recv_x.get());
      npy_intp d_ints[2] = {3, n}, d_n = n;
      Obj ints(PyArray_EMPTY(2, d_ints, NPY_INT64, 0)),
          wts(PyArray_EMPTY(1, &d_n, NPY_FLOAT32, 0));
      if (!ints || !wts) return nullptr;
      c[S_N] = n;
      c[S_OUT_X] = reinterpret_cast<intptr_t>(recv.data_ptr());
      c[S_WTS] = array_addr(wts.get());
      c[S_INTS] = array_addr(ints.get());
      run(d.v[SD_ROWS], c);
      const double t1 = now_us();
      if (c[S_LEFT] || !results.dispatch) {        // rows missing: the bounded wait
        r = tuple_steal({tpe.release(), recv_x.release(), ints.release(), wts.release(),
                         PyFloat_FromDouble(t1)});
      } else {
        // `SinglePath._dispatch_end`'s handle and stats
        PyObject* state = tuple_steal({pyint(c[S_IDX]), pyint(c[S_W]), pyint(k_n),
                                       ints.share()});
        PyObject* handle = instance(results.handle, {
            {names[N_BUFFER_ID], pyint(d.v[SD_BUFFER_ID])}, {names[N_CALL], pyint(call)},
            {names[N_NUM_TOKENS], pyint(t_n)}, {names[N_NUM_RECV], pyint(n)},
            {names[N_HIDDEN], pyint(hidden)},
            {names[N_TOPK_IDX], ref(a[2])}, {names[N_TOPK_WEIGHTS], ref(a[3])},
            {names[N_ORIGINS], ints.share()}, {names[N_STATE], state}});
        if (!handle) return nullptr;
        PyObject* ts = tuple_steal({PyFloat_FromDouble(t0), PyFloat_FromDouble(t1),
                                    PyFloat_FromDouble(t1), PyFloat_FromDouble(now_us())});
        PyObject* stats = deferred_stats(d.o[SD_DBUILD], tuple_steal({
            ts, pyint(c[S_SENDS]), pyint(n), pyint(rb), pyint(epoch)}));
        r = instance(results.dispatch, {
            {names[N_RECV_X], recv_x.release()}, {names[N_WEIGHTS], wts.release()},
            {names[N_TPE], tpe.release()},
            {names[N_HANDLE], handle}, {names[N_STATS], stats}});
        return r;
      }
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  if (!r) return nullptr;
  // the rest in Python, from where the entry stopped
  PyObject* res = PyObject_CallFunction(d.o[SD_RESUME], "sOOOOLdL", "dispatch_resume", r,
                                        a[1], a[2], a[3], static_cast<long long>(call), t0,
                                        static_cast<long long>(epoch));
  Py_DECREF(r);
  return res;
}

// staged_door_combine(door, expert_out, handle, weighted, out) -> CombineResult or
// NotImplemented
PyObject* staged_door_combine(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!arity(nargs, 5)) return nullptr;
  Door d;
  if (!d.parse(a[0], "SinglePath.door")) return nullptr;
  PyObject *rows = a[1], *handle = a[2], *out_arg = a[4];
  int64_t hv[4];               // buffer_id, num_recv, hidden, num_tokens
  int weighted;
  const int go = combine_handle(handle, rows, a[3], d.v[SD_BUFFER_ID], hv, weighted);
  if (go <= 0) return go < 0 ? nullptr : not_taken();
  const at::Tensor& e = THPVariable_Unpack(rows);
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(e.scalar_type()));
  PyObject* codes = lookup(d.o[SD_ELEMS], dtype);    // (elem, ecode, lut, n_lut): 16/32-bit
  if (!codes || !PyTuple_Check(codes) || PyTuple_GET_SIZE(codes) != 4) return not_taken();
  int64_t ev[4];
  if (!ints(&PyTuple_GET_ITEM(codes, 0), 4, ev)) return nullptr;
  const int64_t t_n = hv[3], hidden = hv[2], n = hv[1];
  const int64_t es = static_cast<int64_t>(e.element_size());
  if (!out_ready(out_arg, rows, t_n)) return not_taken();
  PyObject* state = PyObject_GetAttr(handle, names[N_STATE]);
  if (!state) return nullptr;
  Obj state_ref(state);
  if (!PyTuple_Check(state) || PyTuple_GET_SIZE(state) != 4) return not_taken();
  int64_t sv[3];               // idx address, weights address, K
  if (!ints(&PyTuple_GET_ITEM(state, 0), 3, sv)) return nullptr;
  PyObject* origins = PyTuple_GET_ITEM(state, 3);
  if (!origins_ok(origins)
      || PyArray_DIM(reinterpret_cast<PyArrayObject*>(origins), 1) != n)
    return not_taken();
  Locked locked(d.o[SD_LOCK]);
  if (!locked.ok()) return nullptr;
  int64_t *bw = state_words(d.o[SD_BUFFER_WORDS]), *pw = state_words(d.o[SD_PATH_WORDS]);
  if (!bw[BW_USABLE]) return not_taken();     // closed or broken: Python names why
  // the call: from here on its state moves (as the path moves it)
  const double t0 = now_us();
  const int64_t epoch = ++pw[SW_C_EPOCH];
  PyObject* r = nullptr;
  try {
    Obj out_obj;
    at::Tensor out;
    if (out_arg == Py_None) {
      out_obj = output(d, t_n, hidden, e, dtype);
      if (!out_obj) return nullptr;
      out = THPVariable_Unpack(out_obj.get());
    } else {
      out = THPVariable_Unpack(out_arg);
      out_obj = Obj(ref(out_arg));
    }
    const bool f32 = e.scalar_type() == at::kFloat;
    const int64_t o = reinterpret_cast<intptr_t>(out.data_ptr());
    int64_t c[S_LEN] = {};
    c[S_STATE] = d.v[SD_STATE];
    c[S_WORLD] = d.v[SD_WORLD];
    c[S_EL] = d.v[SD_EL];
    c[S_EPOCH] = epoch;
    c[S_ELEM] = ev[0];
    c[S_ROWS] = reinterpret_cast<intptr_t>(e.const_data_ptr());
    c[S_N] = n;
    c[S_RB] = hidden * es;
    c[S_INTS] = array_addr(origins);
    c[S_T] = t_n;
    run(d.v[SD_CBEGIN], c);
    if (c[S_LEFT] < 0) {          // an sp sentinel abort: Python names it
      r = tuple_steal({pyint(c[S_LEFT])});
    } else {
      const double t1 = now_us();
      c[S_IDX] = sv[0];
      c[S_W] = sv[1];
      c[S_K] = sv[2];
      c[S_WEIGHTED] = weighted;
      c[S_ES] = es;
      c[S_ECODE] = ev[1];
      c[S_LUT] = ev[2];
      c[S_NLUT] = ev[3];
      c[S_Y] = f32 ? o : d.v[SD_Y];
      c[S_HIDDEN] = hidden;
      c[S_SPINS] = d.v[SD_SPINS];
      c[S_CAST] = f32 ? CAST_NONE : CAST_16;
      c[S_OUT] = f32 ? 0 : o;
      run(d.v[SD_CPOLL], c);
      if (c[S_LEFT] || c[S_META] || !results.combine) {   // a wait, or hellos to check
        r = tuple_steal({pyint(c[S_LEFT]), out_obj.release(), PyFloat_FromDouble(t1)});
      } else {
        PyObject* ts = tuple_steal({PyFloat_FromDouble(t0), PyFloat_FromDouble(t1),
                                    PyFloat_FromDouble(now_us())});
        PyObject* stats = deferred_stats(d.o[SD_CBUILD], tuple_steal({
            ts, pyint(n), pyint(c[S_ROUTED]), pyint(hidden * es), pyint(epoch)}));
        return instance(results.combine, {{names[N_Y], out_obj.release()},
                                          {names[N_STATS], stats}});
      }
    }
  } catch (const std::exception& ex) {
    PyErr_SetString(PyExc_RuntimeError, ex.what());
    return nullptr;
  }
  if (!r) return nullptr;
  PyObject* res = PyObject_CallFunction(d.o[SD_RESUME], "sOOOOdL", "combine_resume", r,
                                        rows, handle, weighted ? Py_True : Py_False, t0,
                                        static_cast<long long>(epoch));
  Py_DECREF(r);
  return res;
}

}  // namespace ubep_native
