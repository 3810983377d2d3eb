"""Exceptions raised by ubep beyond ValueError/TypeError for bad input."""

import errno


class UbepError(RuntimeError):
    """Base class for runtime failures of an executor."""


class PeerTimeoutError(UbepError, TimeoutError):
    """A wait passed its deadline: names the waiting rank, the phase and the peers."""

    def __init__(self, rank: int, phase: str, peers: list[int] | tuple[int, ...], timeout_s: float,
                 detail: str = ""):
        # `peers` are the other ranks; waiting on this rank's own workers is said in words
        own = rank in peers
        self.rank, self.phase, self.timeout_s = rank, phase, timeout_s
        self.peers = [p for p in peers if p != rank]
        waiting = " and ".join(
            ([f"rank(s) {self.peers}"] if self.peers or not own else []) +
            (["this rank's own workers"] if own else []))
        msg = f"rank {rank} timed out after {timeout_s:g}s in phase {phase!r} waiting for {waiting}"
        super().__init__(msg + (f": {detail}" if detail else ""))


class PeerDiedError(UbepError):
    """A peer process is gone while this rank was waiting for it."""

    def __init__(self, rank: int, phase: str, peers: list[int] | tuple[int, ...]):
        self.rank, self.phase, self.peers = rank, phase, list(peers)
        super().__init__(f"rank {rank} in phase {phase!r}: peer rank(s) {self.peers} died")


class BrokenBufferError(UbepError):
    """An earlier failure left the Buffer unusable; close it and make a new one."""


class RankRemovedError(UbepError):
    """This rank is no longer an active member of an elastic Buffer (`Buffer(elastic=True)`):
    the other ranks removed it (`set_active_ranks`) or found it dead. Close the Buffer."""

    def __init__(self, rank: int, why: str):
        self.rank = rank
        super().__init__(f"rank {rank} is no longer an active rank of this elastic Buffer "
                         f"({why}); it makes no more calls: close it (the other ranks go on "
                         f"without it)")


class StoreHostDiedError(UbepError):
    """An elastic torch Buffer lost the `torch.distributed` store that coordinates recovery:
    the process that hosts it (rank 0 of the default group, the TCPStore master) died."""


class ShmError(OSError):
    """A shared-memory segment could not be created or attached; says why and what to do."""


class ShmCapacityError(ShmError):
    """/dev/shm has no room for a segment: carries the bytes needed and the bytes free."""

    def __init__(self, msg: str, *, needed: int, available: int):
        super().__init__(errno.ENOSPC, msg)
        self.needed, self.available = needed, available

    def __str__(self) -> str:
        return self.strerror
