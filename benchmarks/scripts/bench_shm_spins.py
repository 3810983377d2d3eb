"""The shm one-worker path with different inline spins (`ubep.runtime.shm.waits.INLINE_SPINS`:
how long a kernel's first poll spins before the Python wait), alternating every 20
dispatch+combine calls in one process pair, ranks bound to cores 0 and 1, each call after a
barrier; the pair's time is the slower rank's. The previous dispatch's result is held during
the next, as a decode loop holds it.

Not a test (pytest does not collect it): it prints its figures.

    .venv/bin/python -m benchmarks bench_shm_spins [owned|direct|staged] [SPINS,...] [BATCH]

("staged": `direct=False`, the paper's two copies, rows through the receiver's window.)
"""

from __future__ import annotations

import gc
import os
import sys
import time

import numpy as np
import torch


def _rank(rank: int, world: int, kind: str, spins: list[int], batch: int, calls: int) -> list:
    os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})
    import ubep
    import ubep.runtime.shm.direct.path as direct
    import ubep.runtime.shm.staged.path as single
    from ubep.bench.flags import HostSync
    from ubep.native.layout import STAGED_DOOR
    from ubep.testing import make_routing, make_tokens

    idx, w = make_routing(batch, 8, 16, kind="uniform", seed=7 + rank)
    x = make_tokens(rank, batch, 7168, torch.bfloat16, seed=3)
    sync = HostSync.create(rank, world, os.environ["UBEP_JOB_ID"])
    perf = time.perf_counter_ns
    rows = []
    gc.collect()
    gc.disable()
    try:
        with ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=128, backend="shm",
                         workers=1, mode="ubep" if kind == "staged" else None,
                         direct={"direct": True, "owned": "owned", "staged": False}[kind]) as buf:
            held = None
            doors = {}                  # staged: its door reads the spins from its words
            if kind == "staged" and buf._door is not None:
                at = STAGED_DOOR.index("spins")
                doors = {s: (*buf._door[:at], s, *buf._door[at + 1:]) for s in spins}
            for i in range(calls + 200):
                s = spins[(i // 20) % len(spins)]
                direct.INLINE_SPINS = single.INLINE_SPINS = s
                if doors:
                    buf._door = doors[s]
                sync.barrier()
                t0 = perf()
                res = buf.dispatch(x, idx, w)
                t1 = perf()
                sync.barrier()
                t2 = perf()
                buf.combine(res.recv_x, res.handle)
                t3 = perf()
                held = res                      # noqa: F841 (held until the next dispatch)
                if i >= 200:
                    rows.append((s, (t1 - t0) / 1e3, (t3 - t2) / 1e3))
    finally:
        sync.close()
    return rows


def main() -> None:
    from ubep.testing import run_ranks

    kind = sys.argv[1] if len(sys.argv) > 1 else "owned"
    spins = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "8,256").split(",")]
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    calls = 3000
    got = run_ranks(_rank, 2, kind, spins, batch, calls, timeout_s=900, threads_per_rank=1)
    a, b = np.array(got[0]), np.array(got[1])
    pair = np.maximum(a[:, 1:], b[:, 1:])
    print(f"{kind}, batch {batch}: dispatch+combine, slower rank, {calls // len(spins)} calls each")
    for s in spins:
        sel = a[:, 0] == s
        tot = pair[sel].sum(1)
        print(f"  spins {s:5d}: dispatch {np.median(pair[sel, 0]):7.1f}  combine "
              f"{np.median(pair[sel, 1]):7.1f}  pair median {np.median(tot):7.1f}  p90 "
              f"{np.percentile(tot, 90):7.1f} µs")


if __name__ == "__main__":
    main()
