"""Continuous batching: budget, sequence cap, chunked prefill and preemption."""

from __future__ import annotations

import pytest

from simulator.kvcache import BlockPool
from simulator.scheduler import Request, Scheduler


def _sched(blocks: int = 1000, seqs: int = 8, budget: int = 256) -> Scheduler:
    return Scheduler(BlockPool(blocks), seqs, budget)


def test_admits_first_come_first_served_up_to_max_num_seqs() -> None:
    sched = _sched(seqs=2)
    for i in range(3):
        sched.add(Request(f"r{i}", 10, 5, 0.0))
    plan = sched.schedule(0.0)
    assert [r.rid for r, _ in plan.items] == ["r0", "r1"]
    assert plan.waiting_blocked


def test_long_prompt_is_chunked_to_the_token_budget() -> None:
    sched = _sched(budget=100)
    sched.add(Request("a", 250, 5, 0.0))
    plan = sched.schedule(0.0)
    assert plan.items[0][1] == 100 and plan.num_tokens == 100


def test_decodes_are_served_before_new_prefills() -> None:
    sched = _sched(budget=50)
    running = Request("old", 10, 5, 0.0)
    running.computed, running.output, running.blocks = 10, 1, 1
    sched.running.append(running)
    sched.pool.allocate(1)
    sched.add(Request("new", 200, 5, 0.0))
    plan = sched.schedule(0.0)
    assert plan.items == [(running, 1), (sched.running[1], 49)]


def test_full_pool_preempts_the_youngest_running_request() -> None:
    sched = _sched(blocks=2, budget=100)
    old, young = Request("old", 16, 5, 0.0), Request("young", 16, 5, 1.0)
    for req in (old, young):
        req.computed, req.output, req.blocks = 16, 1, 1
        sched.running.append(req)
    sched.pool.allocate(2)
    plan = sched.schedule(2.0)
    assert [r.rid for r in plan.preempted] == ["young"]
    assert young.computed == 0 and young.preemptions == 1
    assert sched.waiting[0] is young
    assert plan.items == [(old, 1)]


def test_waiting_request_that_does_not_fit_stays_queued() -> None:
    sched = _sched(blocks=3)
    sched.add(Request("big", 100, 5, 0.0))
    plan = sched.schedule(0.0)
    assert plan.items == [] and len(sched.waiting) == 1


# --- the priority policy (vLLM's --scheduling-policy priority) ----------------------------------------


def _classes(policy: str) -> list[str]:
    """Four requests arriving low, normal, high, high into a scheduler with room for two: who runs."""
    sched = Scheduler(BlockPool(1000), 2, 256, policy=policy)  # type: ignore[arg-type]
    for i, (name, priority) in enumerate([("low", 1), ("normal", 0), ("high-a", -1), ("high-b", -1)]):
        sched.add(Request(name, 10, 5, float(i), priority))
    return [r.rid for r, _ in sched.schedule(4.0).items]


def test_the_priority_policy_admits_the_lowest_value_first_and_equals_by_arrival() -> None:
    assert _classes("priority") == ["high-a", "high-b"]
    assert _classes("fcfs") == ["low", "normal"]  # the field is ignored without the policy


def _full_pool(policy: str) -> tuple[Scheduler, list[Request]]:
    """Three running requests on a full pool: ``low`` (oldest, first in line) and ``tail`` need no new
    block this step, ``high`` does, so something must be preempted."""
    sched = Scheduler(BlockPool(3), 8, 100, policy=policy)  # type: ignore[arg-type]
    low, high, tail = (
        Request("low", 10, 5, 0.0, 1),
        Request("high", 16, 5, 1.0, -1),
        Request("tail", 5, 5, 2.0),
    )
    low.computed, low.output = 10, 1  # token 11 of 16 in its block
    high.computed, high.output = 16, 1  # token 17: a second block
    tail.computed, tail.output = 5, 1
    for req in (low, high, tail):
        req.blocks = 1
        sched.running.append(req)
    sched.pool.allocate(3)
    return sched, [low, high, tail]


def test_the_priority_policy_preempts_the_lowest_priority_even_when_already_scheduled_this_step() -> None:
    sched, (low, high, tail) = _full_pool("priority")
    plan = sched.schedule(3.0)
    assert plan.preempted == [low]
    assert plan.items == [(high, 1), (tail, 1)] and plan.num_tokens == 2  # low's token went back
    assert sched.running == [high, tail] and list(sched.waiting) == [low]
    assert low.computed == 0 and low.blocks == 0 and sched.pool.used == 3


def test_fcfs_preempts_the_youngest_in_the_same_place() -> None:
    sched, (low, high, tail) = _full_pool("fcfs")
    plan = sched.schedule(3.0)
    assert plan.preempted == [tail]
    assert plan.items == [(low, 1), (high, 1)]


def test_a_preempted_request_goes_back_by_its_rank() -> None:
    sched, _ = _full_pool("priority")
    sched.add(Request("waiting-high", 10, 5, 2.5, -1))
    sched.add(Request("waiting-low", 10, 5, 2.6, 1))
    sched.schedule(3.0)  # low (arrival 0) is preempted: ahead of the later low, behind the high
    assert [r.rid for r in sched.waiting] == ["waiting-high", "low", "waiting-low"]


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy must be one of fcfs, priority, got 'lifo'"):
        Scheduler(BlockPool(10), 2, 100, policy="lifo")  # type: ignore[arg-type]
