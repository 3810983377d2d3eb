"""How often this host takes a core away, and how fast it runs the core it gives.

Not a test (pytest does not collect it). Each process, bound to its core, reads the clock
back to back for `seconds` and counts the gaps longer than 20, 50 and 100 µs (the VM's
other tenants, interrupts, the kernel's own work), beside the local timer interrupts the
core took meanwhile (`/proc/interrupts`, Linux: how many of the gaps the kernel's own tick
could explain), and where in each millisecond the gaps start (`benchmarks.timer_windows`:
on this project's VM most of them in one or two 50 µs windows, the same on every core).
A call of d µs that needs both cores is hit by a gap about (gaps per second on both
cores) x (d + typical gap) of the time: at ~200 gaps a second, a 35 µs batch-1
dispatch+combine about 1.4% of calls, so its p99 is one of them, whatever the call does
(docs/results.md: the copy bound's own p99/median). It then replays such calls over
the gaps both cores saw (`benchmarks.host_floor`): the p99/median the host alone gives them.

Then a fixed loop of Python arithmetic is timed in 100 ms chunks, on one core alone and on
both at once, `rounds` times: on a VM whose cores share physical cores with other tenants
(SMT siblings) the same loop runs at two speeds, and a median read while the host is in
the slow one is not the code's.

    .venv/bin/python -m benchmarks bench_host_gaps [seconds] [rounds]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys


def timer_ticks() -> dict[int, int] | None:
    """Local timer interrupts so far per core (the LOC row of /proc/interrupts), or None."""
    try:
        with open("/proc/interrupts") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    cpus = [int(c[3:]) for c in lines[0].split()]
    for line in lines[1:]:
        parts = line.split()
        if parts and parts[0] == "LOC:":
            return {c: int(v) for c, v in zip(cpus, parts[1:1 + len(cpus)])}
    return None


def _gaps(core: int, seconds: float):
    from benchmarks.probes import GapLog, clock_gaps

    os.sched_setaffinity(0, [core])
    log = GapLog()
    clock_gaps(seconds, log=log)
    return core, log


def _speed(core: int, seconds: float) -> float:
    """`loop_speed` on `core`: the median of 100 ms chunks, loop iterations a µs."""
    from benchmarks.probes import loop_speed

    os.sched_setaffinity(0, [core])
    return loop_speed(seconds, 0.1)


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    cores = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    with ctx.Pool(len(cores)) as pool:
        ticks0 = timer_ticks()
        results = pool.starmap(_gaps, [(c, seconds) for c in cores])
        ticks1 = timer_ticks()
        for core, log in results:
            us = sorted(g / 1e3 for g in log.probes[0][3])
            med = us[len(us) // 2] if us else 0.0
            tick = ("" if ticks0 is None or core not in ticks0 else
                    f"; timer interrupts {(ticks1[core] - ticks0[core]) / seconds:.0f}/s")
            print(f"core {core}: gaps > 20 µs {len(us) / seconds:.0f}/s, > 50 µs "
                  f"{sum(g > 50 for g in us) / seconds:.0f}/s, > 100 µs "
                  f"{sum(g > 100 for g in us) / seconds:.0f}/s; median gap {med:.0f} µs, "
                  f"longest {us[-1] if us else 0:.0f} µs{tick}")
        from benchmarks.probes import timer_windows_words
        from benchmarks.timer_windows import find_windows

        for core, log in results:
            words = timer_windows_words(find_windows(log.starts))
            print(f"core {core}: gaps' phase in the millisecond: "
                  + (words.strip(" ()") if words else "anywhere (no window holds more than "
                     "3x its share)"))
        from benchmarks.host_floor import tail_ratio

        probes = [[log.probes[0] for _, log in results]]
        print("the host's floor: p99/median of back-to-back calls that need every core for "
              "a fixed time, replayed over these gaps: " + ", ".join(
                  f"{us} µs {tail_ratio(us, probes) or float('nan'):.2f}x"
                  for us in (10, 20, 35, 45, 90)))
        print("fixed loop, 1 s a round, median of 100 ms chunks (loop iterations a µs):")
        for r in range(rounds):
            solo = pool.apply(_speed, (cores[0], 1.0))
            both = pool.starmap(_speed, [(c, 1.0) for c in cores])
            print(f"  round {r}: core {cores[0]} alone {solo:.1f}; all at once "
                  + ", ".join(f"core {c} {s:.1f}" for c, s in zip(cores, both)))


if __name__ == "__main__":
    main()
