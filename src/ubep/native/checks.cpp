// ubep's compiled input checks: the fast checks `Buffer.dispatch` and `Buffer.combine` run on
// every eager call (`ubep.validate.dispatch_inputs_ready` / `combine_inputs_ready`).
//
// Same rules as the Python functions, read straight from the tensors: a batch-1 call's
// Python check is ~4 µs of attribute reads and one numba entry; here it is one C call.
// False still means "not sure" (the full Python check then decides and names the error), so
// anything unusual (a tensor subclass, a non-strided layout, a torch error) answers False.
// Entries take positional arguments by METH_FASTCALL: no argument parsing layer.
#include "native.h"

namespace {

bool movable(at::ScalarType d) {     // ubep.validate.MOVABLE_DTYPES
  switch (d) {
    case at::kBFloat16: case at::kHalf: case at::kFloat: case at::kChar: case at::kByte:
    case at::kShort: case at::kInt: case at::kFloat8_e4m3fn: case at::kFloat8_e5m2:
      return true;
    default:
      return false;
  }
}

bool summable(at::ScalarType d) {    // floating, at most 4 bytes (ubep.validate._summable)
  return at::isFloatingType(d) && at::elementSize(d) <= 4;
}

// a plain CPU tensor (torch.Tensor or Parameter, strided): anything else is "not sure"
const at::Tensor* plain(PyObject* o) {
  if (!THPVariable_CheckExact(o)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(o);
  if (!t.defined() || t.layout() != at::kStrided || !t.is_cpu()) return nullptr;
  return &t;
}

// ids valid: each in [-1, num_experts), no expert twice in a row (ubep.validate._scan_topk)
bool topk_ok(const int64_t* p, int64_t rows, int64_t cols, int64_t num_experts) {
  for (int64_t t = 0; t < rows; ++t, p += cols)
    for (int64_t k = 0; k < cols; ++k) {
      int64_t e = p[k];
      if (e < -1 || e >= num_experts) return false;
      if (e >= 0)
        for (int64_t j = 0; j < k; ++j)
          if (p[j] == e) return false;
    }
  return true;
}

}  // namespace

namespace ubep_native {

bool dispatch_ready(PyObject* const* a, const int64_t* lim) {
  const int64_t hidden = lim[0], num_experts = lim[1], max_tokens = lim[2], max_top_k = lim[3];
  const at::Tensor *x = plain(a[0]), *idx = plain(a[1]), *w = plain(a[2]);
  if (!x || !idx || !w) return false;
  if (x->dim() != 2 || idx->dim() != 2 || w->dim() != 2) return false;
  const int64_t t_n = x->size(0), k_n = idx->size(1);
  if (x->size(1) != hidden || t_n > max_tokens || idx->size(0) != t_n || k_n > max_top_k
      || w->size(0) != t_n || w->size(1) != k_n)
    return false;
  if (idx->scalar_type() != at::kLong || w->scalar_type() != at::kFloat
      || !movable(x->scalar_type()))
    return false;
  if (!x->is_contiguous() || !idx->is_contiguous() || !w->is_contiguous()) return false;
  if (x->requires_grad() || w->requires_grad() || hidden == 1 || t_n == 0) return false;
  return topk_ok(idx->const_data_ptr<int64_t>(), t_n, k_n, num_experts);
}

bool combine_ready(PyObject* const* a, const int64_t* lim) {
  const at::Tensor* e = plain(a[0]);
  return e && e->dim() == 2 && e->size(0) == lim[0] && e->size(1) == lim[1]
      && summable(e->scalar_type()) && e->is_contiguous() && !e->requires_grad()
      && e->stride(1) == 1;
}

bool out_ready(PyObject* out, PyObject* rows, int64_t num_tokens, int64_t avoid,
               int64_t avoid_len) try {
  if (out == Py_None) return true;
  const at::Tensor *o = plain(out), *e = plain(rows);
  if (!o || !e || o->dim() != 2 || o->size(0) != num_tokens || o->size(1) != e->size(1)
      || o->scalar_type() != e->scalar_type() || !o->is_contiguous() || o->requires_grad())
    return false;
  // no byte shared with the rows (`Buffer._overlap`: such an `out` is filled afterwards) nor
  // with [avoid, avoid + avoid_len) (the Python path names that error)
  if (o->numel() == 0) return true;
  const auto span = [](const at::Tensor& t) {
    const int64_t p = reinterpret_cast<intptr_t>(t.const_data_ptr());
    return std::pair<int64_t, int64_t>(p, p + t.numel() * t.element_size());
  };
  const auto [o0, o1] = span(*o);
  const auto [e0, e1] = span(*e);
  return (e->numel() == 0 || o1 <= e0 || e1 <= o0) && (o1 <= avoid || avoid + avoid_len <= o0);
} catch (const std::exception&) {     // a torch error on an odd tensor: "not sure"
  return false;
}

}  // namespace ubep_native

namespace {

template <bool (*Check)(PyObject* const*, const int64_t*), Py_ssize_t NT, Py_ssize_t NI>
PyObject* entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!ubep_native::arity(nargs, NT + NI)) return nullptr;
  int64_t lim[NI > 0 ? NI : 1];
  if (!ubep_native::ints(args + NT, NI, lim)) return nullptr;
  bool ok = false;
  try {
    ok = Check(args, lim);
  } catch (const std::exception&) {     // a torch error on an odd tensor: "not sure"
    ok = false;
  }
  if (ok) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

}  // namespace

namespace ubep_native {

PyObject* dispatch_inputs_ready(PyObject* self, PyObject* const* a, Py_ssize_t n) {
  return entry<ubep_native::dispatch_ready, 3, 4>(self, a, n);
}

PyObject* combine_inputs_ready(PyObject* self, PyObject* const* a, Py_ssize_t n) {
  return entry<ubep_native::combine_ready, 1, 2>(self, a, n);
}

}  // namespace ubep_native
