"""Quaternary search: which expert holds send number `target` of a concatenated send list.

A worker that owns the slice starting at position `target` of the sends concatenated in
expert order must find the expert (and the offset inside it) where the slice starts. With
`prefix[i]` = sends of experts `0..i` (inclusive prefix sums), the answer is the first `i`
with `prefix[i] > target`, the same as `np.searchsorted(prefix, target, side="right")`.

The paper's search tests three pivots per step (on a vector core one vectorized compare
evaluates all three) and keeps the quarter of the window that holds the target, so it
takes about log4(E) steps. The window `(L, R)` keeps `prefix[L] <= target < prefix[R]`
(with `prefix[-1] = 0` and `prefix[E] = +inf`); it stops when `R - L <= 1`, the point where
the paper's printed loop would spin forever.
"""

from __future__ import annotations

import numpy as np


def _pivots(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Three pivots strictly inside each window `(lo, hi)` (hi - lo >= 2), at its quarters."""
    gap = hi - lo
    quarters = -((-gap[..., None] * np.array([1, 2, 3])) // 4)  # ceil(k * gap / 4)
    return lo[..., None] + np.clip(quarters, 1, gap[..., None] - 1)


def quaternary_search(prefix: np.ndarray, target: int) -> tuple[int, int]:
    """`(index, steps)`: the first `index` with `prefix[index] > target`, and the steps taken.

    Arguments:
        prefix: `[E]`, non-decreasing ints; inclusive prefix sums of per-expert send counts.
        target: a send position, `>= 0`; `target >= prefix[-1]` gives `E` (past the end).

    Returns:
        The expert index (as `np.searchsorted(prefix, target, side="right")`) and the number
        of three-pivot steps, at most `ceil(log4(E + 1))`.
    """
    index, steps = quaternary_search_many(np.asarray(prefix), np.asarray([target]))
    return int(index[0]), int(steps)


def quaternary_search_many(prefix: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, int]:
    """`quaternary_search` for many targets at once (the workers search in parallel).

    Returns `(index [len(targets)] int64, steps)`, steps being the largest any target took.
    """
    prefix = np.asarray(prefix, dtype=np.int64)
    targets = np.asarray(targets, dtype=np.int64)
    if prefix.ndim != 1:
        raise ValueError(f"prefix must be 1-D, got shape {tuple(prefix.shape)}")
    if targets.size and targets.min() < 0:
        raise ValueError(f"targets must be >= 0, got {int(targets.min())}")
    e = prefix.shape[0]
    # sentinel ends: position 0 is prefix[-1] = 0 (never > target), position e+1 is +inf
    ext = np.empty(e + 2, dtype=np.int64)
    ext[0], ext[1:-1], ext[-1] = -1, prefix, np.iinfo(np.int64).max
    lo = np.zeros(targets.shape, dtype=np.int64)          # index into ext: L + 1
    hi = np.full(targets.shape, e + 1, dtype=np.int64)     # R + 1
    steps = 0
    while True:
        active = hi - lo > 1
        if not active.any():
            break
        steps += 1
        a_lo, a_hi, a_t = lo[active], hi[active], targets[active]
        piv = _pivots(a_lo, a_hi)                                  # [m, 3]
        below = (ext[piv] <= a_t[:, None]).sum(axis=1)             # one compare, 3 pivots
        # pivots with prefix <= target form a prefix of the three (prefix is monotone)
        bounds = np.concatenate([a_lo[:, None], piv, a_hi[:, None]], axis=1)
        rows = np.arange(bounds.shape[0])
        lo[active] = bounds[rows, below]
        hi[active] = bounds[rows, below + 1]
    return hi - 1, steps
