"""`ubep soak`: a short randomized run against the oracle is clean, and the checker is live."""

from __future__ import annotations

import random

import pytest

from ubep.soak import Tally, _soak_rank, random_session, soak, soak_kills
from ubep.testing import run_ranks


def test_a_short_soak_is_clean():
    t = soak(calls=150, seed=7, calls_per_session=25)
    assert t.ok, t.failures[:5]
    assert t.calls == 150 and t.sessions >= 6 and t.failures == []


def _flipping(rank, world, sessions):
    import torch

    import ubep

    real = ubep.Buffer.dispatch

    def flipped(self, *a, **kw):          # the fault a torn row would be: one byte off
        res = real(self, *a, **kw)
        if res.recv_x.numel():
            res.recv_x.view(torch.uint8).view(-1)[0] ^= 1
        return res

    ubep.Buffer.dispatch = flipped
    return _soak_rank(rank, world, sessions, float("inf"))


def test_the_soak_checker_counts_a_one_byte_flip():
    rng = random.Random(3)
    sessions = [random_session(rng, 2, 10) for _ in range(3)]
    for s in sessions:                     # rows every call, so a flip has a byte to hit
        s["kw"].update(backend="shm", direct=False)
    out = [Tally(**o) for o in run_ranks(_flipping, 2, sessions, timeout_s=300)]
    assert sum(t.mismatches for t in out) > 0
    assert any("differs from the reference" in f for t in out for f in t.failures)


def test_a_short_kill_soak_is_clean():
    """`--kill-every`: ranks die inside calls, the survivors match the masked oracle."""
    t = soak_kills(calls=24, minutes=None, world=4, seed=3, calls_per_session=12,
                   kill_every=4)
    assert t.ok, t.failures[:5]
    assert t.calls >= 24 and t.sessions == 2 and t.kills == 4


@pytest.mark.parametrize("argv", [["--calls", "0"], ["--minutes", "-1"], ["--world", "0"],
                                  ["--kill-every", "0"], ["--kill-every", "2", "--world", "2"]])
def test_bad_arguments_exit_2(argv, capsys):
    from ubep.cli import main

    assert main(["soak", *argv]) == 2
    assert "error" in capsys.readouterr().err
