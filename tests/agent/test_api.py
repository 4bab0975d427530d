from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

from agent.api import build_app, build_gate_app
from agent.exporter import Exporter
from agent.gate.upstreams import UpstreamPool
from agent.loop import Loop
from agent.store import Store
from detectors.snapshot import Reading, SourceStatus
from detectors.stall import EngineStallDetector


class OneValue:
    name = "engine"

    async def collect(self, now: float) -> Reading:
        return Reading("engine", now, SourceStatus.OK, {"engine.requests_running": 4.0})

    async def close(self) -> None:
        pass


def _app(now: list[float], **options: Any) -> tuple[Any, Loop]:
    detectors = [EngineStallDetector(stall_s=30)]
    loop = Loop([OneValue()], Store(10, 10), interval_s=1.0, source_timeout_s=0.5, detectors=detectors)
    exporter = Exporter()
    loop.subscribe(exporter.publish)
    return build_app(loop, exporter, clock=lambda: now[0], **options), loop


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
    healthz = await client.get("/healthz")
    assert healthz.status == 200 and healthz.headers["Server"] == "servepilot"  # no aiohttp version
    state = await (await client.get("/api/state")).json()
    assert state["values"]["engine.requests_running"] == 4.0
    assert state["sources"]["engine"]["status"] == "ok"
    metrics = await (await client.get("/metrics")).text()
    assert "servepilot_engine_requests_running 4.0" in metrics
    assert "servepilot_engine_up 1.0" in metrics
    # OpenMetrics for a scraper that asks for it, as Prometheus does: it carries the gate's exemplars
    asked = await client.get("/metrics", headers={"Accept": "application/openmetrics-text;version=1.0.0"})
    assert asked.headers["Content-Type"].startswith("application/openmetrics-text")
    text = await asked.text()
    assert "servepilot_engine_requests_running 4.0" in text and text.endswith("# EOF\n")


async def test_readyz_is_503_while_the_engine_is_stalled_unless_turned_off(aiohttp_client: Any) -> None:
    """The engine holds 4 requests and no progress signal moves: after 30 s the stall detector finds it
    hung. Its own /health still answers, so the sidecar's readiness is what takes the pod out."""
    for unready, status in ((True, 503), (False, 200)):
        now = [100.0]
        app, loop = _app(now, unready_on_engine_stall=unready)
        client = await aiohttp_client(app)
        await loop.tick(100.0)
        assert (await client.get("/readyz")).status == 200
        now[0] = 131.0
        await loop.tick(131.0)
        response = await client.get("/readyz")
        assert response.status == status
        if unready:
            body = await response.json()
            assert body == {
                "status": "engine_stalled",
                "reason": "engine stalled: 4 request(s) held, no progress for 31s",
            }


async def test_readyz_is_503_while_the_gate_has_no_healthy_upstream(aiohttp_client: Any) -> None:
    """Beside a vLLM killed -9 under load the gate answered 716 requests 502 in 38 s: with no upstream
    healthy it can serve nothing, and an engine whose process stays up while its /health fails keeps the
    pod in the Service for the minute its own liveness probe takes."""
    now = [100.0]
    pool = UpstreamPool({"primary": "http://127.0.0.1:9", "small": "http://127.0.0.1:10"}, {"primary": 1})
    app, loop = _app(now, upstreams=pool)
    client = await aiohttp_client(app)
    await loop.tick(100.0)
    pool.mark("primary", False, 100.0, "ClientConnectorError: refused")
    assert (await client.get("/readyz")).status == 200  # the small model still serves
    pool.mark("small", False, 100.0, "health check returned HTTP 503")
    response = await client.get("/readyz")
    assert response.status == 503
    assert await response.json() == {
        "status": "no_upstream",
        "reason": "primary: ClientConnectorError: refused; small: health check returned HTTP 503",
    }
    pool.mark("primary", True, 105.0)  # back: ready again at its next health check
    assert (await client.get("/readyz")).status == 200


