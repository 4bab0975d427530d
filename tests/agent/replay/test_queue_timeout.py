"""The gate's queue timeout in replay: a request not scheduled within ``queue_timeout_s`` is answered 503,
never served, counted as a miss, and not shown to the breaker as an engine error."""

import numpy as np

from agent.replay.driver import Replay
from agent.replay.slo import Slo
from agent.replay.summary import summarise
from agent.replay.workload import Workload
from simulator.engine import make_core

SLO = Slo(2.0, 0.1)


def _burst(n: int = 400) -> Workload:
    """``n`` 2k-token prompts within one second: far more prefill than one A100 does in the SLO."""
    arrivals = np.linspace(0.0, 1.0, n)
    return Workload("burst", arrivals, np.full(n, 2000, dtype=np.int64), np.full(n, 20, dtype=np.int64))


def _run(timeout: float):
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=64, max_num_batched_tokens=2048)
    return Replay(core, _burst(), SLO, queue_timeout_s=timeout).run()


def test_a_backlog_past_the_timeout_is_answered_503_and_never_served():
    run = _run(1.5)
    assert run.expired > 0
    assert (run.error.sum(), (run.done & run.error).sum()) == (run.expired, 0)
    assert run.done.sum() + run.expired == len(run.workload)
    summary = summarise(run, "static:64")
    assert (summary["expired"], summary["errors"]) == (run.expired, 0)


def test_shedding_the_hopeless_keeps_more_requests_inside_the_slo():
    shed, kept = _run(1.5), _run(float("inf"))
    assert kept.expired == 0 and kept.done.all()
    # without the timeout the backlog makes every later request late; with it, the served ones are in time
    assert shed.good.sum() > kept.good.sum()
    assert np.percentile(shed.ttft[shed.done], 99) < np.percentile(kept.ttft[kept.done], 99)


def test_expired_requests_are_not_engine_errors_for_the_breaker():
    seen = []
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=64, max_num_batched_tokens=2048)
    run = Replay(core, _burst(), SLO, queue_timeout_s=1.5, on_tick=seen.append).run()
    assert run.expired > 0
    assert sum(s.values.get("gate.errors", 0.0) for s in seen) == 0.0


def test_a_preempted_request_waiting_again_is_not_expired():
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=64, max_num_batched_tokens=2048)
    replay = Replay(core, _burst(3), SLO, queue_timeout_s=1.0)
    for i in range(3):
        replay._submit(i, 0.0)
    head = core.scheduler.waiting[0]
    head.first_scheduled = 0.0  # admitted once, then preempted back to the head of the queue
    replay._expire(5.0)
    assert [r.rid for r in core.scheduler.waiting] == [head.rid]
    assert replay.expired == 2 and replay.error.tolist() == [False, True, True]
