"""Per-call account of a 2-rank shm dispatch+combine: what the slow calls spent their time on.

Not a test (pytest does not collect it). Two ranks run `pairs` dispatch+combine pairs, each op
started right after a barrier as `ubep bench` does; for every call each rank records its
phases (the path's own `Stats`), how its bounded waits backed off (yields, sleeps and the
time slept: `waits.py` is given counting stand-ins for `os.sched_yield` / `time.sleep`),
and from getrusage(RUSAGE_THREAD) the minor page faults and the voluntary / involuntary
context switches. It prints the median and tail of the pair (max over ranks), which share
of pairs slept, was preempted or faulted, the slowest pairs call by call, and each rank's
median phases. A pair whose rank shows an involuntary switch was preempted (the host's
scheduler, not the path); a sleep means a wait backed off past its yield window.

    .venv/bin/python -m benchmarks bench_shm_calls [ubep|bsp|direct] \
        [pairs] [batch] [--gc]

Python's cyclic GC is off in the ranks, as in `ubep bench`'s timed loops, unless `--gc`.
`taskset -c 1 ...` puts both ranks on one core (the placement a co-runner can cause).
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import time

import numpy as np


def _rank(rank: int, world: int, kind: str, pairs: int, batch: int, keep_gc: bool) -> list:
    import torch

    import ubep
    from ubep.bench.flags import HostSync
    from ubep.runtime.shm import waits
    from ubep.testing import make_routing, make_tokens

    cnt = {"yields": 0, "sleeps": 0, "slept_us": 0.0}

    class _Time:                                   # waits.py's `time`, counting sleeps
        perf_counter = staticmethod(time.perf_counter)
        perf_counter_ns = staticmethod(time.perf_counter_ns)

        @staticmethod
        def sleep(s: float) -> None:
            cnt["sleeps"] += 1
            t = time.perf_counter()
            time.sleep(s)
            cnt["slept_us"] += (time.perf_counter() - t) * 1e6

    class _Os:                                     # waits.py's `os`, counting yields
        @staticmethod
        def sched_yield() -> None:
            cnt["yields"] += 1
            os.sched_yield()

    waits.time, waits.os = _Time, _Os
    opts = {"direct": dict(direct=True), "ubep": dict(mode="ubep"), "bsp": dict(mode="bsp")}
    idx, w = make_routing(batch * world, 8, 16, kind="uniform", seed=7)
    idx = idx[rank * batch:(rank + 1) * batch].contiguous()
    w = w[rank * batch:(rank + 1) * batch].contiguous()
    x = make_tokens(rank, batch, 7168, torch.bfloat16, seed=3)
    sync = HostSync.create(rank, world, f"calls{os.getppid()}", timeout_s=60)
    if not keep_gc:
        gc.collect()
        gc.disable()
    warm, rec = 300, []
    try:
        with ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=max(batch, 128),
                         backend="shm", workers=1, **opts[kind]) as buf:
            for i in range(warm + pairs):
                ops = []
                ru0 = resource.getrusage(resource.RUSAGE_THREAD)
                for op in ("dispatch", "combine"):
                    sync.barrier()
                    for k in cnt:
                        cnt[k] = 0
                    t0 = time.perf_counter_ns()
                    if op == "dispatch":
                        r = buf.dispatch(x, idx, w)
                    else:
                        buf.combine(r.recv_x, r.handle)
                    t1 = time.perf_counter_ns()
                    ops.append(((t1 - t0) / 1e3, dict(buf.last_stats.phases_us), dict(cnt)))
                ru1 = resource.getrusage(resource.RUSAGE_THREAD)
                if i >= warm:
                    rec.append((ops, ru1.ru_minflt - ru0.ru_minflt, ru1.ru_nvcsw - ru0.ru_nvcsw,
                                ru1.ru_nivcsw - ru0.ru_nivcsw))
    finally:
        gc.enable()
        sync.close()
    return rec


def _fmt_op(name: str, op) -> str:
    us, phases, c = op
    ph = " ".join(f"{k}={v:.0f}" for k, v in phases.items())
    return f"{name}{us:.0f}[{ph}] y{c['yields']} s{c['sleeps']}"


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    kind = args[0] if args else "ubep"
    pairs = int(args[1]) if len(args) > 1 else 1000
    batch = int(args[2]) if len(args) > 2 else 1
    from ubep.testing import run_ranks

    out = run_ranks(_rank, 2, kind, pairs, batch, "--gc" in sys.argv, timeout_s=900)
    n = len(out[0])
    per_op = np.array([[max(out[r][i][0][j][0] for r in range(2)) for j in range(2)]
                       for i in range(n)])
    tot = per_op.sum(1)
    med, p99 = np.median(tot), np.percentile(tot, 99)
    print(f"{kind} batch {batch}, {n} pairs, load {os.getloadavg()[0]:.1f}: dispatch+combine "
          f"median {med:.1f} µs, p90 {np.percentile(tot, 90):.1f}, p99 {p99:.1f} "
          f"({p99 / med:.2f}x median); dispatch {np.median(per_op[:, 0]):.1f}, combine "
          f"{np.median(per_op[:, 1]):.1f}")
    for r in range(2):
        o = out[r]
        slept = sum(1 for e in o if any(op[2]["sleeps"] for op in e[0]))
        faults = [e[1] for e in o if e[1]]
        print(f"  rank {r}: pairs with a sleep {slept}/{n}, preempted (involuntary switch) "
              f"{sum(1 for e in o if e[3])}, faulted {len(faults)} (median "
              f"{np.median(faults) if faults else 0:.0f} faults)")
    print("  slowest pairs (µs): per rank dispatch[phases] yields sleeps, combine[...], "
          "faults, voluntary / involuntary switches")
    for i in np.argsort(tot)[::-1][:10]:
        line = f"  {tot[i]:8.1f} |"
        for r in range(2):
            ops, flt, vcs, ivcs = out[r][i]
            line += (f" r{r} {_fmt_op('D', ops[0])} {_fmt_op('C', ops[1])} f{flt} v{vcs} "
                     f"i{ivcs} |")
        print(line)
    for r in range(2):
        o = out[r]
        meds = []
        for j, name in ((0, "D"), (1, "C")):
            keys = list(o[0][0][j][1])
            meds.append(f"{name} " + " ".join(
                f"{k}={np.median([e[0][j][1][k] for e in o]):.1f}" for k in keys))
        print(f"  rank {r} median phases (µs): " + " | ".join(meds))


if __name__ == "__main__":
    main()
