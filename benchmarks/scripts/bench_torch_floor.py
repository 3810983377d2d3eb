"""The torch backend against its own collectives with and without the same host work.

Not a test (pytest does not collect it). Two ranks (gloo), one batch size per run. First
each rank times, over a few untimed calls, the host work the backend does around its
collectives: before the first, between two, after the last (medians, per op, per rank,
measured in place, so whatever this host adds to host work right after a collective is in
them). Then, interleaved round by round, each started after a tight cross-process barrier:

* `torch`: `Buffer(backend="torch")` dispatch + combine;
* `raw`: the same `all_to_all_single` calls on the same bytes, bare (the "raw collectives"
  line of `ubep bench`);
* `raw+host`: the same calls with a busy wait of this rank's measured host time in each
  gap where the backend computes (no memory traffic: only the time is the same); host work
  the backend does while a collective runs (async, before its wait) is not replayed;
* `copy`: one memcpy of the bytes dispatch and combine must move (the copy bound).

`raw+host` is the floor of what any implementation with that much host work can reach on
this host; `torch / raw+host` is what remains that is not host time. The backend's Python path
(`UBEP_NATIVE=0`): the compiled one calls its collectives from C++, where this cannot time
them (`bench_torch_native.py` compares the two).

    .venv/bin/python -m benchmarks bench_torch_floor [batch] [rounds]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

KINDS = ("torch", "raw", "raw+host", "copy")


def _spin_ns(ns: float) -> None:
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


def _rank(rank: int, world: int, batch: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist

    import ubep
    import ubep.runtime.torch_backend as tb
    from ubep.bench.flags import HostSync
    from ubep.bench.systems import replay_calls
    from ubep.testing import make_routing, make_tokens

    torch.set_num_threads(1)
    sync = HostSync.create(rank, world, os.environ["UBEP_JOB_ID"], timeout_s=60)
    real = tb.all_to_all
    pg = dist.group.WORLD
    marks: list = []

    def timed(*a, async_op=False):  # the backend's collectives, each with its entry and exit
        t0 = time.perf_counter_ns()     # time (for an async one: the return of its wait;
        work = real(*a, async_op=async_op)  # host work overlapped is inside)
        if not async_op:
            marks.append((t0, time.perf_counter_ns()))
            return None
        return _Wait(work, t0)

    class _Wait:
        def __init__(self, work, t0):
            self.work, self.t0 = work, t0

        def is_completed(self):      # the backend's `wait` polls this first
            return self.work.is_completed()

        def wait(self):
            self.work.wait()
            marks.append((self.t0, time.perf_counter_ns()))

    tb.all_to_all = timed
    buf = ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=batch, backend="torch",
                      max_top_k=8)
    idx, w = make_routing(batch, 8, 16, kind="uniform", seed=17 + rank)
    x = make_tokens(rank, batch, 7168, torch.bfloat16, seed=1)
    res = None

    def run_torch(op: str) -> None:
        nonlocal res
        if op == "dispatch":
            res = buf.dispatch(x, idx, w)
        else:
            buf.combine(res.recv_x, res.handle)

    gaps = {"dispatch": [], "combine": []}
    for i in range(40):                     # the host work around each collective, in place
        for op in ("dispatch", "combine"):
            marks.clear()
            sync.barrier()
            t0 = time.perf_counter_ns()
            run_torch(op)
            t1 = time.perf_counter_ns()
            edges = [t0] + [t for m in marks for t in m] + [t1]
            if i >= 10:
                gaps[op].append([edges[j + 1] - edges[j] for j in range(0, len(edges), 2)])
    gaps = {op: np.median(np.array(g), axis=0) for op, g in gaps.items()}
    calls = {"dispatch": replay_calls(res.stats), "combine": replay_calls(buf.last_stats)}
    nbytes = {"dispatch": int((idx >= 0).sum()) * 7168 * 2,
              "combine": res.recv_x.numel() * 2}
    src = np.ones(max(nbytes.values()), dtype=np.uint8)
    dst = np.zeros_like(src)

    def run_raw(op: str, host: bool) -> None:
        g = gaps[op]
        for i, (out, inp, r, s) in enumerate(calls[op]):
            if host:
                _spin_ns(g[i])
            t0 = time.perf_counter_ns()
            real(pg, out, inp, r, s)
            marks.append((t0, time.perf_counter_ns()))
        if host:
            _spin_ns(g[-1])

    out = {k: [] for k in KINDS}
    inside = {k: [] for k in KINDS}       # time inside the collectives
    import gc
    gc.disable()
    try:
        for _ in range(rounds):
            for k in KINDS:
                t = []
                marks.clear()
                for op in ("dispatch", "combine"):
                    sync.barrier()
                    t0 = time.perf_counter_ns()
                    if k == "torch":
                        run_torch(op)
                    elif k == "copy":
                        np.copyto(dst[:nbytes[op]], src[:nbytes[op]])
                    else:
                        run_raw(op, k == "raw+host")
                    t.append(time.perf_counter_ns() - t0)
                out[k].append(sum(t) / 1e3)
                inside[k].append(sum(b - a for a, b in marks) / 1e3)
    finally:
        gc.enable()
        sync.close()
        buf.close()
    return {"times": {k: np.array(v) for k, v in out.items()},
            "inside": {k: np.array(v) for k, v in inside.items()},
            "gaps_us": {op: (g / 1e3).round(1).tolist() for op, g in gaps.items()}}


def main() -> None:
    from ubep.testing import run_ranks

    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    res = run_ranks(_rank, 2, batch, rounds, env={"UBEP_NATIVE": "0"})
    print(f"P=2, hidden 7168 bf16, top-8 of 16 experts, batch {batch}, {rounds} rounds "
          f"interleaved; load {os.getloadavg()[0]:.1f}")
    for r in range(2):
        print(f"rank {r} host work around the collectives (us): {res[r]['gaps_us']}")
    med = {}
    for k in KINDS:
        t = np.maximum(res[0]["times"][k], res[1]["times"][k])
        med[k] = float(np.median(t))
        c = np.maximum(res[0]["inside"][k], res[1]["inside"][k])
        print(f"{k:9s} dispatch+combine median {med[k]:8.0f} us  p10 "
              f"{np.percentile(t, 10):8.0f}  p90 {np.percentile(t, 90):8.0f}   inside the "
              f"collectives {np.median(c):6.0f}")
    base = med["raw"] + med["copy"]
    print(f"torch / (raw + copy) {med['torch'] / base:.2f}x   (raw+host) / (raw + copy) "
          f"{med['raw+host'] / base:.2f}x   torch / (raw+host) "
          f"{med['torch'] / med['raw+host']:.2f}x")


if __name__ == "__main__":
    main()
