"""The bounded store: ring order, bounded memory, eviction and window bounds."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.store import Store
from detectors.snapshot import Snapshot


def snap(now: float, **values: float) -> Snapshot:
    return Snapshot(now, values, {})


def test_latest_is_the_newest_point() -> None:
    store = Store(points_per_series=8, max_series=4)
    store.append(snap(1.0, a=10.0))
    store.append(snap(2.0, a=20.0))
    assert store.latest("a") == (2.0, 20.0)


def test_latest_of_unknown_series_is_none() -> None:
    assert Store(8, 4).latest("nope") is None


def test_window_after_wrap_around_is_chronological() -> None:
    store = Store(points_per_series=4, max_series=4)
    for t in range(10):
        store.append(snap(float(t), a=float(100 + t)))
    times, values = store.window("a", since=-np.inf)
    np.testing.assert_array_equal(times, [6.0, 7.0, 8.0, 9.0])
    np.testing.assert_array_equal(values, [106.0, 107.0, 108.0, 109.0])


def test_window_before_filling_holds_only_written_points() -> None:
    store = Store(points_per_series=10, max_series=4)
    store.append(snap(1.0, a=1.0))
    store.append(snap(2.0, a=2.0))
    times, _ = store.window("a", since=0.0)
    np.testing.assert_array_equal(times, [1.0, 2.0])


def test_window_since_is_inclusive() -> None:
    store = Store(points_per_series=10, max_series=4)
    for t in range(5):
        store.append(snap(float(t), a=float(t)))
    times, values = store.window("a", since=2.0)
    np.testing.assert_array_equal(times, [2.0, 3.0, 4.0])
    np.testing.assert_array_equal(values, [2.0, 3.0, 4.0])


def test_window_since_after_last_point_is_empty() -> None:
    store = Store(points_per_series=10, max_series=4)
    store.append(snap(1.0, a=1.0))
    times, values = store.window("a", since=1.5)
    assert times.size == 0 and values.size == 0


def test_window_of_unknown_series_is_empty() -> None:
    times, values = Store(10, 4).window("nope", since=0.0)
    assert times.shape == (0,) and values.shape == (0,)


def test_window_returns_copies() -> None:
    store = Store(points_per_series=4, max_series=4)
    for t in range(6):  # wrapped and not-wrapped paths both copy
        store.append(snap(float(t), a=float(t)))
        _, values = store.window("a", since=0.0)
        values[:] = -1.0
    assert store.latest("a") == (5.0, 5.0)
    assert store.window("a", since=0.0)[1].min() >= 0.0


def test_series_missing_from_a_snapshot_gets_no_point() -> None:
    store = Store(points_per_series=10, max_series=4)
    store.append(snap(1.0, a=1.0, b=1.0))
    store.append(snap(2.0, a=2.0))
    store.append(snap(3.0, a=3.0, b=3.0))
    np.testing.assert_array_equal(store.window("b", since=0.0)[0], [1.0, 3.0])


def test_memory_is_constant_after_many_appends() -> None:
    store = Store(points_per_series=50, max_series=64)
    values = {f"s{i}": float(i) for i in range(40)}
    store.append(Snapshot(0.0, values, {}))
    before = store.nbytes
    for t in range(1, 5_000):
        store.append(Snapshot(float(t), values, {}))
    assert store.nbytes == before
    assert len(store) == 40
    assert store.window("s7", since=0.0)[0].size == 50


def test_memory_never_exceeds_max_series_rows() -> None:
    store = Store(points_per_series=10, max_series=100)
    for t in range(300):  # 300 distinct names churn through 100 rows
        store.append(snap(float(t), **{f"n{t}": 1.0}))
    assert store.nbytes == 100 * 10 * 8 * 2 + 100 * 8 * 3  # two float64 slabs + three int64 vectors
    assert len(store) == 100


def test_new_series_evicts_the_least_recently_updated() -> None:
    store = Store(points_per_series=4, max_series=2)
    store.append(snap(1.0, a=1.0, b=1.0))
    store.append(snap(2.0, a=2.0))  # b is now the stalest
    store.append(snap(3.0, c=3.0))
    assert store.names() == ["a", "c"]
    assert store.evictions == 1


def test_evicted_row_starts_empty_for_its_new_series() -> None:
    store = Store(points_per_series=4, max_series=1)
    for t in range(3):
        store.append(snap(float(t), a=float(t)))
    store.append(snap(10.0, b=7.0))
    times, values = store.window("b", since=-np.inf)
    np.testing.assert_array_equal(times, [10.0])
    np.testing.assert_array_equal(values, [7.0])
    assert "a" not in store


def test_snapshot_wider_than_max_series_drops_the_excess() -> None:
    store = Store(points_per_series=4, max_series=3)
    store.append(snap(1.0, a=1.0, b=2.0, c=3.0, d=4.0, e=5.0))
    assert len(store) == 3
    assert store.dropped_values == 2
    assert store.evictions == 0


def test_history_survives_growth_of_the_slabs() -> None:
    store = Store(points_per_series=5, max_series=1000)
    store.append(snap(1.0, first=42.0))
    store.append(Snapshot(2.0, {f"s{i}": float(i) for i in range(500)}, {}))
    assert store.latest("first") == (1.0, 42.0)
    assert store.latest("s499") == (2.0, 499.0)


def test_non_finite_time_is_rejected() -> None:
    with pytest.raises(ValueError, match="finite"):
        Store(4, 4).append(snap(float("nan"), a=1.0))


def test_sizes_below_one_are_rejected() -> None:
    with pytest.raises(ValueError, match="points_per_series"):
        Store(0, 4)


@settings(max_examples=60, deadline=None)
@given(
    points=st.integers(1, 6),
    ticks=st.lists(st.dictionaries(st.sampled_from("abcd"), st.floats(-1e6, 1e6), max_size=4), max_size=30),
)
def test_matches_a_deque_per_series(points: int, ticks: list[dict[str, float]]) -> None:
    """With room for every name, the store is exactly a bounded deque of (time, value) per series."""
    store = Store(points_per_series=points, max_series=4)
    model: dict[str, deque[tuple[float, float]]] = {}
    for t, values in enumerate(ticks):
        store.append(Snapshot(float(t), values, {}))
        for name, value in values.items():
            model.setdefault(name, deque(maxlen=points)).append((float(t), value))
    assert store.names() == sorted(model)
    for name, expected in model.items():
        times, values = store.window(name, since=-np.inf)
        assert list(zip(times.tolist(), values.tolist(), strict=True)) == list(expected)


def test_a_repeated_set_of_names_lands_in_the_same_rows() -> None:
    store = Store(points_per_series=4, max_series=8)
    for t in range(3):
        store.append(snap(float(t), a=float(t), b=10.0 + t))
    assert store.latest("a") == (2.0, 2.0) and store.latest("b") == (2.0, 12.0)
    np.testing.assert_array_equal(store.window("b", -np.inf)[1], [10.0, 11.0, 12.0])


def test_rows_reused_for_a_repeated_snapshot_follow_an_eviction_in_between() -> None:
    store = Store(points_per_series=4, max_series=2)
    store.append(snap(1.0, a=1.0, b=2.0))
    store.append(snap(2.0, a=3.0, b=4.0))  # same names: rows reused
    store.append(snap(3.0, c=5.0))  # evicts a (least recently updated, lowest row)
    store.append(snap(4.0, a=6.0, b=7.0))  # same names as before the eviction: must not reuse stale rows
    assert store.latest("a") == (4.0, 6.0)
    assert store.latest("b") == (4.0, 7.0)
    assert "c" not in store
    np.testing.assert_array_equal(store.window("a", -np.inf)[1], [6.0])
