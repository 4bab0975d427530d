"""Histograms with vLLM's bucket boundaries."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.stats import TTFT_BUCKETS, Histogram, buckets_1_2_5


def test_value_on_a_bound_falls_in_that_bucket() -> None:
    hist = Histogram((0.1, 0.5))
    hist.observe(0.1)
    assert hist.cumulative() == [("0.1", 1.0), ("0.5", 1.0), ("+Inf", 1.0)]


def test_observe_many_equals_repeated_observe() -> None:
    values = np.array([0.0005, 0.01, 0.3, 7.0, 5000.0])
    one, many = Histogram(TTFT_BUCKETS), Histogram(TTFT_BUCKETS)
    for v in values:
        one.observe(float(v), 3)
    many.observe_many(values, 3)
    assert np.array_equal(one.counts, many.counts)
    assert one.sum == pytest.approx(many.sum) and one.count == many.count == 15


def test_1_2_5_buckets_stop_at_the_context_length() -> None:
    assert buckets_1_2_5(4096)[:4] == (1.0, 2.0, 5.0, 10.0)
    assert buckets_1_2_5(4096)[-1] == 2000.0
    assert buckets_1_2_5(8192)[-1] == 5000.0


def test_quantile_is_the_bucket_upper_bound() -> None:
    hist = Histogram((1.0, 2.0, 4.0))
    for v in (0.5, 1.5, 3.0, 3.5):
        hist.observe(v)
    assert hist.quantile(0.5) == 2.0
    assert hist.quantile(0.99) == 4.0


def test_buffered_values_count_like_observe_many_when_read() -> None:
    values = [0.0005, 0.01, 0.3, 7.0, 5000.0, 0.01]
    direct, buffered = Histogram(TTFT_BUCKETS), Histogram(TTFT_BUCKETS)
    direct.observe_many(np.array(values))
    buffered.observe_list(values[:2])
    buffered.observe_list(values[2:])
    assert np.array_equal(direct.counts, buffered.counts)
    assert buffered.sum == pytest.approx(direct.sum) and buffered.count == direct.count == 6


def test_the_buffer_is_counted_once_it_is_full() -> None:
    hist = Histogram((1.0,))
    hist.observe_list([0.5] * (Histogram.FLUSH_AT - 1))
    assert len(hist._pending) == Histogram.FLUSH_AT - 1
    hist.observe_list([2.0])
    assert hist._pending == [] and hist._counts.tolist() == [Histogram.FLUSH_AT - 1, 1]
