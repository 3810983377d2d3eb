"""What the ranks of a host tell each other beside the rows: origins and batch sizes.

An entry rank forwards the rows it received from other hosts through a shared-memory
dispatch, numbering them by *virtual token* in arrival order (after its own tokens, when
they travel in the same dispatch). A rank that receives such a row learns (entry, virtual
token) from that dispatch; it reads the row's origin, (source rank, source token), from the
entry's table here. Each rank also publishes its call's token count and its measured costs
(with the largest its sources sent), from which the host's ranks pick the next call's mode
alike (`backend.HybridBackend`, `modes.py`).

Ordering: a rank writes its table and count before the shm dispatch that needs them; a
receiver reads them after that dispatch returned, having acquired the writer's count words
or rows (the shm path's release/acquire), so it sees them. Reuse: a call's forwarded rows
may come in several chunks (one shm dispatch each), each with a table of its own: slot
`parity * chunks + chunk`; a rank writes call n+2's slots only after the shm exchanges of
call n+1, which need every rank of the host to have finished call n.
"""

from __future__ import annotations

import os

import numpy as np

from ubep.runtime import bootstrap
from ubep.runtime.shm import segments

#: words before a slot's table: the rank's batch and its flat and hierarchical costs
WORDS = 3


class OriginTables:
    """Each rank's `2 * chunks` slots `[batch, flat µs, hierarchical µs, (src << 32) |
    token ...]`, mapped by its host (the batch and costs in slots 0 and 1, by parity)."""

    def __init__(self, group, *, rank: int, world: int, capacity: int, buffer_id: int,
                 timeout_s: float, chunks: int = 1):
        self.capacity = max(1, capacity)
        self.chunks = max(2, 2 * chunks)
        self.rank = rank
        self._own: segments.Segment | None = None
        self._peers: list[segments.Segment] = []
        self._views: list[np.ndarray] = []
        size = self.chunks * 8 * (WORDS + self.capacity)
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
                self._views.append(np.frombuffer(seg.buf, np.int64).reshape(self.chunks, -1))
            bootstrap.exchange(True, group, rank=rank, world=world, timeout_s=timeout_s,
                               phase="Buffer()/origin tables attached")
        finally:
            segments.unlink_name(name)      # mapped by every rank (or failed): memory stays

    def write_words(self, parity: int, words: tuple[int, int, int]) -> None:
        """This rank's (batch, flat µs, hierarchical µs) of the call of parity `parity`."""
        self._views[self.rank][parity, :WORDS] = words

    def max_words(self, parity: int) -> tuple[int, ...]:
        """The largest of each word the host's ranks published for parity `parity`."""
        return tuple(int(w) for w in np.max([v[parity, :WORDS] for v in self._views], axis=0))

    def write(self, slot: int, src: np.ndarray, token: np.ndarray) -> None:
        """This rank's table in `slot`: virtual token v came from (src[v], token[v])."""
        self._views[self.rank][slot, WORDS:WORDS + len(src)] = (src << 32) | token

    def read(self, entry: int, slot: int, vtoken: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source rank, source token) of virtual tokens `vtoken` of `entry` (host index)."""
        packed = self._views[entry][slot, WORDS + vtoken]
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
