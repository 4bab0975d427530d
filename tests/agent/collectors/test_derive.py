"""derive: counter rates with resets and gaps, windowed histogram quantiles, window means, pruning."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.collectors.derive import (
    CounterRate,
    Trackers,
    WindowedHistogram,
    WindowedIncrease,
    WindowedMean,
    bucket_quantile,
)

INF = math.inf
BOUNDS = (0.1, 0.5, 1.0, INF)


def _q(q: float, bounds: tuple[float, ...], counts: list[float]) -> float | None:
    return bucket_quantile(q, np.asarray(bounds), np.asarray(counts, dtype=float))


def test_quantile_interpolates_inside_the_bucket() -> None:
    # 10 in (0, 0.1], 10 in (0.1, 0.5]: the median is the top of the first bucket, p75 halfway up the second
    assert _q(0.5, BOUNDS, [10, 20, 20, 20]) == pytest.approx(0.1)
    assert _q(0.75, BOUNDS, [10, 20, 20, 20]) == pytest.approx(0.3)


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    assert _q(0.99, BOUNDS, [0, 0, 1, 10]) == 1.0


def test_quantile_without_observations_is_none() -> None:
    assert _q(0.5, BOUNDS, [0, 0, 0, 0]) is None


@given(st.lists(st.integers(min_value=0, max_value=1000), min_size=4, max_size=4))
def test_quantiles_are_ordered_and_within_the_finite_bounds(increments: list[int]) -> None:
    counts = np.cumsum(increments).astype(float)
    values = [_q(q, BOUNDS, list(counts)) for q in (0.5, 0.95, 0.99)]
    if counts[-1] == 0 or counts[-2] == 0:
        return  # nothing observed, or everything above the last finite bound
    assert all(v is not None for v in values)
    assert values == sorted(values)
    assert all(0.0 <= v <= 1.0 for v in values if v is not None)


def test_rate_needs_two_samples() -> None:
    rate = CounterRate(max_gap_s=60)
    assert rate.update(100.0, now=0.0) is None
    assert rate.update(130.0, now=2.0) == 15.0


def test_counter_reset_gives_the_new_value_over_the_interval_not_a_negative_rate() -> None:
    rate = CounterRate(max_gap_s=60)
    rate.update(1000.0, now=0.0)
    assert rate.update(40.0, now=4.0) == 10.0
    assert rate.update(60.0, now=5.0) == 20.0  # and it continues from the new value


def test_rate_after_a_stale_gap_restarts_instead_of_averaging_the_outage() -> None:
    rate = CounterRate(max_gap_s=10)
    rate.update(0.0, now=0.0)
    assert rate.update(500.0, now=100.0) is None
    assert rate.update(510.0, now=101.0) == 10.0


def test_repeated_tick_reports_nothing_and_keeps_the_first_base() -> None:
    rate = CounterRate(max_gap_s=60)
    rate.update(0.0, now=0.0)
    assert rate.update(50.0, now=0.0) is None
    assert rate.update(20.0, now=2.0) == 10.0


def test_clock_going_backwards_restarts_the_rate() -> None:
    rate = CounterRate(max_gap_s=60)
    rate.update(10.0, now=10.0)
    assert rate.update(20.0, now=5.0) is None
    assert rate.update(30.0, now=6.0) == 10.0


def test_histogram_needs_two_snapshots() -> None:
    hist = WindowedHistogram(window_s=60)
    assert hist.update(BOUNDS, [5, 5, 5, 5], 0.25, now=0.0) is None
    stats = hist.update(BOUNDS, [5, 15, 15, 15], 3.25, now=1.0)
    assert stats is not None and stats.count == 10.0
    assert stats.mean == pytest.approx(0.3)


def test_histogram_window_forgets_observations_older_than_the_window() -> None:
    hist = WindowedHistogram(window_s=10)
    hist.update(BOUNDS, [0, 0, 0, 0], 0.0, now=0.0)
    hist.update(BOUNDS, [0, 0, 0, 100], 500.0, now=5.0)  # 100 slow requests early on
    hist.update(BOUNDS, [0, 0, 0, 100], 500.0, now=10.0)
    stats = hist.update(BOUNDS, [50, 50, 50, 150], 502.5, now=20.0)  # then 50 fast ones
    assert stats is not None and stats.count == 50.0
    assert stats.quantiles[0.99] <= 0.1
    assert stats.window_s == 10.0


def test_histogram_without_new_observations_gives_nothing() -> None:
    hist = WindowedHistogram(window_s=60)
    hist.update(BOUNDS, [1, 2, 3, 4], 1.0, now=0.0)
    assert hist.update(BOUNDS, [1, 2, 3, 4], 1.0, now=1.0) is None


def test_histogram_reset_counts_observations_since_the_restart() -> None:
    hist = WindowedHistogram(window_s=60)
    hist.update(BOUNDS, [100, 200, 300, 400], 99.0, now=0.0)
    stats = hist.update(BOUNDS, [2, 4, 4, 4], 1.0, now=1.0)
    assert stats is not None and stats.count == 4.0 and stats.mean == pytest.approx(0.25)


def test_histogram_bucket_change_restarts_the_window() -> None:
    hist = WindowedHistogram(window_s=60)
    hist.update(BOUNDS, [1, 2, 3, 4], 1.0, now=0.0)
    assert hist.update((0.2, INF), [5, 9], 2.0, now=1.0) is None
    assert hist.update((0.2, INF), [6, 10], 2.1, now=2.0) is not None


def test_histogram_without_inf_bucket_gives_no_quantiles() -> None:
    hist = WindowedHistogram(window_s=60)
    hist.update((0.1, 0.5), [1, 2], None, now=0.0)
    assert hist.update((0.1, 0.5), [3, 9], None, now=1.0) is None


def test_histogram_after_a_stale_gap_restarts() -> None:
    hist = WindowedHistogram(window_s=10)
    hist.update(BOUNDS, [0, 0, 0, 0], 0.0, now=0.0)
    assert hist.update(BOUNDS, [9, 9, 9, 9], 0.5, now=100.0) is None


def test_increase_spans_what_a_histogram_updated_on_the_same_scrapes_spans() -> None:
    """The per-token reading divides a histogram's window by a counter's: both must cover one span, through
    the window's slide, a reset and a stale gap alike."""
    counter, histogram = WindowedIncrease(window_s=10.0), WindowedHistogram(window_s=10.0)
    samples = [(0.0, 0.0), (4.0, 40.0), (8.0, 80.0), (12.0, 120.0), (16.0, 30.0), (40.0, 50.0), (44.0, 90.0)]
    spans = []
    for now, value in samples:
        increase = counter.update(value, now)
        stats = histogram.update(BOUNDS, [value, value, value, value], value, now)
        assert (increase is None) == (stats is None)
        if increase is not None and stats is not None:
            assert increase[0] == stats.window_s
            assert increase[1] == stats.count  # buckets and counter count alike here
            spans.append(increase)
    # the base is the newest sample at or before now - 10 (0 for 12), the reset at 16 counts its 30 from
    # the sample before (12), and the gap from 16 to 40 restarts
    assert spans == [(4.0, 40.0), (8.0, 80.0), (12.0, 120.0), (4.0, 30.0), (4.0, 40.0)]
    assert counter.update(90.0, 44.0) is None  # a repeated tick


def test_window_mean_averages_samples_inside_the_window() -> None:
    mean = WindowedMean(window_s=10)
    assert mean.update(100.0, now=0.0) == 100.0
    mean.update(2.0, now=5.0)
    assert mean.update(4.0, now=12.0) == 3.0  # the sample at t=0 left the window


def test_trackers_forget_signals_not_seen_within_the_stale_limit() -> None:
    trackers = Trackers(window_s=10)
    trackers.rate("engine.x", 1.0, now=0.0)
    trackers.rate("engine.y", 1.0, now=0.0)
    trackers.rate("engine.y", 2.0, now=15.0)
    trackers.prune(now=15.0)
    assert set(trackers.rates_) == {"engine.y"}
