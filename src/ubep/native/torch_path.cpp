// The torch backend's CPU dispatch and combine as one C++ entry each: the kernels between the
// collectives (numba cfuncs, `ubep.runtime.torch_entries`), the collectives themselves
// (`c10d::ProcessGroup::all_to_all_single` on the caller's group, polled as the Python path's
// `wait` polls them) and the results; and a door that takes `Buffer`'s common call whole, as
// door.cpp does for the shm direct path. Why: at batch 1 the Python around the collectives
// cost more than the collectives' own host work (benchmarks/scripts/bench_torch_native.py);
// gloo's threads share the cores with the caller, so each Python statement runs on cold caches.
//
// The Python path (`TorchBackend._dispatch_cpu` / `_combine_cpu`) stays the definition: these
// take a call only when the backend has made its words (`_dispatch_door` / `_combine_door`,
// per row type and inline capacity) and the call fits the scratch, and otherwise decline
// (NotImplemented) before anything moves; a dispatch whose phase 2 needs a larger receive
// buffer hands back to Python after its first collective (the door's `rest`,
// `TorchBackend._native_rest`, grows it). The inline capacity every rank agrees on lives in
// the backend's words (TW_INLINE).
#include "native.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace ubep_layout;
using ubep_native::names;
using ubep_native::now_us;
using ubep_native::Obj;
using ubep_native::ref;
using ubep_native::tuple_steal;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

// the blocks' words (K_*, B_*) and the door tuples' (TD_*, TC_*, TR_*): `layout`'s

using Kernel = void (*)(int64_t*);

// kernel at word `which` of block `k` (a cfunc), without the GIL: nogil, as the Python path's
// numba calls are; false with a RuntimeError when it reports an error in `k[err]`
bool run(int64_t* k, int64_t which, int64_t err) {
  Kernel f = reinterpret_cast<Kernel>(static_cast<intptr_t>(k[which]));
  Py_BEGIN_ALLOW_THREADS
  f(k);
  Py_END_ALLOW_THREADS
  if (k[err] == 0) return true;
  PyErr_SetString(PyExc_RuntimeError, "torch backend: a kernel's sizes out of its plan");
  return false;
}

int64_t* words(PyObject* arr) { return static_cast<int64_t*>(ubep_native::np_data(arr)); }

// the group a capsule from `torch_group` holds
Group* group_of(PyObject* capsule) {
  return static_cast<Group*>(PyCapsule_GetPointer(capsule, "ubep.torch_group"));
}

// scratch buffer `name` (`names[N_SEND]` ...) of the backend's `_scratch` (flat uint8), or
// nullptr (none yet)
const at::Tensor* scratch(PyObject* dict, PyObject* name) {
  PyObject* t = PyDict_GetItemWithError(dict, name);
  if (!t) PyErr_Clear();
  return t && THPVariable_Check(t) ? &THPVariable_Unpack(t) : nullptr;
}

// whether a dispatch of `t_n` tokens fits the scratch (as `TorchBackend._cpu_shape` sizes
// it): phase 1 in the receive buffer, phase 1 and every peer's phase 2 in the send buffer;
// if so, their addresses and sizes into the block
bool fits(int64_t* k, PyObject* dict, int64_t t_n) {
  const at::Tensor* send = scratch(dict, names[N_SEND]);
  const at::Tensor* recv = scratch(dict, names[N_RECV]);
  if (!send || !recv) return false;
  const int64_t rb = k[K_ROW_BYTES], peers = k[K_WORLD] - 1, meta = 4 * (1 + 2 * k[K_META_K]);
  const int64_t rows =
      peers * (k[K_HROWS] + k[K_INLINE]) + peers * (t_n + (t_n * meta + rb - 1) / rb);
  if (rows * rb > send->numel() || k[K_RECV_BYTES] > recv->numel()) return false;
  k[K_SEND] = reinterpret_cast<intptr_t>(send->data_ptr());
  k[K_SEND_BYTES] = send->numel();
  k[K_RECV] = reinterpret_cast<intptr_t>(recv->data_ptr());
  k[K_RECV_CAP] = recv->numel();
  return true;
}

// An elastic Buffer's hooks on its collectives (`TorchElastic`), from a door's `check` and
// `rec` words (None, None without elastic): each collective is written in `rec` (a REC_*
// block: what a replay after a recovery sends again) before it starts; `check()` is called
// every `every_ns` while a collective is overdue, and raises (the recovery's `Redo`, or a
// named error) to abandon it.
struct Watch {
  PyObject* check;
  int64_t* rec;       // nullptr without elastic
  int64_t every_ns;
};

