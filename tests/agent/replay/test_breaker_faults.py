"""The breaker closed-loop on the simulator: injected faults escalate and recover in order, no flapping."""

import itertools

import numpy as np
import pytest

from agent.replay.brain import Brain
from agent.replay.driver import FaultEvent, Replay
from agent.replay.slo import Slo
from agent.replay.workload import Workload
from policies.breaker import Breaker
from policies.registry import default_arbiter
from simulator.engine import make_core
from simulator.faults import FaultSwitches

DWELL_S = 60.0


def _workload(duration_s: float = 1500.0) -> Workload:
    arrivals = np.arange(0.0, duration_s, 1.0)
    n = arrivals.size
    return Workload("steady", arrivals, np.full(n, 200, dtype=np.int64), np.full(n, 50, dtype=np.int64))


class _Recording:
    """The breaker, recording its level at every tick (the test's window into the closed loop)."""

    name = "breaker"

    def __init__(self, inner: Breaker) -> None:
        self.inner = inner
        self.trace: list[tuple[float, int]] = []

    def decide(self, snapshot, findings, state, now):
        state, proposals = self.inner.decide(snapshot, findings, state, now)
        self.trace.append((now, state.level))
        return state, proposals


def _levels(faults: list[FaultEvent]) -> tuple[list[int], list[float]]:
    """The breaker level after each of its changes, and when they happened."""
    recorder = _Recording(Breaker(dwell_s=DWELL_S, probe_s=20.0))
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=64, max_num_batched_tokens=2048)
    brain = Brain([recorder], default_arbiter())
    Replay(core, _workload(), Slo(1.0, 0.05), controller=brain, faults=faults).run()
    return level_changes(recorder.trace)


def level_changes(trace: list[tuple[float, int]]) -> tuple[list[int], list[float]]:
    """The levels a (time, level) trace changed to, and when, starting from L0."""
    levels, times, level = [], [], 0
    for now, new in trace:
        if new != level:
            level = new
            levels.append(level)
            times.append(now)
    return levels, times


#: 300 s of each fault, from 400 s: a breaker trips on a burn once it has watched for 5 minutes.
SPIKE = [FaultEvent(400.0, FaultSwitches(latency_factor=20.0)), FaultEvent(700.0, FaultSwitches())]
STORM = [FaultEvent(400.0, FaultSwitches(error_rate=0.3)), FaultEvent(700.0, FaultSwitches())]


@pytest.mark.parametrize("faults", [SPIKE, STORM], ids=["latency_spike", "5xx_storm"])
def test_fault_escalates_then_recovers_in_reverse_order(faults):
    levels, _ = _levels(faults)
    assert levels == [1, 2, 3, 2, 1, 0]


@pytest.mark.parametrize("faults", [SPIKE, STORM], ids=["latency_spike", "5xx_storm"])
def test_no_more_than_one_level_change_per_dwell(faults):
    _, times = _levels(faults)
    assert all(b - a >= DWELL_S - 1.0 for a, b in itertools.pairwise(times))


def test_memory_leak_escalates():
    leak = [FaultEvent(0.0, FaultSwitches(leak_bytes_per_hour=40e9, leak_step_bytes=1e9))]
    levels, _ = _levels(leak)
    assert levels[:2] == [1, 2]
