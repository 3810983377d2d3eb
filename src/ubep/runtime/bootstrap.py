"""The constructor's exchanges between ranks: bounded by `timeout_s`, checked for agreement.

`exchange` is `all_gather_object` that waits at most `timeout_s` for the slowest rank (a
gloo monitored barrier first: it names the ranks that did not come), so a rank that never
builds its Buffer is a `PeerTimeoutError` instead of a wait as long as the process group's
timeout. `agree` compares the fields every rank must share and raises the same `ValueError`
on every rank, naming each differing field and every rank's value.
"""

from __future__ import annotations

import re
from datetime import timedelta

import torch.distributed as dist

from ubep.errors import PeerTimeoutError

_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def _bounded_barrier(group, rank: int, world: int, timeout_s: float, phase: str) -> None:
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return
    if "gloo" not in backend:
        return                      # no monitored barrier: the group's own timeout applies
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
    except RuntimeError as e:
        m = _MISSING.search(str(e))
        if m:
            peers = sorted({int(p) for p in re.findall(r"\d+", m.group(1))})
        else:           # ranks other than 0 wait for rank 0 to see everyone arrive
            peers = [0] if rank != 0 else []
        raise PeerTimeoutError(rank, phase, peers, timeout_s,
                               "a rank did not reach the Buffer's constructor in time "
                               f"({str(e).splitlines()[0][:200]})") from None


def exchange(obj, group, *, rank: int, world: int, timeout_s: float, phase: str) -> list:
    """Every rank's `obj`, by rank; waits at most `timeout_s` for the other ranks."""
    if world == 1:
        return [obj]
    _bounded_barrier(group, rank, world, timeout_s, phase)
    out: list = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def disagreements(values: list[dict]) -> str:
    """'' if every rank's dict is equal, else one line per differing field with all values."""
    lines = []
    for key in values[0]:
        seen = [v.get(key) for v in values]
        if any(s != seen[0] for s in seen):
            by_rank = ", ".join(f"rank {r}: {s!r}" for r, s in enumerate(seen))
            lines.append(f"{key} ({by_rank})")
    return "; ".join(lines)


def agree(fields: dict, group, *, rank: int, world: int, timeout_s: float,
          what: str = "Buffer") -> None:
    """Raise ValueError on every rank unless all ranks passed the same `fields`."""
    values = exchange(fields, group, rank=rank, world=world, timeout_s=timeout_s,
                      phase=f"{what}()/agree")
    diff = disagreements(values)
    if diff:
        raise ValueError(f"{what} arguments differ between ranks; every rank of the group must "
                         f"pass the same values: {diff}")
