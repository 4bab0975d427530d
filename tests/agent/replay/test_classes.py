"""Priority classes in replay: drawn from the mix with the seed, waiting in the live gate's admission
queue (high first, its reserve, aging, each class's deadline), judged by their own targets, and steering
the policies' ITL target as live."""

import numpy as np
import pytest

from agent.config import build
from agent.gate.admission import MAX_WAIT_S, Priority
from agent.itl_steering import AUDIT_KNOB
from agent.replay.brain import Brain, Steering
from agent.replay.classes import CLASSES, ClassPlan
from agent.replay.driver import Replay
from agent.replay.runner import ReplaySpec, class_plan, gate_for, run_summary
from agent.replay.slo import Slo
from agent.replay.summary import class_table, summarise
from agent.replay.workload import Workload
from detectors.snapshot import Snapshot
from policies.arbiter import Decision
from policies.registry import build_set, default_arbiter
from simulator.engine import make_core

SLO = Slo(2.0, 0.1)


def _plan(mix: dict[str, float], own: dict[str, dict[str, float]] | None = None, steering: str = "global"):
    section = {"ttft_slo_s": SLO.ttft_s, "itl_slo_s": SLO.itl_s, "slo_by_priority": own or {}}
    section["itl_steering"] = steering
    return ClassPlan(mix, build({"policies": section}, environ={}).policies)


def _burst(n: int, classes: list[int]) -> tuple[Workload, np.ndarray]:
    """``n`` 2k-token prompts within a second: a backlog an A100 at 16 sequences works through in ~10 s."""
    arrivals = np.linspace(0.0, 1.0, n)
    work = Workload("burst", arrivals, np.full(n, 2000, dtype=np.int64), np.full(n, 20, dtype=np.int64))
    return work, np.resize(np.array(classes, dtype=np.int64), n)


def _replay(plan: ClassPlan, work: Workload, classes: np.ndarray, timeout: float) -> Replay:
    """The gate's limit at 16 in front of an engine that could run 256."""
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=256, scheduling_policy="priority")
    return Replay(
        core,
        work,
        SLO,
        queue_timeout_s=timeout,
        classes=classes,
        targets=plan.targets(),
        gate=gate_for(plan, 16),
    )


def test_classes_are_drawn_from_the_mix_with_the_seed():
    plan = _plan({"high": 0.1, "normal": 0.7, "low": 0.2})
    drawn = plan.draw(20_000, seed=3)
    shares = np.bincount(drawn, minlength=3) / drawn.size
    assert shares == pytest.approx([0.1, 0.7, 0.2], abs=0.01)
    assert (plan.draw(20_000, seed=3) == drawn).all()
    assert (plan.draw(20_000, seed=4) != drawn).any()
    assert set(_plan({"low": 1.0}).draw(100, seed=0).tolist()) == {CLASSES.index("low")}


def test_a_class_without_its_own_targets_takes_the_slos_and_deadlines_scale_with_ttft():
    plan = _plan({"high": 1, "low": 1}, {"high": {"itl_s": 0.05}, "low": {"ttft_s": 30.0}})
    assert plan.targets() == (Slo(2.0, 0.05), Slo(2.0, 0.1), Slo(30.0, 0.1))
    assert plan.wait_scales() == (1.0, 1.0, 15.0)
    gate = gate_for(plan, 16)
    gate.max_wait_s = 2.0
    assert (gate.max_wait_for(Priority.HIGH), gate.max_wait_for(Priority.LOW)) == (2.0, 30.0)
    gate.max_wait_s = 400.0
    assert gate.max_wait_for(Priority.LOW) == MAX_WAIT_S  # capped as the live gate caps it


@pytest.mark.parametrize(
    ("mix", "message"),
    [
        ({"urgent": 1.0}, "unknown class 'urgent'"),
        ({"high": 0.0}, "a share above 0"),
        ({"high": -1.0}, ">= 0"),
    ],
)
def test_a_bad_mix_is_one_line(mix, message):
    with pytest.raises(ValueError, match=message):
        _plan(mix)


def test_the_engine_serves_high_first_and_each_class_is_judged_by_its_own_targets():
    # 120 long prompts in a second on 16 sequences: high (a sixth) goes first and is served in full; low's
    # 60 s TTFT target gives it a 60 s deadline, so it waits out the backlog where normal's 2 s runs out
    plan = _plan({"high": 1, "normal": 3, "low": 2}, {"low": {"ttft_s": 60.0, "itl_s": 0.2}})
    work, classes = _burst(120, [0, 1, 1, 1, 2, 2])
    run = _replay(plan, work, classes, timeout=2.0).run()
    high, normal, low = (classes == i for i in range(3))
    assert run.refused is not None
    assert run.done[high].all() and not run.refused[high].any()
    assert np.median(run.ttft[high]) < np.median(run.ttft[low])
    assert run.refused[normal].sum() > 30  # the backlog outlasts normal's 2 s
    assert run.done[low].all() and not run.refused[low].any()  # 60 s: all of low is served, late
    assert run.ttft[low].max() > 2.0
    # each judged by its own targets: low met its own though it waited past the SLO's 2 s; high did not
    assert run.good[low].all() and not run.good[high].all()
    summary = summarise(run, "static:16")
    assert summary["classes"]["low"]["slo_attainment"] == 1.0
    assert summary["classes"]["normal"]["expired"] == int(run.refused[normal].sum())
    assert sum(c["expired"] for c in summary["classes"].values()) == summary["expired"]
    assert summary["classes"]["low"]["slo"] == {"ttft_s": 60.0, "itl_s": 0.2}
    assert "normal" in class_table(summary)


