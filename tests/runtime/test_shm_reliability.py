"""The shm runtime under failure: deadlines, dead peers, bad input, leaks, long runs."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import numpy as np
import pytest
import torch

from ubep.testing import RankFailure, make_routing, make_tokens, run_ranks


def _shm_entries(job: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if job in n]


def _buffer(**kw):
    import ubep

    base = dict(num_experts=4, hidden=16, max_tokens_per_rank=8, backend="shm", timeout_s=2.0)
    base.update(kw)
    return ubep.Buffer(**base)


def _inputs(rank, num_tokens=4, dtype=torch.bfloat16, top_k=2, seed=0):
    idx, w = make_routing(num_tokens, top_k, 4, seed=seed + rank)
    return make_tokens(rank, num_tokens, 16, dtype, seed=seed), idx, w


# -- a peer that does not come / dies ---------------------------------------------------------
def _late_peer(rank, world):
    import ubep

    with _buffer(timeout_s=1.0) as buf:
        if rank == 1:
            time.sleep(3.0)           # never dispatches in time
            return "slept"
        t0 = time.monotonic()
        try:
            buf.dispatch(*_inputs(rank))
        except ubep.PeerTimeoutError as e:
            took = time.monotonic() - t0
            try:
                buf.dispatch(*_inputs(rank))
            except ubep.BrokenBufferError:
                broken = True
            return (e.rank, e.phase, e.peers, took, broken)
    return "no error"


def test_a_late_peer_is_a_timeout_naming_rank_phase_and_peer():
    out = run_ranks(_late_peer, 2, timeout_s=120)
    rank, phase, peers, took, broken = out[0]
    assert (rank, peers, broken) == (0, [1], True)
    assert phase.startswith("dispatch/")
    assert 1.0 <= took < 10.0
    assert out[1] == "slept"


def _dies_mid_dispatch(rank, world, job):
    import ubep
    from ubep.plan.fastplan import count_experts
    from ubep.runtime.shm.kernels import slots
    from ubep.runtime.shm.region import L_EL, L_WORLD
    from ubep.runtime.shm.staged import kernels as single

    x, idx, w = _inputs(rank, num_tokens=8, top_k=4)
    with _buffer(timeout_s=20.0, workers=1) as buf:
        if rank == 1:
            def die(state, epoch, *rest):    # the one-worker send entry
                k, lay, bases = single.consts(state)
                me = int(k[single.K_ME])
                counts = np.zeros(lay[L_WORLD] * lay[L_EL], np.int64)
                count_experts(idx.numpy(), counts)
                slots.send_counts(bases, lay, me, epoch, counts, 1, 0, 0, 0, lay[L_WORLD])
                os.kill(os.getpid(), signal.SIGKILL)    # counts are out, the rows never come
            single.dispatch_begin_at = die
            buf._door = None         # the Python path, whose entry this rank replaced
        t0 = time.monotonic()
        try:
            buf.dispatch(x, idx, w)
        except ubep.PeerDiedError as e:
            return (e.rank, e.phase, e.peers, time.monotonic() - t0, _shm_entries(job))
    return "no error"


def test_a_peer_killed_mid_dispatch_is_reported_and_leaves_no_segment():
    job = f"died{os.getpid()}"
    out = run_ranks(_dies_mid_dispatch, 2, job, timeout_s=120, return_exceptions=True,
                    env={"UBEP_JOB_ID": job})
    assert isinstance(out[1], RankFailure) and out[1].kind == "died"
    rank, phase, peers, took, left = out[0]
    # a PeerDiedError (not a PeerTimeoutError at the 20 s deadline): found by liveness
    assert (rank, phase, peers, left) == (0, "dispatch/rows", [1], [])
    assert _shm_entries(job) == []


def _killed_after_bootstrap(rank, world, job):
    buf = _buffer()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    left = _shm_entries(job)
    buf.close()
    return left


def test_sigkill_leaves_nothing_in_dev_shm():
    job = f"kill{os.getpid()}"
    out = run_ranks(_killed_after_bootstrap, 2, job, timeout_s=120, return_exceptions=True,
                    env={"UBEP_JOB_ID": job})
    assert out[0] == []            # names are unlinked as soon as every rank mapped them
    assert _shm_entries(job) == []


# -- bad input and protocol errors ---------------------------------------------------------------
def _bad_inputs(rank, world):
    import ubep
    from ubep.plan.blocks import SENTINEL

    out = {}
    with _buffer(sync="sp", block_bytes=32) as buf:
        x, idx, w = _inputs(rank, num_tokens=6, dtype=torch.int8)
        try:
            buf.dispatch(x, idx, w)
        except ValueError as e:
            out["int8"] = str(e)
        x, idx, w = _inputs(rank, num_tokens=6)
        if rank == 0:
            idx[3] = torch.tensor([0, 2])
            words = x.view(torch.uint8).reshape(6, -1)
            # record = 16 B header + row; the first 32 B block's marker is row bytes 8..15
            words[3, 8:16] = torch.tensor(list(SENTINEL.to_bytes(8, "little")),
                                           dtype=torch.uint8)
        try:
            buf.dispatch(x, idx, w)
            out["sentinel"] = "no error"
        except ValueError as e:
            out["sentinel"] = str(e)
        except ubep.UbepError as e:
            out["sentinel"] = f"peer: {type(e).__name__}: {e}"
    return out


def test_sp_refuses_integer_rows_and_rows_holding_the_sentinel():
    out = run_ranks(_bad_inputs, 2, timeout_s=120)
    for r in range(2):
        assert "tff" in out[r]["int8"] and "int8" in out[r]["int8"]
    assert "row 3" in out[0]["sentinel"] and "sentinel" in out[0]["sentinel"]
    assert out[1]["sentinel"].startswith("peer: ShmProtocolError")
    assert "[0]" in out[1]["sentinel"]


DC_DEADLINE_S = 2.0


def _corrupt_dc(rank, world, phase):
    """Rank 0 sends, then flips a bit of the checksum it left in rank 1's region (the shared
    memory the receiver reads); rank 1 comes late, so it reads only the corrupted batch."""
    import torch.distributed as dist

    import ubep
    from ubep.runtime.shm.region import L_CBATCH_OFF, L_DBATCH_OFF, L_MW, L_WORLD
    from ubep.runtime.shm.staged import kernels as single

    with _buffer(sync="dc", timeout_s=DC_DEADLINE_S, workers=1) as buf:
        x, idx, w = _inputs(rank, num_tokens=6)
        if rank == 0:
            entry = "dispatch_begin_at" if phase == "dispatch" else "combine_begin_at"
            send = getattr(single, entry)

            def send_then_corrupt(state, epoch, *rest):
                out = send(state, epoch, *rest)
                k, lay, bases = single.consts(state)
                me = int(k[single.K_ME])
                off = lay[L_DBATCH_OFF] if phase == "dispatch" else lay[L_CBATCH_OFF]
                slot = int(bases[1] + off + ((epoch & 1) * lay[L_WORLD] + me) * lay[L_MW] * 64)
                word = np.frombuffer((ctypes.c_char * 8).from_address(slot), np.int64)
                word[0] ^= 1                            # worker 0's checksum word
                return out
            setattr(single, entry, send_then_corrupt)
            buf._door = None         # the Python path, whose entry this rank replaced
        try:
            if rank == 1 and phase == "dispatch":
                time.sleep(0.3)
            res = buf.dispatch(x, idx, w)
            if rank == 1:
                time.sleep(0.3)
            t0 = time.monotonic()
            buf.combine(res.recv_x, res.handle)
            out = "ok"
        except ubep.PeerTimeoutError as e:
            took = time.monotonic() - t0 if phase == "combine" else None
            out = (e.phase, e.peers, str(e), took)
        except ubep.UbepError as e:   # rank 0: its peer gave up on it
            out = type(e).__name__
        dist.barrier()                # rank 0 stays alive (not a PeerDiedError) meanwhile
    return out


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_a_corrupted_dc_checksum_is_reported_at_the_deadline(phase):
    out = run_ranks(_corrupt_dc, 2, phase, timeout_s=120)
    got_phase, peers, msg, took = out[1]
    assert got_phase.startswith(phase) and peers == [0]
    assert "checksum mismatch from rank(s) [0]" in msg
    if took is not None:
        assert took >= DC_DEADLINE_S         # it waited for a good batch until the deadline


def _other_host(rank, world):
    import socket

    from ubep.runtime.shm import segments

    if rank == 1:      # another host: another name, and another kernel's /dev/shm
        socket.gethostname = lambda: "elsewhere"
        key = segments.host_memory_key()
        segments.host_memory_key = lambda: ("another boot", *key[1:])
    try:
        _buffer()
    except ValueError as e:
        return str(e)
    return "accepted"


def test_ranks_on_different_hosts_are_refused():
    out = run_ranks(_other_host, 2, timeout_s=120)
    for msg in out:
        assert "one host" in msg and "elsewhere" in msg


def _dtype_mismatch(rank, world):
    import ubep

    with _buffer() as buf:
        x, idx, w = _inputs(rank, dtype=torch.bfloat16 if rank == 0 else torch.float16)
        try:
            buf.dispatch(x, idx, w)
        except ubep.UbepError as e:
            return str(e)
    return "accepted"


def test_peers_with_different_dtypes_fail_clearly():
    out = run_ranks(_dtype_mismatch, 2, timeout_s=120)
    assert all("same dtype" in m for m in out)


# -- lifecycle ---------------------------------------------------------------------------------
def _lifecycle(rank, world):
    buf = _buffer(workers=2)
    res = buf.dispatch(*_inputs(rank))
    buf.combine(res.recv_x, res.handle)
    pool = buf._backend._res.pool
    backend = buf._backend
    buf.close()
    buf.close()
    backend.close()
    try:
        buf.dispatch(*_inputs(rank))
    except RuntimeError as e:
        return str(e), [t.is_alive() for t in pool._threads]
    return "dispatched after close", None


def test_close_is_idempotent_and_stops_workers():
    out = run_ranks(_lifecycle, 2, timeout_s=120)
    for msg, alive in out:
        assert msg == "cannot dispatch after close"
        assert not any(alive or [])


# -- many calls: epochs ---------------------------------------------------------------------------
def _reference_for(rank, world, ins, weighted):
    from ubep import reference
    from ubep.testing import expert_fn

    ref = reference.dispatch([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], 8)
    ys = reference.combine([expert_fn(d.recv_x) for d in ref], ref, [i[1] for i in ins],
                           [i[2] for i in ins], weighted=weighted)
    return ref[rank], ys[rank]


def _many_calls(rank, world, configs):
    import ubep
    from ubep.testing import ROUTINGS, expert_fn

    bad = []
    calls = 0
    for kw, n_calls in configs:
        with ubep.Buffer(num_experts=8, hidden=24, max_tokens_per_rank=12, backend="shm",
                         max_top_k=4, timeout_s=30, **kw) as buf:
            for i in range(n_calls):
                kind = ROUTINGS[i % len(ROUTINGS)]
                ins = []
                for r in range(world):
                    t = (i * 7 + r * 5) % 13
                    idx, w = make_routing(t, 1 + i % 4, 8, kind=kind, seed=i * 31 + r)
                    ins.append((make_tokens(r, t, 24, torch.bfloat16, seed=i), idx, w))
                res = buf.dispatch(*ins[rank])
                calls += 1
                check_combine = i % 5 == 0
                if check_combine:
                    y = buf.combine(expert_fn(res.recv_x), res.handle, weighted=i % 2 == 0)
                ref, ref_y = _reference_for(rank, world, ins, i % 2 == 0)
                if not torch.equal(res.recv_x.view(torch.uint8), ref.recv_x.view(torch.uint8)) \
                        or not torch.equal(res.recv_src_token, ref.recv_src_token) \
                        or not torch.equal(res.recv_src_rank, ref.recv_src_rank):
                    bad.append((kw, i, "dispatch"))
                if check_combine and not torch.equal(y.view(torch.uint8),     # bit for bit
                                                     ref_y.view(torch.uint8)):
                    bad.append((kw, i, "combine"))
    return bad, calls


@pytest.mark.slow
def test_2000_back_to_back_calls_with_changing_routing_never_mismatch():
    configs = [(dict(mode="ubep", sync="tff"), 2000), (dict(mode="ubep", sync="sp"), 300),
               (dict(mode="ubep", sync="dc"), 300), (dict(mode="bsp", sync="sw", workers=2), 300)]
    out = run_ranks(_many_calls, 2, configs, timeout_s=280)
    for bad, calls in out:
        assert bad == []
        assert calls == 2900


def _exit_without_close(rank, world):
    buf = _buffer(workers=2)
    res = buf.dispatch(*_inputs(rank))
    buf.combine(res.recv_x, res.handle)
    buf._leak = buf          # a cycle: only the exit-time finalizer can release it
    return [t.name for t in buf._backend._res.pool._threads if t.is_alive()]


def test_interpreter_exit_with_live_workers_does_not_hang():
    out = run_ranks(_exit_without_close, 2, timeout_s=120)
    assert all(len(names) == 1 for names in out)   # the worker was alive; exit still worked