Watch watch_of(PyObject* check, PyObject* rec, int64_t every_ns) {
  if (rec != Py_None) words(rec)[REC_COUNT] = 0;        // a new call
  return Watch{check, rec == Py_None ? nullptr : words(rec), every_ns};
}

// one collective into `watch.rec`: its source (REC_SEND ...), byte offset, bytes, and its
// splits in bytes (empty: equal parts)
void record(const Watch& watch, int64_t source, int64_t at, const at::Tensor& in,
            const at::Tensor& out, const std::vector<int64_t>& in_splits,
            const std::vector<int64_t>& out_splits, int64_t world) {
  int64_t* r = watch.rec + REC_FIRST + watch.rec[REC_COUNT]++ * (REC_SPLITS + 2 * world);
  const int64_t isz = in.element_size(), osz = out.element_size();
  r[REC_SOURCE] = source;
  r[REC_AT] = at;
  r[REC_BYTES] = in.numel() * isz;
  for (int64_t i = 0; i < world; ++i) {
    r[REC_SPLITS + i] = in_splits.empty() ? in.numel() * isz / world : in_splits[i] * isz;
    r[REC_SPLITS + world + i] =
        out_splits.empty() ? out.numel() * osz / world : out_splits[i] * osz;
  }
}

// One all_to_all_single on `g`, from launch to completion: `between` runs while it is in
// flight; the wait polls `isCompleted()` for up to `poll_ns`, yielding the core (as
// `torch_backend.wait`), then blocks in `wait()`, which raises the collective's error and keeps
// the group's timeout; with `watch.check` (elastic) it sleeps between polls instead, backing
// off to 1 ms, and calls `check` every `watch.every_ns` (as `TorchElastic._wait`). All of it
// without the GIL but `check`, the launch too: gloo's thread takes the GIL to drop a finished
// collective's Python-owned tensors while it holds the lock a launch takes.
// `source`, `at`: where `in` lies, for `watch.rec`. False with a RuntimeError on a
// collective's error, or with `check`'s exception.
template <typename F>
bool exchange(Group& g, at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
              std::vector<int64_t>& in_splits, int64_t poll_ns, const Watch& watch,
              int64_t source, int64_t at, F between) {
  if (watch.rec) record(watch, source, at, in, out, in_splits, out_splits, g->getSize());
  std::string error;
  bool raised = false;          // `check` raised: its exception is set
  PyThreadState* py = PyEval_SaveThread();
  try {
    c10d::AllToAllOptions opts;
    opts.asyncOp = true;
    // scratch bytes that never require grad: straight to the group's kernel, past autograd's
    // fallback for an op without a derivative (its checks cost a µs or two a call)
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto work = g->all_to_all_single(out, in, out_splits, in_splits, opts);
    between();
    if (work) {
      const double end = now_us() + poll_ns * 1e-3;
      while (!work->isCompleted() && now_us() < end) sched_yield();
      if (watch.check != Py_None) {
        double next = now_us() + watch.every_ns * 1e-3;
        for (int64_t n = 1; !raised && !work->isCompleted(); ++n) {
          usleep(static_cast<useconds_t>(std::min<int64_t>(1000, 50 * n)));
          if (now_us() < next) continue;
          PyEval_RestoreThread(py);
          PyObject* r = PyObject_CallNoArgs(watch.check);
          raised = r == nullptr;
          Py_XDECREF(r);
          py = PyEval_SaveThread();
          next = now_us() + watch.every_ns * 1e-3;
        }
      }
      if (!raised) work->wait();
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  PyEval_RestoreThread(py);
  if (raised) return false;
  if (error.empty()) return true;
  PyErr_SetString(PyExc_RuntimeError, error.c_str());
  return false;
}

// `sizes` of `t`'s dtype from byte `at` of `t`'s memory, for a collective: a tensor that holds
// `t`'s storage, not `t` (as `t.narrow(0, at, n)` of flat uint8 `t`, or `t` itself). A narrow
// would cost the dispatcher's view bookkeeping (several µs a call on the cold caches gloo's
// threads leave), and `t` would tie the collective to its Python object: gloo's thread,
// dropping a finished collective's tensors, would take the GIL from the caller's next kernel.
// The storage (which Python never sees) keeps the memory alive as long as gloo holds the
// collective, a failed or timed-out one too.
at::Tensor on_storage(const at::Tensor& t, int64_t at, at::IntArrayRef sizes) {
  return at::from_blob(static_cast<uint8_t*>(t.data_ptr()) + at, sizes,
                       [keep = t.storage()](void*) {}, t.options());
}

bool tuple_of(PyObject* t, Py_ssize_t n, const char* what) {
  if (PyTuple_CheckExact(t) && PyTuple_GET_SIZE(t) == n) return true;
  PyErr_Format(PyExc_TypeError, "%s must be the tuple TorchBackend made", what);
  return false;
}

// `[n * size for n in counts]` of a list of ints
bool splits(PyObject* counts, int64_t size, std::vector<int64_t>& out) {
  if (!PyList_Check(counts)) {
    PyErr_SetString(PyExc_TypeError, "expected a list of counts");
    return false;
  }
  out.resize(PyList_GET_SIZE(counts));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(counts); ++i) {
    out[i] = PyLong_AsLongLong(PyList_GET_ITEM(counts, i)) * size;
    if (PyErr_Occurred()) return false;
  }
  return true;
}

// `list(a[:n])` of int64 words, with `a[me]` as 0
PyObject* int_list(const int64_t* a, int64_t n, int64_t me) {
  PyObject* l = PyList_New(n);
  for (int64_t i = 0; l && i < n; ++i) {
    PyObject* v = PyLong_FromLongLong(i == me ? 0 : a[i]);
    if (!v) {
      Py_CLEAR(l);
      break;
    }
    PyList_SET_ITEM(l, i, v);
  }
  return l;
}

// `nbytes` of memory for a result the caller will own (uint8, 1-D): a tensor of `pool` (a
// list the backend keeps, at most 3) that nothing else references any more (the pool's is its
// only reference: a result made on it by `on` holds another) and is large enough, else a new
// one, kept if the pool has room. Fresh memory costs a page fault per 4 KiB when first written
// (`TorchBackend._owned_rows`, the Python path's twin, says how much).
at::Tensor owned_bytes(PyObject* pool, int64_t nbytes) {
  const Py_ssize_t n = PyList_GET_SIZE(pool);
  Py_ssize_t spare = -1;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor& t = THPVariable_Unpack(PyList_GET_ITEM(pool, i));
    if (t.use_count() != 1 || Py_REFCNT(PyList_GET_ITEM(pool, i)) != 1) continue;
    if (t.numel() >= nbytes) return t;
    spare = i;
  }
  at::Tensor t = at::empty({std::max<int64_t>(nbytes + nbytes / 8, 1)}, at::kByte);
  if (spare >= 0 || n < 3) {
    PyObject* obj = THPVariable_Wrap(t);
    if (!obj) throw std::runtime_error("no memory for a result");
    if (spare >= 0) {
      PyList_SetItem(pool, spare, obj);      // steals obj, drops the smaller one
    } else if (PyList_Append(pool, obj) < 0) {
      Py_DECREF(obj);
      throw std::runtime_error("no memory for a result");
    } else {
      Py_DECREF(obj);
    }
  }
  return t;
}

