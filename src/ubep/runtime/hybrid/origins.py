"""Where each forwarded row came from, shared by the ranks of a host.

An entry rank forwards the rows it received from other hosts through one shared-memory
dispatch, numbering them by *virtual token* 0..n-1 in arrival order. A rank that receives
such a row learns (entry, virtual token) from that dispatch; it reads the row's origin,
(source rank, source token), from the entry's table here. The entry writes its table before
it starts that dispatch, so a receiver that saw any of its rows arrive (release/acquire on
the row's flag word) sees the table too. Two tables per rank, by call parity: the entry
writes call n+2's table only after the shm exchanges of call n+1, which need every rank of
the host to have finished call n.
"""

from __future__ import annotations

import os

import numpy as np

from ubep.runtime import bootstrap
from ubep.runtime.shm import segments


class OriginTables:
    """Each rank's table of packed origins `(src << 32) | token`, mapped by its host."""

    def __init__(self, group, *, rank: int, world: int, capacity: int, buffer_id: int,
                 timeout_s: float):
        self.capacity = max(1, capacity)
        self._own: segments.Segment | None = None
        self._peers: list[segments.Segment] = []
        self._views: list[np.ndarray] = []
        size = 2 * 8 * self.capacity
        name = segments.segment_name(os.environ.get("UBEP_JOB_ID", "job") + "o", buffer_id,
                                     rank)
        try:
            self._own = segments.create(name, size)
            names = bootstrap.exchange(name, group, rank=rank, world=world,
                                       timeout_s=timeout_s, phase="Buffer()/origin tables")
            for r, n in enumerate(names):
                seg = self._own if r == rank else segments.attach(n)
                if r != rank:
                    self._peers.append(seg)
                self._views.append(np.frombuffer(seg.buf, np.int64).reshape(2, self.capacity))
            bootstrap.exchange(True, group, rank=rank, world=world, timeout_s=timeout_s,
                               phase="Buffer()/origin tables attached")
        finally:
            segments.unlink_name(name)      # mapped by every rank (or failed): memory stays
        self.rank = rank

    def write(self, parity: int, src: np.ndarray, token: np.ndarray) -> None:
        """This rank's table of call parity `parity`: row v came from (src[v], token[v])."""
        self._views[self.rank][parity, :len(src)] = (src << 32) | token

    def read(self, entry: int, parity: int, vtoken: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source rank, source token) of virtual tokens `vtoken` of `entry` (host index)."""
        packed = self._views[entry][parity, vtoken]
        return packed >> 32, packed & 0xFFFFFFFF

    def close(self) -> None:
        """Unmap every table (idempotent)."""
        self._views.clear()
        for seg in [*self._peers, self._own]:
            if seg is not None:
                try:
                    seg.close()
                except (BufferError, OSError):
                    pass
        self._peers, self._own = [], None
