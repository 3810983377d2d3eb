"""What the hybrid backend's flat mode costs over `backend="torch"` at small batches: two
ranks on one machine, each told it is a host of its own (`UBEP_SHM_DOMAIN`), a hybrid
Buffer and a torch Buffer side by side in one process pair (`ubep.testing.alternate`: turns
of 20 calls, every turn started after a cross-process barrier, the pair's time the slower
rank's). Both run the same compiled torch exchange; the ratio is what the hybrid adds per
call. Not a test (pytest does not collect it); the figure is in docs/results/multihost.md.

    .venv/bin/python -m benchmarks bench_hybrid_flat [--batch 1] [--rounds 30] [--hybrid-first]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys


def _rank(rank: int, world: int, batch: int, rounds: int, hybrid_first: bool) -> dict:
    import torch

    os.environ["UBEP_SHM_DOMAIN"] = f"host{rank}"
    import ubep
    from ubep.bench.flags import HostSync
    from ubep.testing import alternate, make_routing, make_tokens

    os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})   # one core per rank
    idx, w = make_routing(batch, 8, 16, kind="uniform", seed=7 + rank)
    x = make_tokens(rank, batch, 7168, torch.bfloat16, seed=3)
    sync = HostSync.create(rank, world, os.environ["UBEP_JOB_ID"], timeout_s=60)
    base = dict(num_experts=16, hidden=7168, max_tokens_per_rank=128)
    try:
        with ubep.Buffer(**base, backend="torch") as t, ubep.Buffer(**base) as h:
            if h.config.backend != "hybrid":
                raise SystemExit(f"expected hybrid: {h.config.backend_reason}")

            def call(buf):
                def run():
                    r = buf.dispatch(x, idx, w)
                    buf.combine(r.recv_x, r.handle)
                return run

            for _ in range(20):     # shapes made, the hybrid settled on its mode
                call(t)()
                call(h)()
            lines = {"torch": call(t), "hybrid": call(h)}
            if hybrid_first:
                lines = dict(reversed(lines.items()))
            gc.collect()
            gc.disable()
            times = alternate(lines, rounds, barrier=sync.barrier)
            gc.enable()
            return times
    finally:
        sync.close()


def main() -> None:
    from ubep.testing import print_turns, run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--hybrid-first", action="store_true", help="the other order of turns")
    a = p.parse_args()
    out = run_ranks(_rank, 2, a.batch, a.rounds, a.hybrid_first, timeout_s=1800,
                    env={"UBEP_JOB_ID": f"hyflat{os.getpid()}"})
    print_turns(out, f"batch {a.batch},")


if __name__ == "__main__":
    sys.exit(main())