// `[rows, hidden]` of `opts`' dtype at the start of `mem` (from `owned_bytes`), on a storage of
// exactly its bytes that holds `mem` while it lives: as `torch.from_numpy` of a slice of the
// Python path's pooled array (a storage larger than the tensor would be saved whole by
// torch.save, and views of it in two dtypes could not be loaded)
at::Tensor on(const at::Tensor& mem, int64_t rows, int64_t hidden, at::TensorOptions opts) {
  return at::from_blob(mem.data_ptr(), {rows, hidden}, [keep = mem](void*) {}, opts);
}

}  // namespace

namespace ubep_native {

// torch_group(group) -> a capsule holding the C++ ProcessGroup of a torch.distributed group
PyObject* torch_group(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!arity(nargs, 1)) return nullptr;
  try {
    auto* g = new Group(pybind11::handle(a[0]).cast<Group>());
    PyObject* cap = PyCapsule_New(g, "ubep.torch_group", [](PyObject* c) {
      delete static_cast<Group*>(PyCapsule_GetPointer(c, "ubep.torch_group"));
    });
    if (!cap) delete g;
    return cap;
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_TypeError, "expected a torch.distributed ProcessGroup (%s)", e.what());
    return nullptr;
  }
}

// a dispatch of (x, topk_idx, topk_weights) through a shape's door words `d` (TD_*), as
// `torch_dispatch` answers
static PyObject* dispatch_core(PyObject* const* d, PyObject* x_obj, PyObject* idx_obj,
                               PyObject* w_obj, int64_t call) {
  try {
    int64_t* k = words(d[TD_K]);
    Group* g = group_of(d[TD_GROUP]);
    if (!g) return nullptr;
    const at::Tensor& x = THPVariable_Unpack(x_obj);
    const at::Tensor& idx = THPVariable_Unpack(idx_obj);
    const at::Tensor& w = THPVariable_Unpack(w_obj);
    const int64_t t_n = idx.size(0), hidden = x.size(1), world = k[K_WORLD], me = k[K_ME];
    const Watch watch = watch_of(d[TD_CHECK], d[TD_REC], k[K_CHECK_NS]);
    if (!fits(k, d[TD_SCRATCH], t_n)) return not_taken();   // the scratch must grow: Python
    k[K_IDX] = reinterpret_cast<intptr_t>(idx.const_data_ptr());
    k[K_W] = reinterpret_cast<intptr_t>(w.const_data_ptr());
    k[K_T] = t_n;
    k[K_K] = idx.size(1);
    k[K_X] = reinterpret_cast<intptr_t>(x.const_data_ptr());
    k[K_X_BYTES] = t_n * k[K_ROW_BYTES];
    const double t0 = now_us();
    if (!run(k, K_PACK, K_ERR)) return nullptr;
    const double t1 = now_us();
    // the first collective: phase 1's blocks (their headers, then `inline` tokens per peer),
    // or the headers alone (a count exchange)
    const int64_t inl = k[K_INLINE], rb = k[K_ROW_BYTES], n1 = k[K_RECV_BYTES];
    at::Tensor recv = *scratch(d[TD_SCRATCH], names[N_RECV]),
               send = *scratch(d[TD_SCRATCH], names[N_SEND]);
    if (inl) {
      std::vector<int64_t> split(world, k[K_BLK_BYTES]);
      split[me] = 0;
      at::Tensor r1 = on_storage(recv, 0, {n1}), s1 = on_storage(send, 0, {n1});
      if (!exchange(*g, r1, s1, split, split, k[K_POLL_NS], watch, REC_SEND, 0, [] {}))
        return nullptr;
      if (!run(k, K_HEADERS, K_ERR)) return nullptr;
    } else {
      const at::Tensor &hr_t = THPVariable_Unpack(d[TD_HDR_RECV]),
                       &hs_t = THPVariable_Unpack(d[TD_HDR_SEND]);
      at::Tensor hr = on_storage(hr_t, 0, hr_t.sizes()), hs = on_storage(hs_t, 0, hs_t.sizes());
      std::vector<int64_t> equal;
      if (!exchange(*g, hr, hs, equal, equal, k[K_POLL_NS], watch, REC_HDR, 0, [] {}))
        return nullptr;
      if (!run(k, K_COUNTS, K_ERR)) return nullptr;
    }
    const double t2 = now_us();
    const int64_t gmax = k[K_GMAX], num_bags = k[K_NUM_BAGS];
    // phase 2: the tokens that did not fit phase 1, if any rank had more (every rank knows)
    int64_t* ws = reinterpret_cast<int64_t*>(static_cast<intptr_t>(k[K_WS]));
    std::vector<int64_t> s2, r2;
    k[K_WORK_BYTES] = n1;
    if (gmax > inl) {
      if (!run(k, K_PHASE2, K_ERR)) return nullptr;
      const int64_t got = n1 + k[K_SUM_R2] * rb;
      if (got > k[K_RECV_CAP])      // the scratch must grow: Python does it, then phase 2
        return tuple_steal({PyLong_FromLongLong(gmax), PyLong_FromLongLong(num_bags),
                            PyFloat_FromDouble(t0), PyFloat_FromDouble(t1),
                            PyFloat_FromDouble(t2)});
      s2.assign(ws + world, ws + 2 * world);          // the workspace's send2 and recv2
      r2.assign(ws + 3 * world, ws + 4 * world);
      std::vector<int64_t> sb(world), gb(world);
      for (int64_t i = 0; i < world; ++i) {
        sb[i] = s2[i] * rb;
        gb[i] = r2[i] * rb;
      }
      const int64_t send1 = (world - 1) * (k[K_HROWS] + inl) * rb;
      at::Tensor r = on_storage(recv, n1, {k[K_SUM_R2] * rb});
      at::Tensor s = on_storage(send, send1, {k[K_SUM_S2] * rb});
      if (!exchange(*g, r, s, gb, sb, k[K_POLL_NS], watch, REC_SEND, send1, [] {}))
        return nullptr;
      k[K_WORK_BYTES] = got;
    }
    const double t3 = now_us();
    int64_t* tw = state_words(d[TD_WORDS]);
    tw[TW_INLINE] = gmax <= k[K_CAP] ? gmax : 0;
    tw[TW_GMAX] = gmax;
    // the plan, into room for every pair the received tokens could name (res_offsets' end at
    // num_recv = most); then recv_x's rows, exactly
    const int64_t most = num_bags * k[K_PAIRS], n_me = k[K_N_ME], sends = k[K_SENDS];
    const int64_t bound = 4 * most + num_bags + k[K_PER_RANK] + sends + t_n + (most + 1) / 2;
    Obj res(np_words(bound));
    if (!res) return nullptr;
    thread_local std::vector<int64_t> gather;    // recv_x's row sources, for `rows_c`
    gather.resize(std::max<int64_t>(most, 1));
    k[K_RES] = reinterpret_cast<intptr_t>(np_data(res.get()));
    k[K_RES_LEN] = bound;
    k[K_GATHER_AT] = reinterpret_cast<intptr_t>(gather.data());
    k[K_GATHER_LEN] = most;
    if (!run(k, K_PLAN, K_ERR)) return nullptr;
    const int64_t num_recv = k[K_NUM_RECV];
    at::Tensor mem = owned_bytes(d[TD_POOL], num_recv * rb);
    k[K_OUT] = reinterpret_cast<intptr_t>(mem.data_ptr());
    k[K_OUT_BYTES] = num_recv * rb;
    if (!run(k, K_ROWS, K_ERR)) return nullptr;
    const double t4 = now_us();
    const int64_t* off = k + K_OFFSETS;
    int64_t* r = words(res.get());
    const int64_t o_dims[2] = {3, num_recv}, w_dims[1] = {num_recv},
                  tpe_dims[1] = {off[4] - off[3]};
    // no rows: origins and weights of their own (empty views of res would be two tensors of
    // two types at one address, which torch.save refuses)
    Obj obase(num_recv ? ref(res.get()) : np_words(1));
    Obj wbase(num_recv ? ref(res.get()) : np_words(1));
    if (!obase || !wbase) return nullptr;
    Obj origins(np_view(obase.get(), num_recv ? r : words(obase.get()), 2, o_dims, false));
    Obj weights(np_view(wbase.get(), num_recv ? r + off[6] : words(wbase.get()), 1, w_dims, true));
    Obj tpe(np_view(res.get(), r + off[3], 1, tpe_dims, false));
    Obj recv_x(THPVariable_Wrap(on(mem, num_recv, hidden, x.options())));
    Obj offsets(PyTuple_New(8));
    if (!origins || !weights || !tpe || !recv_x || !offsets) return nullptr;
    for (int i = 0; i < 8; ++i) {
      PyObject* v = PyLong_FromLongLong(off[i]);
      if (!v) return nullptr;
      PyTuple_SET_ITEM(offsets.get(), i, v);
    }
    Obj sent(int_list(ws, world, me)), got(int_list(ws + 2 * world, world, me));
    if (!sent || !got) return nullptr;
    // _TorchState.cpu(res, res_addr, offsets, recv_weights, num_pairs, num_bags, sends,
    //                 num_tokens, sent_per_rank, recv_per_rank, num_back, num_own,
    //                 num_remote_bags)
    Obj state(PyObject_CallFunction(d[TD_STATE], "OLOOLLLLOOLLL", res.get(),
                                    static_cast<long long>(k[K_RES]), offsets.get(),
                                    weights.get(), static_cast<long long>(num_recv),
                                    static_cast<long long>(num_bags),
                                    static_cast<long long>(sends), static_cast<long long>(t_n),
                                    sent.get(), got.get(),
                                    static_cast<long long>(k[K_NUM_BACK]),
                                    static_cast<long long>(n_me),
                                    static_cast<long long>(k[K_REMOTE_BAGS])));
    if (!state) return nullptr;
    PyObject* handle = instance(results.handle, {
        {names[N_BUFFER_ID], ref(d[TD_BUFFER_ID])}, {names[N_CALL], PyLong_FromLongLong(call)},
        {names[N_NUM_TOKENS], PyLong_FromLongLong(t_n)},
        {names[N_NUM_RECV], PyLong_FromLongLong(num_recv)},
        {names[N_HIDDEN], PyLong_FromLongLong(hidden)}, {names[N_TOPK_IDX], ref(idx_obj)},
        {names[N_TOPK_WEIGHTS], ref(w_obj)}, {names[N_ORIGINS], origins.release()},
        {names[N_STATE], state.release()}});
    if (!handle) return nullptr;
    const double t5 = now_us();
    PyObject* times = tuple_steal({PyFloat_FromDouble(t0), PyFloat_FromDouble(t1),
                                   PyFloat_FromDouble(t2), PyFloat_FromDouble(t3),
                                   PyFloat_FromDouble(t4), PyFloat_FromDouble(t5)});
    PyObject* stats;
    // (the handle last: a backend that reports the call in its own terms reads it)
    if (gmax > inl) {   // _rows_dispatch_stats(world, me, t, inline, block, row, s2, r2, handle)
      stats = deferred_stats(d[TD_BUILD_ROWS], tuple_steal({
          PyLong_FromLongLong(world), ref(d[TD_RANK]), times, PyLong_FromLongLong(inl),
          PyLong_FromLongLong(k[K_BLK_BYTES]), PyLong_FromLongLong(rb),
          int_list(s2.data(), world, -1), int_list(r2.data(), world, -1), ref(handle)}));
    } else {            // _cpu_dispatch_stats(rank, t, bytes, collectives, row, handle)
      stats = deferred_stats(d[TD_BUILD], tuple_steal({
          ref(d[TD_RANK]), times, ref(d[TD_BYTES]), ref(d[TD_COLL]), PyLong_FromLongLong(rb),
          ref(handle)}));
    }
    return instance(results.dispatch, {
        {names[N_RECV_X], recv_x.release()}, {names[N_WEIGHTS], weights.release()},
        {names[N_TPE], tpe.release()},
        {names[N_HANDLE], handle}, {names[N_STATS], stats}});
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}


// a combine of `e_obj`'s rows for the dispatch whose state is `st` through a shape's door
// words `d` (TC_*) into `out_arg` (None: a new y), as `torch_combine` answers
static PyObject* combine_core(PyObject* const* d, PyObject* e_obj, PyObject* st, int weighted,
                              PyObject* out_arg) {
  try {
    int64_t* b = words(d[TC_B]);
    Group* g = group_of(d[TC_GROUP]);
    if (!g) return nullptr;
    const Watch watch = watch_of(d[TC_CHECK], d[TC_REC], b[B_CHECK_NS]);
    const at::Tensor& e = THPVariable_Unpack(e_obj);
    Obj at_words(PyObject_GetAttr(st, names[N_AT])), sizes(PyObject_GetAttr(st, names[N_SIZES]));
    Obj t_obj(PyObject_GetAttr(st, names[N_NUM_TOKENS]));
    Obj to_peers(PyObject_GetAttr(st, names[N_RECV_PER_RANK]));
    Obj from_peers(PyObject_GetAttr(st, names[N_SENT_PER_RANK]));
    if (!at_words || !sizes || !t_obj || !to_peers || !from_peers) return nullptr;
    if (!tuple_of(at_words.get(), 5, "state.at") || !tuple_of(sizes.get(), 3, "state.sizes"))
      return nullptr;
    int64_t at5[5], sz[3];
    if (!ints(&PyTuple_GET_ITEM(at_words.get(), 0), 5, at5)
        || !ints(&PyTuple_GET_ITEM(sizes.get(), 0), 3, sz))
      return nullptr;
    const int64_t t_n = PyLong_AsLongLong(t_obj.get());
    if (t_n == -1 && PyErr_Occurred()) return nullptr;
    if (!out_ready(out_arg, e_obj, t_n)) return not_taken();
    int64_t nret, own, back;   // partials: of received tokens, of mine, coming back
    if (!get_int(st, names[N_NUM_REMOTE_BAGS], nret) || !get_int(st, names[N_NUM_OWN], own)
        || !get_int(st, names[N_NUM_BACK], back))
      return nullptr;
    const int64_t hidden = b[B_HIDDEN], prow = hidden * static_cast<int64_t>(e.element_size());
    const at::Tensor *csend = scratch(d[TC_SCRATCH], names[N_CSEND]),
                     *cback = scratch(d[TC_SCRATCH], names[N_COMBINE]);
    if (!csend || !cback || (nret + own) * prow > csend->numel() || back * prow > cback->numel())
      return not_taken();      // the scratch must grow: the Python path does it
    b[B_SEND_AT] = reinterpret_cast<intptr_t>(csend->data_ptr());
    b[B_BACK_AT] = reinterpret_cast<intptr_t>(cback->data_ptr());
    std::vector<int64_t> send_splits, recv_splits;
    if (!splits(to_peers.get(), prow, send_splits) || !splits(from_peers.get(), prow, recv_splits))
      return nullptr;
    const double t0 = now_us();
    b[B_ROWS] = reinterpret_cast<intptr_t>(e.const_data_ptr());
    b[B_NUM_ROWS] = e.size(0);
    b[B_WEIGHTED] = weighted;
    b[B_W_AT] = at5[0];
    b[B_ROWS_AT] = at5[1];
    b[B_OFFS_AT] = at5[2];
    b[B_FIN_ROWS_AT] = at5[3];
    b[B_FIN_OFFS_AT] = at5[4];
    b[B_NUM_PAIRS] = sz[0];
    b[B_NUM_BAGS] = sz[1];
    b[B_SENDS] = sz[2];
    b[B_NUM_TOKENS] = t_n;
    b[B_NRET] = nret;
    b[B_OWN] = own;
    b[B_BACK] = back;
    b[B_OWN_AT] = b[B_SEND_AT] + nret * prow;
    b[B_J0] = 0;
    b[B_J1] = nret;
    b[B_DST] = b[B_SEND_AT];
    if (!run(b, B_BAGS, B_ERR)) return nullptr;
    at::Tensor recv = on_storage(*cback, 0, {back * prow});
    at::Tensor send = on_storage(*csend, 0, {nret * prow});
    b[B_J0] = nret;
    b[B_J1] = nret + own;
    b[B_DST] = b[B_OWN_AT];
    Kernel bags = reinterpret_cast<Kernel>(static_cast<intptr_t>(b[B_BAGS]));
    double t2, t3;
    if (nret * prow <= b[B_INLINE_BYTES]) {   // latency: own tokens summed while it runs
      if (!exchange(*g, recv, send, recv_splits, send_splits, b[B_POLL_NS], watch,
                    REC_CSEND, 0, [&] { bags(b); t2 = now_us(); }))
        return nullptr;
      t3 = now_us();
      if (b[B_ERR]) {
        PyErr_SetString(PyExc_RuntimeError, "torch backend: a kernel's sizes out of its plan");
        return nullptr;
      }
    } else {                                  // bytes: the sums would compete for the cores
      t2 = now_us();
      if (!exchange(*g, recv, send, recv_splits, send_splits, b[B_POLL_NS], watch,
                    REC_CSEND, 0, [] {}))
        return nullptr;
      t3 = now_us();
      if (!run(b, B_BAGS, B_ERR)) return nullptr;
    }
    at::Tensor y = out_arg == Py_None ? at::empty({t_n, hidden}, e.options())
                                      : THPVariable_Unpack(out_arg);
    b[B_Y] = reinterpret_cast<intptr_t>(y.data_ptr());
    if (!run(b, B_FINAL, B_ERR)) return nullptr;
    const double t4 = now_us();
    Obj y_obj(out_arg == Py_None ? THPVariable_Wrap(y) : ref(out_arg));
    if (!y_obj) return nullptr;
    PyObject* times = tuple_steal({PyFloat_FromDouble(t0), PyFloat_FromDouble(t2),
                                   PyFloat_FromDouble(t3), PyFloat_FromDouble(t4)});
    PyObject* stats = deferred_stats(d[TC_BUILD], tuple_steal({
        ref(d[TC_RANK]), times, PyLong_FromLongLong(nret * prow),
        PyLong_FromLongLong(back * prow), ref(st), PyLong_FromLongLong(prow)}));
    return instance(results.combine, {{names[N_Y], y_obj.release()}, {names[N_STATS], stats}});
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}


// torch_dispatch(door, x, topk_idx, topk_weights, call) -> DispatchResult, or
// (global_max, num_bags, t0, t1, t2) when some peer sent more than phase 1 holds (the Python
// path runs phase 2 from there; the door's K array holds the plan's words)
PyObject* torch_dispatch(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!arity(nargs, 5) || !tuple_of(a[0], TD_LEN, "door")) return nullptr;
  const int64_t call = PyLong_AsLongLong(a[4]);
  if (call == -1 && PyErr_Occurred()) return nullptr;
  return dispatch_core(&PyTuple_GET_ITEM(a[0], 0), a[1], a[2], a[3], call);
}

// torch_combine(door, expert_out, state, weighted, out) -> CombineResult: expert_out's rows
// (contiguous, the partials' dtype) summed per received token into the send buffer, the
// collective (this rank's own tokens summed while a small one runs, after a large one), then
// each token's partials summed at the source into y (`out` when not None: contiguous, the
// rows' dtype; anything `out_ready` refuses answers NotImplemented)
PyObject* torch_combine(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!arity(nargs, 5) || !tuple_of(a[0], TC_LEN, "door")) return nullptr;
  const int weighted = PyObject_IsTrue(a[3]);
  if (weighted < 0) return nullptr;
  return combine_core(&PyTuple_GET_ITEM(a[0], 0), a[1], a[2], weighted, a[4]);
}

