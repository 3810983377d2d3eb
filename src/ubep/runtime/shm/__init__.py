"""The shared-memory runtime: ranks on one host as processes, workers as threads.

Follow a call from `backend.ShmBackend` (bootstrap, then one path per Buffer):

* `single.py`: one worker per rank, the call in the calling thread;
* `pool.py`: `workers` >= 2 threads, in the paper's roles (mode "ubep") or the baseline's
  barrier-separated phases (mode "bsp"); `call.py` holds a call's shared state and how
  its workers run, `workers.py` the threads;
* `direct.py`: `direct=True`, each row copied once, straight to its final place.

Shared pieces: `context.py` (what every path reads about the mapped regions), `region.py`
(the layout of a rank's region), `segments.py` (create, attach, release shared memory),
`atomics.py` (acquire/release loads and stores for Numba), `waits.py` (bounded waits with
deadlines and liveness), `protocol.py` (dtype codes, status, `ShmProtocolError`),
`elements.py` (how combine sums any float dtype), and `kernels/` (the Numba kernels, one
module per purpose).
"""

__all__ = ["MEMORY_MODEL"]


def __getattr__(name: str):
    """`MEMORY_MODEL` (`atomics`), imported on first read: a submodule imported alone (the
    segments `Buffer` reads to choose a backend) loads no Numba."""
    if name == "MEMORY_MODEL":
        from ubep.runtime.shm.atomics import MEMORY_MODEL

        return MEMORY_MODEL
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
