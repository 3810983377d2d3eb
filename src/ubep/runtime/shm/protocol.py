"""What ranks tell each other about a call besides rows: dtype codes, status, their errors.

Every count slot and hello carries the sender's dtype code and a status (`region.STATUS_*`);
a receiver checks them once it has all of them, so a dtype mismatch or a peer that aborted
(bad input on that rank) becomes one clear `ShmProtocolError` on every rank.
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.errors import UbepError
from ubep.runtime.shm.region import STATUS_ABORT
from ubep.validate import MOVABLE_DTYPES

#: dtype -> the code a rank publishes with its counts/hello
DTYPE_CODES: dict[torch.dtype, int] = {d: i for i, d in enumerate(MOVABLE_DTYPES)}


class ShmProtocolError(UbepError):
    """Peers disagree about a call (dtype), or a peer aborted it (bad input on that rank)."""


_VERBS = {"dispatch": "dispatches", "combine": "combines"}


def check_peers_meta(meta: np.ndarray, elem: int, rank: int, what: str, lo: int = 0,
                     hi: int | None = None) -> None:
    """Raise `ShmProtocolError` if a peer of [lo, hi) aborted or uses another dtype than
    code `elem`.

    `meta` `[world, 3]`: each peer's (token workers, dtype code, status).
    """
    ranks = range(lo, meta.shape[0] if hi is None else hi)
    aborted = [s for s in ranks if meta[s, 2] == STATUS_ABORT]
    if aborted:
        raise ShmProtocolError(f"rank {rank}: peer rank(s) {aborted} aborted the "
                               f"{what} (bad input on that rank, see its error)")
    wrong = [s for s in ranks if meta[s, 1] != elem]
    if wrong:
        names = {s: str(MOVABLE_DTYPES[int(meta[s, 1])]) for s in wrong}
        raise ShmProtocolError(
            f"rank {rank} {_VERBS.get(what, what)} {MOVABLE_DTYPES[elem]} rows but rank(s) "
            f"{names} use another dtype; every rank must pass the same dtype")


class SentinelAbort(ValueError):
    """sp: a row holds the sentinel. Raised after the peers were told to abort the call, so
    this rank is out of step with them (the Buffer is broken) although the cause is input."""


def sentinel_error(what: str, row: int) -> SentinelAbort:
    """sp: row `row` of argument `what` holds the sentinel and cannot be sent."""
    return SentinelAbort(
        f"{what} row {row} holds the sp sentinel pattern 0xFFF7FFF7FFF7FFF7 at a block "
        f"marker position; sync='sp' cannot send it (the receiver would wait forever): "
        f"use sync='tff'")


def dc_detail(batch: np.ndarray) -> str:
    """The timeout detail of a dc wait: the ranks whose checksum did not match (`batch` -1)."""
    bad = [s for s in range(batch.shape[0]) if batch[s] == -1]
    return f"dc checksum mismatch from rank(s) {bad}" if bad else ""
