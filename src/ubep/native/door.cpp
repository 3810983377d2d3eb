// The common call's whole way from `Buffer.dispatch` / `Buffer.combine` to the shm direct
// path's kernels in one C++ call: the inputs' fast check, the Buffer's lock and state, the
// path's choice of where rows go, the compiled entry (direct.cpp) and the Buffer's stats.
//
// Why: a call that follows other work (an attention layer, another system) starts on cold
// caches, and there each Python statement costs ~0.5-2 µs; the layers between
// `Buffer.dispatch` and the entry were about half of such a call in one process
// (benchmarks/scripts/bench_shm_door.py).
// The Python code stays the definition: this file takes the call only when the Python path
// would take its straight line (nothing to refuse, a free lent area, views and codes already
// made), else it answers NotImplemented before changing anything and the Python path runs as
// before. A call that must wait goes on in Python (the door's `resume`: the backend's), the
// lock still held. State moves through the Buffer's and the path's words (BW_*, DW_*).
#include "native.h"

#include <torch/csrc/DynamicTypes.h>

namespace {

using namespace ubep_layout;
using ubep_native::names;
using ubep_native::now_us;
using ubep_native::Obj;
using ubep_native::ref;

// the door's words: `layout.DIRECT_DOOR` (DR_*)
using Door = ubep_native::DoorWords<DR_LEN, DR_INTS>;

// `DirectPath._free_area`: the first lent area whose storage only the path itself
// references (its use count is the path's own), else 0
int64_t free_area(const Door& d) {
  PyObject *cdata = d.o[DR_CDATA], *uses = d.o[DR_USES];
  const Py_ssize_t n = PyList_GET_SIZE(cdata);
  for (Py_ssize_t i = 1; i < n; ++i) {
    const int64_t p = PyLong_AsLongLong(PyList_GET_ITEM(cdata, i));
    if (p == 0) return i;
    const int64_t mine = PyLong_AsLongLong(PyList_GET_ITEM(uses, i));
    if (PyErr_Occurred()) return -1;
    auto* impl = reinterpret_cast<c10::StorageImpl*>(static_cast<intptr_t>(p));
    if (static_cast<int64_t>(c10::raw::intrusive_ptr::use_count(impl)) == mine) return i;
  }
  return PyErr_Occurred() ? -1 : 0;
}

}  // namespace

namespace ubep_native {

// door_dispatch(door, x, topk_idx, topk_weights) -> DispatchResult or NotImplemented
PyObject* door_dispatch(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!arity(nargs, 4)) return nullptr;
  Door d;
  if (!d.parse(a[0], "DirectPath.door")) return nullptr;
  const int64_t* lim = d.v + DR_HIDDEN;
  if (!passes(dispatch_ready, a + 1, lim)) return not_taken();
  Locked locked(d.o[DR_LOCK]);
  if (!locked.ok()) return nullptr;
  int64_t *bw = state_words(d.o[DR_BUFFER_WORDS]), *pw = state_words(d.o[DR_PATH_WORDS]);
  if (!bw[BW_USABLE]) return not_taken();     // closed or broken: Python names why
  const bool owned = d.v[DR_OWNED] != 0;
  int64_t area = 0;
  if (owned) {
    area = free_area(d);
    if (area <= 0) return area < 0 ? nullptr : not_taken();
  }
  const at::Tensor& x = THPVariable_Unpack(a[1]);
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(x.scalar_type()));
  PyObject* code = lookup(d.o[DR_CODES], dtype);
  PyObject* view_key = Py_BuildValue("(LO)", static_cast<long long>(area), dtype);
  if (!view_key) return nullptr;
  PyObject* view = lookup(d.o[DR_VIEWS], view_key);
  Py_DECREF(view_key);
  if (!code || !view) return not_taken();
  Obj view_ref(ref(view));     // held while the call runs (allocations may run the GC)
  const int64_t code_v = PyLong_AsLongLong(code);
  if (code_v == -1 && PyErr_Occurred()) return nullptr;
  // the call: from here on its state moves (as `_dispatch_checked` and the path move it)
  const int64_t call = ++bw[BW_CALLS];
  const double t0 = now_us();
  const int64_t epoch = ++pw[DW_EPOCH];
  const int64_t roff = d.v[DR_RECV_OFF] + area * d.v[DR_AREA];
  PyObject* r = dispatch_call(reinterpret_cast<int64_t*>(static_cast<intptr_t>(d.v[DR_ST])),
                              a[1], a[2], a[3], epoch, code_v, roff, owned, view, call,
                              d.v[DR_BUFFER_ID], t0, d.o[DR_DBUILD]);
  if (!r) return nullptr;
  if (PyTuple_Check(r)) {      // a wait: Python goes on from where the entry stopped
    PyObject* res = PyObject_CallFunction(d.o[DR_RESUME], "sOOOOLdLLL",
                                          "dispatch_resume", r, a[1], a[2], a[3],
                                          static_cast<long long>(call), t0,
                                          static_cast<long long>(epoch),
                                          static_cast<long long>(area),
                                          static_cast<long long>(roff));
    Py_DECREF(r);
    return res;
  }
  pw[DW_LAST_CALL] = call;
  pw[DW_LAST_CODE] = code_v;
  return r;
}


