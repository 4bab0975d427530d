"""A config reload's SLO targets, batch bounds and schedule reach the running policies (policies/registry.py
``retune``, ``with_batch_bounds``): the reloaded parameters change, every other one stays as it was, and a
value a policy cannot take raises before anything is swapped."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies.batch_auto import AutoBatch
from policies.batch_seed import SeedBatch
from policies.breaker import Breaker
from policies.energy import Energy
from policies.knobs import BATCH, TOKEN_BUDGET
from policies.queue_deadline import QueueDeadline
from policies.registry import build_set, default_arbiter, retune, with_batch_bounds
from policies.schedule import Schedule
from policies.token_budget import TokenBudget

PEAK = Schedule.from_data(
    {
        "timezone": "UTC",
        "windows": [
            {"days": ["mon", "tue", "wed", "thu", "fri"], "start": "09:00", "end": "18:00", "mode": "peak"}
        ],
    }
)


def _retuned(policy: object, **changes: object) -> object:
    new: dict[str, object] = {
        "ttft_slo_s": 1.0,
        "itl_slo_s": 0.05,
        "batch_bounds": (16.0, 128.0),
        "schedule": PEAK,
    }
    new.update(changes)
    return retune(policy, **new)  # type: ignore[arg-type]


def test_every_policy_of_the_auto_set_takes_the_new_slo_and_keeps_the_rest() -> None:
    running = build_set(
        "auto",
        ttft_slo_s=2.0,
        itl_slo_s=0.1,
        batch_bounds=(8.0, 512.0),
        initial_batch=64.0,
        clock_levels_mhz=(1980.0, 1500.0, 1100.0),
        initial_token_budget=8192.0,
        queue_deadline=True,
    )
    retuned = [_retuned(policy) for policy in running]
    assert [p.name for p in retuned] == [p.name for p in running]  # the loop keeps each one's state by name
    by_type = {type(p): p for p in retuned}
    auto = by_type[AutoBatch]
    assert (auto.ttft_slo_s, auto.itl_slo_s, auto.lower, auto.upper) == (1.0, 0.05, 16.0, 128.0)
    budget = by_type[TokenBudget]
    assert (budget.ttft_slo_s, budget.itl_slo_s) == (1.0, 0.05)
    assert budget.initial == 8192.0 and budget.upper == 8192.0  # learnt from the engine: not reset
    assert by_type[QueueDeadline].ttft_slo_s == 1.0
    energy = by_type[Energy]
    assert (energy.ttft_slo_s, energy.itl_slo_s, energy.schedule) == (1.0, 0.05, PEAK)
    assert energy.levels_mhz == (1980.0, 1500.0, 1100.0)
    assert by_type[Breaker].itl_slo_s == 0.05
    for old, new in zip(running, retuned, strict=True):  # nothing else moved
        kept = {"ttft_slo_s", "itl_slo_s", "lower", "upper", "initial", "schedule"}
        assert {k: v for k, v in vars(old).items() if k not in kept} == {
            k: v for k, v in vars(new).items() if k not in kept
        }


def test_the_batch_start_is_held_inside_the_new_bounds() -> None:
    started_at_engine_cap = AutoBatch(2.0, 0.1, lower=8.0, upper=512.0, initial=256.0)
    assert _retuned(started_at_engine_cap).initial == 128.0
    assert _retuned(started_at_engine_cap, batch_bounds=(300.0, 400.0)).initial == 300.0
    assert _retuned(started_at_engine_cap, batch_bounds=(8.0, 512.0)).initial == 256.0


def test_the_seed_rule_and_a_breaker_without_an_itl_slo_come_back_as_they_were() -> None:
    seed, breaker = SeedBatch(), Breaker()
    assert _retuned(seed) is seed  # the published rule keeps its [8, 32]
    assert _retuned(breaker) is breaker


def test_the_breaker_takes_a_new_error_budget_and_keeps_its_own_without_one() -> None:
    built = build_set("auto", ttft_slo_s=2.0, itl_slo_s=0.1, error_budget=0.005)
    [breaker] = [p for p in built if isinstance(p, Breaker)]
    assert breaker.slo_target == pytest.approx(0.995)
    assert _retuned(breaker).slo_target == pytest.approx(0.995)  # the replay's steering names no budget
    looser = _retuned(breaker, error_budget=0.02)
    assert isinstance(looser, Breaker) and looser.slo_target == pytest.approx(0.98)
    assert looser.itl_slo_s == 0.05


def test_a_value_the_policy_cannot_take_raises() -> None:
    with pytest.raises(ValueError, match="SLO targets must be > 0"):
        _retuned(AutoBatch(2.0, 0.1), ttft_slo_s=0.0)
    with pytest.raises(ValueError, match=r"slo_target must be in \(0, 1\), got 0.0"):
        _retuned(Breaker(), error_budget=1.0)


def test_the_arbiter_holds_the_batch_to_the_new_bounds_and_keeps_its_other_rules() -> None:
    arbiter = default_arbiter((8.0, 512.0))
    narrowed = with_batch_bounds(arbiter, (16.0, 64.0))
    assert (narrowed.rules[BATCH].lower, narrowed.rules[BATCH].upper) == (16.0, 64.0)
    assert narrowed.rules[BATCH] == replace(arbiter.rules[BATCH], lower=16.0, upper=64.0)
    assert narrowed.rules[TOKEN_BUDGET] == arbiter.rules[TOKEN_BUDGET]
    assert narrowed.check(BATCH, 100) is not None and arbiter.check(BATCH, 100) is None
    assert arbiter.rules[BATCH].upper == 512.0  # a new arbiter: the running one is untouched until swapped
