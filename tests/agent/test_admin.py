"""Operator override routes: bearer token from a file, constant-time check, pause/pin/breaker, actions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from agent.admin import add_admin_routes, load_token
from agent.audit import Action, AuditLog
from agent.config import AuditConfig
from agent.modes import Actuation
from policies.registry import default_arbiter

TOKEN = "s3cret-token-0123456789"


@pytest.fixture
async def admin() -> AsyncIterator[tuple[str, Actuation, AuditLog]]:
    audit = AuditLog(AuditConfig(path=None), CollectorRegistry())
    actuation = Actuation("act", audit)
    limit = {"value": 64}

    async def read() -> int:
        return limit["value"]

    async def write(value: int) -> int:
        limit["value"] = value
        return value

    def upstream(value: object) -> str | None:
        return (
            None
            if value in ("primary", "fp8")
            else f"route.upstream must be one of primary, fp8, got {value!r}"
        )

    actuation.bind("batch.max_in_flight", read, write)
    actuation.bind("route.upstream", read, write, upstream)
    actuation.bounds = default_arbiter((8.0, 512.0)).check
    app = web.Application()
    add_admin_routes(app, actuation, audit, TOKEN)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", actuation, audit
    await runner.cleanup()


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_writes_without_the_token_get_401(admin: tuple[str, Actuation, AuditLog]) -> None:
    url, actuation, _ = admin
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = await s.post(url + "/api/admin/pause", headers=headers)
            assert resp.status == 401 and "bearer token" in (await resp.json())["error"]
    assert not actuation.paused


async def test_pause_and_resume(admin: tuple[str, Actuation, AuditLog]) -> None:
    url, actuation, _ = admin
    async with aiohttp.ClientSession() as s:
        assert (await (await s.post(url + "/api/admin/pause", headers=AUTH)).json())["paused"] is True
        assert actuation.paused
        await s.post(url + "/api/admin/resume", headers=AUTH)
    assert not actuation.paused


async def test_pin_and_unpin_a_knob(admin: tuple[str, Actuation, AuditLog]) -> None:
    url, actuation, _ = admin
    async with aiohttp.ClientSession() as s:
        await s.post(url + "/api/admin/pin", headers=AUTH, json={"knob": "batch.max_in_flight", "value": 32})
        assert actuation.pins == {"batch.max_in_flight": 32}
        assert (await s.delete(url + "/api/admin/pin/batch.max_in_flight", headers=AUTH)).status == 200
        assert (await s.delete(url + "/api/admin/pin/batch.max_in_flight", headers=AUTH)).status == 404
    assert actuation.pins == {}


@pytest.mark.parametrize(
    ("knob", "value", "error"),
    [
        (
            "batch.max_inflight",
            16,
            "no knob 'batch.max_inflight' is bound here; bound knobs: batch.max_in_flight",
        ),
        ("batch.max_in_flight", 100000, "batch.max_in_flight must be in [8, 512], got 100000"),
        ("batch.max_in_flight", "abc", "batch.max_in_flight takes a number, got 'abc'"),
        ("route.upstream", "fp16", "route.upstream must be one of primary, fp8, got 'fp16'"),
    ],
)
async def test_a_pin_the_knob_cannot_take_is_refused_with_the_reason(
    admin: tuple[str, Actuation, AuditLog], knob: str, value: object, error: str
) -> None:
    """Seen live: each of these was answered 200 and pinned; the typo pinned nothing, 100000 opened the
    gate past policies.batch_max, and a string on an integer engine knob failed, audited, every tick."""
    url, actuation, _ = admin
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url + "/api/admin/pin", headers=AUTH, json={"knob": knob, "value": value})
        assert resp.status == 400
        assert error in (await resp.json())["error"]
    assert actuation.pins == {}


async def test_force_and_release_a_breaker_level(admin: tuple[str, Actuation, AuditLog]) -> None:
    url, actuation, _ = admin
    async with aiohttp.ClientSession() as s:
        await s.post(url + "/api/admin/breaker", headers=AUTH, json={"level": 2})
        assert actuation.forced == {"breaker.level": 2}
        bad = await s.post(url + "/api/admin/breaker", headers=AUTH, json={"level": "high"})
        assert bad.status == 400
        await s.post(url + "/api/admin/breaker", headers=AUTH, json={"level": None})
    assert actuation.forced == {}


async def test_a_breaker_level_without_its_upstream_cannot_be_forced() -> None:
    """With primary and small only, L2 (fp8) is refused with the usable levels named; L3 is accepted."""
    audit = AuditLog(AuditConfig(path=None), CollectorRegistry())
    actuation = Actuation("act", audit)
    app = web.Application()
    add_admin_routes(app, actuation, audit, TOKEN, breaker_levels=(0, 1, 3))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/api/admin/breaker"
    try:
        async with aiohttp.ClientSession() as s:
            bad = await s.post(url, headers=AUTH, json={"level": 2})
            assert bad.status == 400 and "must be one of 0, 1, 3" in (await bad.json())["error"]
            assert actuation.forced == {}
            assert (await s.post(url, headers=AUTH, json={"level": 3})).status == 200
    finally:
        await runner.cleanup()
    assert actuation.forced == {"breaker.level": 3}


async def test_each_accepted_override_is_one_audit_record_and_a_refused_one_none(
    admin: tuple[str, Actuation, AuditLog],
) -> None:
    """Until 2026-12-06 only a pin's effect reached the audit log, and only when it moved the knob: a
    pause during an incident, who forced the breaker and when, were nowhere."""
    url, _, audit = admin
    async with aiohttp.ClientSession() as s:
        for method, path, doc in [
            ("POST", "pause", None),
            ("POST", "resume", None),
            ("POST", "pin", {"knob": "batch.max_in_flight", "value": 32}),
            ("POST", "pin", {"knob": "batch.max_in_flight", "value": 100_000}),  # past the bounds: refused
            ("DELETE", "pin/batch.max_in_flight", None),
            ("DELETE", "pin/batch.max_in_flight", None),  # not pinned any more: 404
            ("POST", "breaker", {"level": 1}),
            ("POST", "breaker", {"level": "high"}),  # refused
            ("POST", "breaker", {"level": None}),
        ]:
            await s.request(method, f"{url}/api/admin/{path}", headers=AUTH, json=doc)
        listed = (await (await s.get(url + "/api/actions")).json())["actions"][::-1]
    assert [(a["knob"], a["from"], a["to"]) for a in listed] == [
        ("actuation.paused", False, True),
        ("actuation.paused", True, False),
        ("batch.max_in_flight", None, 32),
        ("batch.max_in_flight", 32, None),
        ("breaker.forced", None, 1),
        ("breaker.forced", 1, None),
    ]
    assert all(a["policy"] == "operator" and a["result"] == "ok" and a["mode"] == "act" for a in listed)
    assert listed[0]["reason"] == "actuation paused by an operator (admin API, from 127.0.0.1)"
    assert listed[4]["reason"].startswith("breaker forced to L1 by an operator")
    assert audit.recent(100) == listed[::-1]


async def test_actions_are_listed_newest_first(admin: tuple[str, Actuation, AuditLog]) -> None:
    url, _, audit = admin
    for i in range(3):
        audit.record(Action(float(i), "gate.limit", 64, 60 - i, "r", "batch", "act", "ok"))
    async with aiohttp.ClientSession() as s:
        doc = await (await s.get(url + "/api/actions?limit=2")).json()
    assert [a["to"] for a in doc["actions"]] == [58, 59]


async def test_without_a_token_the_write_routes_are_disabled() -> None:
    audit = AuditLog(AuditConfig(path=None), CollectorRegistry())
    app = web.Application()
    add_admin_routes(app, Actuation("act", audit), audit, None)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(f"http://127.0.0.1:{runner.addresses[0][1]}/api/admin/pause")
            assert resp.status == 503 and "admin_token_file" in (await resp.json())["error"]
    finally:
        await runner.cleanup()


def test_token_file_is_read_and_short_tokens_refused(tmp_path: Path) -> None:
    good, short = tmp_path / "good", tmp_path / "short"
    good.write_text(TOKEN + "\n")
    short.write_text("abc")
    assert load_token(good) == TOKEN
    with pytest.raises(ValueError, match="shorter than 16"):
        load_token(short)
    with pytest.raises(ValueError, match="cannot read admin token file"):
        load_token(tmp_path / "missing")


async def _reload_app(reload: object) -> tuple[web.AppRunner, str]:
    audit = AuditLog(AuditConfig(path=None), CollectorRegistry())
    app = web.Application()
    add_admin_routes(app, Actuation("act", audit), audit, TOKEN, reload=reload)  # type: ignore[arg-type]
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.mark.parametrize(
    ("result", "status"), [("applied", 200), ("unchanged", 200), ("invalid", 400), ("refused", 409)]
)
async def test_reload_answers_the_result_with_its_status(result: str, status: int) -> None:
    from agent.reload import ReloadResult

    triggers: list[str] = []

    def reload(trigger: str) -> ReloadResult:
        triggers.append(trigger)
        return ReloadResult(result, f"one line about {result}", {"gate.lines.a.requests_per_min": (1.0, 2.0)})

    runner, url = await _reload_app(reload)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/api/admin/reload") as r:
                assert r.status == 401  # a reload is a write: the token is required
            async with s.post(f"{url}/api/admin/reload", headers=AUTH) as r:
                assert r.status == status
                doc = await r.json()
    finally:
        await runner.cleanup()
    assert triggers == ["admin API"]
    assert doc["result"] == result and doc["message"] == f"one line about {result}"
    assert doc["changed"] == {"gate.lines.a.requests_per_min": {"from": 1.0, "to": 2.0}}
    assert ("error" in doc) == (status != 200)


async def test_reload_without_a_config_file_is_404() -> None:
    runner, url = await _reload_app(None)
    try:
        async with aiohttp.ClientSession() as s, s.post(f"{url}/api/admin/reload", headers=AUTH) as r:
            assert r.status == 404
            assert "not started with --config" in (await r.json())["error"]
    finally:
        await runner.cleanup()
