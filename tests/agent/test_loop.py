from __future__ import annotations

import asyncio
from collections.abc import Callable

from agent.loop import Loop
from agent.state import AgentState
from agent.store import Store
from detectors.base import Finding, Severity
from detectors.snapshot import Reading, Snapshot, SourceStatus
from policies.base import Proposal


class StaticCollector:
    def __init__(self, name: str, values: dict[str, float]) -> None:
        self.name = name
        self.values = values
        self.calls = 0

    async def collect(self, now: float) -> Reading:
        self.calls += 1
        return Reading(self.name, now, SourceStatus.OK, self.values)

    async def close(self) -> None:
        pass


class HangingCollector(StaticCollector):
    async def collect(self, now: float) -> Reading:
        await asyncio.Event().wait()  # never answers
        raise AssertionError("unreachable")


class RaisingCollector(StaticCollector):
    async def collect(self, now: float) -> Reading:
        raise RuntimeError("bug in a collector")


class ThresholdDetector:
    name = "threshold"

    def update(self, snapshot: Snapshot) -> list[Finding]:
        value = snapshot.get("engine.requests_waiting")
        if value is None or value < 10:
            return []
        return [Finding(self.name, "engine.requests_waiting", Severity.WARNING, 0.7, "queue", snapshot.now)]


class BrokenDetector:
    name = "broken"

    def update(self, snapshot: Snapshot) -> list[Finding]:
        raise ValueError("boom")


def _loop(*collectors: StaticCollector, detectors: tuple[object, ...] = ()) -> Loop:
    return Loop(
        collectors,
        Store(100, 100),
        interval_s=1.0,
        source_timeout_s=0.05,
        detectors=detectors,  # type: ignore[arg-type]
    )


async def test_tick_merges_readings_into_one_snapshot() -> None:
    loop = _loop(StaticCollector("engine", {"engine.a": 1.0}), StaticCollector("nvml", {"nvml.gpu0.x": 2.0}))
    state = await loop.tick(100.0)
    assert state.snapshot is not None
    assert dict(state.snapshot.values) == {"engine.a": 1.0, "nvml.gpu0.x": 2.0}
    assert state.snapshot.now == 100.0
    assert loop.store.latest("engine.a") == (100.0, 1.0)


async def test_a_hanging_source_is_cut_at_the_deadline_and_others_still_arrive() -> None:
    loop = _loop(HangingCollector("engine", {}), StaticCollector("nvml", {"nvml.gpu0.x": 2.0}))
    state = await asyncio.wait_for(loop.tick(1.0), timeout=2.0)
    assert state.snapshot is not None
    assert state.snapshot.readings["engine"].status is SourceStatus.ERROR
    assert "no answer within" in (state.snapshot.readings["engine"].error or "")
    assert state.snapshot.get("nvml.gpu0.x") == 2.0


async def test_a_raising_collector_becomes_an_error_reading() -> None:
    loop = _loop(RaisingCollector("probe", {}))
    state = await loop.tick(1.0)
    assert state.snapshot is not None
    assert state.snapshot.readings["probe"].status is SourceStatus.ERROR


async def test_findings_published_and_broken_detector_counted_not_fatal() -> None:
    loop = _loop(
        StaticCollector("engine", {"engine.requests_waiting": 25.0}),
        detectors=(BrokenDetector(), ThresholdDetector()),
    )
    state = await loop.tick(5.0)
    assert [f.detector for f in state.findings] == ["threshold"]
    assert state.stats.detector_errors == {"broken": 1, "threshold": 0}


class BrokenPolicy:
    name = "broken"

    def decide(self, snapshot, findings, state, now):  # type: ignore[no-untyped-def]
        raise ZeroDivisionError("a signal the code did not expect")


class FixedPolicy:
    name = "fixed"

    def decide(self, snapshot, findings, state, now):  # type: ignore[no-untyped-def]
        return (state or 0) + 1, [Proposal(self.name, "gate.max_in_flight", 16, "why", 10)]


