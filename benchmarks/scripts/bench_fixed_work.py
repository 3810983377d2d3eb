"""A batch-1 shm call against fixed work of the same length, and the host's floor under both.

Not a test (pytest does not collect it). Two ranks, each bound to core `rank`, alternate
turns of 20 calls of two "systems" timed as `ubep bench` times them (`runner.timed_pair`):

- `shm-owned`: batch-1 dispatch+combine, hidden 7168 bf16, top-8 of 16 experts, the clone
  expert between them (untimed);
- `fixed work`: a numba loop calibrated to half the call's median per op on every rank (or
  to `us` µs per call if given): a call that never varies and moves nothing between cores,
  so its tail is the host's. With `us` fixed, its median also tells whether the host runs
  code slower at the time, or only moves lines between cores slower.

Gap probes on both cores at the start and the end (`benchmarks.probes.gaps_per_s`) are replayed
(`benchmarks.host_floor`) into the p99/median the host alone gives each median. The fixed
work's measured ratio checks the replay; the call's, against both, is what the call adds.

    .venv/bin/python -m benchmarks bench_fixed_work [rounds] [us]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from numba import njit


@njit(cache=True)
def _spin(n: int) -> int:
    """n rounds of integer arithmetic: fixed work, no memory traffic."""
    s = 0
    for _ in range(n):
        s = (s * 1103515245 + 12345) & 0xFFFFFFFF
    return s


def _rounds_for(us: float) -> int:
    """`_spin` rounds that take `us` µs here (the best of 50 timings of a 200 µs loop)."""
    n = 1 << 16
    _spin(10)
    best = min(_timed(n) for _ in range(50))
    return max(1, int(n * us * 1e3 / best))


def _timed(n: int) -> int:
    t = time.perf_counter_ns()
    _spin(n)
    return time.perf_counter_ns() - t


def _rank(rank: int, world: int, rounds: int, us: float | None) -> dict:
    import torch

    import ubep
    from benchmarks.probes import GapLog, gaps_per_s
    from ubep.bench.flags import HostSync
    from ubep.bench.runner import gc_paused, timed_pair
    from ubep.testing import make_routing, make_tokens

    os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    idx, w = make_routing(1, 8, 16, kind="uniform", seed=7 + rank)
    x = make_tokens(rank, 1, 7168, torch.bfloat16, seed=3)
    sync = HostSync.create(rank, world, os.environ["UBEP_JOB_ID"], timeout_s=60)
    buf = ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=128, backend="shm",
                      workers=1, direct="owned")

    class Call:
        def dispatch(self):
            self.r = buf.dispatch(x, idx, w)

        def expert(self):
            self.y = self.r.recv_x.clone()

        def combine(self):
            buf.combine(self.y, self.r.handle)

    class Fixed:
        n = 1

        def dispatch(self):
            _spin(self.n)

        def combine(self):
            _spin(self.n)

    call, fixed, log = Call(), Fixed(), GapLog()
    try:
        first = [sum(timed_pair(sync, call)) for _ in range(400)]   # warm-up and the median
        fixed.n = _rounds_for((us or float(np.median(first))) / 2)
        gaps_per_s(sync, log=log)
        times: dict[str, list[float]] = {"shm-owned": [], "fixed work": []}
        with gc_paused():
            for _ in range(rounds):
                for name, s in (("shm-owned", call), ("fixed work", fixed)):
                    for i in range(21):                        # a turn's first call untimed
                        t = sum(timed_pair(sync, s))
                        if i:
                            times[name].append(t)
        gaps_per_s(sync, log=log)
        return {"times": times, "log": log}
    finally:
        buf.close()
        sync.close()


def main() -> None:
    from benchmarks.host_floor import tail_ratio
    from ubep.testing import run_ranks

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    us = float(sys.argv[2]) if len(sys.argv) > 2 else None
    out = run_ranks(_rank, 2, rounds, us, timeout_s=1800,
                    env={"UBEP_JOB_ID": f"fixed{os.getpid()}"})
    probes = [list(k) for k in zip(*(o["log"].probes for o in out))]
    print(f"{rounds} turns of 20 calls each, alternating; dispatch+combine µs, the slower "
          "rank's; the host's floor from its gap probes at the start and the end:")
    for name in out[0]["times"]:
        t = np.maximum(*(np.asarray(o["times"][name]) for o in out))
        med, p99 = float(np.median(t)), float(np.percentile(t, 99))
        floor = tail_ratio(med, probes)
        print(f"  {name:10s} median {med:6.1f}  p99 {p99:6.1f}  p99/median {p99 / med:.2f}x  "
              f"host floor {'-' if floor is None else f'{floor:.2f}x'}; calls over 1 ms "
              f"{int((t > 1000).sum())}")


if __name__ == "__main__":
    main()
