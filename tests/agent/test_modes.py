"""Observe, advise and act; level-based writes; pause and pins; errors audited, never raised."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from agent.audit import AuditLog
from agent.config import AuditConfig
from agent.modes import Actuation, Mode
from policies.base import Proposal


class Knob:
    def __init__(self, value: Any = 64, fail: bool = False) -> None:
        self.value, self.fail, self.writes = value, fail, 0

    async def read(self) -> Any:
        return self.value

    async def write(self, value: Any) -> Any:
        if self.fail:
            raise RuntimeError("engine said no")
        self.writes += 1
        self.value = value
        return value


def _actuation(mode: str, knob: Knob) -> Actuation:
    act = Actuation(mode, AuditLog(AuditConfig(path=None), CollectorRegistry()), clock=lambda: 5.0)
    act.bind("gate.limit", knob.read, knob.write)
    return act


PROPOSAL = Proposal("batch", "gate.limit", 48, "ttft p99 over SLO")


async def test_observe_does_nothing_and_audits_nothing() -> None:
    knob = Knob()
    act = _actuation("observe", knob)
    assert await act.execute(PROPOSAL) is None and knob.writes == 0 and act.audit.recent() == []


async def test_advise_audits_what_it_would_do_and_changes_nothing() -> None:
    knob = Knob()
    action = await _actuation("advise", knob).execute(PROPOSAL)
    assert (
        action is not None and action.result == "advised" and (action.from_value, action.to_value) == (64, 48)
    )
    assert knob.writes == 0


async def test_act_writes_the_absolute_value_and_audits_it() -> None:
    knob = Knob()
    action = await _actuation(Mode.ACT, knob).execute(PROPOSAL)
    assert action is not None and action.result == "ok" and knob.value == 48


async def test_a_knob_already_at_the_value_is_not_written() -> None:
    knob = Knob(48)
    assert await _actuation("act", knob).execute(PROPOSAL) is None and knob.writes == 0


async def test_paused_actuation_audits_but_does_not_write() -> None:
    knob = Knob()
    act = _actuation("act", knob)
    act.paused = True
    action = await act.execute(PROPOSAL)
    assert action is not None and action.result == "paused" and knob.value == 64


async def test_a_knob_whose_actuator_is_not_ready_holds_the_decision_once_and_counts_no_error() -> None:
    """The GPU actuator before the probe names the engine's GPUs: a normal start, not a failure."""
    knob, registry = Knob(), CollectorRegistry()
    act = Actuation("act", AuditLog(AuditConfig(path=None), registry), clock=lambda: 5.0)
    why: list[str | None] = ["waiting for the probe"]
    act.bind("gate.limit", knob.read, knob.write, waiting=lambda: why[0])
    outcomes = [await act.execute(PROPOSAL) for _ in range(3)]
    assert [o.result if o else None for o in outcomes] == ["waiting", None, None] and knob.writes == 0
    assert outcomes[0] is not None and outcomes[0].reason == "ttft p99 over SLO; held: waiting for the probe"
    counted = {
        result: registry.get_sample_value(
            "servepilot_actions_total", {"knob": "gate.limit", "result": result}
        )
        for result in ("waiting", "error")
    }
    assert counted["waiting"] == 1.0 and not counted["error"]  # ServepilotActuationFailing counts errors
    why[0] = None
    action = await act.execute(PROPOSAL)
    assert action is not None and action.result == "ok" and knob.value == 48


async def test_the_same_advice_is_recorded_once_not_every_tick() -> None:
    """Nothing is applied in advise mode (or while paused), so a policy proposes the same move each tick;
    it is news once, and again when either end of it changes."""
    for mode, paused, result in (("advise", False, "advised"), ("act", True, "paused")):
        knob = Knob()
        act = _actuation(mode, knob)
        act.paused = paused
        outcomes = [await act.execute(PROPOSAL) for _ in range(5)]
        assert [a.result for a in outcomes if a is not None] == [result], mode
        assert await act.execute(Proposal("batch", "gate.limit", 32, "lower still")) is not None
        knob.value = 80  # someone else moved it: the same target from another value is news again
        assert await act.execute(Proposal("batch", "gate.limit", 32, "lower still")) is not None
        assert len(act.audit.recent()) == 3 and knob.writes == 0


async def test_advice_that_wobbles_around_the_last_record_is_recorded_every_5_minutes() -> None:
    """Beside vLLM in advise mode the batch policy read 4 or 5 requests running each tick and advised
    16 -> 9, 16 -> 11, 16 -> 9, ...: 51 records in four minutes, all one recommendation. Now that is one
    record, and a reminder every ADVICE_REPEAT_S with the count and range; a move the other way, or one
    that ends well past the recorded one, is news at once."""
    now = {"t": 0.0}
    act = Actuation("advise", AuditLog(AuditConfig(path=None), CollectorRegistry()), clock=lambda: now["t"])
    knob = Knob(16)
    act.bind("batch.max_in_flight", knob.read, knob.write)
    recorded = []
    for tick, target in enumerate([9, 11, 9, 12, 8, 11, 9] * 50):  # 350 one-second ticks
        now["t"] = float(tick)
        action = await act.execute(Proposal("batch_auto", "batch.max_in_flight", target, "engine queues"))
        if action is not None:
            recorded.append(action)
    # 9 again at 300 and 301 is the record itself; 11 at 302 is the first near one past the 5 minutes
    assert [(a.time, a.to_value) for a in recorded] == [(0.0, 9), (302.0, 11)]
    assert recorded[1].reason == "engine queues (proposed 301 more time(s) since the last record, to 8..12)"
    for target in (20, 3):  # up instead of down; down to 3, past half the recorded move (16 -> 8) beyond 8
        action = await act.execute(Proposal("batch_auto", "batch.max_in_flight", target, "r"))
        assert action is not None and action.to_value == target
    assert knob.writes == 0


