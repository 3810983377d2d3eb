"""Elastic expert parallelism on the torch backend (`Buffer(backend="torch", elastic=True)`).

A non-zero rank SIGKILLed at a random point inside a call (or between a dispatch and its
combine), 20 trials of 4 ranks on gloo: the survivors recover through the store, never raise,
never wait past their deadline, agree on `active_ranks`, move the rows between them exactly
(combine to the torch backend's rounding) from the call after the death on, and the call the
death happened in keeps the dead rank's rows all or none. Also the planned drain, and the
named error when the rank that hosts the store dies.
"""

from __future__ import annotations

import os
import random
import socket
import time
from datetime import timedelta

import pytest
from elastic_cases import (
    HIDDEN,
    TOKENS,
    TOP_K,
    assert_drained,
    assert_survivors,
    calls_until_store_host_dies,
    check_call,
    drain_trial,
    elastic_trial,
    expert_rows,
    inputs,
)

from ubep.native import load_native
from ubep.testing import run_ranks

NATIVE = load_native()

WORLD = 4
DEADLINE_S = 10.0
TRIALS = 20


def _plan(n: int, seed: str) -> list[tuple]:
    rng = random.Random(seed)
    return [(("dispatch", "combine", "between")[t % 3], rng.randint(1, WORLD - 1),
             rng.randint(1, 2), 0.0 if t % 4 == 0 else rng.uniform(0, 3e-3))
            for t in range(n)]


@pytest.mark.parametrize("trial,phase,victim,kill_at,delay",
                         [(t, *p) for t, p in enumerate(_plan(TRIALS, "elastic-torch"))])
def test_survivors_go_on_after_a_sigkill(trial, phase, victim, kill_at, delay):
    out = run_ranks(elastic_trial, WORLD, dict(backend="torch"), victim, kill_at, phase,
                    delay, kill_at + 3, trial, DEADLINE_S, timeout_s=120,
                    return_exceptions=True, env={"UBEP_JOB_ID": f"elt{os.getpid()}t{trial}"})
    where = f"{phase} victim={victim} kill_at={kill_at} delay={delay * 1e3:.2f} ms"
    assert_survivors(out, victim, DEADLINE_S, where)
    if NATIVE is not None:      # the calls before the death ran on the compiled path
        assert all(o["compiled"] >= kill_at for r, o in enumerate(out) if r != victim), out


def _replay_trial(rank: int, world: int, at: int, phase: str) -> dict:
    """Six calls; rank 1 sees call `at`'s `phase` fail after its last collective completed
    (as when a peer died between sending to one rank and to another): the others completed
    the call, so the recovery has them replay it from what they kept (the compiled path's
    record, or the Python path's collectives) while rank 1 redoes it. Nobody died: every call
    is exact on every rank, the redone one too."""
    import ubep

    experts = 2 * world
    buf = ubep.Buffer(num_experts=experts, hidden=HIDDEN, max_tokens_per_rank=TOKENS,
                      max_top_k=TOP_K, timeout_s=DEADLINE_S, elastic=True, backend="torch")
    backend, el = buf._backend, buf._backend.recovery
    errors, calls = [], [0]

    def failing(once):
        def call(*args):
            res = once(*args)
            if rank == 1 and calls[0] == at and el.gen == 0:
                # the others finish the call meanwhile (else they may see the recovery
                # inside it, and every rank redoes it: correct, but no replay to test)
                time.sleep(0.3)
                el.recover(RuntimeError("injected: the collective failed here"))   # (Redo)
            return res
        return call

    if phase == "dispatch":
        backend._dispatch_once = failing(backend._dispatch_once)
    else:
        backend._combine_once = failing(backend._combine_once)
    try:
        for i in range(6):
            calls[0] = i
            ins = inputs(world, experts, i, 3)
            res = buf.dispatch(*ins[rank])
            y = buf.combine(expert_rows(res.recv_x, res.tokens_per_expert,
                                        rank * (experts // world)), res.handle)
            why = check_call(rank, world, experts, ins, res, y, buf.active_ranks, True, -1,
                             bits=False)
            if why:
                errors.append(f"call {i}: {why}")
        return dict(errors=errors, active=buf.active_ranks.tolist(), replays=el.replays,
                    compiled=el.compiled_calls, gen=el.gen)
    finally:
        buf.close()


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_ranks_a_call_ahead_replay_it_exactly(phase, native):
    """The replay a recovery needs when some ranks completed the failed call: from the
    compiled path's record (`UBEP_NATIVE=1`) and from the Python path's collectives."""
    if native == "1" and NATIVE is None:
        pytest.skip("ubep.native not built")
    out = run_ranks(_replay_trial, 3, 2, phase, timeout_s=120,
                    env={"UBEP_NATIVE": native, "UBEP_JOB_ID": f"rp{os.getpid()}{phase}"})
    for r, o in enumerate(out):
        assert o["errors"] == [] and o["active"] == [True] * 3 and o["gen"] == 1, (r, o)
        assert o["replays"] == (0 if r == 1 else 1), (r, o)
        assert (o["compiled"] >= 2) == (native == "1"), (r, o)


def test_planned_drain():
    out = run_ranks(drain_trial, WORLD, dict(backend="torch"), 2, 5, 3, DEADLINE_S,
                    timeout_s=120, return_exceptions=True)
    assert_drained(out, 2, DEADLINE_S)


def _store_host_rank(rank: int, world: int, port: int, conn) -> None:
    """A rank of a job whose store rank 0 hosts (as `init_process_group` with env:// does);
    rank 0 dies after one call; the others report what their next call raised."""
    import torch.distributed as dist

    import ubep

    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                              wait_for_workers=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        buf = ubep.Buffer(num_experts=2 * world, hidden=HIDDEN, max_tokens_per_rank=TOKENS,
                          max_top_k=TOP_K, backend="torch", elastic=True, timeout_s=DEADLINE_S)
        calls_until_store_host_dies(buf, rank, world, conn)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        conn.send((type(e).__name__, str(e)))
    finally:
        conn.close()
        os._exit(0)     # no teardown: the store is gone


def test_store_host_death_is_named():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 3
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [ctx.Process(target=_store_host_rank, args=(r, world, port, pipes[r][1]))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = {}
        for r in (1, 2):
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
