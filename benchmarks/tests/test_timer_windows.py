"""The host's timer windows: found where gaps bunch in the period, and calls across them."""

import numpy as np
import pytest

from benchmarks.probes import GapLog, clear_of_windows, clock_gaps
from benchmarks.timer_windows import PERIOD_NS, TimerWindows, find_windows, overlaps


def _gaps(rng, n_bunched, phases_us, n_scattered, periods=5000):
    """Gap starts: `n_bunched` at `phases_us` (+- 10 µs) of random periods, the rest anywhere."""
    at = rng.integers(0, periods, n_bunched) * PERIOD_NS
    at += rng.choice(np.asarray(phases_us) * 1000, n_bunched) + rng.integers(-10_000, 10_000,
                                                                              n_bunched)
    return np.concatenate([at, rng.integers(0, periods * PERIOD_NS, n_scattered)]) + 7 * 10**12


def test_windows_are_the_phases_where_gaps_bunch():
    rng = np.random.default_rng(0)
    w = find_windows(_gaps(rng, 600, [725, 975], 300))
    assert w is not None and w.gaps == 900
    # 725 +- 10 µs lies in the 700-750 bin; 975 +- 10 in 950-1000 (+ 0-50 after the wrap
    # only if the jitter crosses it: it does not here)
    assert w.spans == ((700_000, 750_000), (950_000, 1_000_000))
    assert w.share_of_time == pytest.approx(0.1)
    assert 0.65 < w.share_of_gaps < 0.75               # the bunched 2/3 and ~1/10 of the rest
    # adjacent crowded bins merge into one span
    w2 = find_windows(_gaps(rng, 600, [745, 755], 100))
    assert w2.spans == ((700_000, 800_000),)


def test_no_windows_where_gaps_fall_anywhere_or_are_too_few():
    rng = np.random.default_rng(1)
    assert find_windows(rng.integers(0, 10**10, 2000)) is None
    assert find_windows(_gaps(rng, 30, [500], 0)) is None          # fewer than MIN_GAPS
    with pytest.raises(ValueError, match="bin_ns=300 must divide period_ns"):
        find_windows([1, 2, 3], bin_ns=300)


def test_an_interval_overlaps_a_window_of_any_period():
    w = TimerWindows(spans=((700_000, 750_000),), period_ns=PERIOD_NS, share_of_gaps=0.5,
                     share_of_time=0.05, gaps=100)
    base = 42 * PERIOD_NS
    lo = np.array([base + 600_000, base + 690_000, base + 749_000, base + 750_000,
                   base + 900_000, base + 900_000, base, base + 100_000])
    hi = np.array([base + 650_000, base + 700_000, base + 760_000, base + 800_000,
                   base + PERIOD_NS + 710_000, base + PERIOD_NS + 650_000,
                   base + PERIOD_NS, base + 100_000])
    assert overlaps(lo, hi, w).tolist() == [False, True, True, False, True, False, True, False]
    with pytest.raises(ValueError, match="hi_ns >= lo_ns"):
        overlaps([5], [4], w)


def test_clear_calls_summary():
    t = np.array([10.0, 11.0, 12.0, 90.0])
    got = clear_of_windows(t, np.array([False, False, False, True]))
    assert got == {"clear_share": 0.75, "clear_median_us": 11.0,
                   "clear_p99_us": pytest.approx(np.percentile([10.0, 11.0, 12.0], 99))}
    assert clear_of_windows(t, None)["clear_p99_us"] is None
    assert clear_of_windows(t, np.ones(4, bool))["clear_share"] is None


def test_clock_gaps_logs_each_gaps_start_and_length():
    log = GapLog()
    gaps = clock_gaps(0.05, min_us=0.0, log=log)           # every clock step counts
    clock_gaps(0.01, min_us=0.0, log=log)
    (first, last, starts, lengths), second = log.probes
    assert len(starts) == len(gaps) > 0 and lengths.tolist() == gaps
    assert (np.diff(starts) > 0).all() and first <= starts[0] and starts[-1] < last
    assert second[0] >= last                                # probes in the order taken
    assert log.starts.size == len(starts) + len(second[2])
