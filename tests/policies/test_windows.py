from dataclasses import dataclass

from policies.base import Proposal
from policies.windows import Hysteresis, Windowed, rolling_sum, window_totals
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
