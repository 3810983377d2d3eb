"""POSIX shared-memory segments: private names, reserved memory, liveness by lock, safe sweep.

* Names are `ubep_<job>_b<buffer>_r<rank>_<token>`: `token` is random (`secrets`), so no
  other user can pre-create a rank's name; creation is exclusive (`O_EXCL`) with mode 0600.
* Memory is reserved at creation (`posix_fallocate`): a tmpfs file that is only
  `ftruncate`d gets its pages on first touch, and a /dev/shm too small for it kills the
  process with SIGBUS then. Reservation fails instead with `ShmCapacityError`, giving the
  bytes needed and the bytes free.
* Liveness does not use process ids (ranks in containers may sit in different PID
  namespaces while sharing /dev/shm): the owner holds an exclusive `flock` on its segment
  for as long as it lives, and the kernel drops that lock when the process dies, whatever
  its namespace. A peer asks with a non-blocking shared lock on its own descriptor: granted
  means the owner is gone (`Segment.owner_alive`).
* `sweep_stale` removes only `ubep_*` segments whose lock it can take: a segment in use is
  locked, so it is never removed. A segment is empty for the few microseconds between its
  creation and its owner's lock; the sweep leaves empty segments alone until they are
  `CREATING_GRACE_S` old.

Once every rank has mapped every segment the names are unlinked (`unlink_name`): the memory
lives on while mapped and the kernel frees it when the last mapping goes, so a SIGKILLed rank
leaks nothing. Only a job killed as a whole during the constructor's exchange leaves names,
and the next sweep (every `Buffer()` runs one) removes them.
"""

from __future__ import annotations

import _posixshmem
import errno
import fcntl
import mmap
import os
import re
import secrets
import time

from ubep.errors import ShmCapacityError, ShmError

PREFIX = "ubep_"
SHM_DIR = "/dev/shm"
#: how long a sweep leaves an empty (just created, not yet locked) segment alone, seconds
CREATING_GRACE_S = 60.0
#: how long `create` tries to take the lock of its new segment (a sweep may hold it briefly)
_LOCK_WAIT_S = 5.0


def host_memory_key(shm_dir: str = SHM_DIR) -> tuple | None:
    """What identifies the shared memory this process maps: (boot id, device, inode) of
    `shm_dir`, or None where there is none (not Linux, no /dev/shm). Ranks with equal keys
    share it, whatever their hostnames (containers with `--ipc=host`) or PID namespaces.

    `UBEP_SHM_DOMAIN` in the environment, when set, is part of the key: ranks with different
    values never share memory though they could (to run the multi-host path on one host,
    as the tests do, or to keep groups of ranks apart)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(shm_dir)
    except OSError:
        return None
    domain = os.environ.get("UBEP_SHM_DOMAIN")
    key = (boot, st.st_dev, st.st_ino)
    return key if domain is None else (*key, domain)


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate in `shm_dir`."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def shm_total_bytes(shm_dir: str = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_blocks * st.f_frsize


def segment_name(job: str, buffer_id: int, rank: int) -> str:
    """A fresh, unpredictable name for rank `rank`'s segment of Buffer `buffer_id` of `job`."""
    safe = re.sub(r"[^A-Za-z0-9]", "", str(job))[:40] or "job"
    return f"{PREFIX}{safe}_b{buffer_id}_r{rank}_{secrets.token_hex(12)}"


def unlink_name(name: str) -> bool:
    """Unlink the segment `name` if it exists; True if this call removed it."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def _try_lock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def sweep_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink `ubep_*` segments that no live process holds; return their names.

    A segment is stale when its owner's lock is gone (the owner died, in any PID namespace).
    Segments of other users (not openable) and segments in use are left alone.
    """
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    now = time.time()
    for name in entries:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue                     # gone, another user's, or not a regular file
        try:
            if not _try_lock(fd, fcntl.LOCK_EX):
                continue                 # its owner is alive
            st = os.fstat(fd)
            if st.st_size == 0 and now - st.st_ctime < CREATING_GRACE_S:
                continue                 # being created: its owner is about to lock it
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)                 # drops our lock
    return removed


