"""Two Buffers timed side by side in one process pair (the `bench_*` scripts' ratios):
batch-1 style inputs, each Buffer's dispatch+combine as one call, turns alternated after a
cross-process barrier (`ubep.testing.alternate`) with the garbage collector off."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable


def pinned_inputs(rank: int, batch: int):
    """This rank pinned to one core; `(x, topk_idx, topk_weights)` of `batch` tokens,
    hidden 7168 bf16, top-8 of 16 experts, uniform."""
    import torch

    from ubep.testing import make_routing, make_tokens

    os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})
    idx, w = make_routing(batch, 8, 16, kind="uniform", seed=7 + rank)
    return make_tokens(rank, batch, 7168, torch.bfloat16, seed=3), idx, w


def call(buf, x, idx, w) -> Callable[[], None]:
    """One dispatch+combine of `buf`."""
    def run() -> None:
        r = buf.dispatch(x, idx, w)
        buf.combine(r.recv_x, r.handle)
    return run


def timed_turns(rank: int, world: int, lines: dict[str, Callable[[], None]],
                rounds: int) -> dict:
    """`alternate(lines, rounds)` in turns started after a barrier, the collector off."""
    from ubep.bench.flags import HostSync
    from ubep.testing import alternate

    sync = HostSync.create(rank, world, os.environ["UBEP_JOB_ID"], timeout_s=60)
    gc.collect()
    gc.disable()
    try:
        return alternate(lines, rounds, barrier=sync.barrier)
    finally:
        gc.enable()
        sync.close()
