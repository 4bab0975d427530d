from __future__ import annotations

import math

import numpy as np
import pytest

from detectors.thresholds import Thresholder

DAY = 86_400.0


def feed(th: Thresholder, scores: list[float], start: float = 0.0, step: float = 60.0) -> list[bool]:
    return [th.update(start + i * step, s).raised for i, s in enumerate(scores)]


def test_single_spike_does_not_raise_with_k_of_n() -> None:
    assert not any(feed(Thresholder(k=2, n=3), [0.1, 0.99, 0.1, 0.1]))


def test_persistent_hits_raise_exactly_once() -> None:
    raised = feed(Thresholder(k=2, n=3), [0.1, 0.95, 0.95, 0.97, 0.99])
    assert raised == [False, False, True, False, False]


def test_second_incident_same_day_is_suppressed_by_budget() -> None:
    th = Thresholder(k=1, n=1)
    raised = feed(th, [0.95, 0.1, 0.95])
    assert raised == [True, False, False]
    assert th.suppressed_total_ == 1


def test_budget_refills_after_a_day() -> None:
    th = Thresholder(k=1, n=1)
    assert th.update(0.0, 0.95).raised
    th.update(60.0, 0.0)
    assert th.update(DAY + 60.0, 0.95).raised


def test_time_stepping_back_refills_nothing() -> None:
    th = Thresholder(k=1, n=1)
    th.update(DAY, 0.95)
    th.update(DAY + 1, 0.0)
    assert not th.update(10.0, 0.95).raised


def test_nan_score_is_not_a_hit() -> None:
    assert not Thresholder(k=1, n=1).update(0.0, math.nan).firing


def test_at_most_one_alarm_per_day_on_noise() -> None:
    import numpy as np

    th = Thresholder(threshold=0.5, k=1, n=1)
    scores = np.random.default_rng(0).uniform(0, 1, 10 * 288).tolist()  # ten days at 5 min, half hits
    assert sum(feed(th, scores, step=300.0)) <= 10


@pytest.mark.parametrize(
    ("kwargs", "needle"), [({"threshold": 1.5}, "threshold"), ({"k": 4, "n": 3}, "k <= n")]
)
def test_bad_parameters_are_one_line_errors(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Thresholder(**kwargs)  # type: ignore[arg-type]


def test_push_is_update_without_the_event() -> None:
    """The general detector's path (push) leaves the same state and raises on the same points."""
    rng = np.random.default_rng(3)
    scores = rng.uniform(0, 1, 5000) ** 4  # mostly low, some >= 0.9
    scores[::97] = math.nan
    by_update, by_push = (
        Thresholder(k=2, n=3, max_alarms_per_day=24),
        Thresholder(k=2, n=3, max_alarms_per_day=24),
    )
    raised = []
    for i, score in enumerate(scores):
        t = 60.0 * i
        event = by_update.update(t, float(score))
        assert by_push.push(t, float(score)) is event.raised
        raised.append(event.raised)
    assert vars(by_update) == vars(by_push)
    assert sum(raised) > 0 and by_update.suppressed_total_ > 0


def test_the_budget_alone_spends_a_token_per_alarm_and_refills_with_time_only() -> None:
    from detectors.thresholds import AlarmBudget

    budget = AlarmBudget(max_alarms_per_day=1.0)
    assert budget.spend(1000.0) and not budget.spend(2000.0)
    assert not budget.spend(500.0)  # time stepped back: nothing refilled
    assert budget.spend(1000.0 + 86_400.0) and budget.suppressed_total_ == 2
    with pytest.raises(ValueError, match="budget needs"):
        AlarmBudget(max_alarms_per_day=-1.0)
