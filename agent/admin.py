"""Operator override routes on the agent API: pause/resume actuation, pin a knob, force a breaker level.

Mount with :func:`add_admin_routes` on the agent's aiohttp app (it listens on loopback by default).
Writes need ``Authorization: Bearer <token>``; the token is read once from a file
(:func:`load_token`) and compared in constant time (``hmac.compare_digest``), so response timing says
nothing about how much of a guess was right. Each accepted override is one audit record, policy
``operator``: pause and resume (knob ``actuation.paused``), a pin and an unpin (the knob; ``to`` is None
when unpinned), a forced or released breaker level (``breaker.forced``), a canary start or abort
(``canary``), with the caller's address. Until 2026-12-06 only a pin's effect was recorded (and only when
it moved the knob): who paused actuation during an incident was nowhere.

Without a token file the write routes answer 503: an override nobody can authenticate is an override
anybody could use. ``GET /api/actions`` is read-only and open, like ``/api/state``.

Routes::

    GET  /api/actions?limit=N          recent actions, newest first
    GET  /api/admin/state              mode, paused, pins, forced values, bound knobs
    POST /api/admin/pause              stop writing knobs (decisions are still audited as "paused")
    POST /api/admin/resume
    POST /api/admin/pin                {"knob": "batch.max_in_flight", "value": 32}; 400 with the reason when
                                       the knob is not bound here, the value is outside the bounds the
                                       policies are held to, or its actuator would not take it
    DELETE /api/admin/pin/{knob}
    POST /api/admin/breaker            {"level": 2}   or {"level": null} to release
    GET  /api/admin/canary             precision canary: phase, step, fp8 share, reason, perplexities
    POST /api/admin/canary             start (or restart) a rollout: perplexity gate, then the steps
    DELETE /api/admin/canary           abort: roll back to 0 % fp8 now
    POST /api/admin/reload             re-read the config file (agent/reload.py): 200 applied or unchanged,
                                       400 invalid, 409 changes a field that needs a restart

The canary routes answer 404 while ``canary.enabled`` is false.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agent.audit import Action, AuditLog
from agent.modes import Actuation

if TYPE_CHECKING:
    from agent.canary_live import LiveCanary
    from agent.reload import ReloadResult


def load_token(path: str | Path) -> str:
    """The bearer token in ``path``, whitespace stripped; ValueError with one line if unusable."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as error:
        raise ValueError(f"cannot read admin token file {str(path)!r}: {error.strerror or error}") from None
    if len(token) < 16:
        raise ValueError(f"admin token in {str(path)!r} is shorter than 16 characters")
    return token


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def add_admin_routes(
    app: web.Application,
    actuation: Actuation,
    audit: AuditLog,
    token: str | None,
    canary: LiveCanary | None = None,
    clock: Any = time.time,
    *,
    breaker_levels: tuple[int, ...] = (0, 1, 2, 3),
    reload: Callable[[str], ReloadResult] | None = None,
) -> None:
    """Add the override routes and ``GET /api/actions`` to ``app`` (before it starts); the canary
    routes act on ``canary`` (``clock`` gives the time a start or abort is recorded at). A forced breaker
    level must be one of ``breaker_levels`` (those whose upstream the gate has)."""
    expected = token.encode() if token else None

    def authorized(request: web.Request) -> web.Response | None:
        if expected is None:
            return _error(503, "admin routes are disabled: set actuators.admin_token_file")
        header = request.headers.get("Authorization", "")
        presented = header[7:].strip().encode() if header[:7].lower() == "bearer " else b""
        if not hmac.compare_digest(presented, expected):
            return web.json_response(
                {"error": "missing or wrong bearer token"}, status=401, headers={"WWW-Authenticate": "Bearer"}
            )
        return None

    def overridden(request: web.Request, knob: str, before: Any, after: Any, what: str) -> None:
        """Audit an operator's override (``what`` it did), once accepted."""
        reason = f"{what} by an operator (admin API, from {request.remote or 'an unknown address'})"
        audit.record(Action(clock(), knob, before, after, reason, "operator", actuation.mode.value, "ok"))

    async def body(request: web.Request) -> dict[str, Any]:
        try:
            doc = json.loads(await request.text() or "{}")
        except ValueError:
            raise web.HTTPBadRequest(
                text=json.dumps({"error": "body is not valid JSON"}), content_type="application/json"
            ) from None
        if not isinstance(doc, dict):
            raise web.HTTPBadRequest(
                text=json.dumps({"error": "body must be a JSON object"}), content_type="application/json"
            )
        return doc

    async def actions(request: web.Request) -> web.Response:
        try:
            limit = max(1, min(10_000, int(request.query.get("limit", "100"))))
        except ValueError:
            return _error(400, "limit must be an integer")
        return web.json_response({"actions": audit.recent(limit)})

    async def state(request: web.Request) -> web.Response:
        return authorized(request) or web.json_response(actuation.state())

    async def pause(request: web.Request) -> web.Response:
        if (denied := authorized(request)) is not None:
            return denied
        overridden(request, "actuation.paused", actuation.paused, True, "actuation paused")
        actuation.paused = True
        return web.json_response(actuation.state())

    async def resume(request: web.Request) -> web.Response:
        if (denied := authorized(request)) is not None:
            return denied
        overridden(request, "actuation.paused", actuation.paused, False, "actuation resumed")
        actuation.paused = False
        return web.json_response(actuation.state())

    async def pin(request: web.Request) -> web.Response:
        if (denied := authorized(request)) is not None:
            return denied
        doc = await body(request)
        knob, value = doc.get("knob"), doc.get("value")
        if not isinstance(knob, str) or not knob:
            return _error(400, "knob must be a non-empty string")
        if value is None or isinstance(value, dict | list):
            return _error(400, "value must be a number, string or boolean")
        if (why := actuation.check(knob, value)) is not None:
            return _error(400, why)
        overridden(request, knob, actuation.pins.get(knob), value, "pinned")
        actuation.pins[knob] = value
        return web.json_response(actuation.state())

    async def unpin(request: web.Request) -> web.Response:
        if (denied := authorized(request)) is not None:
            return denied
        knob = request.match_info["knob"]
        if (value := actuation.pins.pop(knob, None)) is None:
            return _error(404, f"knob {knob!r} is not pinned")
        overridden(request, knob, value, None, "unpinned (the policies decide it again)")
        return web.json_response(actuation.state())

    async def breaker(request: web.Request) -> web.Response:
        if (denied := authorized(request)) is not None:
            return denied
        level = (await body(request)).get("level", "missing")
        before = actuation.forced.get("breaker.level")
        if level is None:
            actuation.forced.pop("breaker.level", None)
            overridden(request, "breaker.forced", before, None, "breaker released to its rules")
        elif isinstance(level, int) and not isinstance(level, bool) and level in breaker_levels:
            actuation.forced["breaker.level"] = level
            overridden(request, "breaker.forced", before, level, f"breaker forced to L{level}")
        else:
            usable = ", ".join(map(str, breaker_levels))
            return _error(
                400,
                f"level must be one of {usable} (L2 needs an fp8 upstream, L3 a small one) or null, "
                f"got {level!r}",
            )
        return web.json_response(actuation.state())

    async def canary_route(request: web.Request) -> web.Response:
        if (denied := authorized(request)) is not None:
            return denied
        if canary is None:
            return _error(404, "the precision canary is disabled: set canary.enabled")
        if request.method == "GET":
            return web.json_response(canary.status())
        before = canary.status().get("phase")
        started = request.method == "POST"
        doc = canary.start(clock()) if started else canary.abort(clock())
        overridden(
            request, "canary", before, doc.get("phase"), "canary started" if started else "canary aborted"
        )
        return web.json_response(doc)

    async def reload_route(request: web.Request) -> web.Response:
        if (denied := authorized(request)) is not None:
            return denied
        if reload is None:
            return _error(404, "no config file to reload: the agent was not started with --config")
        result = reload("admin API")
        doc = result.to_json()
        if not result.ok:
            doc["error"] = result.message
        return web.json_response(doc, status={"invalid": 400, "refused": 409}.get(result.result, 200))

    app.router.add_get("/api/actions", actions)
    app.router.add_post("/api/admin/reload", reload_route)
    app.router.add_get("/api/admin/state", state)
    app.router.add_post("/api/admin/pause", pause)
    app.router.add_post("/api/admin/resume", resume)
    app.router.add_post("/api/admin/pin", pin)
    app.router.add_delete("/api/admin/pin/{knob}", unpin)
    app.router.add_post("/api/admin/breaker", breaker)
    app.router.add_get("/api/admin/canary", canary_route)
    app.router.add_post("/api/admin/canary", canary_route)
    app.router.add_delete("/api/admin/canary", canary_route)
