"""The hybrid backend's choice between flat and hierarchical calls (`runtime.hybrid.modes`):
a pure function of what every rank knows alike, so every rank picks the same mode."""

from __future__ import annotations

from ubep.runtime.hybrid.modes import REPROBE, REPROBE_MOST, SAMPLES, ModePicker


def _steady(picker: ModePicker, costs: dict[bool, float], calls: int, start: int = 1):
    """Run `calls` calls of one large batch (bucket 8, per-peer bucket 7) where a flat call
    costs costs[True] and a hierarchical one costs[False]; the modes run, in order."""
    modes, flat = [], False
    for call in range(start, start + calls):
        modes.append(flat)
        flat = _call(picker, flat, costs[flat], call)
    return modes


def _call(picker: ModePicker, flat: bool, us: float, call: int) -> bool:
    """One call in the backend's order: the decision at the dispatch's end (a hierarchical
    call's header carrying the costs known when it started), the cost at the combine's."""
    if flat:
        nxt = picker.after_flat(7, False, call)
    else:
        nxt = picker.after_hier(8, False, *picker.shared(), call)
    picker.record(picker.bucket, flat, us)
    return nxt


def test_probes_flat_once_then_keeps_the_cheaper():
    """A new bucket: SAMPLES + 1 hierarchical calls (the last carries their cost), as many
    flat ones (a probe), one hierarchical call carrying the probe's cost, then the cheaper
    mode; the other mode runs once every REPROBE calls."""
    n = SAMPLES + 1
    explore = [False] * n + [True] * n + [False]
    fast_flat = _steady(ModePicker(), {True: 10.0, False: 30.0}, 3 * REPROBE)
    assert fast_flat[:2 * n + 2] == [*explore, True]
    assert sum(not f for f in fast_flat[2 * n + 2:]) <= 3  # re-measurements only
    slow_flat = _steady(ModePicker(), {True: 30.0, False: 10.0}, 3 * REPROBE)
    assert slow_flat[:2 * n + 2] == [*explore, False]
    assert 1 <= sum(slow_flat[2 * n + 2:]) <= 3


def test_small_batches_stay_flat_and_growth_goes_hierarchical():
    p = ModePicker()
    assert p.after_flat(1, True, 1)
    assert not p.after_flat(9, False, 2)        # grew past the threshold: measure it
    assert p.after_hier(3, True, 0, 0, 3)       # back to small


def test_a_chosen_flat_run_leaves_when_the_batch_changes():
    p = ModePicker()
    _steady(p, {True: 10.0, False: 30.0}, 2 * SAMPLES + 4)
    assert p.after_flat(7, False, 2 * SAMPLES + 5)
    assert not p.after_flat(9, False, 2 * SAMPLES + 6)     # per-peer count: another bucket


def test_a_probe_ends_even_where_the_per_peer_count_is_small():
    """A batch just past the threshold whose per-peer counts are below it: the flat probe
    still hands back to a hierarchical call, which carries its cost."""
    p = ModePicker()
    decided = [p.after_hier(5, False, 0, 100, call) for call in range(1, SAMPLES + 2)]
    assert decided == [False] * SAMPLES + [True]
    probe = [p.after_flat(3, True, SAMPLES + 1 + i) for i in range(1, SAMPLES + 2)]
    assert probe == [True] * SAMPLES + [False]


def test_a_chosen_flat_run_times_only_what_the_re_measurement_compares():
    """Where flat was chosen, only its last call before each re-measurement is timed (the
    cost that re-measurement carries); a small batch's flat calls never are."""
    p, flat, runs = ModePicker(), False, []
    for call in range(1, 4 * REPROBE):
        flat = _call(p, flat, 10.0 if flat else 12.0, call)
        runs.append((flat, flat and not p.untimed(call + 1)))      # the next call's
    explore = 2 * (SAMPLES + 1) + 1
    hier = [i for i in range(explore, len(runs)) if not runs[i][0]]
    assert len(hier) >= 2
    for i in range(explore, len(runs)):
        if runs[i][0]:
            left = min([h - i for h in hier if h > i], default=REPROBE)
            assert runs[i][1] == (left == 1), (i, runs)
    assert sum(f and not t for f, t in runs[explore:]) > len(runs) // 2        # most
    small = ModePicker()
    assert small.after_flat(1, True, 1) and small.untimed(2)


def _runs(modes: list[bool], family: bool) -> int:
    """How many runs of calls of `family` `modes` holds."""
    return sum(m == family and (i == 0 or modes[i - 1] != family) for i, m in enumerate(modes))


def test_a_choice_far_cheaper_is_re_measured_rarer():
    """Re-measurements run every REPROBE calls times the costs' rounded ratio (at most
    REPROBE_MOST): a probe of a mode 3x costlier costs the same share of the time as one
    of a mode 1.2x costlier would every REPROBE calls, about 2/3 / REPROBE."""
    calls = 10 * REPROBE
    n = 2 * (SAMPLES + 1) + 2
    for costs, every in (({True: 10.0, False: 12.0}, REPROBE),
                         ({True: 10.0, False: 30.0}, 3 * REPROBE),
                         ({True: 30.0, False: 10.0}, 3 * REPROBE),
                         ({True: 1.0, False: 1000.0}, REPROBE_MOST)):
        cheap = min(costs, key=costs.get)
        modes = _steady(ModePicker(), costs, calls)
        other = _runs(modes[n:], not cheap)
        assert (calls - n) // every - 1 <= other <= (calls - n) // every + 1, (costs, other)


def test_a_first_call_after_the_other_mode_does_not_keep_a_stale_choice():
    """A mode's first call after the other's costs more than its steady calls. Where the
    costs are close, a re-measurement measures past that call: when the chosen mode
    becomes the costlier, the ranks switch (one re-measurement late at most)."""
    for first in (False, True):                 # the family that starts out cheaper
        p, flat, prev, modes = ModePicker(), False, None, []
        for call in range(1, 8 * REPROBE):
            steady = {first: 10.0, not first: 11.0} if call < 3 * REPROBE else {
                first: 12.0, not first: 11.0}   # the load changed
            us = steady[flat] + (6.0 if prev is not None and prev != flat else 0.0)
            modes.append(flat)
            prev, flat = flat, _call(p, flat, us, call)
        assert modes[3 * REPROBE - 8:3 * REPROBE].count(first) >= 6, (first, modes)
        assert modes[-REPROBE:].count(not first) >= REPROBE - 4, (first, modes)
