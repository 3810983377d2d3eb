"""How often this host takes a core away: gaps in a tight clock loop, one process per core.

Not a test (pytest does not collect it). Each process, bound to its core, reads the clock
back to back for `seconds` and counts the gaps longer than 20, 50 and 100 µs (the VM's
other tenants, interrupts, the kernel's own work). A call of d µs that needs both cores is
hit by a gap about (gaps per second on both cores) x (d + typical gap) of the time: at
~200 gaps a second, a 35 µs batch-1 dispatch+combine about 1.4% of calls, so its p99 is
one of them, whatever the call does (docs/results.md: the copy bound's own p99/median).

    .venv/bin/python tests/runtime/bench_host_gaps.py [seconds]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys


def _gaps(core: int, seconds: float) -> tuple[int, list[int]]:
    from ubep.bench.flags import clock_gaps

    os.sched_setaffinity(0, [core])
    return core, clock_gaps(seconds)


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    cores = sorted(os.sched_getaffinity(0))
    with mp.get_context("spawn").Pool(len(cores)) as pool:
        results = pool.starmap(_gaps, [(c, seconds) for c in cores])
    for core, gaps in results:
        us = sorted(g / 1e3 for g in gaps)
        med = us[len(us) // 2] if us else 0.0
        print(f"core {core}: gaps > 20 µs {len(us) / seconds:.0f}/s, > 50 µs "
              f"{sum(g > 50 for g in us) / seconds:.0f}/s, > 100 µs "
              f"{sum(g > 100 for g in us) / seconds:.0f}/s; median gap {med:.0f} µs, "
              f"longest {us[-1] if us else 0:.0f} µs")


if __name__ == "__main__":
    main()
