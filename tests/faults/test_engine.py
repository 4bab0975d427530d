"""Engine faults: down, slow, serving garbage, and coming back. The tick always completes, the engine's
reading says what went wrong in one line, and the other sources are untouched."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from agent.collectors.engine_metrics import EngineMetricsCollector
from agent.config import EngineConfig
from agent.loop import Loop
from agent.store import Store
from detectors.snapshot import Reading, SourceStatus
from tests.faults.conftest import app_with, closed_port_url, serve

EXPO = Path(__file__).resolve().parents[1] / "fixtures" / "expo"
VLLM = (EXPO / "vllm-0.32-cpu" / "vllm-0.32.0-cpu-metrics_busy.prom").read_text()


class _Steady:
    """A source that always answers, to show a failing engine does not take the others down."""

    name = "steady"

    async def collect(self, now: float) -> Reading:
        return Reading("steady", now, SourceStatus.OK, {"steady.value": 1.0})

    async def close(self) -> None:
        return None


def _loop(url: str, timeout_s: float = 0.5) -> tuple[Loop, EngineMetricsCollector]:
    engine = EngineMetricsCollector(EngineConfig(url=url, kind="vllm", timeout_s=timeout_s))
    loop = Loop([engine, _Steady()], Store(100, 256), interval_s=1.0, source_timeout_s=timeout_s)
    return loop, engine


async def test_engine_down_is_an_error_reading_and_the_tick_completes() -> None:
    loop, engine = _loop(closed_port_url())
    try:
        state = await loop.tick(100.0)
    finally:
        await engine.close()
    assert state.snapshot is not None
    reading = state.snapshot.readings["engine"]
    assert reading.status is SourceStatus.ERROR and "cannot connect" in (reading.error or "")
    assert state.snapshot.readings["steady"].status is SourceStatus.OK


async def test_a_slow_engine_is_abandoned_at_the_source_deadline() -> None:
    never = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        await never.wait()
        return web.Response(text="")

    async with serve(app_with("/metrics", hang)) as url:
        loop, engine = _loop(url, timeout_s=0.05)
        try:
            state = await asyncio.wait_for(loop.tick(5.0), timeout=5)
        finally:
            never.set()
            await engine.close()
    assert state.snapshot is not None
    reading = state.snapshot.readings["engine"]
    assert reading.status is SourceStatus.ERROR and "\n" not in (reading.error or "")
    assert state.snapshot.readings["steady"].status is SourceStatus.OK


async def test_garbage_metrics_are_an_error_with_one_line_and_no_values() -> None:
    html = (EXPO / "failures" / "garbage.prom").read_text()

    async def garbage(_: web.Request) -> web.Response:
        return web.Response(text=html)

    async with serve(app_with("/metrics", garbage)) as url:
        loop, engine = _loop(url)
        try:
            state = await loop.tick(1.0)
        finally:
            await engine.close()
    assert state.snapshot is not None
    reading = state.snapshot.readings["engine"]
    assert reading.status is not SourceStatus.OK and not reading.values
    assert reading.error and "\n" not in reading.error


async def test_an_engine_that_comes_back_is_read_again_without_a_restart() -> None:
    healthy = {"on": False}

    async def metrics(_: web.Request) -> web.Response:
        if not healthy["on"]:
            return web.Response(status=503, text="loading")
        return web.Response(text=VLLM, content_type="text/plain")

    async with serve(app_with("/metrics", metrics)) as url:
        loop, engine = _loop(url)
        try:
            down = await loop.tick(1.0)
            healthy["on"] = True
            up = await loop.tick(2.0)
        finally:
            await engine.close()
    assert down.snapshot is not None and up.snapshot is not None
    assert "HTTP 503" in (down.snapshot.readings["engine"].error or "")
    assert up.snapshot.readings["engine"].status is SourceStatus.OK
