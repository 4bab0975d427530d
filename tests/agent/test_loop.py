from __future__ import annotations

import asyncio

from agent.loop import Loop
from agent.store import Store
from detectors.base import Finding, Severity
from detectors.snapshot import Reading, Snapshot, SourceStatus


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
    assert state.stats.detector_errors == {"broken": 1}


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
