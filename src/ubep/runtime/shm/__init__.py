"""The shared-memory runtime: ranks on one host as processes, workers as threads.

`backend.ShmBackend` is what `Buffer(backend="shm")` builds; `region` lays out each rank's
shared region, `segments` creates and releases it, `kernels` are the Numba kernels and
`atomics` their acquire/release intrinsics.
"""

from ubep.runtime.shm.atomics import MEMORY_MODEL

__all__ = ["MEMORY_MODEL"]
