"""Elastic expert parallelism on shared memory (`Buffer(elastic=True)`), real processes.

A rank SIGKILLed at a random point inside a call (or between a dispatch and its combine): the
survivors never raise, never wait past their deadline, agree on `active_ranks`, keep the
traffic between them exact in the call the death happened in (the dead rank's rows all
there or none, combine summing exactly the slots `handle.masked` leaves) and match the
oracle with the dead rank masked bit for bit from the next call on; `/dev/shm` holds nothing
of the job after. 20 trials spread over the four paths (`direct="owned"`, `direct=True`,
the one-worker staged path, the worker pool), each a short job of 4 ranks. Also: the
planned drain, input checks, and that nothing changes without elastic.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from elastic_cases import assert_drained, assert_survivors, drain_trial, elastic_trial

from ubep.testing import run_ranks

WORLD = 4
DEADLINE_S = 5.0
PATHS = {"owned": dict(direct="owned", workers=1), "direct": dict(direct=True, workers=1),
         "staged": dict(mode="ubep", workers=1), "pool": dict(mode="ubep", workers=2)}
TRIALS = 20


def _plan(n: int, seed: str) -> list[tuple]:
    rng = random.Random(seed)
    paths = sorted(PATHS)
    out = []
    for t in range(n):
        phase = ("dispatch", "combine", "between")[t % 3]
        delay = 0.0 if t % 4 == 0 else rng.uniform(0, 1.5e-3)
        out.append((paths[t % len(paths)], phase, rng.randrange(WORLD), rng.randint(1, 2),
                    delay))
    return out


def _job(path, phase, victim, kill_at, delay, trial):
    job = f"el{os.getpid()}t{trial}"
    out = run_ranks(elastic_trial, WORLD, dict(backend="shm", **PATHS[path]), victim, kill_at,
                    phase, delay, kill_at + 3, trial, DEADLINE_S, timeout_s=120,
                    return_exceptions=True, env={"UBEP_JOB_ID": job})
    return out, [n for n in os.listdir("/dev/shm") if job in n]


@pytest.mark.parametrize("trial,path,phase,victim,kill_at,delay",
                         [(t, *p) for t, p in enumerate(_plan(TRIALS, "elastic-shm"))])
def test_survivors_go_on_after_a_sigkill(trial, path, phase, victim, kill_at, delay):
    out, left = _job(path, phase, victim, kill_at, delay, trial)
    where = f"{path} {phase} victim={victim} kill_at={kill_at} delay={delay * 1e3:.2f} ms"
    assert_survivors(out, victim, DEADLINE_S, where)
    assert left == [], where


@pytest.mark.parametrize("path", ["owned", "staged"])
def test_planned_drain(path):
    job = f"eldr{os.getpid()}{path}"
    out = run_ranks(drain_trial, WORLD, dict(backend="shm", **PATHS[path]), 1, 5, 3,
                    DEADLINE_S, timeout_s=120, return_exceptions=True,
                    env={"UBEP_JOB_ID": job})
    assert_drained(out, 1, DEADLINE_S)
    assert [n for n in os.listdir("/dev/shm") if job in n] == []


def _checks(rank, world):
    import ubep

    got = {}
    with ubep.Buffer(num_experts=4, hidden=8, max_tokens_per_rank=2, max_top_k=2,
                     backend="shm", workers=1) as plain:
        idx = torch.tensor([[0, 3], [1, -1]])
        res = plain.dispatch(torch.ones(2, 8), idx, torch.ones(2, 2))
        got["masked"] = res.masked.tolist() + res.handle.masked.tolist()
        plain.combine(res.recv_x, res.handle)
        got["load"] = plain.expert_load().tolist()
        got["active"] = plain.active_ranks.tolist()
        try:
            plain.set_active_ranks(torch.ones(world, dtype=torch.bool))
        except ValueError as e:
            got["not_elastic"] = str(e)
    try:
        ubep.Buffer(num_experts=4, hidden=8, max_tokens_per_rank=2, backend="shm",
                    sync="sp", elastic=True)
    except ValueError as e:
        got["sp"] = str(e)
    with ubep.Buffer(num_experts=4, hidden=8, max_tokens_per_rank=2, max_top_k=2,
                     backend="shm", workers=1, elastic=True) as buf:
        bad = []
        without_me = torch.ones(world, dtype=torch.bool)
        without_me[rank] = False
        for mask in (torch.ones(world), torch.ones(world + 1, dtype=torch.bool), without_me,
                     [1, 1]):
            try:
                buf.set_active_ranks(mask)
                bad.append("accepted")
            except (TypeError, ValueError) as e:
                bad.append(f"{type(e).__name__}: {e}")
        got["bad"] = bad
        res = buf.dispatch(torch.ones(2, 8), torch.tensor([[0, 3], [1, -1]]), torch.ones(2, 2))
        buf.combine(res.recv_x, res.handle)
        got["usable"] = buf.active_ranks.tolist()
    return got


def test_checks_and_nothing_changes_without_elastic():
    out = run_ranks(_checks, 2)
    for r, got in enumerate(out):
        assert got["masked"] == [[False, False], [False, False]] * 2
        assert sum(got["load"]) > 0 and got["active"] == [True, True]
        assert "needs Buffer(elastic=True)" in got["not_elastic"]
        assert "sync='sp'" in got["sp"]
        assert got["bad"][0].startswith("TypeError: mask must have dtype torch.bool")
        assert got["bad"][1].startswith("ValueError: mask must have shape [2]")
        assert f"removes rank {r}, the caller" in got["bad"][2], got["bad"]
        assert got["bad"][3].startswith("TypeError: mask must be a torch.Tensor")
        assert got["usable"] == [True, True]
