"""A call that fails midway leaves the Buffer broken on every path: the next use is refused."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from ubep.testing import RankFailure, make_routing, make_tokens, run_ranks

PATHS = {"one-worker": dict(workers=1), "pool": dict(workers=2),
         "direct": dict(workers=1, direct=True), "owned": dict(workers=1, direct="owned")}


def _inputs(rank, seed=0):
    idx, w = make_routing(6, 2, 4, seed=seed * 10 + rank)
    return make_tokens(rank, 6, 16, torch.float32, seed=seed), idx, w


def _interrupted(rank, world, kw):
    import ubep

    with ubep.Buffer(num_experts=4, hidden=16, max_tokens_per_rank=8, backend="shm",
                     timeout_s=3.0, **kw) as buf:
        res = buf.dispatch(*_inputs(rank))
        buf.combine(res.recv_x, res.handle)
        if rank == 1:
            time.sleep(1.0)           # late: rank 0 is waiting for it when it is interrupted
            try:
                res = buf.dispatch(*_inputs(rank, 1))
                buf.combine(res.recv_x, res.handle)
            except ubep.UbepError as e:
                return type(e).__name__, e.peers
            return "peer completed"
        # a process started with SIGINT ignored (a CI job run in the background: bash ignores
        # SIGINT for asynchronous commands) gets no KeyboardInterrupt: install Python's own
        signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            buf.dispatch(*_inputs(rank, 1))
            return "not interrupted"
        except KeyboardInterrupt:
            pass
        state = repr(buf)
        t0 = time.monotonic()
        try:
            buf.dispatch(*_inputs(rank, 2))
        except ubep.BrokenBufferError as e:
            return "broken", state, time.monotonic() - t0, str(e)
        return "reused"


@pytest.mark.parametrize("path", sorted(PATHS))
def test_an_interrupt_mid_dispatch_breaks_the_buffer(path):
    out = run_ranks(_interrupted, 2, PATHS[path], timeout_s=120, return_exceptions=True)
    assert isinstance(out[0], tuple) and len(out[0]) == 4, out     # what each rank saw
    what, state, took, msg = out[0]
    assert what == "broken" and "broken" in state and "KeyboardInterrupt" in msg
    assert took < 0.5                      # refused at once, no wait on the peers
    peer = out[1]
    assert not isinstance(peer, RankFailure) or peer.kind != "timeout", peer
    if peer != "peer completed":
        assert peer[1] == [0], peer        # the peer blames the interrupted rank


def _sentinel_abort(rank, world, workers):
    import ubep
    from ubep.plan.blocks import SENTINEL

    with ubep.Buffer(num_experts=4, hidden=16, max_tokens_per_rank=8, backend="shm",
                     sync="sp", block_bytes=32, workers=workers, timeout_s=5.0) as buf:
        x, idx, w = _inputs(rank)
        if rank == 0:       # record = 16 B header + row: row bytes 8..15 are a marker word
            idx[3] = torch.tensor([0, 2])
            x.view(torch.uint8).reshape(6, -1)[3, 8:16] = torch.tensor(
                list(SENTINEL.to_bytes(8, "little")), dtype=torch.uint8)
        try:
            buf.dispatch(x, idx, w)
            first = "no error"
        except (ValueError, ubep.UbepError) as e:
            first = type(e).__name__
        t0 = time.monotonic()
        try:
            buf.dispatch(*_inputs(rank, 1))
            return first, "reused", time.monotonic() - t0
        except ubep.BrokenBufferError:
            return first, "broken", time.monotonic() - t0


@pytest.mark.parametrize("workers", [1, 2])
def test_the_sp_sentinel_abort_breaks_the_buffer_on_every_rank(workers):
    out = run_ranks(_sentinel_abort, 2, workers, timeout_s=120)
    assert out[0][:2] == ("SentinelAbort", "broken") and out[0][2] < 0.5
    assert out[1][:2] == ("ShmProtocolError", "broken") and out[1][2] < 0.5
