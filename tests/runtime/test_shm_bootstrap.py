"""The Buffer constructor across ranks: agreed config, bounded waits, capacity, namespaces."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from ubep.testing import RankFailure, run_ranks

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


# -- /dev/shm too small: an error on every rank, no SIGBUS ------------------------------------
def _too_big(rank, world):
    import ubep
    from ubep.runtime.shm.segments import ShmCapacityError

    try:
        # ~2 x 8 MiB of windows per rank, /dev/shm is 8 MiB
        ubep.Buffer(num_experts=4, hidden=1024, max_tokens_per_rank=512, max_top_k=4,
                    backend="shm", workers=1).close()
    except ShmCapacityError as e:
        return str(e), e.needed, e.available
    return "constructed"


def test_a_dev_shm_too_small_for_the_buffer_is_an_error_on_every_rank():
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs over /dev/shm in a mount namespace")
    code = textwrap.dedent(f"""
        import subprocess, os, sys
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", "/dev/shm"], check=True)
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_shm_bootstrap import _too_big
        from ubep.testing import RankFailure, run_ranks
        print(repr(run_ranks(_too_big, 2, timeout_s=120, return_exceptions=True)))
        print(repr(os.listdir("/dev/shm")))
        """)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(["unshare", "-m", sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode and "mount" in r.stderr and "Traceback" not in r.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    out, left = eval(lines[-2]), eval(lines[-1])     # noqa: S307 - our own repr
    for res in out:
        assert not isinstance(res, RankFailure), res   # an error, not a SIGBUS'd rank
        msg, needed, available = res
        assert "could not reserve" in msg and needed > available > 0
        assert str(needed) in msg and str(available) in msg
    assert left == []


# -- ranks in different PID namespaces sharing /dev/shm ---------------------------------------
_RANK = """
import os, sys, time, torch, torch.distributed as dist
from datetime import timedelta
import ubep
from ubep.testing import make_routing, make_tokens
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
buf = ubep.Buffer(num_experts=4, hidden=16, max_tokens_per_rank=8, backend="shm",
                  workers={workers}, timeout_s=20.0)
for i in range(20):
    idx, w = make_routing(6, 2, 4, seed=i * 10 + rank)
    res = buf.dispatch(make_tokens(rank, 6, 16, torch.float32, seed=i), idx, w)
    buf.combine(res.recv_x, res.handle)
print("CALLS", rank, os.getpid(), flush=True)
dist.barrier()
if rank == 1:
    os._exit(0)                      # gone without a word: the peer must notice, by lock
t0 = time.monotonic()
try:
    idx, w = make_routing(6, 2, 4, seed=99)
    buf.dispatch(make_tokens(rank, 6, 16, torch.float32), idx, w)
    print("NOERROR", flush=True)
except ubep.PeerDiedError as e:
    print("DIED", e.peers, round(time.monotonic() - t0, 3), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_ranks_in_different_pid_namespaces_work_and_see_a_peer_die(workers):
    if os.geteuid() != 0:
        pytest.skip("needs root for unshare")
    probe = subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr!r}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = _RANK.format(port=port, workers=workers)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               UBEP_JOB_ID=f"pidns{os.getpid()}", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, "0"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
             subprocess.Popen(["unshare", "-p", "-f", "--mount-proc", "--kill-child",
                               sys.executable, "-c", code, "1"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    (out0, err0), (out1, err1) = outs
    assert "CALLS 1 1" in out1, err1        # rank 1 is pid 1 of its own namespace
    assert "CALLS 0" in out0, err0
    last = out0.strip().splitlines()[-1]
    assert last.startswith("DIED [1]"), out0 + err0
    assert _job_entries(f"pidns{os.getpid()}") == []


# -- the whole job killed inside the constructor ----------------------------------------------
def _killed_inside_constructor(rank, world):
    import os
    import signal

    import ubep
    from ubep.runtime import bootstrap

    real = bootstrap.exchange

    def exchange(obj, group, *, phase, **kw):
        if phase == "Buffer()/attach":          # segments created and mapped, names not yet
            os.kill(os.getpid(), signal.SIGKILL)  # unlinked: the one window that leaves names
        return real(obj, group, phase=phase, **kw)

    bootstrap.exchange = exchange
    ubep.Buffer(num_experts=4, hidden=8, max_tokens_per_rank=4, backend="shm", workers=1)
    return "constructed"


def test_a_job_killed_inside_the_constructor_leaves_names_the_next_sweep_removes():
    from ubep.runtime.shm import segments

    job = f"killctor{os.getpid()}"
    out = run_ranks(_killed_inside_constructor, 2, timeout_s=120, return_exceptions=True,
                    env={"UBEP_JOB_ID": job})
    assert all(isinstance(o, RankFailure) and o.kind == "died" for o in out), out
    left = _job_entries(job)
    assert len(left) == 2                        # one per rank, their owners dead
    removed = segments.sweep_stale()             # what every Buffer() runs first
    assert set(left) <= set(removed) and _job_entries(job) == []
