"""What `Buffer(elastic=True)` costs while nothing fails: batch-1 dispatch+combine of an
elastic Buffer against a plain one of the same kind, side by side in one process pair
(`ubep.testing.alternate`: turns of 20 calls, every turn started after a cross-process
barrier, the pair's time the slower rank's). Results are checked equal first. Not a test
(pytest does not collect it); the ratio is in docs/reliability.md ("Elastic").

The default is the path `backend="auto"` runs on one host (shm, `direct="owned"`);
`--path` picks another shm path, `--backend torch` the torch backend (gloo).

    .venv/bin/python -m benchmarks bench_elastic_cost [--path owned|direct|staged|pool]
        [--backend shm|torch] [--rounds 40] [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import sys

PATHS = {"owned": dict(direct="owned", workers=1), "direct": dict(direct=True, workers=1),
         "staged": dict(mode="ubep", workers=1), "pool": dict(mode="ubep", workers=2)}


def _rank(rank: int, world: int, kw: dict, rounds: int, batch: int) -> dict:
    import torch

    import ubep
    from benchmarks.pair import call, pinned_inputs, timed_turns

    x, idx, w = pinned_inputs(rank, batch)
    base = dict(num_experts=16, hidden=7168, max_tokens_per_rank=128, **kw)
    with ubep.Buffer(**base) as plain, ubep.Buffer(**base, elastic=True) as elastic:
        a, b = plain.dispatch(x, idx, w), elastic.dispatch(x, idx, w)
        if not (torch.equal(a.recv_x, b.recv_x) and torch.equal(
                plain.combine(a.recv_x, a.handle), elastic.combine(b.recv_x, b.handle))):
            raise SystemExit("the two Buffers disagree")
        del a, b
        return timed_turns(rank, world, {"elastic=False": call(plain, x, idx, w),
                                         "elastic=True": call(elastic, x, idx, w)}, rounds)


def main() -> None:
    from ubep.testing import print_turns, run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default="owned", choices=sorted(PATHS))
    p.add_argument("--backend", default="shm", choices=["shm", "torch"])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--batch", type=int, default=1)
    a = p.parse_args()
    kw = dict(backend="torch") if a.backend == "torch" else dict(backend="shm", **PATHS[a.path])
    out = run_ranks(_rank, 2, kw, a.rounds, a.batch, timeout_s=1800,
                    env={"UBEP_JOB_ID": f"elcost{os.getpid()}"})
    label = "torch" if a.backend == "torch" else f"shm {a.path}"
    print_turns(out, f"{label}, batch {a.batch},")


if __name__ == "__main__":
    sys.exit(main())