async def test_a_raising_policy_is_counted_and_the_others_still_propose() -> None:
    loop = _loop(StaticCollector("engine", {"engine.a": 1.0}))
    loop.policies = [BrokenPolicy(), FixedPolicy()]
    await loop.tick(1.0)
    state = await loop.tick(2.0)
    assert [p.policy for p in state.proposals] == ["fixed"]
    assert state.stats.policy_errors == {"broken": 2, "fixed": 0}
    assert loop.policy_state("fixed") == 2 and loop.policy_state("broken") is None


async def test_listeners_get_each_state_and_ticks_count() -> None:
    loop = _loop(StaticCollector("engine", {"engine.a": 1.0}))
    seen: list[int] = []
    loop.subscribe(lambda s: seen.append(s.stats.ticks))
    await loop.tick(1.0)
    await loop.tick(2.0)
    assert seen == [1, 2]


async def test_non_finite_values_never_reach_the_snapshot() -> None:
    loop = _loop(
        StaticCollector("engine", {"engine.a": float("nan"), "engine.b": float("inf"), "engine.c": 3})
    )
    state = await loop.tick(1.0)
    assert state.snapshot is not None
    assert dict(state.snapshot.values) == {"engine.c": 3.0}


async def test_run_ticks_until_stopped() -> None:
    stop = asyncio.Event()

    class StopAfterTwo(StaticCollector):
        async def collect(self, now: float) -> Reading:
            if self.calls == 1:
                stop.set()
            return await super().collect(now)

    collector = StopAfterTwo("engine", {"engine.a": 1.0})
    loop = Loop([collector], Store(10, 10), interval_s=0.01, source_timeout_s=0.01)
    await asyncio.wait_for(loop.run(stop), timeout=2.0)
    assert loop.state.stats.ticks == 2


async def test_derived_signals_join_the_snapshot_as_their_own_source() -> None:
    def tokens_per_request(values: object, now: float) -> dict[str, float]:
        assert isinstance(values, dict) or hasattr(values, "get")
        return {"derived.x2": 2 * values["engine.a"]}  # type: ignore[index]

    def broken(values: object, now: float) -> dict[str, float]:
        raise RuntimeError("bug")

    loop = Loop(
        [StaticCollector("engine", {"engine.a": 3.0})],
        Store(10, 10),
        interval_s=1.0,
        source_timeout_s=0.1,
        derive=[broken, tokens_per_request],
    )
    state = await loop.tick(1.0)
    assert state.snapshot is not None
    assert state.snapshot.get("derived.x2") == 6.0 and state.snapshot.get("engine.a") == 3.0
    assert state.snapshot.readings["derived"].status is SourceStatus.OK


class AheadCollector(StaticCollector):
    """A source read over HTTP: the loop may start it before the tick. Records when it ran (loop time)."""

    ahead_of_tick = True

    def __init__(
        self, name: str, values: dict[str, float], work_s: float = 0.0, hang_from_call: int | None = None
    ) -> None:
        super().__init__(name, values)
        self.work_s, self.hang_from_call = work_s, hang_from_call
        self.hanging = asyncio.Event()
        self.finished_at: list[float] = []
        self.cancelled = False

    async def collect(self, now: float) -> Reading:
        try:
            if self.hang_from_call is not None and self.calls + 1 >= self.hang_from_call:
                self.hanging.set()
                await asyncio.Event().wait()
            await asyncio.sleep(self.work_s)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        self.finished_at.append(asyncio.get_running_loop().time())
        return await super().collect(now)


class InTickCollector(StaticCollector):
    """Records the loop time at which the tick called it: when the tick began collecting."""

    def __init__(self, name: str, values: dict[str, float]) -> None:
        super().__init__(name, values)
        self.called_at: list[float] = []

    async def collect(self, now: float) -> Reading:
        self.called_at.append(asyncio.get_running_loop().time())
        return await super().collect(now)