def test_without_classes_the_same_backlog_turns_away_every_class_alike():
    plan = _plan({"high": 1, "normal": 1, "low": 1}, {"low": {"ttft_s": 60.0}})
    work, classes = _burst(120, [0, 1, 1, 1, 2, 2])
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=16)
    run = Replay(core, work, SLO, queue_timeout_s=2.0).run()
    assert run.classes is None and "classes" not in summarise(run, "static:16")
    with_classes = _replay(plan, work, classes, timeout=2.0).run()
    assert with_classes.expired < run.expired  # low's scaled deadline keeps it


def test_steering_follows_the_classes_that_arrived_within_the_window():
    own = {"high": {"itl_s": 0.05}, "low": {"itl_s": 0.2}}
    plan = _plan({"high": 1, "low": 1}, own, steering="served_classes")
    policies = build_set("auto", ttft_slo_s=2.0, itl_slo_s=0.1, initial_batch=64.0, batch_bounds=(8.0, 512.0))
    last_seen: dict[str, float] = {}
    brain = Brain(policies, default_arbiter(), steering=Steering(plan.policies, last_seen, (8.0, 512.0), 0.1))

    def tick(now: float) -> list:
        moves = brain.control(Snapshot(now, {}, {}), {"engine.max_num_seqs": 64.0})
        return [(d.previous, d.value) for d in moves if d.knob == AUDIT_KNOB]

    assert tick(1.0) == []  # nothing sent yet: the SLO's 0.1 s
    last_seen["low"] = 1.5
    assert tick(2.0) == [(0.1, 0.2)]
    last_seen["high"] = 2.5
    assert tick(3.0) == [(0.2, 0.05)]
    assert all(getattr(p, "itl_slo_s", 0.05) == 0.05 for p in brain.loop.policies)
    assert tick(4.0) == []
    assert tick(2.5 + 301.0) == [(0.05, 0.1)]  # both out of the 300 s window


def test_a_replay_spec_with_classes_runs_end_to_end_and_is_checked_as_the_config_is(conv):
    spec = ReplaySpec(
        conv,
        duration_s=300.0,
        priority_mix=(("high", 0.2), ("normal", 0.8)),
        class_slo=(("high", 1.0, 0.03),),
        itl_steering="served_classes",
    )
    summary = run_summary(spec, "auto")
    assert set(summary["classes"]) == {"high", "normal"}
    assert summary["classes"]["high"]["slo"] == {"ttft_s": 1.0, "itl_s": 0.03}
    moves = [a for a in summary["actions"] if a["knob"] == AUDIT_KNOB]
    assert moves and moves[0]["value"] == 0.03 and moves[0]["policy"] == "itl_steering"
    assert sum(c["requests"] for c in summary["classes"].values()) == summary["requests"]
    bad = ReplaySpec(conv, priority_mix=(("high", 1.0),), class_slo=(("high", 900.0, None),))
    with pytest.raises(
        ValueError, match=r"policies.slo_by_priority.high.ttft_s must be in \(0, 600\], got 900"
    ):
        class_plan(bad)
    with pytest.raises(ValueError, match="need a priority mix"):
        class_plan(ReplaySpec(conv, itl_steering="served_classes"))
    # left unset, the steering is the config's default, as a sidecar's would be; global only when asked
    mix = (("high", 1.0),)
    assert class_plan(ReplaySpec(conv, priority_mix=mix)).policies.itl_steering == "served_classes"
    pinned = ReplaySpec(conv, priority_mix=mix, itl_steering="global")
    assert class_plan(pinned).policies.itl_steering == "global"
    assert class_plan(ReplaySpec(conv, itl_steering="global")) is None  # one class: nothing to steer


def test_the_batch_knob_is_the_gates_limit_and_a_ttft_counts_the_wait_there():
    plan = _plan({"normal": 1})
    work, classes = _burst(60, [1])
    replay = _replay(plan, work, classes, timeout=30.0)
    assert replay.actual()["batch.max_in_flight"] == 16.0
    decision = Decision("batch.max_in_flight", 4, 16.0, "test", "test", 0.0)
    replay.apply(decision, 0.0)
    assert replay.gate is not None and replay.gate.limit == 4
    assert replay.core.settings.max_num_seqs == 256  # the engine keeps its own, as live
    run = replay.run()
    assert run.done.all() and max(row.running for row in run.timeline) <= 4
    # 60 long prompts through 4 slots: the last ones waited in the gate, and their TTFT says so
    assert run.ttft.max() > 5.0


