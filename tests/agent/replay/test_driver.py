import math

import numpy as np
import pytest

from agent.replay.brain import Brain
from agent.replay.driver import FaultEvent, Replay
from agent.replay.slo import Slo
from agent.replay.workload import load
from policies import knobs
from policies.arbiter import Arbiter, Decision, KnobRule
from policies.batch_auto import AutoBatch
from simulator.engine import make_core
from simulator.faults import FaultSwitches

SLO = Slo(10.0, 0.1)


def _replay(conv, **options):
    core = make_core(
        "a100-80g", "llama-2-7b", max_num_seqs=options.pop("batch", 64), max_num_batched_tokens=2048
    )
    return Replay(core, load(conv, max_model_len=4096, rate_scale=options.pop("scale", 5.0)), SLO, **options)


def test_static_replay_serves_every_request(conv):
    run = _replay(conv).run()
    assert run.done.all()


def test_light_load_meets_the_slo(conv):
    run = _replay(conv, scale=1.0).run()
    assert run.good.mean() > 0.99


def test_latency_fault_slows_the_engine(conv):
    slow = _replay(conv, faults=[FaultEvent(0.0, FaultSwitches(latency_factor=3.0))]).run()
    fast = _replay(conv).run()
    assert np.median(slow.tpot) > 2 * np.median(fast.tpot)


def test_error_storm_answers_a_share_with_5xx(conv):
    run = _replay(conv, faults=[FaultEvent(0.0, FaultSwitches(error_rate=0.5))]).run()
    assert 0.35 < run.error.mean() < 0.65 and not run.good[run.error].any()


def test_every_tick_is_on_the_timeline(conv):
    replay = _replay(conv, interval_s=2.0)
    run = replay.run()
    assert len(run.timeline) == math.floor(run.end_s / 2.0)


def test_snapshots_carry_the_live_signal_names(conv):
    seen = []
    _replay(conv, on_tick=seen.append).run()
    names = set().union(*(s.values for s in seen))
    assert {
        knobs.RUNNING,
        knobs.WAITING,
        knobs.KV_USAGE,
        knobs.GPU_UTIL,
        knobs.ITL_MEAN,
        knobs.GATE_LIMIT,
    } <= names


def test_snapshot_values_are_finite(conv):
    seen = []
    _replay(conv, on_tick=seen.append).run()
    assert all(math.isfinite(v) for s in seen for v in s.values.values())


class _SetBatch:
    def control(self, snapshot, actual):
        if actual[knobs.BATCH] != 8.0:
            return [Decision(knobs.BATCH, 8.0, actual[knobs.BATCH], "test", "pin", snapshot.now)]
        return []


def test_decisions_are_applied_to_the_engine(conv):
    replay = _replay(conv, controller=_SetBatch())
    run = replay.run()
    assert replay.core.settings.max_num_seqs == 8 and len(run.actions) == 1


def test_fp8_upstream_switches_the_engine_precision(conv):
    replay = _replay(conv)
    replay.apply(Decision(knobs.UPSTREAM, "fp8", "primary", "breaker", "L2", 0.0), 0.0)
    assert replay.core.settings.precision == "fp8"


def test_brain_runs_policies_through_the_arbiter(conv):
    # a short 8x burst: a preemption rate of 0.5/s already counts as a storm
    auto = AutoBatch(10.0, 0.1, initial=256, preempt_max=0.5)
    brain = Brain([auto], Arbiter({knobs.BATCH: KnobRule(1, 1024, integer=True)}))
    run = _replay(conv, batch=256, scale=8.0, controller=brain).run()
    assert run.actions and all(a.policy == "batch_auto" for a in run.actions)


@pytest.mark.parametrize("batch", [4, 64])
def test_same_input_same_result(conv, batch):
    a, b = _replay(conv, batch=batch).run(), _replay(conv, batch=batch).run()
    assert np.array_equal(a.ttft, b.ttft)
