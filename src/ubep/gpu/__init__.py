"""One accelerator as an emulated superpod: P expert-parallel ranks as Triton programs.

`EmulatedSuperpod(P, E, hidden, mode="ubep" | "bsp")` keeps every rank's buffers in one
device tensor per kind and runs dispatch/combine as Triton kernels planned by
`ubep.plan.make_plan`: "bsp" one kernel per phase, "ubep" one dependency-driven kernel per
call (count, sender and receiver programs, per-row flags, no barrier).

Needs `triton` (`pip install 'ubep[gpu]'`). Without CUDA the kernels run under Triton's
interpreter on CPU tensors: importing this package then sets TRITON_INTERPRET=1 unless it
is set already (it must be set before Triton builds the kernels).
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from ubep.gpu.executor import (  # noqa: E402
    MODES,
    EmulatedSuperpod,
    GpuDispatch,
    RankDispatch,
    Routing,
    SpinLimitError,
    device_topology,
)

__all__ = ["EmulatedSuperpod", "GpuDispatch", "RankDispatch", "Routing", "SpinLimitError",
           "device_topology", "MODES"]
