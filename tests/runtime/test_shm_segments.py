"""Shared-memory segments: private names, reserved memory, liveness and sweep without pids.

Namespace and small-/dev/shm cases run helpers under `unshare` (root); they skip, saying why,
where the host cannot make namespaces.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from ubep.runtime.shm import segments

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.abspath(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _unshare_ok(*flags: str) -> str:
    """'' if `unshare flags true` works here, else why not."""
    if os.geteuid() != 0:
        return "needs root for unshare"
    try:
        r = subprocess.run(["unshare", *flags, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare unavailable: {e}"
    return "" if r.returncode == 0 else f"unshare {' '.join(flags)} failed: {r.stderr!r}"


def _py(code: str, *, unshare: tuple[str, ...] = (), timeout: float = 120, **kw):
    cmd = [*(["unshare", *unshare] if unshare else []), sys.executable, "-c",
           textwrap.dedent(code)]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, **kw)


def _mine(tag: str) -> list[str]:
    return [n for n in os.listdir(segments.SHM_DIR) if n.startswith(f"ubep_{tag}_")]


# -- names and creation ----------------------------------------------------------------------
def test_names_are_unpredictable_and_segments_private_and_exclusive():
    tag = f"names{os.getpid()}"
    a, b = segments.segment_name(tag, 1, 0), segments.segment_name(tag, 1, 0)
    assert a != b and a.startswith(f"ubep_{tag}_b1_r0_") and str(os.getpid()) not in a[-24:]
    seg = segments.create(a, 8192)
    try:
        mode = stat.S_IMODE(os.stat(os.path.join(segments.SHM_DIR, a)).st_mode)
        assert mode & 0o077 == 0, oct(mode)          # owner only
        with pytest.raises(segments.ShmError, match="already exists") as e:
            segments.create(a, 8192)                 # exclusive, and a clear message
        assert a in str(e.value)
        assert _mine(tag) == [a]                     # the failed create removed nothing
    finally:
        seg.close()
        segments.unlink_name(a)
    assert _mine(tag) == []


def test_attach_of_a_missing_or_foreign_segment_says_why():
    with pytest.raises(segments.ShmError, match="is gone"):
        segments.attach(segments.segment_name("missing", 1, 0))
    if os.geteuid() != 0:
        pytest.skip("the permission case needs root to switch to another user")
    name = segments.segment_name(f"perm{os.getpid()}", 1, 0)
    seg = segments.create(name, 4096)
    try:
        r = _py(f"""
            import os
            from ubep.runtime.shm import segments
            os.setgid(65534); os.setuid(65534)         # another user: nobody
            try:
                segments.attach({name!r})
            except segments.ShmError as e:
                print("ERR", e)
            """)
        assert "ERR" in r.stdout and "same user" in r.stdout, r.stdout + r.stderr
    finally:
        seg.close()
        segments.unlink_name(name)


# -- memory reserved at creation ---------------------------------------------------------------
def test_creation_reserves_the_memory():
    name = segments.segment_name(f"rsv{os.getpid()}", 1, 0)
    seg = segments.create(name, 1 << 20)
    try:
        st = os.stat(os.path.join(segments.SHM_DIR, name))
        assert st.st_size == 1 << 20 and st.st_blocks * 512 >= 1 << 20   # allocated, not sparse
    finally:
        seg.close()
        segments.unlink_name(name)


def test_a_segment_larger_than_dev_shm_is_an_error_not_sigbus():
    why = _unshare_ok("-m")
    if why:
        pytest.skip(why)
    r = _py("""
        import subprocess
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", "/dev/shm"], check=True)
        import os
        from ubep.runtime.shm import segments
        name = segments.segment_name("small", 1, 0)
        try:
            seg = segments.create(name, 8 << 20)
            seg.buf[-1] = 1        # without a reservation this touch is SIGBUS
            print("CREATED")
        except segments.ShmCapacityError as e:
            print("ERR", e.needed, e.available, os.listdir("/dev/shm"))
        """, unshare=("-m",))
    assert r.returncode == 0, f"rc={r.returncode} {r.stderr}"
    words = r.stdout.split()
    assert words[0] == "ERR", r.stdout
    assert int(words[1]) == 8 << 20 and 0 < int(words[2]) <= 4 << 20
    assert words[3] == "[]"               # nothing left behind


# -- liveness and sweep: by lock, not by pid --------------------------------------------------
_OWNER = """
    import sys, time
    from ubep.runtime.shm import segments
    seg = segments.create(segments.segment_name({tag!r}, 1, 0), 4096)
    print(seg.name, flush=True)
    {after}
    """


_owners: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _kill_owners():
    yield
    while _owners:
        p = _owners.pop()
        if p.poll() is None:
            p.kill()
            p.wait(30)


def _start_owner(tag: str, after: str = "time.sleep(120)", unshare: tuple[str, ...] = ()):
    code = textwrap.dedent(_OWNER.format(tag=tag, after=after))
    cmd = [*(["unshare", *unshare] if unshare else []), sys.executable, "-c", code]
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, text=True)
    _owners.append(p)
    name = p.stdout.readline().strip()
    assert name.startswith(f"ubep_{tag}_"), name
    return p, name


def test_owner_liveness_follows_the_process_not_its_pid():
    p, name = _start_owner(f"live{os.getpid()}")
    peer = segments.attach(name)
    try:
        assert peer.owner_alive()
        assert name not in segments.sweep_stale()         # in use: never swept
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        deadline = time.monotonic() + 10
        while peer.owner_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not peer.owner_alive()
        assert name in segments.sweep_stale()             # dead owner: stale
    finally:
        peer.close()
        segments.unlink_name(name)


def test_a_sweep_from_another_pid_namespace_never_removes_a_live_segment():
    why = _unshare_ok("-p", "-f", "--mount-proc")
    if why:
        pytest.skip(why)
    tag = f"pidns{os.getpid()}"
    name = segments.segment_name(tag, 1, 0)
    seg = segments.create(name, 4096)                    # owned by this (live) process
    try:
        r = _py("""
            import os
            from ubep.runtime.shm import segments
            print(os.getpid(), segments.sweep_stale())
            """, unshare=("-p", "-f", "--mount-proc"))
        assert r.returncode == 0, r.stderr
        assert name not in r.stdout and _mine(tag) == [name], r.stdout
    finally:
        seg.close()
        segments.unlink_name(name)


def test_a_live_owner_in_another_pid_namespace_is_alive_and_a_dead_one_dead():
    why = _unshare_ok("-p", "-f", "--mount-proc")
    if why:
        pytest.skip(why)
    p, name = _start_owner(f"nsown{os.getpid()}",
                           unshare=("-p", "-f", "--mount-proc", "--kill-child"))
    peer = segments.attach(name)
    try:
        assert peer.owner_alive()
        assert name not in segments.sweep_stale()
        p.send_signal(signal.SIGKILL)        # unshare --kill-child takes the owner along
        p.wait(30)
        deadline = time.monotonic() + 10
        while peer.owner_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not peer.owner_alive()
    finally:
        peer.close()
        segments.unlink_name(name)


def test_stale_segment_of_a_dead_owner_is_swept_and_a_fresh_empty_one_is_not():
    tag = f"stale{os.getpid()}"
    r = _py(_OWNER.format(tag=tag, after="import os; os._exit(0)"))
    assert r.returncode == 0, r.stderr
    stale = _mine(tag)
    assert len(stale) == 1, "the crashed process should have left its segment"
    # an empty, unlocked segment is one being created right now: left alone
    fresh = f"ubep_{tag}_creating"
    fd = os.open(os.path.join(segments.SHM_DIR, fresh), os.O_CREAT | os.O_EXCL | os.O_RDWR,
                 0o600)
    try:
        removed = segments.sweep_stale()
        assert stale[0] in removed and fresh not in removed
        assert _mine(tag) == [fresh]
    finally:
        os.close(fd)
        segments.unlink_name(fresh)
