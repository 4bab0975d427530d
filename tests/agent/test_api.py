from __future__ import annotations

from typing import Any

from agent.api import build_app
from agent.exporter import Exporter
from agent.loop import Loop
from agent.store import Store
from detectors.snapshot import Reading, SourceStatus


class OneValue:
    name = "engine"

    async def collect(self, now: float) -> Reading:
        return Reading("engine", now, SourceStatus.OK, {"engine.requests_running": 4.0})

    async def close(self) -> None:
        pass


def _app(now: list[float]) -> tuple[Any, Loop]:
    loop = Loop([OneValue()], Store(10, 10), interval_s=1.0, source_timeout_s=0.5)
    exporter = Exporter()
    loop.subscribe(exporter.publish)
    return build_app(loop, exporter, clock=lambda: now[0]), loop


async def test_readyz_is_503_until_the_first_tick_then_200(aiohttp_client: Any) -> None:
    now = [100.0]
    app, loop = _app(now)
    client = await aiohttp_client(app)
    assert (await client.get("/readyz")).status == 503
    await loop.tick(100.0)
    assert (await client.get("/readyz")).status == 200
    now[0] = 200.0  # the loop has not ticked for 100 s: wedged
    response = await client.get("/readyz")
    assert response.status == 503
    assert "last tick" in (await response.json())["reason"]


async def test_healthz_state_and_metrics(aiohttp_client: Any) -> None:
    now = [1.0]
    app, loop = _app(now)
    client = await aiohttp_client(app)
    await loop.tick(1.0)
    assert (await client.get("/healthz")).status == 200
    state = await (await client.get("/api/state")).json()
    assert state["values"]["engine.requests_running"] == 4.0
    assert state["sources"]["engine"]["status"] == "ok"
    metrics = await (await client.get("/metrics")).text()
    assert "servepilot_engine_requests_running 4.0" in metrics
    assert "servepilot_engine_up 1.0" in metrics
