"""SIGKILL of one rank at random points of dispatch or combine, on every shm path.

The survivor must raise `PeerDiedError` naming the dead rank and the phase it was in, well
before its deadline (a wait checks its peers' liveness every few milliseconds: a timeout at
the deadline would mean the death went unseen), and /dev/shm must hold nothing of the job
afterwards. 20 trials per (path, phase): the kill lands inside or just after the victim's
call (a random delay of 0-2 ms on a timer thread), after 0-3 calls that completed.

Mutation this fails on: the liveness check disabled in the waits (`dead = []` in
`ubep.runtime.shm.waits.wait`): every path then times out at the deadline.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ubep.testing import RankFailure, make_routing, make_tokens, run_ranks

PATHS = {"one-worker": dict(workers=1), "multi-worker": dict(workers=2),
         "direct": dict(workers=2, direct=True), "owned": dict(workers=1, direct="owned")}
TRIALS = 20
CONCURRENT = 4
DEADLINE_S = 10.0
#: a death must show well within the deadline: liveness is checked every
#: `waits.LIVENESS_EVERY_S` (5 ms); the rest is room for a loaded host's scheduling
DETECT_S = DEADLINE_S / 4


def _inputs(rank, i):
    idx, w = make_routing(8, 2, 4, seed=i * 10 + rank)
    return make_tokens(rank, 8, 32, torch.bfloat16, seed=i), idx, w


def _trial(rank, world, kw, phase, warm, delay_s):
    import ubep

    buf = ubep.Buffer(num_experts=4, hidden=32, max_tokens_per_rank=8, max_top_k=2,
                      backend="shm", timeout_s=DEADLINE_S, **kw)
    if rank == 1:                                   # the victim
        for i in range(warm):
            res = buf.dispatch(*_inputs(rank, i))
            buf.combine(res.recv_x, res.handle)
        timer = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL))
        if phase == "dispatch":
            timer.start()
        res = buf.dispatch(*_inputs(rank, warm))
        if phase == "combine":
            timer.start()
        buf.combine(res.recv_x, res.handle)
        time.sleep(60)                              # the timer kills it by then
        return "survived"
    t0 = time.monotonic()
    try:
        # the victim's warm-up calls, then the death shows within five more; it may show in
        # the last warm-up call already (the victim returns from it, then dies, before this
        # rank has read what it needs from the victim's memory)
        for i in range(warm + 5):
            t0 = time.monotonic()
            res = buf.dispatch(*_inputs(rank, i))
            t0 = time.monotonic()
            buf.combine(res.recv_x, res.handle)
    except (ubep.PeerDiedError, ubep.PeerTimeoutError) as e:
        took = time.monotonic() - t0
        buf.close()
        return type(e).__name__, e.rank, e.phase, e.peers, took
    finally:
        buf.close()
    return "no error"


def _job_entries(job: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if job in n]


def _one(path, phase, trial, warm, delay):
    job = f"km{os.getpid()}{path[:3]}{phase[:3]}{trial}"
    out = run_ranks(_trial, 2, PATHS[path], phase, warm, delay, timeout_s=120,
                    return_exceptions=True, env={"UBEP_JOB_ID": job})
    return out, _job_entries(job)


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_sigkill_of_a_rank_at_random_points(path, phase):
    rng = random.Random(f"{path}/{phase}")
    # a third of the kills as soon as the timer thread runs (inside the call), the rest
    # within 2 ms (inside, or just after, the call)
    plan = [(t, rng.randint(0, 3), 0.0 if t % 3 == 0 else rng.uniform(0, 2e-3))
            for t in range(TRIALS)]
    # trials are independent jobs: a few at once (each mostly waits for its processes)
    with ThreadPoolExecutor(CONCURRENT) as ex:
        results = list(ex.map(lambda p: _one(path, phase, *p), plan))
    seen = []
    for (trial, warm, delay), (out, left) in zip(plan, results):
        where = f"trial {trial} (warm={warm}, delay={delay * 1e3:.2f} ms): {out}"
        assert isinstance(out[1], RankFailure) and out[1].kind == "died", where
        assert not isinstance(out[0], RankFailure) and out[0] != "no error", where
        kind, rank, got_phase, peers, took = out[0]
        assert kind == "PeerDiedError", where       # the death seen, not waited out
        assert (rank, peers) == (0, [1]), where
        assert got_phase.split("/")[0] in ("dispatch", "combine"), where
        assert took <= DETECT_S, where
        assert left == [], where                    # nothing of the job in /dev/shm
        seen.append((kind, got_phase))
    assert any(p.startswith(phase) for _, p in seen), seen
