"""Continuous batching: budget, sequence cap, chunked prefill and preemption."""

from __future__ import annotations

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