// torch_door_dispatch(door, x, topk_idx, topk_weights) -> DispatchResult or NotImplemented:
// `Buffer.dispatch`'s common call on the torch backend's compiled path, from the inputs' fast
// check to the last stats (as door.cpp for the shm direct path): declined, before any state
// moves, unless the inputs pass the fast check, the Buffer takes calls and the backend has
// this shape's door words (its first call of a shape runs in Python and makes them)
PyObject* torch_door_dispatch(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!arity(nargs, 4) || !tuple_of(a[0], TR_LEN, "door")) return nullptr;
  PyObject* const* d = &PyTuple_GET_ITEM(a[0], 0);
  int64_t lim[4];
  if (!ints(d + TR_HIDDEN, 4, lim)) return nullptr;
  if (!passes(dispatch_ready, a + 1, lim)) return not_taken();
  Locked locked(d[TR_LOCK]);
  if (!locked.ok()) return nullptr;
  int64_t* bw = state_words(d[TR_BUFFER_WORDS]);
  if (!bw[BW_USABLE]) return not_taken();     // closed or broken: Python names why
  const at::Tensor& x = THPVariable_Unpack(a[1]);
  const at::Tensor& idx = THPVariable_Unpack(a[2]);
  const int64_t* tw = state_words(d[TR_WORDS]);
  if (tw[TW_SHUT]) return not_taken();        // (the hybrid backend's calls not flat)
  const int64_t inl = tw[TW_INLINE];
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(x.scalar_type()));
  Obj k(Py_BuildValue("(LOL)", static_cast<long long>(x.size(1)), dtype,
                      static_cast<long long>(inl)));
  if (!k) return nullptr;
  PyObject* door = lookup(d[TR_DOORS], k.get());        // (`TorchBackend._dispatch_door`)
  if (!door || !PyTuple_CheckExact(door) || PyTuple_GET_SIZE(door) != TD_LEN) return not_taken();
  Obj door_ref(ref(door));     // held while the call runs
  if (!fits(words(PyTuple_GET_ITEM(door, TD_K)), PyTuple_GET_ITEM(door, TD_SCRATCH),
            idx.size(0)))
    return not_taken();        // the scratch must grow: the Python path does it
  // the call: from here on its state moves (as `Buffer._dispatch_checked` moves it)
  const int64_t call = ++bw[BW_CALLS];
  PyObject* r = dispatch_core(&PyTuple_GET_ITEM(door, 0), a[1], a[2], a[3], call);
  if (!r || !PyTuple_Check(r)) return r;
  // phase 2 needs more receive scratch: on in Python (`rest`)
  Obj cl(PyLong_FromLongLong(call));
  PyObject* args[5] = {a[1], a[2], a[3], cl.get(), r};
  PyObject* res = cl ? PyObject_Vectorcall(d[TR_REST], args, 5, nullptr) : nullptr;
  Py_DECREF(r);
  return res;
}