async def test_engine_livez_fails_only_after_a_long_stall_and_only_on_fresh_evidence(
    aiohttp_client: Any,
) -> None:
    """For the engine container's liveness probe: the kubelet restarts a hung engine, never a healthy one
    whose sidecar is wedged, and nothing restarts unless ``agent.engine_restart_stall_s`` says so."""
    for restart_after, status_at_400 in ((300.0, 503), (0.0, 200)):
        now = [100.0]
        app, loop = _app(now, engine_restart_stall_s=restart_after)
        client = await aiohttp_client(app)
        assert (await client.get("/engine/livez")).status == 200  # no tick yet: no evidence
        await loop.tick(100.0)  # the 4 held requests' last progress (the stall detector's since)
        now[0] = 131.0
        await loop.tick(131.0)
        assert (await client.get("/readyz")).status == 503  # stalled: out of the Service at once
        assert (await client.get("/engine/livez")).status == 200  # but not restarted yet
        for t in (*range(141, 400, 10), 399):  # the loop ticks on through the stall (every 10 s here)
            now[0] = float(t)
            await loop.tick(float(t))
        assert (await client.get("/engine/livez")).status == 200
        now[0] = 400.0
        await loop.tick(400.0)
        response = await client.get("/engine/livez")
        assert response.status == status_at_400
        if restart_after:
            assert await response.json() == {
                "status": "engine_hung",
                "reason": "engine stalled: 4 request(s) held, no progress for 300s; restart: stalled past "
                "agent.engine_restart_stall_s 300 s",
                "stalled_s": 300.0,
            }
        now[0] = 420.0  # the sidecar's loop stopped ticking: its evidence is stale, so no verdict
        assert (await client.get("/engine/livez")).status == 200


async def test_the_standalone_gates_port_serves_its_registry_and_is_unready_with_no_upstream_up(
    aiohttp_client: Any,
) -> None:
    """``servepilot gate``: /metrics on the gate's own port is the engine's, so its metrics have a port of
    their own; /readyz there is 503, naming why, while no upstream is healthy."""
    registry = CollectorRegistry()
    Counter("servepilot_gate_requests", "Requests.", registry=registry).inc(3)
    pool = UpstreamPool({"primary": "http://127.0.0.1:9", "small": "http://127.0.0.1:10"}, {"primary": 1})
    client = await aiohttp_client(build_gate_app(registry, pool))
    assert "servepilot_gate_requests_total 3.0" in await (await client.get("/metrics")).text()
    assert (await client.get("/healthz")).status == 200
    ready = await client.get("/readyz")
    assert ready.headers["Server"] == "servepilot"
    assert ready.status == 200 and (await ready.json())["healthy_upstreams"] == ["primary", "small"]
    pool.mark("primary", False, 1.0, "stalled: 2 streaming request(s) held, no byte from it for 60 s")
    assert (await (await client.get("/readyz")).json())["healthy_upstreams"] == ["small"]
    pool.mark("small", False, 1.0, "health check returned HTTP 503")
    unready = await client.get("/readyz")
    assert unready.status == 503
    upstreams = await (await client.get("/api/upstreams")).json()
    assert upstreams["primary"] == {
        "url": "http://127.0.0.1:9",
        "weight": 1.0,
        "healthy": False,
        "reason": "stalled: 2 streaming request(s) held, no byte from it for 60 s",
        "checked_at": 1.0,
    }
    assert (
        upstreams["small"]["weight"] == 0.0
        and upstreams["small"]["reason"] == "health check returned HTTP 503"
    )
    assert (await unready.json())["reason"] == (
        "primary: stalled: 2 streaming request(s) held, no byte from it for 60 s; "
        "small: health check returned HTTP 503"
    )


async def test_the_agent_lists_the_gates_upstreams_only_with_a_gate(aiohttp_client: Any) -> None:
    """Why is an upstream out? The log said it once; ``/api/upstreams`` says it whenever asked."""
    pool = UpstreamPool({"primary": "http://svc:s3cret@127.0.0.1:9"}, {"primary": 1})
    loop = Loop([OneValue()], Store(10, 10), interval_s=1.0, source_timeout_s=0.5)
    with_gate = await aiohttp_client(build_app(loop, Exporter(), upstreams=pool))
    primary = (await (await with_gate.get("/api/upstreams")).json())["primary"]
    assert primary["healthy"] is True and primary["url"] == "http://127.0.0.1:9"  # no credentials shown
    without = await aiohttp_client(build_app(loop, Exporter()))
    assert (await without.get("/api/upstreams")).status == 404


async def test_readyz_is_503_draining_once_the_shutdown_began(aiohttp_client: Any) -> None:
    """SIGTERM: the gate still serves for ``gate.shutdown_delay_s``, and a load balancer that polls
    readiness stops sending meanwhile; both the sidecar's and the standalone gate's say so."""
    shutting = [False]
    pool = UpstreamPool({"primary": "http://127.0.0.1:9"}, {"primary": 1})
    app, loop = _app([100.0], upstreams=pool, shutting_down=lambda: shutting[0])
    sidecar = await aiohttp_client(app)
    gate = await aiohttp_client(build_gate_app(CollectorRegistry(), pool, lambda: shutting[0]))
    await loop.tick(100.0)
    assert (await sidecar.get("/readyz")).status == 200 and (await gate.get("/readyz")).status == 200
    shutting[0] = True
    for client in (sidecar, gate):
        response = await client.get("/readyz")
        assert response.status == 503
        assert await response.json() == {"status": "draining", "reason": "shutting down"}
