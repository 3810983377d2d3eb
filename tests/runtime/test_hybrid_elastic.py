"""Elastic expert parallelism on the hybrid backend (`Buffer(elastic=True)` across emulated
hosts, `ubep.testing.run_hosts`: 2 hosts x 2 ranks, `backend="auto"`, which picks hybrid).

A non-zero rank SIGKILLed at a random point inside a call (or between a dispatch and its
combine): on the other host, or a host's entry rank; at small batches (the flat exchange)
and large ones (the hierarchical exchange through shared memory). The survivors never raise,
never wait past their deadline, agree on `active_ranks`, move the rows between them exactly
from the call after the death on (combine: the oracle's sum over the slots it reports), and
the call the death happened in keeps the dead rank's rows all or none; no host's /dev/shm
keeps anything. Also the planned drain, and the named error when the rank that hosts the
store dies. Needs root and `ip`.
"""

from __future__ import annotations

import random

import pytest
from elastic_cases import (
    assert_drained,
    assert_survivors,
    calls_until_store_host_dies,
    drain_trial,
    elastic_trial,
)

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
    for t, (victim, tokens) in enumerate([(3, SMALL), (2, LARGE), (1, SMALL), (3, LARGE)]):
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


def _store_host_rank(rank: int, world: int, port: int, conn) -> None:
    """A rank of a job whose store rank 0 hosts, hosts told apart by `UBEP_SHM_DOMAIN`
    ((0, 1), (2, 3)); rank 0 dies in its second call; the others report what they raised."""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from elastic_cases import HIDDEN, TOP_K

    import ubep

    os.environ["UBEP_SHM_DOMAIN"] = f"h{rank // 2}"
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                              wait_for_workers=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        buf = ubep.Buffer(num_experts=2 * world, hidden=HIDDEN, max_tokens_per_rank=SMALL,
                          max_top_k=TOP_K, backend="hybrid", elastic=True, timeout_s=DEADLINE_S)
        calls_until_store_host_dies(buf, rank, world, conn, tokens=SMALL)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        conn.send((type(e).__name__, str(e)))
    finally:
        conn.close()
        os._exit(0)     # no teardown: the store is gone


def test_store_host_death_is_named():
    """Rank 0 hosts the store (as `init_process_group` with env:// does) and dies: the
    survivors raise `StoreHostDiedError` within their deadline; no segment is left."""
    import multiprocessing as mp
    import os
    import socket

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes = [ctx.Pipe(duplex=False) for _ in range(WORLD)]
    procs = [ctx.Process(target=_store_host_rank, args=(r, WORLD, port, pipes[r][1]))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = {}
        for r in range(1, WORLD):
            assert pipes[r][0].poll(120), f"rank {r} did not answer"
            got[r] = pipes[r][0].recv()
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for r, g in got.items():
        assert g[0] == "StoreHostDiedError", (r, g)
        assert "hosts it (rank 0" in g[1] and g[2] <= DEADLINE_S, (r, g)
    assert not [n for n in os.listdir("/dev/shm") if "ubep" in n.lower()]
