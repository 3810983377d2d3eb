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
import os
import sys


def _rank(rank: int, world: int, batch: int, rounds: int, hybrid_first: bool) -> dict:
    os.environ["UBEP_SHM_DOMAIN"] = f"host{rank}"
    import ubep
    from benchmarks.pair import call, pinned_inputs, timed_turns

    x, idx, w = pinned_inputs(rank, batch)
    base = dict(num_experts=16, hidden=7168, max_tokens_per_rank=128)
    with ubep.Buffer(**base, backend="torch") as t, ubep.Buffer(**base) as h:
        if h.config.backend != "hybrid":
            raise SystemExit(f"expected hybrid: {h.config.backend_reason}")
        lines = {"torch": call(t, x, idx, w), "hybrid": call(h, x, idx, w)}
        for _ in range(20):     # shapes made, the hybrid settled on its mode
            for run in lines.values():
                run()
        if hybrid_first:
            lines = dict(reversed(lines.items()))
        return timed_turns(rank, world, lines, rounds)


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
