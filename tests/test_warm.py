"""`ubep warm` compiles on one rank what a job of several ranks runs: the same kernels, with
the same argument types (a signature it missed would be compiled by every rank of the
first job, on the cores they share)."""

from __future__ import annotations

import multiprocessing as mp

import torch

from ubep.testing import make_routing, make_tokens, run_ranks
from ubep.warm import compiled_signatures

SYSTEMS = ("shm-owned", "shm-ubep", "torch")


def _warm_job(q) -> None:
    from ubep import warm

    warm._buffers(SYSTEMS, ("bfloat16",), bench=False)
    q.put(compiled_signatures())


def _two_rank_job(rank, world):
    import ubep
    from ubep.bench.config import BUFFER_SYSTEMS

    idx, w = make_routing(3, 2, 4, seed=rank)
    x = make_tokens(rank, 3, 64, torch.bfloat16, seed=rank)
    for name in SYSTEMS:
        backend, mode, direct = BUFFER_SYSTEMS[name]
        with ubep.Buffer(num_experts=4, hidden=64, max_tokens_per_rank=3, max_top_k=2,
                         backend=backend, mode=mode, direct=direct,
                         workers=1 if backend == "shm" else None) as buf:
            for _ in range(2):
                r = buf.dispatch(x, idx, w)
                buf.combine(r.recv_x, r.handle)
    return compiled_signatures()


def test_the_warm_jobs_compile_every_kernel_signature_a_two_rank_job_uses():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_warm_job, args=(q,))
    p.start()
    warmed = q.get(timeout=600)
    p.join(60)
    used = run_ranks(_two_rank_job, 2)
    for rank, sigs in enumerate(used):
        assert sigs, rank                               # the job ran kernels
        assert sigs <= warmed, (rank, sorted(sigs - warmed))
