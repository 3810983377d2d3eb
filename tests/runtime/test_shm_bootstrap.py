"""The Buffer constructor across ranks: agreed config, bounded waits, capacity, namespaces."""

from __future__ import annotations

import os
import time

import pytest

from ubep.testing import run_ranks

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))


def _job_entries(job: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if job in n]


def _mismatched(rank, world, backend, field, values):
    import ubep

    kw = dict(num_experts=4, hidden=32, max_tokens_per_rank=8, backend=backend, timeout_s=5.0)
    kw[field] = values[rank]
    try:
        ubep.Buffer(**kw).close()
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("backend,field,values", [
    ("shm", "hidden", (32, 64)),
    ("torch", "hidden", (32, 64)),
    ("shm", "max_tokens_per_rank", (8, 16)),
    ("shm", "num_experts", (4, 8)),
    ("shm", "max_top_k", (8, 4)),
    ("shm", "block_bytes", (512, 256)),
    ("shm", "sync", ("tff", "sw")),
    ("shm", "mode", ("ubep", "bsp")),
    ("shm", "workers", (1, 2)),
    ("shm", "direct", (False, True)),
    ("torch", "backend", ("torch", "shm")),
])
def test_constructor_arguments_that_differ_between_ranks_are_a_value_error_on_every_rank(
        backend, field, values):
    out = run_ranks(_mismatched, 2, backend, field, values, timeout_s=120)
    for msg in out:
        assert field in msg and "differ between ranks" in msg, msg
        assert f"rank 0: {values[0]!r}" in msg and f"rank 1: {values[1]!r}" in msg, msg


def _late_constructor(rank, world):
    import ubep

    if rank == 1:
        time.sleep(6.0)        # never builds its Buffer in rank 0's time
        return "late"
    t0 = time.monotonic()
    try:
        ubep.Buffer(num_experts=4, hidden=8, max_tokens_per_rank=4, backend="shm", timeout_s=1.0)
    except ubep.PeerTimeoutError as e:
        return e.rank, e.phase, e.peers, time.monotonic() - t0
    return "constructed"


def test_constructor_waits_honour_timeout_s():
    out = run_ranks(_late_constructor, 2, timeout_s=120, return_exceptions=True)
    rank, phase, peers, took = out[0]
    assert (rank, peers) == (0, [1]) and phase.startswith("Buffer()")
    assert took < 6.0            # the deadline, not the late rank's arrival, ended the wait
