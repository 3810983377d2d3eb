"""The hybrid backend's network part: point-to-point messages between a rank and its peers
on other hosts, over the caller's torch.distributed group, every wait with a deadline.

The pairing is fixed (`plan.hosts.HostLayout.entry`), so each side knows whom it hears
from: dispatch sends one message to each other host's entry (a count header, the rows, their
routing), combine one back (the partial rows). A rank talks to H - 1 peers instead of the
W - 1 of a group all-to-all. Messages are `isend`/`irecv` (gloo runs them on its own
threads, so shared-memory work proceeds while they travel); a receive buffer may be larger
than the message, so dispatch posts buffers sized for the largest message it could get.

gloo completes a point-to-point `Work` only inside `wait()`, so waits block with the time
left to the deadline (gloo then closes the pair: the Buffer is broken anyway). A peer that
died closes its sockets, and the wait raises at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ubep.errors import PeerDiedError, PeerTimeoutError, UbepError


class NetworkError(UbepError):
    """An exchange between hosts failed for a reason other than a lost or late peer."""


@dataclass
class Exchange:
    """The messages of one step in flight: `finish` waits for all of them."""

    rank: int
    phase: str
    timeout_s: float
    sends: list = field(default_factory=list)        # (peer, work)
    recvs: list = field(default_factory=list)        # (peer, work)

    def finish(self, deadline: float, clock) -> None:
        """Wait for every receive, then every send, until `deadline` (`clock()` seconds)."""
        for peer, work in self.recvs + self.sends:
            left = deadline - clock()
            try:
                work.wait(timedelta(seconds=max(left, 1e-3)))
            except RuntimeError as e:
                raise network_error(self.rank, self.phase, peer, e, self.timeout_s) from e
        self.sends.clear()
        self.recvs.clear()


def post(ex: Exchange, pg, sends: dict[int, torch.Tensor],
         recvs: dict[int, torch.Tensor], tag: int = 0) -> Exchange:
    """Post `recvs` (peer group rank -> buffer) then `sends` (peer -> tensor) on the process
    group object `pg` with `tag` (a call's chunks travel under tags 0, 1, ...), as
    `dist.irecv`/`dist.isend` do without their Python wrappers' checks (tens of µs a call
    on a slow host, as `collectives.all_to_all` notes)."""
    try:
        for peer, buf in recvs.items():
            ex.recvs.append((peer, pg.recv([buf], peer, tag)))
        for peer, buf in sends.items():
            ex.sends.append((peer, pg.send([buf], peer, tag)))
    except RuntimeError as e:
        raise network_error(ex.rank, ex.phase, next(iter(recvs or sends), -1), e,
                            ex.timeout_s) from e
    return ex


def network_error(rank: int, phase: str, peer: int | list[int], e: BaseException,
                  timeout_s: float) -> UbepError:
    """The named error for a failed wait on `peer` (or one of several): died, timed out, or
    other; anything but a torch.distributed error is returned as it is."""
    if not isinstance(e, RuntimeError) or isinstance(e, UbepError):
        return e
    peers = list(peer) if isinstance(peer, list) else [peer]
    which = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {peers}"
    text = str(e)
    first = text.splitlines()[0][:300] if text else type(e).__name__
    low = text.lower()
    if "timeout" in low or "timed out" in low:
        return PeerTimeoutError(rank, phase, peers, timeout_s,
                                f"no message from {which} in time")
    if any(w in low for w in ("closed by peer", "connection reset", "broken pipe", "crash")):
        err = PeerDiedError(rank, phase, peers)
        err.args = (f"{err.args[0]} (the connection to {which} closed: {first})",)
        return err
    return NetworkError(f"rank {rank} in phase {phase!r}: the exchange with {which} "
                        f"failed: {first}")