def test_under_sustained_overload_low_waits_out_the_normal_stream_as_in_the_live_gate():
    """Aging promotes a low request that waited 200 ms to normal, but every normal request waiting that
    long is promoted to high meanwhile, so under sustained overload low still goes last: the replay shows
    what the live gate's rules do, not a gentler model of them."""
    plan = _plan({"normal": 4, "low": 1}, {"low": {"ttft_s": 60.0}})
    n = 400
    arrivals = np.linspace(0.0, 40.0, n)  # 10 a second, more than 2 slots serve
    work = Workload("stream", arrivals, np.full(n, 1500, dtype=np.int64), np.full(n, 50, dtype=np.int64))
    classes = np.resize(np.array([1, 1, 1, 1, 2], dtype=np.int64), n)
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=256, scheduling_policy="priority")
    gate = gate_for(plan, 2)
    run = Replay(
        core, work, SLO, queue_timeout_s=30.0, classes=classes, targets=plan.targets(), gate=gate
    ).run()
    normal, low = classes == 1, classes == 2
    assert gate.promotions > 0
    assert run.done[low].all()  # its 30 s x 30 deadline outlasts the stream
    first_low = (run.ttft + arrivals)[low].min()
    assert first_low > arrivals[-1]  # not one low request before the last normal one arrived
    assert np.median(run.ttft[low]) > np.median(run.ttft[normal & run.done])


def test_each_tick_reports_each_classs_answers_and_misses():
    plan = _plan({"high": 1, "normal": 3, "low": 2}, {"high": {"itl_s": 0.05}, "low": {"ttft_s": 60.0}})
    work, classes = _burst(120, [0, 1, 1, 1, 2, 2])
    replay = _replay(plan, work, classes, timeout=2.0)
    seen: list[Snapshot] = []
    replay.on_tick = seen.append
    run = replay.run()
    for snap in seen:  # the classes' answers and misses add up to the tick's
        for what in ("requests", "slo_bad"):
            total = sum(snap.values[f"gate.class.{name}.{what}"] for name in CLASSES)
            assert total == snap.values[f"gate.{what}"]
    reported = {name: sum(s.values[f"gate.class.{name}.slo_bad"] for s in seen) for name in CLASSES}
    # high at 0.05 s misses (ITL ~0.11 s), judged by its own target; low waited past 2 s but met its 60 s
    assert reported["high"] > 0 and reported["low"] == 0
    assert sum(s.values["gate.class.high.requests"] for s in seen) <= run.done[classes == 0].sum()


def test_each_tick_reports_the_gates_in_flight_and_reserve_as_the_live_gate_does():
    """The batch policy tells a bound limit by ``running >= L - R - 1``: without the gate's reserve and
    in-flight count in the replay's ticks, normal traffic (which fills only L - R) never looked bound and
    the limit never grew for it, which the live gate's snapshot does not hide."""
    plan = _plan({"normal": 1})
    work, classes = _burst(60, [1])
    replay = _replay(plan, work, classes, timeout=30.0)
    seen: list[Snapshot] = []
    replay.on_tick = seen.append
    replay.run()
    assert all(snap.values["gate.reserved"] == 3.0 for snap in seen)  # round(20% of 16)
    assert max(snap.values["gate.in_flight"] for snap in seen) == 13.0  # normal fills L - R of 16


def test_a_promoted_request_reaches_the_engine_with_its_own_class():
    """Promotion gets a request out of the gate's queue; the engine is told the class it arrived in, as
    the live gate tells it (``gate.engine_priority``), so promoted normal traffic does not rank with, and
    ahead of, fresh high requests in the engine's queue and among its preemption victims."""
    plan = _plan({"normal": 4, "low": 1}, {"low": {"ttft_s": 60.0}})
    n = 100
    arrivals = np.linspace(0.0, 10.0, n)
    work = Workload("stream", arrivals, np.full(n, 1500, dtype=np.int64), np.full(n, 50, dtype=np.int64))
    classes = np.resize(np.array([1, 1, 1, 1, 2], dtype=np.int64), n)
    core = make_core("a100-80g", "llama-2-7b", max_num_seqs=256, scheduling_policy="priority")
    told: dict[int, int] = {}
    submit = core.submit

    def spy(rid, prompt, output, at, priority=0):
        told[int(rid)] = priority
        return submit(rid, prompt, output, at, priority)

    core.submit = spy
    gate = gate_for(plan, 2)
    Replay(core, work, SLO, queue_timeout_s=30.0, classes=classes, targets=plan.targets(), gate=gate).run()
    assert gate.promotions > 0
    assert {told[i] for i in np.flatnonzero(classes == 1)} == {1}  # vLLM's order: high 0, normal 1, low 2
    assert {told[i] for i in np.flatnonzero(classes == 2)} == {2}
