"""What the two-copy paths do for a rank that became inactive (`Buffer(elastic=True)`).

The one-worker and pool paths (`staged/`, `pool/`) wait, in their own region, for a count
slot (dispatch) and a hello (combine) from every source, then for each source's rows. For an
inactive source:

* its count slot and hello are written by the receiver itself, empty (`proxy_*`), unless the
  source wrote them for this call before it died: no rows are then expected from it;
* if it wrote its counts and died before all its rows arrived, all its rows are dropped
  (`drop_partial`), never some: the wait stops counting them, and the backend leaves them
  out of the result (`ubep.elastic.without_sources`);
* in combine, tokens stop waiting for its rows (the routing without it), and at the end every
  token with a slot on it is summed again without it (`tokens_on`): a token summed before
  the death was found may hold one of its rows, and no token may keep one.
"""

from __future__ import annotations

import numpy as np

from ubep.runtime.shm.context import ShmContext
from ubep.runtime.shm.kernels import members as KM


def inactive_ranks(ctx: ShmContext) -> np.ndarray:
    """The inactive ranks as an int64 array (empty outside elastic Buffers)."""
    if ctx.members is None:
        return np.zeros(0, np.int64)
    return np.asarray(ctx.members.members.inactive, np.int64)


def proxy_counts(ctx: ShmContext, epoch: int, elem: int) -> None:
    """Empty count slots of `epoch` in my region for the inactive sources that wrote none."""
    ranks = inactive_ranks(ctx)
    if ranks.size:
        KM.proxy_counts(ctx.bases, ctx.lay, ctx.rank, epoch, ranks,
                        np.zeros(ctx.config.num_experts, np.int64), elem)


def proxy_hellos(ctx: ShmContext, epoch: int, elem: int) -> None:
    """Combine hellos of `epoch` in my region for the inactive ranks that wrote none."""
    ranks = inactive_ranks(ctx)
    if ranks.size:
        KM.proxy_hellos(ctx.bases, ctx.lay, ctx.rank, epoch, ranks, elem)


def drop_partial(ctx: ShmContext, counts: np.ndarray, done: np.ndarray,
                 dropped: list[int]) -> None:
    """Dispatch's rows: an inactive source whose rows (source-major, `counts` `[world, E/P]`,
    `done` flags) have not all arrived is dropped whole: its rows are marked done, so no wait
    is for them, and it joins `dropped`."""
    rows = counts.sum(1)
    ends = np.cumsum(rows)
    for r in inactive_ranks(ctx).tolist():
        if r in dropped or rows[r] == 0:
            continue
        seg = done[ends[r] - rows[r]:ends[r]]
        if not seg.all():
            dropped.append(r)
            seg[:] = 1


def mark_dropped(ints: np.ndarray, counts: np.ndarray, out_start: np.ndarray,
                 dropped: list[int]) -> None:
    """The origins of the dropped sources' rows (the output rows their counts reserved,
    some never written): source rank, token 0, slot 0, so nothing reads them as another's."""
    for r in dropped:
        for e in range(counts.shape[1]):
            o, n = int(out_start[r, e]), int(counts[r, e])
            ints[0, o:o + n] = r
            ints[1:, o:o + n] = 0


def tokens_on(idx: np.ndarray, ranks: list[int], experts_per_rank: int) -> np.ndarray:
    """The tokens of routing `idx` `[T, K]` with a slot on one of `ranks`."""
    on = np.isin(np.where(idx >= 0, idx // experts_per_rank, -1), ranks)
    return np.flatnonzero(on.any(1))
