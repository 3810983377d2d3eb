"""The Numba kernels of the shm runtime, one module per purpose.

* `records`: the block format of a row on the wire (write a record, read it, is it there);
* `slots`: the small control messages: per-expert counts, combine hellos, sw/dc batch flags;
* `dispatch`, `combine`: rows to their destination window and back, reordering and summing;
* `local`: synchronization among the workers of one rank (barrier, publish);
* `sentinel`: sp's reserved marker pattern (arm the windows, refuse inputs that hold it);
* `warmup`: compile them all (and the paths' own, `direct/kernels.py`, `staged/kernels.py`)
  before a Buffer's first call.

Every kernel is `@jit` = `@njit(nogil=True, cache=True)`, so worker threads run them in
parallel. Shared words are addressed by raw address (`bases[d]` + offset, see `region.py`).
Rules:

* every flag/marker read is `load_acquire` (a plain load in a spin loop gets hoisted);
* window blocks are copied by our own byte loops (not `memcpy`, whose store order within
  one copy is not defined), and each block's marker word is written last with
  `store_release`; the direct path's rows, each guarded by a separate meta word, are
  copied by `memcpy_at` (no read of the lines it overwrites) and `store_fence`d before it;
* waits are bounded: a poll kernel spins at most `spins` rounds with `cpu_pause` and returns
  what is still missing; the Python side (`waits.py`) backs off, checks deadline and
  liveness, and re-enters;
* Numba's disk cache checks only a kernel's own source file: a module whose kernels call
  another module's (`staged/kernels.py`, `warmup`) must be edited too when those change
  what they write where, or a stale cached copy keeps the old layout.
"""

from numba import njit

#: how every kernel is compiled: releases the GIL (workers run in parallel), cached on disk
jit = njit(nogil=True, cache=True)
