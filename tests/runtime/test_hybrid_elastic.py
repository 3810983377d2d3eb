"""Elastic expert parallelism on the hybrid backend (`Buffer(elastic=True)` across emulated
hosts, `ubep.testing.run_hosts`: 2 hosts x 2 ranks, `backend="auto"`, which picks hybrid).

A non-zero rank SIGKILLed at a random point inside a call (or between a dispatch and its
combine): on the other host, or a host's entry rank; at small batches (the flat exchange)
and large ones (the hierarchical exchange through shared memory). The survivors never raise,
never wait past their deadline, agree on `active_ranks`, move the rows between them exactly
from the call after the death on (combine: the oracle's sum over the slots it reports), and
the call the death happened in keeps the dead rank's rows all or none; no host's /dev/shm
keeps anything. Also the planned drain. Needs root and `ip`.
"""

from __future__ import annotations

import random

import pytest
from elastic_cases import assert_drained, assert_survivors, drain_trial, elastic_trial

from ubep.testing import hosts_available, run_hosts

WORLD = 4
DEADLINE_S = 10.0
#: tokens per rank: 6 runs the flat exchange after the first call, 3000 the joint one
SMALL, LARGE = 6, 3000


@pytest.fixture(autouse=True)
def _need_hosts():
    ok, why = hosts_available()
    if not ok:
        pytest.skip(why)


def _plan() -> list[tuple]:
    """(phase, victim, kill_at, delay, tokens): ranks 2 (host 1's first, an entry) and 3
    (host 1's second) and 1 (host 0's second), at small and large batches."""
    rng = random.Random("hybrid-elastic")
    out = []
    for t, (victim, tokens) in enumerate([(3, SMALL), (2, LARGE), (1, SMALL), (3, LARGE),
                                          (2, SMALL), (1, LARGE)]):
        phase = ("dispatch", "combine", "between")[t % 3]
        out.append((phase, victim, rng.randint(1, 2),
                    0.0 if t % 4 == 0 else rng.uniform(0, 3e-3), tokens))
    return out


@pytest.mark.parametrize("trial,phase,victim,kill_at,delay,tokens",
                         [(t, *p) for t, p in enumerate(_plan())])
def test_survivors_go_on_after_a_sigkill(trial, phase, victim, kill_at, delay, tokens):
    out = run_hosts(elastic_trial, dict(backend="auto"), victim, kill_at, phase, delay,
                    kill_at + 3, trial, DEADLINE_S, tokens, hosts=2, ranks_per_host=2,
                    timeout_s=120, return_exceptions=True)
    where = (f"{phase} victim={victim} kill_at={kill_at} delay={delay * 1e3:.2f} ms "
             f"tokens={tokens}")
    assert_survivors(out, victim, DEADLINE_S, where)
    assert all(out[r]["backend"] == "hybrid" for r in range(WORLD) if r != victim), out
    assert out.leaks == {}, out.leaks


def test_planned_drain():
    out = run_hosts(drain_trial, dict(backend="hybrid"), 2, 5, 3, DEADLINE_S, hosts=2,
                    ranks_per_host=2, timeout_s=120, return_exceptions=True)
    assert_drained(out, 2, DEADLINE_S)
    assert out.leaks == {}, out.leaks