// door_combine(door, expert_out, handle, weighted, out) -> CombineResult or NotImplemented
// (`out`: None, or the caller's `[T, hidden]` tensor the sums land in, which is y)
PyObject* door_combine(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!arity(nargs, 5)) return nullptr;
  Door d;
  if (!d.parse(a[0], "DirectPath.door")) return nullptr;
  PyObject *rows = a[1], *handle = a[2], *out = a[4];
  int64_t hv[4];               // buffer_id, num_recv, hidden, num_tokens
  int weighted;
  const int go = combine_handle(handle, rows, a[3], d.v[DR_BUFFER_ID], hv, weighted);
  if (go <= 0) return go < 0 ? nullptr : not_taken();
  Locked locked(d.o[DR_LOCK]);
  if (!locked.ok()) return nullptr;
  int64_t *bw = state_words(d.o[DR_BUFFER_WORDS]), *pw = state_words(d.o[DR_PATH_WORDS]);
  if (!bw[BW_USABLE]) return not_taken();     // closed or broken: Python names why
  const bool owned = d.v[DR_OWNED] != 0;
  int64_t call;
  if (!get_int(handle, names[N_CALL], call)) return nullptr;
  // direct=True: the latest dispatch only (Python names the error)
  if (!owned && call != pw[DW_LAST_CALL]) return not_taken();
  const at::Tensor& e = THPVariable_Unpack(rows);
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(e.scalar_type()));
  PyObject* codes = lookup(d.o[DR_ELEMS], dtype);    // (code, ecode): bf16, fp16, fp32
  if (!codes) return not_taken();
  int64_t v[15] = {};          // direct_combine's ints, in its argument order
  PyObject* cc[2] = {PyTuple_GET_ITEM(codes, 0), PyTuple_GET_ITEM(codes, 1)};
  if (!ints(cc, 2, v + 2)) return nullptr;
  const int64_t n_recv = hv[1], rb = d.v[DR_HIDDEN] * static_cast<int64_t>(e.element_size());
  const int64_t ptr = reinterpret_cast<intptr_t>(e.const_data_ptr());
  const int64_t comb = d.v[DR_COMB], recv_addr = d.v[DR_BASE] + d.v[DR_RECV_OFF];
  bool copied;
  if (owned) {
    if (ptr == comb && n_recv && call != pw[DW_LENT_COMB]) return not_taken();
    // the lent areas: areas 1.. of my receive region (`DirectPath._lent_lo/_lent_hi`)
    const int64_t lo = recv_addr + d.v[DR_AREA];
    const int64_t hi = recv_addr + d.v[DR_AREA] * PyList_GET_SIZE(d.o[DR_CDATA]);
    const bool lent = lo <= ptr && ptr + n_recv * rb <= hi;
    copied = n_recv > 0 && ptr != comb && !lent;
  } else {
    copied = n_recv > 0 && ptr != recv_addr && ptr != comb;
  }
  PyObject* state = PyObject_GetAttr(handle, names[N_STATE]);
  if (!state) return nullptr;
  Obj state_ref(state);
  if (!PyTuple_Check(state) || PyTuple_GET_SIZE(state) < 7) return not_taken();
  PyObject* si[4] = {PyTuple_GET_ITEM(state, 0), PyTuple_GET_ITEM(state, 1),
                     PyTuple_GET_ITEM(state, 2), PyTuple_GET_ITEM(state, 4)};
  int64_t sv[4];               // idx address, weights address, K, pos address
  if (!ints(si, 4, sv)) return nullptr;
  PyObject* origins = PyTuple_GET_ITEM(state, 6);
  if (!origins_ok(origins)) return not_taken();
  const int64_t t_n = hv[3];
  if (!out_ready(out, rows, t_n, comb, d.v[DR_AREA])) return not_taken();   // not in my comb
  PyObject* topk_idx = PyObject_GetAttr(handle, names[N_TOPK_IDX]);
  if (!topk_idx) return nullptr;
  Obj topk_ref(topk_idx);
  // the call: from here on its state moves (as the path moves it)
  const double t0 = now_us();
  if (owned) pw[DW_LENT_COMB] = 0;
  const int64_t epoch = ++pw[DW_C_EPOCH];
  v[0] = d.v[DR_ST];
  v[1] = epoch;
  v[4] = (copied || !n_recv ? comb : ptr) - d.v[DR_BASE];
  v[5] = ptr;
  v[6] = copied ? n_recv : 0;
  v[8] = sv[0];
  v[9] = sv[1];
  v[10] = t_n;
  v[11] = sv[2];
  v[12] = weighted;
  v[13] = sv[3];
  PyObject* copied_obj = copied ? Py_True : Py_False;
  PyObject* r = combine_call(reinterpret_cast<int64_t*>(static_cast<intptr_t>(v[0])), v,
                             origins, out, e.scalar_type(), t0,
                             d.o[DR_CBUILD], copied_obj, topk_idx);
  if (!r || !PyTuple_Check(r)) return r;
  // a wait: Python goes on from where the entry stopped
  PyObject* res = PyObject_CallFunction(d.o[DR_RESUME], "sOOOOdLLLOO",
                                        "combine_resume", r, rows, handle,
                                        weighted ? Py_True : Py_False, t0,
                                        static_cast<long long>(epoch),
                                        static_cast<long long>(v[4]),
                                        static_cast<long long>(ptr), copied_obj, out);
  Py_DECREF(r);
  return res;
}

}  // namespace ubep_native
