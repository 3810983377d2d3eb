"""`ubep.native`'s door against the Python layers it replaces, in one process pair: two Buffers
of the same kind, one with its door turned off (`Buffer._door = None`: the Python layers over
the same compiled entries), alternating every 20 batch-1 dispatch+combine calls; each rank's
thread bound to core `rank`, each call started after a tight cross-process barrier, the
pair's time the slower rank's. `--evict MB`: before every call each rank writes a byte of
every cache line of MB megabytes (outside the timed region), so every call starts on cold
caches, as a MoE layer's call does after the attention layer before it. Results are checked
equal first. Not a test (pytest does not collect it): it prints its figures.

`--direct false` is the one-worker staged path (`SinglePath`, its door `native/staged.cpp`).

    .venv/bin/python -m benchmarks bench_shm_door [--direct owned|true|false] [--evict MB]
        [--rounds 40] [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def _rank(rank: int, world: int, direct, rounds: int, evict_mb: int, batch: int) -> dict:
    import gc

    import torch

    import ubep
    from ubep.bench.flags import HostSync
    from ubep.testing import make_routing, make_tokens

    os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})
    idx, w = make_routing(batch, 8, 16, kind="uniform", seed=7 + rank)
    x = make_tokens(rank, batch, 7168, torch.bfloat16, seed=3)
    junk = np.zeros(max(1, evict_mb << 20), np.uint8)
    sync = HostSync.create(rank, world, os.environ["UBEP_JOB_ID"], timeout_s=60)
    perf = time.perf_counter_ns
    kw = dict(num_experts=16, hidden=7168, max_tokens_per_rank=128, backend="shm", direct=direct,
              workers=1)
    try:
        with ubep.Buffer(**kw) as door, ubep.Buffer(**kw) as layers:
            if door._door is None:
                raise SystemExit("ubep.native is not built: python -m ubep.native build")
            layers._door = None
            a, b = door.dispatch(x, idx, w), layers.dispatch(x, idx, w)
            if not (torch.equal(a.recv_x, b.recv_x) and torch.equal(
                    door.combine(a.recv_x, a.handle), layers.combine(b.recv_x, b.handle))):
                raise SystemExit("the two Buffers disagree")
            del a, b
            times: dict[str, list[int]] = {"python layers": [], "door": []}
            gc.collect()
            gc.disable()
            for _ in range(rounds):
                for name, buf in (("python layers", layers), ("door", door)):
                    for _ in range(20):
                        if evict_mb:
                            junk[::64] += 1
                        sync.barrier()
                        t = perf()
                        r = buf.dispatch(x, idx, w)
                        buf.combine(r.recv_x, r.handle)
                        times[name].append(perf() - t)
                        del r
            gc.enable()
            return times
    finally:
        sync.close()


def main() -> None:
    from ubep.testing import print_turns, run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--direct", default="owned", choices=["owned", "true", "false"])
    p.add_argument("--evict", type=int, default=0, metavar="MB")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--batch", type=int, default=1)
    a = p.parse_args()
    direct = {"true": True, "false": False, "owned": "owned"}[a.direct]
    out = run_ranks(_rank, 2, direct, a.rounds, a.evict, a.batch, timeout_s=1800,
                    env={"UBEP_JOB_ID": f"door{os.getpid()}"})
    print_turns(out, f"direct={a.direct}, batch {a.batch}, evict {a.evict} MB,")


if __name__ == "__main__":
    sys.exit(main())
