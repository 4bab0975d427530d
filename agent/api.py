"""The agent's HTTP face (aiohttp): ``/metrics``, ``/healthz``, ``/readyz`` and ``/api/state``.

``/healthz`` says the process is alive; ``/readyz`` says the loop has completed a tick recently (a stuck
loop turns it 503, so Kubernetes restarts a wedged sidecar but not one whose engine is merely down).

With the gate, ``/api/upstreams`` lists its upstreams: split, health and why one is out.

``/readyz`` is also 503 while the gate has no healthy upstream (with the gate on): it can serve nothing
then (beside a vLLM killed -9 under load, it answered 716 requests 502 in the 38 s until the engine was
back). An engine container whose process exits is taken out of the Service by the kubelet at once; one
whose process stays while its ``/health`` fails is not, for the minute its liveness probe takes (it
has no readiness probe once started), nor is a pod whose gate sends to upstreams outside it. Unready,
the Service sends new requests to the pod's replicas.

And it is 503 while the ``engine_stall`` detector finds the engine hung (unless
``agent.unready_when_engine_stalled`` is off): the engine's ``/health`` still answers then, so nothing
else takes the pod out of its Service, and every request sent to it would wait for a 503 from the gate.
Unready, the pod gets no new requests; it is ready again at the engine's first progress. Readiness, not
liveness: a restart reloads the weights, which a short or mistaken verdict must never cost.

And it is 503 from the moment the sidecar starts to shut down (SIGTERM) while the gate keeps serving
for ``gate.shutdown_delay_s``: a load balancer that polls readiness stops sending new requests before
the listener closes.

``/engine/livez`` is for the *engine* container's liveness probe, and off unless
``agent.engine_restart_stall_s`` is set: 503 once the engine has been stalled that long (say 15
minutes: no verdict lasts that long by mistake), so the kubelet restarts a hung engine without waiting
for a person. Anything short of that evidence is 200, a wedged sidecar loop included.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from agent.exporter import Exporter
from agent.gate.upstreams import UpstreamPool
from agent.loop import Loop
from agent.server_name import without_versions
from agent.tls import client_certificate_required

#: The detector whose finding makes the pod unready (detectors/stall.py).
ENGINE_STALL = "engine_stall"
LOOP_KEY: web.AppKey[Loop] = web.AppKey("loop", Loop)
EXPORTER_KEY: web.AppKey[Exporter] = web.AppKey("exporter", Exporter)


def build_app(
    loop: Loop,
    exporter: Exporter,
    *,
    clock: Callable[[], float] = time.time,
    unready_on_engine_stall: bool = True,
    upstreams: UpstreamPool | None = None,
    engine_restart_stall_s: float = 0.0,
    client_certificates: bool = False,
    shutting_down: Callable[[], bool] = lambda: False,
) -> web.Application:
    """``client_certificates``: mutual TLS, every path but the probes' needs a verified client
    certificate (:mod:`agent.tls`). ``shutting_down``: true once the gate's shutdown has begun."""
    middlewares = [client_certificate_required] if client_certificates else []
    app = without_versions(web.Application(client_max_size=64 * 1024, middlewares=middlewares))
    app[LOOP_KEY] = loop
    app[EXPORTER_KEY] = exporter

    metrics = _metrics_handler(exporter.registry)
    stale_after = max(5.0, 5 * loop.interval_s)  # no tick for this long: the loop is stuck

    async def readyz(_: web.Request) -> web.Response:
        if shutting_down():
            return _draining_response()
        snap = loop.state.snapshot
        if snap is None:
            return web.json_response({"status": "starting", "reason": "no tick completed yet"}, status=503)
        age = clock() - snap.now
        if age > stale_after:
            reason = f"last tick {age:.1f} s ago (limit {stale_after:g} s)"
            return web.json_response({"status": "stalled", "reason": reason}, status=503)
        if unready_on_engine_stall:
            for finding in loop.state.findings:
                if finding.detector == ENGINE_STALL:
                    return web.json_response(
                        {"status": "engine_stalled", "reason": finding.summary}, status=503
                    )
        if upstreams is not None and (unready := _no_healthy_upstream(upstreams)) is not None:
            return unready
        return web.json_response({"status": "ready", "last_tick_age_s": round(age, 3)})

    async def engine_livez(_: web.Request) -> web.Response:
        """503 once the engine has been stalled ``engine_restart_stall_s``: the engine container's
        liveness probe asks this, so the kubelet restarts a hung engine. 200 on anything short of that
        evidence: the setting off, no tick yet, a wedged loop (the sidecar's fault, not the engine's)."""
        snap = loop.state.snapshot
        if engine_restart_stall_s <= 0 or snap is None:
            return web.json_response({"status": "alive"})
        if clock() - snap.now > stale_after:
            return web.json_response({"status": "alive", "reason": "no recent tick: no verdict"})
        for finding in loop.state.findings:
            stalled_s = snap.now - finding.since
            if finding.detector == ENGINE_STALL and stalled_s >= engine_restart_stall_s:
                limit = f"agent.engine_restart_stall_s {engine_restart_stall_s:g} s"
                why = f"{finding.summary}; restart: stalled past {limit}"
                return web.json_response(
                    {"status": "engine_hung", "reason": why, "stalled_s": round(stalled_s, 1)}, status=503
                )
        return web.json_response({"status": "alive"})

    async def state(_: web.Request) -> web.Response:
        return web.json_response(loop.state.to_json())

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/engine/livez", engine_livez)
    app.router.add_get("/api/state", state)
    if upstreams is not None:
        app.router.add_get("/api/upstreams", _upstreams_handler(upstreams))
    return app


