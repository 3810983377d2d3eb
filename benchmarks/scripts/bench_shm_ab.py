"""The shm backend of this tree against another tree's (e.g. the previous main), in one process
or one process pair: both Buffers alternate every 20 batch-1 dispatch+combine calls, so the
host's speed states (it flips between two ~1.6x apart every few seconds) hit both alike; in a
pair each rank's thread is bound to core `rank` and the pair's time is the slower rank's.

The other tree's `ubep` package is copied to a temporary folder as a package named
`ubep_other` (every `ubep` name in it renamed, its torch operators included), so both import
side by side; its numba caches go there, not into that tree. The copy never loads this
environment's `ubep.native` build (its build folder is renamed with it), so its Python path
runs: against this very tree (`src`), the A/B times `ubep.native` alone. Results are checked
equal before timing. Not a test (pytest does not collect it): it prints its figures.

    .venv/bin/python -m benchmarks bench_shm_ab OTHER_SRC [--world 1|2] [--direct owned|true]
        [--rounds 60] [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile


def _copy_other(src: str, folder: str) -> None:
    """`src`/ubep as `folder`/ubep_other, every `ubep` identifier renamed."""
    dst = os.path.join(folder, "ubep_other")
    shutil.copytree(os.path.join(src, "ubep"), dst,
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    for root, _, files in os.walk(dst):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    text = re.sub(r"\bubep\b", "ubep_other", f.read())
                with open(path, "w") as f:
                    f.write(text)


def _rank(rank: int, world: int, folder: str, batch: int, direct, rounds: int) -> dict:
    import torch

    os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})
    sys.path.insert(0, folder)
    import ubep_other

    import ubep
    from ubep.testing import alternate, make_routing, make_tokens

    idx, w = make_routing(batch, 8, 16, kind="uniform", seed=7 + rank)
    x = make_tokens(rank, batch, 7168, torch.bfloat16, seed=3)
    kw = dict(num_experts=16, hidden=7168, max_tokens_per_rank=128, backend="shm", workers=1,
              direct=direct)
    with ubep.Buffer(**kw) as this, ubep_other.Buffer(**kw) as other:
        ys = {}
        for name, buf in (("other", other), ("this", this)):
            for _ in range(50):
                r = buf.dispatch(x, idx, w)
                ys[name] = buf.combine(r.recv_x, r.handle)
        assert torch.equal(ys["this"].view(torch.int16), ys["other"].view(torch.int16))

        def call(buf):
            def once():
                r = buf.dispatch(x, idx, w)
                buf.combine(r.recv_x, r.handle)
            return once

        if rank == 0:
            from ubep.native import status
            other_native = getattr(ubep_other, "native", None)     # older trees have none
            print(f"this: {status()}; other: "
                  f"{other_native.status() if other_native else 'no ubep.native'}", flush=True)
        return alternate({"other": call(other), "this": call(this)}, rounds)


def main() -> None:
    from ubep.testing import print_turns, run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("other_src")
    p.add_argument("--world", type=int, default=2, choices=(1, 2))
    p.add_argument("--direct", default="owned", choices=("owned", "true"))
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--batch", type=int, default=1)
    a = p.parse_args()
    folder = tempfile.mkdtemp(prefix="ubep-ab-")
    try:
        _copy_other(a.other_src, folder)
        out = run_ranks(_rank, a.world, folder, a.batch,
                        True if a.direct == "true" else a.direct, a.rounds, timeout_s=1800,
                        threads_per_rank=1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print_turns(out, f"world {a.world}, batch {a.batch}, direct={a.direct},")

if __name__ == "__main__":
    main()
