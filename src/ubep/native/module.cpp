// The `ubep_native` module: its entries (positional arguments, METH_FASTCALL) and its init.
#include "native.h"

namespace {

PyMethodDef methods[] = {
    {"dispatch_inputs_ready", (PyCFunction)(void (*)())ubep_native::dispatch_inputs_ready,
     METH_FASTCALL,
     "dispatch_inputs_ready(x, topk_idx, topk_weights, hidden, num_experts, max_tokens, "
     "max_top_k) -> bool"},
    {"combine_inputs_ready", (PyCFunction)(void (*)())ubep_native::combine_inputs_ready,
     METH_FASTCALL, "combine_inputs_ready(expert_out, num_recv, hidden) -> bool"},
    {"direct_dispatch", (PyCFunction)(void (*)())ubep_native::direct_dispatch, METH_FASTCALL,
     "the shm direct path's one-worker dispatch (see ubep.runtime.shm.direct.path)"},
    {"direct_combine", (PyCFunction)(void (*)())ubep_native::direct_combine, METH_FASTCALL,
     "the shm direct path's one-worker combine (see ubep.runtime.shm.direct.path)"},
    {"set_result_types", (PyCFunction)(void (*)())ubep_native::set_result_types, METH_FASTCALL,
     "set_result_types(DispatchHandle, DispatchResult, CombineResult, DeferredStats, NAMES): "
     "the classes the entries make their results of, and the names they use on Python "
     "objects (ubep.native.layout.NAMES); ubep.native calls it when it loads the extension"},
    {"door_dispatch", (PyCFunction)(void (*)())ubep_native::door_dispatch, METH_FASTCALL,
     "door_dispatch(door, x, topk_idx, topk_weights): Buffer.dispatch's common call "
     "on the shm direct path, or NotImplemented (see native/door.cpp)"},
    {"door_combine", (PyCFunction)(void (*)())ubep_native::door_combine, METH_FASTCALL,
     "door_combine(door, expert_out, handle, weighted, out): Buffer.combine's common call "
     "on the shm direct path, or NotImplemented (see native/door.cpp)"},
    {"staged_door_dispatch", (PyCFunction)(void (*)())ubep_native::staged_door_dispatch,
     METH_FASTCALL, "staged_door_dispatch(door, x, topk_idx, topk_weights): "
     "Buffer.dispatch's common call on the shm one-worker staged path, or NotImplemented "
     "(see native/staged.cpp)"},
    {"staged_door_combine", (PyCFunction)(void (*)())ubep_native::staged_door_combine,
     METH_FASTCALL, "staged_door_combine(door, expert_out, handle, weighted, out): "
     "Buffer.combine's common call on the shm one-worker staged path, or NotImplemented"},
    {"torch_group", (PyCFunction)(void (*)())ubep_native::torch_group, METH_FASTCALL,
     "torch_group(group): the C++ ProcessGroup of a torch.distributed group, as a capsule"},
    {"torch_dispatch", (PyCFunction)(void (*)())ubep_native::torch_dispatch, METH_FASTCALL,
     "the torch backend's CPU dispatch (see native/torch_path.cpp)"},
    {"torch_combine", (PyCFunction)(void (*)())ubep_native::torch_combine, METH_FASTCALL,
     "the torch backend's CPU combine (see native/torch_path.cpp)"},
    {"torch_door_dispatch", (PyCFunction)(void (*)())ubep_native::torch_door_dispatch,
     METH_FASTCALL, "torch_door_dispatch(door, x, topk_idx, topk_weights): "
     "Buffer.dispatch's common call on the torch backend, or NotImplemented"},
    {"torch_door_combine", (PyCFunction)(void (*)())ubep_native::torch_door_combine,
     METH_FASTCALL, "torch_door_combine(door, expert_out, handle, weighted, out): "
     "Buffer.combine's common call on the torch backend, or NotImplemented"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "ubep_native", nullptr, -1, methods};

}  // namespace

#define UBEP_CAT2(a, b) a##b
#define UBEP_CAT(a, b) UBEP_CAT2(a, b)

// TORCH_EXTENSION_NAME: the module name torch.utils.cpp_extension.load was given
PyMODINIT_FUNC UBEP_CAT(PyInit_, TORCH_EXTENSION_NAME)() {
  if (!ubep_native::init_direct() || !ubep_native::init_staged()) return nullptr;
  return PyModule_Create(&module);
}