def build_gate_app(
    registry: CollectorRegistry, pool: UpstreamPool, shutting_down: Callable[[], bool] = lambda: False
) -> web.Application:
    """The standalone gate's own face (``servepilot gate``): its metrics, on their own port, since every
    path of the gate's port belongs to the upstream (``/metrics`` there is the engine's). ``/readyz`` is
    503 while no upstream is healthy: the gate would still try them all, but a load balancer with another
    replica should send the request there."""
    app = without_versions(web.Application(client_max_size=64 * 1024))

    async def readyz(_: web.Request) -> web.Response:
        if shutting_down():
            return _draining_response()
        if (unready := _no_healthy_upstream(pool)) is not None:
            return unready
        healthy = [up.name for up in pool.upstreams.values() if up.healthy]
        return web.json_response({"status": "ready", "healthy_upstreams": healthy})

    app.router.add_get("/metrics", _metrics_handler(registry))
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/api/upstreams", _upstreams_handler(pool))
    return app


def _draining_response() -> web.Response:
    return web.json_response({"status": "draining", "reason": "shutting down"}, status=503)


def _no_healthy_upstream(pool: UpstreamPool) -> web.Response | None:
    """The 503 a readiness probe gets while none of the gate's upstreams is healthy (each one's last
    error named), or None."""
    if any(up.healthy for up in pool.upstreams.values()):
        return None
    reasons = "; ".join(f"{up.name}: {up.last_error or 'down'}" for up in pool.upstreams.values())
    return web.json_response({"status": "no_upstream", "reason": reasons}, status=503)


def _upstreams_handler(pool: UpstreamPool) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``GET /api/upstreams``: the gate's upstreams, their split and health, and why one is out (a failed
    health check, or ejected as hung) — what the log said when it went out, asked for at any time."""

    async def upstreams(_: web.Request) -> web.Response:
        return web.json_response(pool.describe())

    return upstreams


def _metrics_handler(registry: CollectorRegistry) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``GET /metrics``: the Prometheus text format, or OpenMetrics for a scraper that asks for it (as
    Prometheus does), which carries the gate's exemplars (a request id on its latency histograms)."""

    async def metrics(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(registry), headers={"Content-Type": content_type})

    return metrics


async def _healthz(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})