class Segment:
    """One mapped POSIX shared-memory segment (`buf` is the mmap).

    Keeps its descriptor open: the owner's holds the liveness lock, a peer's is what it
    probes the owner's lock through.
    """

    def __init__(self, name: str, buf: mmap.mmap, fd: int, owner: bool):
        self.name, self.buf, self.size = name, buf, len(buf)
        self.fd, self.owner = fd, owner

    def owner_alive(self) -> bool:
        """False once the process that created this segment has died (any PID namespace)."""
        if self.owner:
            return True
        if self.fd < 0:
            return False
        if not _try_lock(self.fd, fcntl.LOCK_SH):
            return True                  # the owner's exclusive lock is held
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def unlock(self) -> None:
        """Release the owner's liveness lock, mapping kept: peers' `owner_alive` then reads
        False, as if this process had died (a rank that leaves the exchange on purpose)."""
        if self.owner and self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Unmap and close (fails with BufferError while numpy views of `buf` are alive)."""
        if not self.buf.closed:
            self.buf.close()
        if self.fd >= 0:
            os.close(self.fd)    # the owner's lock goes with it
            self.fd = -1


def _reserve(fd: int, name: str, size: int) -> None:
    """Allocate `size` bytes of `fd` now, or raise ShmCapacityError (no SIGBUS later)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            os.ftruncate(fd, size)       # no fallocate here: size only (not reserved)
            return
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        free = shm_free_bytes()
        raise ShmCapacityError(
            f"cannot reserve {size} bytes of shared memory for {name} in {SHM_DIR}: "
            f"{free} bytes free of {shm_total_bytes()} ({e.strerror})",
            needed=size, available=free) from None


# We map segments ourselves instead of using multiprocessing.shared_memory: on Python 3.11
# it registers every attach with the resource tracker, which processes of one job share
# (forkserver), so one rank's unregister races another's and the tracker unlinks or warns.
def create(name: str, size: int) -> Segment:
    """Create `name` exclusively (mode 0600) with `size` bytes reserved and zero-filled.

    Takes the owner's liveness lock. Raises `ShmCapacityError` if /dev/shm has no room and
    `ShmError` if the name exists or cannot be created; nothing is left behind either way.
    """
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
    try:
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
    except FileExistsError:
        raise ShmError(errno.EEXIST, f"shared-memory segment {SHM_DIR}/{name} already exists "
                       f"(names are random: another process made it on purpose or a job was "
                       f"started twice)") from None
    except PermissionError as e:
        raise ShmError(errno.EACCES, f"cannot create {SHM_DIR}/{name}: {e.strerror} (check "
                       f"that {SHM_DIR} is writable by this user)") from None
    try:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while not _try_lock(fd, fcntl.LOCK_EX):     # only a sweep can hold it, briefly
            if time.monotonic() > deadline:
                raise ShmError(errno.EBUSY, f"{SHM_DIR}/{name} is locked by another process")
            time.sleep(1e-3)
        _reserve(fd, name, size)
        return Segment(name, mmap.mmap(fd, size), fd, owner=True)
    except BaseException:
        unlink_name(name)
        os.close(fd)
        raise


def attach(name: str) -> Segment:
    """Map an existing segment (never unlinks it); `ShmError` saying why if it cannot."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise ShmError(errno.ENOENT, f"shared-memory segment {SHM_DIR}/{name} is gone (its "
                       f"owner died or removed it)") from None
    except PermissionError as e:
        raise ShmError(errno.EACCES, f"cannot open {SHM_DIR}/{name}: {e.strerror} (segments "
                       f"are private to the user who made them: run every rank as the same "
                       f"user)") from None
    try:
        size = os.fstat(fd).st_size
        return Segment(name, mmap.mmap(fd, size), fd, owner=False)
    except BaseException:
        os.close(fd)
        raise