async def test_after_a_pause_the_decision_is_applied_and_recorded() -> None:
    knob = Knob()
    act = _actuation("act", knob)
    act.paused = True
    await act.execute(PROPOSAL)
    act.paused = False
    action = await act.execute(PROPOSAL)
    assert action is not None and action.result == "ok" and knob.value == 48


async def test_a_pinned_knob_gets_the_pinned_value() -> None:
    knob = Knob()
    act = _actuation("act", knob)
    act.pins["gate.limit"] = 32
    action = await act.execute(PROPOSAL)
    assert knob.value == 32 and action is not None and "pinned by operator" in action.reason


async def test_a_pin_held_while_no_policy_proposes_says_no_policy_wanted_it() -> None:
    """The sidecar proposes a pin itself while no policy proposes that knob; its record read "pinned by
    operator (policy wanted 12)" for a pin of 12 that the policy had just moved away from (seen live)."""
    knob = Knob()
    act = _actuation("act", knob)
    act.pins["gate.limit"] = 32
    action = await act.execute(Proposal("operator", "gate.limit", 32, "pinned by operator"))
    assert knob.value == 32 and action is not None
    assert action.reason == "pinned by operator" and action.policy == "operator"


async def test_a_failing_actuator_is_audited_as_an_error_not_raised() -> None:
    action = await _actuation("act", Knob(fail=True)).execute(PROPOSAL)
    assert action is not None and action.result == "error: RuntimeError: engine said no"


async def test_an_unbound_knob_is_an_audited_error() -> None:
    action = await _actuation("act", Knob()).execute(Proposal("p", "gpu_power_limit_w", 300, "r"))
    assert action is not None and action.result.startswith("error: no actuator")


async def test_an_unbound_knob_is_reported_once_not_every_tick() -> None:
    """A policy whose knob the deployment lacks proposes every tick: one audited error, then silence, until
    the knob is bound (the next proposal is then carried out as usual)."""
    act = _actuation("act", Knob())
    proposal = Proposal("p", "gpu.power_limit_w", 300, "r")
    first = await act.execute(proposal)
    assert first is not None and "reported once" in first.result
    assert [await act.execute(proposal) for _ in range(3)] == [None, None, None]
    assert len(act.audit.recent()) == 1
    knob = Knob(400)
    act.bind("gpu.power_limit_w", knob.read, knob.write)
    bound = await act.execute(proposal)
    assert bound is not None and bound.result == "ok" and knob.value == 300


async def test_advice_for_an_unbound_knob_is_recorded_when_it_changes() -> None:
    """Advise mode still says what it would do without the actuator, once per new value."""
    act = _actuation("advise", Knob())
    results = [await act.execute(Proposal("p", "batch.max_in_flight", v, "r")) for v in (48, 48, 72, 72)]
    assert [a.result if a else None for a in results] == ["advised", None, "advised", None]


async def test_a_failure_that_repeats_every_tick_is_written_once_per_5_minutes_and_counted_each_time() -> (
    None
):
    """A pin on an engine knob while the engine is down fails every tick; the audit log gets the first
    failure and a reminder every ERROR_REPEAT_S with the count in between, the counter every one."""
    now = {"t": 0.0}
    registry = CollectorRegistry()
    act = Actuation("act", AuditLog(AuditConfig(path=None), registry), clock=lambda: now["t"])

    async def down() -> Any:
        raise ConnectionError("engine refused the connection")

    async def never(value: Any) -> Any:
        raise AssertionError("not written: the read failed")

    act.bind("engine.max_num_batched_tokens", down, never)
    act.pins["engine.max_num_batched_tokens"] = 2048
    proposal = Proposal("pin", "engine.max_num_batched_tokens", 2048, "r")
    recorded = []
    for tick in range(601):  # ten minutes of 1 s ticks
        now["t"] = float(tick)
        if (action := await act.execute(proposal)) is not None:
            recorded.append(action)
    assert [a.time for a in recorded] == [0.0, 300.0, 600.0]
    assert all(a.result == "error: read: ConnectionError: engine refused the connection" for a in recorded)
    assert "failed 299 more time(s) since the last record" in recorded[1].reason
    errors = registry.get_sample_value(
        "servepilot_actions_total", {"knob": "engine.max_num_batched_tokens", "result": "error"}
    )
    assert errors == 601  # ServepilotActuationFailing reads every failure


async def test_a_new_error_a_new_value_or_a_success_in_between_is_recorded_at_once() -> None:
    knob = Knob(fail=True)
    act = _actuation("act", knob)  # the clock stands still: only a change is news
    assert await act.execute(PROPOSAL) is not None
    assert await act.execute(PROPOSAL) is None
    other = await act.execute(Proposal("batch", "gate.limit", 40, "r"))  # another value
    assert other is not None and other.to_value == 40
    knob.fail = False
    assert (await act.execute(PROPOSAL)).result == "ok"  # type: ignore[union-attr]
    knob.fail, knob.value = True, 64
    again = await act.execute(PROPOSAL)  # failing again after a success: news
    assert again is not None and again.result.startswith("error") and "more time" not in again.reason
