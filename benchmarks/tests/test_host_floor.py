"""The host's floor under a tail: calls that never vary, replayed over the gaps it took."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.host_floor import MIN_CALLS, replay, tail_ratio


def _probe(first, last, gaps):
    """One rank's probe: `gaps` as (start, length) pairs."""
    starts = np.array([g[0] for g in gaps], np.int64)
    return (first, last, starts, np.array([g[1] for g in gaps], np.int64))


def test_without_gaps_every_call_takes_its_work():
    d = replay(10, [[_probe(0, 105, []), _probe(0, 105, [])]])
    assert d.tolist() == [10] * 10


def test_a_gap_lengthens_the_call_it_falls_in_and_only_that():
    # rank 1 is away 25-40: the call of 20-30 finishes 15 later; the next starts at 45
    d = replay(10, [[_probe(0, 100, []), _probe(0, 100, [(25, 15)])]])
    assert d.tolist() == [10, 10, 25, 10, 10, 10, 10, 10]


def test_each_core_waits_out_its_own_gaps_only():
    # both ranks away in the same call: the call ends with the later core (max, not sum)
    d = replay(20, [[_probe(0, 100, [(5, 10)]), _probe(0, 100, [(8, 30)])]])
    assert d[0] == 50
    # a core away when a call starts (gap begun before the window) starts late
    d = replay(10, [[_probe(0, 50, [(-5, 12)]), _probe(0, 50, [])]])
    assert d.tolist() == [17, 10, 10, 10]


def test_calls_run_where_every_rank_probed_and_probes_add_up():
    one = [_probe(0, 60, []), _probe(15, 100, [])]            # common window 15-60
    two = [_probe(1000, 1031, []), _probe(1000, 1040, [])]
    assert replay(10, [one]).size == 4
    assert replay(10, [one, two]).size == 7
    with pytest.raises(ValueError, match="work_ns=0 must be > 0"):
        replay(0, [one])


def _brute(work, t1, per_core):
    """Unit steps: a core progresses one unit a step unless away; a call ends when every
    core has `work` units of it."""
    away = [np.zeros(t1 + 1, bool) for _ in per_core]
    for a, gaps in zip(away, per_core):
        for s, n in gaps:
            a[max(s, 0):max(s + n, 0)] = True
    out, t = [], 0
    while True:
        ends = []
        for a in away:
            got, u = 0, t
            while got < work and u < t1:
                got += not a[u]
                u += 1
            if got < work:
                return out
            ends.append(u)
        out.append(max(ends) - t)
        t = max(ends)


_gaps = st.lists(st.tuples(st.integers(0, 13), st.integers(1, 6)), max_size=25).map(
    lambda gs: [(20 * i + s, n) for i, (s, n) in enumerate(gs)])   # one per 20 units, apart


@settings(max_examples=150, deadline=None)
@given(work=st.integers(1, 40), g0=_gaps, g1=_gaps)
def test_replay_matches_stepping_every_core_unit_by_unit(work, g0, g1):
    t1 = 520
    d = replay(work, [[_probe(0, t1, g0), _probe(0, t1, g1)]])
    assert d.tolist() == _brute(work, t1, [g0, g1])


def test_tail_ratio_needs_enough_calls_and_reads_the_replay():
    # a 40 µs gap every 100 µs: of each 100 µs, six 10 µs calls, one of them hit (50 µs)
    probes = [[_probe(0, 20_000_000, [(k * 100_000 + 55_000, 40_000) for k in range(200)])]]
    d = replay(10_000, probes)
    assert d.size == 1200 and (d == 50_000).sum() == 200
    assert tail_ratio(10.0, probes) == 5.0 and tail_ratio(10.0, probes, q=50) == 1.0
    assert tail_ratio(20.0, probes) is None                   # 800 calls < MIN_CALLS
    assert MIN_CALLS == 1000