// torch_door_combine(door, expert_out, handle, weighted, out) -> CombineResult or
// NotImplemented: the
// common combine (this Buffer's handle of a compiled-layout CPU dispatch, bf16 or fp32 rows,
// `out` None or as `out_ready` takes it) as `torch_door_dispatch` takes the common dispatch
PyObject* torch_door_combine(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!arity(nargs, 5) || !tuple_of(a[0], TR_LEN, "door")) return nullptr;
  PyObject* const* d = &PyTuple_GET_ITEM(a[0], 0);
  PyObject *rows = a[1], *handle = a[2];
  const int64_t own_id = PyLong_AsLongLong(d[TR_BUFFER_ID]);
  if (own_id == -1 && PyErr_Occurred()) return nullptr;
  int64_t hv[4];                // buffer_id, num_recv, hidden, num_tokens
  int weighted;
  const int go = combine_handle(handle, rows, a[3], own_id, hv, weighted);
  if (go <= 0) return go < 0 ? nullptr : not_taken();
  const at::Tensor& e = THPVariable_Unpack(rows);
  if (e.scalar_type() != at::kBFloat16 && e.scalar_type() != at::kHalf
      && e.scalar_type() != at::kFloat)
    return not_taken();
  Locked locked(d[TR_LOCK]);
  if (!locked.ok()) return nullptr;
  if (!state_words(d[TR_BUFFER_WORDS])[BW_USABLE]) return not_taken();   // Python names why
  if (state_words(d[TR_WORDS])[TW_SHUT]) return not_taken();   // (the hybrid's: timed calls)
  Obj st(PyObject_GetAttr(handle, names[N_STATE]));
  if (!st) return nullptr;
  if (reinterpret_cast<PyObject*>(Py_TYPE(st.get())) != d[TR_STATE_TYPE]) return not_taken();
  Obj res(PyObject_GetAttr(st.get(), names[N_RES]));
  if (!res) return nullptr;
  if (res.get() == Py_None) return not_taken();       // a device dispatch's state
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(e.scalar_type()));
  Obj k(Py_BuildValue("(OL)", dtype, static_cast<long long>(hv[2])));
  if (!k) return nullptr;
  PyObject* door = lookup(d[TR_DOORS], k.get());        // (`TorchBackend._combine_door`)
  if (!door || !PyTuple_CheckExact(door) || PyTuple_GET_SIZE(door) != TC_LEN) return not_taken();
  Obj door_ref(ref(door));
  // (NotImplemented: the scratch must grow, which the Python path does)
  return combine_core(&PyTuple_GET_ITEM(door, 0), rows, st.get(), weighted, a[4]);
}

}  // namespace ubep_native
