import math
from dataclasses import dataclass

import pytest

from policies.base import Proposal
from policies.windows import Hysteresis, Windowed, rolling_sum, smoothed, window_totals
from tests.policies.conftest import make_snapshot


@dataclass(frozen=True)
class Counter:
    """Proposes the number of times it was asked."""

    name: str = "counter"

    def decide(self, snapshot, findings, state, now):
        n = (state or 0) + 1
        return n, [Proposal(self.name, "k", float(n), "count")]


def test_windowed_asks_the_inner_policy_once_per_window():
    policy, state = Windowed(Counter(), window_s=10.0), None
    for t in range(25):
        state, proposals = policy.decide(make_snapshot(float(t)), [], state, float(t))
    assert proposals[0].value == 3.0


def test_hysteresis_drops_small_relative_changes():
    policy, state = Hysteresis(Counter(), band=0.5), None
    passed = []
    for t in range(4):
        state, proposals = policy.decide(make_snapshot(float(t)), [], state, float(t))
        passed += [p.value for p in proposals]
    assert passed == [1.0, 2.0, 4.0]


def test_rolling_sum_drops_old_buckets():
    buckets = ()
    for t in range(0, 600, 10):
        buckets = rolling_sum(buckets, float(t), 60.0, 120.0, 1.0, 0.0)
    assert [key for key, _, _ in buckets] == [7, 8, 9]


def test_window_totals_respects_since():
    buckets = ((0, 5.0, 5.0), (1, 3.0, 0.0), (2, 2.0, 1.0))
    assert window_totals(buckets, 150.0, 60.0, 300.0, since=60.0) == (5.0, 1.0)


def test_smoothed_starts_the_clock_then_follows_with_its_time_constant():
    assert smoothed(0.0, None, 10.0, 50.0, 30.0) == 0.0  # one tick is no rate
    rate, at = 0.0, 0.0
    for now in range(1, 31):  # a steady 4/s for one time constant: 1 - 1/e of the way there
        rate, at = smoothed(rate, at, float(now), 4.0, 30.0), float(now)
    assert abs(rate - 4.0 * (1 - math.exp(-1.0))) < 1e-9
    assert smoothed(rate, at, at + 30.0, 0.0, 30.0) == pytest.approx(rate / math.e)  # and decays as fast