def _stop_after(ticks: int, stop: asyncio.Event, states: list[AgentState]) -> Callable[[AgentState], None]:
    def listener(state: AgentState) -> None:
        states.append(state)
        if len(states) >= ticks:
            stop.set()

    return listener


async def test_run_reads_http_sources_ahead_of_the_tick_and_keeps_when_they_were_read() -> None:
    engine = AheadCollector("engine", {"engine.a": 1.0}, work_s=0.01)
    nvml = InTickCollector("nvml", {"nvml.gpu0.x": 2.0})
    loop = Loop([engine, nvml], Store(10, 10), interval_s=0.3, source_timeout_s=0.2, lead_s=0.1)
    stop, states = asyncio.Event(), list[AgentState]()
    loop.subscribe(_stop_after(3, stop, states))
    await asyncio.wait_for(loop.run(stop), timeout=5.0)
    assert len(states) == 3
    # the first tick comes at once, its reads with it; every later one finds them taken 0.1 s before
    later = zip(states[1:], engine.finished_at[1:], nvml.called_at[1:], strict=True)
    for state, finished, tick_began in later:
        snapshot = state.snapshot
        assert snapshot is not None and snapshot.get("engine.a") == 1.0 and snapshot.get("nvml.gpu0.x") == 2.0
        # the engine was read ~0.1 s before the snapshot, and its reading says so; NVML at the tick itself
        assert 0.05 < snapshot.now - snapshot.readings["engine"].observed_at < 0.3
        assert snapshot.readings["nvml"].observed_at == snapshot.now
        # ...and was in before the tick began: the tick did not wait for it
        assert finished < tick_began


async def test_a_tick_driven_by_hand_reads_every_source_inside_it() -> None:
    engine = AheadCollector("engine", {"engine.a": 1.0})
    loop = Loop([engine], Store(10, 10), interval_s=1.0, source_timeout_s=0.1, lead_s=0.1)
    state = await loop.tick(50.0)
    assert state.snapshot is not None and state.snapshot.readings["engine"].observed_at == 50.0


async def test_an_ahead_source_still_out_at_the_tick_is_cut_at_its_own_deadline() -> None:
    engine = AheadCollector("engine", {}, hang_from_call=2)
    loop = Loop([engine], Store(10, 10), interval_s=0.4, source_timeout_s=0.15, lead_s=0.1)
    stop, states = asyncio.Event(), list[AgentState]()
    loop.subscribe(_stop_after(2, stop, states))
    await asyncio.wait_for(loop.run(stop), timeout=5.0)
    second = states[1]
    reading = second.snapshot.readings["engine"] if second.snapshot else None
    assert reading is not None and reading.status is SourceStatus.ERROR
    assert "no answer within 0.15 s" in (reading.error or "")
    # the deadline counts from when the read started (0.1 s before the tick), not from the tick
    assert second.stats.last_collect_s < 0.12


async def test_stopping_between_the_read_ahead_and_the_tick_cancels_the_read() -> None:
    engine = AheadCollector("engine", {}, hang_from_call=2)  # the first tick's read answers, the next hangs
    loop = Loop([engine], Store(10, 10), interval_s=2.0, source_timeout_s=1.5, lead_s=1.0)
    stop = asyncio.Event()
    run = asyncio.create_task(loop.run(stop))
    await asyncio.wait_for(engine.hanging.wait(), timeout=3.0)  # read 1 s before the second tick
    stop.set()
    await asyncio.wait_for(run, timeout=1.0)  # not the 1.5 s source deadline
    assert engine.cancelled and loop.state.stats.ticks == 1


def test_the_lead_is_at_most_half_a_tick() -> None:
    assert Loop([], Store(10, 10), interval_s=0.2, source_timeout_s=0.1, lead_s=1.0).lead_s == 0.1
    assert Loop([], Store(10, 10), interval_s=1.0, source_timeout_s=0.1, lead_s=-1).lead_s == 0.0
