"""The queue-aware breaker (the auto set's: it knows the ITL SLO) closed-loop on the simulator: injected
faults still escalate and recover in order without flapping, and plain overload does not trip it."""

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
from tests.agent.replay.test_breaker_faults import SPIKE, STORM, _Recording, level_changes

DWELL_S = 60.0
SLO = Slo(1.0, 0.05)
#: Overload: 12 prompts of 1600 tokens a second (19k tokens/s, over the A100's ~16k prefill), in
#: 1024-token chunks so that decode steps stay near 0.06 s, within a 0.1 s ITL SLO.
OVERLOAD_SLO = Slo(5.0, 0.1)


def _workload(rate_per_s: float, prompt: int, duration_s: float = 1500.0) -> Workload:
    arrivals = np.arange(0.0, duration_s, 1.0 / rate_per_s)
    n = arrivals.size
    return Workload("steady", arrivals, np.full(n, prompt, dtype=np.int64), np.full(n, 50, dtype=np.int64))


def _levels(
    workload: Workload, faults: list[FaultEvent], slo: Slo = SLO, budget: int = 2048
) -> tuple[list[int], list[float]]:
    recorder = _Recording(Breaker(dwell_s=DWELL_S, probe_s=20.0, itl_slo_s=slo.itl_s))
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=64, max_num_batched_tokens=budget)
    Replay(core, workload, slo, controller=Brain([recorder], default_arbiter()), faults=faults).run()
    return level_changes(recorder.trace)


@pytest.mark.parametrize("faults", [SPIKE, STORM], ids=["latency_spike", "5xx_storm"])
def test_faults_still_escalate_then_recover_in_reverse_order_without_flapping(faults):
    levels, times = _levels(_workload(1.0, 200), faults)
    assert levels == [1, 2, 3, 2, 1, 0]
    assert all(b - a >= DWELL_S - 1.0 for a, b in itertools.pairwise(times))


def test_overload_that_only_queues_does_not_trip():
    """Prompts arrive faster than the GPU prefills them: first tokens come late (the SLO burns) while
    decode stays fast. The breaker holds L0: its levels would only cut capacity further."""
    workload = _workload(12.0, 1600, duration_s=600.0)
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=64, max_num_batched_tokens=1024)
    run = Replay(core, workload, OVERLOAD_SLO).run()
    assert run.good.mean() < 0.5  # the workload does burn the SLO (the premise of the test)
    assert np.nanmean(run.tpot[run.done]) < OVERLOAD_SLO.itl_s  # ... through TTFT, not decode
    levels, _ = _levels(workload, [], OVERLOAD_SLO, budget=1024)
    assert levels == []
