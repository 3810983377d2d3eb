"""The torch backend of this tree against another tree's (e.g. main's), in one process pair:
both backends on one process group, alternating every 20 dispatch+combine calls, so the
host's speed states (it flips between two ~1.7x apart every few seconds) hit both alike.
The pair's time is the slower rank's; each rank's main thread is pinned to core `rank`.

The other tree's `torch_backend.py`/`torch_layout.py` are copied to a temporary folder as
modules of their own (so numba caches them there, not in that tree) and that backend is
set on a second Buffer. Not a test (pytest does not collect it); the numbers are in
docs/results/torch_backend.md.

    .venv/bin/python -m benchmarks bench_torch_ab OTHER_SRC [BATCH [ROUNDS]]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch


def _other_backend(src: str, folder: str):
    """The TorchBackend class of the tree at `src` (its `ubep` package folder's parent)."""
    rt = os.path.join(src, "ubep", "runtime")
    with open(os.path.join(rt, "torch_layout.py")) as f:
        layout = f.read()
    with open(os.path.join(rt, "torch_backend.py")) as f:
        backend = f.read().replace("from ubep.runtime.torch_layout import",
                                   "from other_torch_layout import")
    for name, text in (("other_torch_layout", layout), ("other_torch_backend", backend)):
        with open(os.path.join(folder, name + ".py"), "w") as f:
            f.write(text)
    sys.path.insert(0, folder)
    import other_torch_backend
    return other_torch_backend.TorchBackend


def _timed(fn, name: str, which: str, phases: dict):
    def timed(*args):
        t = time.perf_counter_ns()
        r = fn(*args)
        phases[which].setdefault("kernel." + name, []).append((time.perf_counter_ns() - t) / 1e3)
        return r
    return timed


def _rank(rank: int, world: int, other: str, folder: str, batch: int, rounds: int):
    os.sched_setaffinity(0, {rank})
    import ubep
    from ubep.testing import alternate, make_routing, make_tokens

    other_cls = _other_backend(other, folder)
    phases: dict[str, dict[str, list[float]]] = {"other": {}, "this": {}}
    # UBEP_AB_WRAP=name,name: time those functions of either backend module (as phases)
    import other_torch_backend

    import ubep.runtime.torch_backend as this_mod
    for mod, m in ((this_mod, "this"), (other_torch_backend, "other")):
        for name in filter(None, os.environ.get("UBEP_AB_WRAP", "").split(",")):
            if hasattr(mod, name):
                setattr(mod, name, _timed(getattr(mod, name), name, m, phases))
    idx, w = make_routing(batch, 8, 16, kind="uniform", seed=7 + rank)
    x = make_tokens(rank, batch, 7168, torch.bfloat16, seed=3)
    kw = dict(num_experts=16, hidden=7168, max_tokens_per_rank=128, backend="torch")
    stats: dict[str, list] = {"other": [], "this": []}
    with ubep.Buffer(**kw) as this, ubep.Buffer(**kw) as buf:
        buf._backend.close()
        buf._backend = other_cls(buf.config, None, buf._id)
        bufs = {"other": buf, "this": this}
        for b in bufs.values():
            for _ in range(30):
                r = b.dispatch(x, idx, w)
                b.combine(r.recv_x, r.handle)

        def call(m, b):
            def once():
                r = b.dispatch(x, idx, w)
                b.combine(r.recv_x, r.handle)
                stats[m].append((r.stats, b.last_stats))     # read after timing
            return once

        res = alternate({m: call(m, b) for m, b in bufs.items()}, rounds)
    for m, pairs in stats.items():
        for pair in pairs:
            for op, st in zip(("dispatch", "combine"), pair):
                for k, v in st.phases_us.items():
                    phases[m].setdefault(f"{op}.{k}", []).append(v)
    return res, phases


def main() -> None:
    from ubep.testing import print_turns, run_ranks

    other = sys.argv[1]
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    folder = tempfile.mkdtemp(prefix="ubep-ab-")
    try:
        out = run_ranks(_rank, 2, other, folder, batch, rounds, timeout_s=1800,
                        threads_per_rank=1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("phase medians, rank 0 / rank 1 (µs):")
    for k in sorted(set(out[0][1]["this"]) & set(out[0][1]["other"])):
        print(f"  {k:28s}" + "   ".join(
            f"{m} " + " / ".join(f"{np.median(out[r][1][m][k]):6.1f}" for r in range(2))
            for m in ("other", "this")))
    print_turns([out[r][0] for r in range(2)], f"batch {batch} dispatch+combine,")

if __name__ == "__main__":
    main()
