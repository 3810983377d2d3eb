"""Quaternary search: agrees with searchsorted, three pivots a step, ~log4(E) steps."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep.plan.schedule import quaternary_search
from ubep.plan.search import quaternary_search_many


def step_bound(num_experts: int) -> int:
    """ceil(log4 E) + 1, in integers."""
    s = 0
    while 4 ** s < num_experts:
        s += 1
    return s + 1


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=600), data=st.data())
def test_agrees_with_searchsorted_within_the_step_bound(counts, data):
    prefix = np.cumsum(counts)
    target = data.draw(st.integers(0, int(prefix[-1]) + 2))
    index, steps = quaternary_search(prefix, target)
    assert index == np.searchsorted(prefix, target, side="right")
    assert steps <= step_bound(len(counts))
    if target < prefix[-1]:
        assert counts[index] > 0  # the expert that holds the send, never an empty one


def test_256_experts_take_at_most_five_steps():
    rng = np.random.default_rng(0)
    prefix = np.cumsum(rng.integers(0, 9, size=256))
    targets = np.arange(prefix[-1])
    index, steps = quaternary_search_many(prefix, targets)
    assert (index == np.searchsorted(prefix, targets, side="right")).all()
    assert steps <= 5


def test_terminates_when_the_window_holds_one_expert():
    # the paper's printed loop spins forever at R - L = 1; ours stops
    assert quaternary_search(np.array([5]), 0) == (0, 1)
    index, steps = quaternary_search(np.array([0, 0, 3]), 2)
    assert index == 2 and 1 <= steps <= step_bound(3)
    assert quaternary_search(np.array([3, 3, 3]), 3)[0] == 3
