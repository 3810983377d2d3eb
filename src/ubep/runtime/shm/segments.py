"""POSIX shared-memory segments: exclusive creation, attach, stale cleanup, leak-proof release.

Names are `ubep_<job>_b<buffer>_r<rank>_p<owner pid>`. A segment whose owner pid is gone
is stale and gets unlinked by the next creator. Once every rank has mapped every segment
the names are unlinked right away (`unlink_name`): the memory lives on while mapped and is
freed by the kernel when the last mapping goes, so even a SIGKILLed rank leaks nothing.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import re

PREFIX = "ubep_"
SHM_DIR = "/dev/shm"
_OWNER = re.compile(r"_p(\d+)$")


def pid_alive(pid: int) -> bool:
    """True if a process with `pid` exists on this host and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")
    except (OSError, ValueError):
        return True  # no /proc: trust kill()


def segment_name(job: str, buffer_id: int, rank: int, pid: int | None = None) -> str:
    """The name rank `rank` of job `job` gives its segment for Buffer `buffer_id`."""
    safe = re.sub(r"[^A-Za-z0-9]", "", str(job))[:40] or "job"
    return f"{PREFIX}{safe}_b{buffer_id}_r{rank}_p{os.getpid() if pid is None else pid}"


def owner_pid(name: str) -> int | None:
    m = _OWNER.search(name)
    return int(m.group(1)) if m else None


def unlink_name(name: str) -> bool:
    """Unlink the segment `name` if it exists; True if this call removed it."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def sweep_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink `ubep_*` segments whose owner process is gone; return their names."""
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    for name in entries:
        if not name.startswith(PREFIX):
            continue
        pid = owner_pid(name)
        if pid is not None and not pid_alive(pid):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except OSError:
                pass
    return removed


class Segment:
    """One mapped POSIX shared-memory segment (`buf` is the mmap)."""

    def __init__(self, name: str, buf: mmap.mmap):
        self.name, self.buf, self.size = name, buf, len(buf)

    def close(self) -> None:
        """Unmap (fails with BufferError while numpy views of `buf` are alive)."""
        if not self.buf.closed:
            self.buf.close()


# We map segments ourselves instead of using multiprocessing.shared_memory: on Python 3.11
# it registers every attach with the resource tracker, which processes of one job share
# (forkserver), so one rank's unregister races another's and the tracker unlinks or warns.
def _open(name: str, flags: int, size: int | None) -> Segment:
    fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
    try:
        if size is not None:
            os.ftruncate(fd, size)
        else:
            size = os.fstat(fd).st_size
        return Segment(name, mmap.mmap(fd, size))
    finally:
        os.close(fd)


def create(name: str, size: int) -> Segment:
    """Create `name` exclusively with `size` bytes (zero-filled).

    A leftover with the same name (a dead process that had our pid) is unlinked first;
    a live owner is an error.
    """
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
    try:
        return _open(name, flags, size)
    except FileExistsError:
        pid = owner_pid(name)
        if pid is not None and pid != os.getpid() and pid_alive(pid):
            raise
        unlink_name(name)
        return _open(name, flags, size)


def attach(name: str) -> Segment:
    """Map an existing segment (never unlinks it)."""
    return _open(name, os.O_RDWR, None)
