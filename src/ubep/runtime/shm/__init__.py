"""The shared-memory runtime: ranks on one host as processes, workers as threads.

Follow a call from `backend.ShmBackend` (bootstrap, then one path per Buffer):

* `direct/`: `direct="owned"` (the default) and `direct=True`, each row copied once,
  straight to its final place;
* `staged/`: rows staged through the peers' windows, one worker per rank, the call in the
  calling thread;
* `pool/`: staged, `workers` >= 2 threads, in the paper's roles (mode "ubep") or the
  baseline's barrier-separated phases (mode "bsp"); `call.py` holds a call's shared state
  and how its workers run, `workers.py` the threads (the direct path uses them too).

Each path's folder holds its class (`path.py`), its own kernels (`kernels.py`) and, where
`ubep.native` has a door for it, the kernels as C entry points (`entries.py`).

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
