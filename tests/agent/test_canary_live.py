"""The precision canary, live: two simulator upstreams (fp16 primary, fp8 candidate) behind the gate,
a rollout started through the admin route, the perplexity gate, and the fp8 share stepping up (or
refused). The loop is ticked by hand in virtual time; only the perplexity requests run for real."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from agent import config
from agent.admin import add_admin_routes
from agent.audit import AuditLog
from agent.canary_live import LiveCanary, PerplexityMeter
from agent.engines.launcher import free_port
from agent.modes import Actuation
from agent.sidecar import Sidecar
from detectors.snapshot import SourceStatus
from policies.canary import CanaryState
from simulator.engine import make_core
from simulator.server import SimServer
from tests.simulator.conftest import FakeClock

TOKEN = "canary-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _simulator(precision: str, fp8_ppl_delta: float) -> TestServer:
    clock = FakeClock()
    core = make_core("a100-80g", "llama-2-7b", precision, 64)
    app = SimServer(core, clock=clock, sleep=clock.sleep, fp8_ppl_delta=fp8_ppl_delta).app()
    server = TestServer(app)
    await server.start_server()
    return server


def _cfg(tmp_path: Path, urls: dict[str, str], policy_set: str = "none", **canary: Any) -> config.Config:
    validation = tmp_path / "validation.jsonl"
    validation.write_text(
        '{"text": "The quick brown fox jumps over the lazy dog."}\n\n'
        '{"text": "Perplexity gates keep a quantised model honest about its quality."}\n',
        encoding="utf-8",
    )
    token = tmp_path / "token"
    token.write_text(TOKEN, encoding="utf-8")
    return config.build(
        {
            "agent": {"listen_port": free_port(), "admin_listen_port": None},
            "gate": {
                "enabled": True,
                "listen_port": free_port(),
                "upstreams": urls,
                "split": {"primary": 1.0},
            },
            "actuators": {"mode": "act", "admin_token_file": str(token)},
            "audit": {"path": str(tmp_path / "audit.jsonl")},
            "probe": {"enabled": False},
            "nvml": {"backend": "off"},
            "forecast": {"enabled": False},
            "policies": {"set": policy_set},
            "canary": {
                "enabled": True,
                "validation_file": str(validation),
                "steps": [0.05, 0.25, 1.0],
                "step_s": 10,
                **canary,
            },
        }
    )


class Rig:
    """A sidecar (knobs started, loop ticked by hand) and a client on its admin routes."""

    def __init__(self, sidecar: Sidecar, admin: TestClient[Any, Any]) -> None:
        self.sidecar = sidecar
        self.admin = admin
        self.now = 1_000.0

    async def tick(self, seconds: float = 1.0) -> None:
        self.now += seconds
        await self.sidecar.loop.tick(self.now)
        meter = self.sidecar.canary.meter  # type: ignore[union-attr]
        if meter._task is not None:  # let a started measurement finish before the next tick
            await meter._task

    def fp8_weight(self) -> float:
        return float(self.sidecar.knobs.gate.pool.weights["fp8"])


@pytest.fixture
async def rig_factory(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[Any]:
    opened: list[Any] = []

    async def build(fp8_ppl_delta: float, policy_set: str = "none", **canary: Any) -> Rig:
        primary = await _simulator("fp16", fp8_ppl_delta)
        fp8 = await _simulator("fp8", fp8_ppl_delta)
        opened.extend([primary, fp8])
        urls = {name: str(s.make_url("")).rstrip("/") for name, s in (("primary", primary), ("fp8", fp8))}
        sidecar = Sidecar(_cfg(tmp_path, urls, policy_set, **canary), collectors=[])
        opened.append(sidecar)
        await sidecar.knobs.start()
        rig = Rig(sidecar, None)  # type: ignore[arg-type]
        app = web.Application()
        knob = sidecar.knobs
        add_admin_routes(app, knob.actuation, knob.audit, knob.token, sidecar.canary, lambda: rig.now)
        rig.admin = await aiohttp_client(app)
        return rig

    yield build
    for thing in reversed(opened):
        if isinstance(thing, Sidecar):
            await thing.stop()
        else:
            await thing.close()


async def test_a_rollout_started_by_the_admin_route_passes_the_gate_and_steps_fp8_up(
    rig_factory: Any,
) -> None:
    rig = await rig_factory(0.003)
    await rig.tick()
    assert (await (await rig.admin.get("/api/admin/canary", headers=AUTH)).json())["phase"] == "idle"
    started = await rig.admin.post("/api/admin/canary", headers=AUTH)
    assert started.status == 200 and (await started.json())["phase"] == "gate"
    [record] = [a for a in rig.sidecar.knobs.audit.recent(100) if a["knob"] == "canary"]
    assert (record["from"], record["to"], record["policy"]) == ("idle", "gate", "operator")
    await rig.tick()  # the meter starts measuring both upstreams (and the tick waits for it here)
    await rig.tick()  # the perplexities are in the snapshot; the gate passes
    status = await (await rig.admin.get("/api/admin/canary", headers=AUTH)).json()
    assert status["phase"] == "rolling", status
    assert status["perplexity"]["ppl_delta"] == pytest.approx(0.003, rel=1e-6)
    assert rig.fp8_weight() == pytest.approx(0.05)
    shares = []
    for _ in range(4):
        await rig.tick(10.0)  # healthy for step_s: the next step
        shares.append(rig.fp8_weight())
    assert shares == pytest.approx([0.25, 1.0, 1.0, 1.0])
    status = await (await rig.admin.get("/api/admin/canary", headers=AUTH)).json()
    assert (status["phase"], status["fp8_share"]) == ("promoted", 1.0)
    assert rig.sidecar.knobs.gate.pool.weights["primary"] == 0.0


async def test_the_rollout_holds_its_shares_beside_the_breaker(rig_factory: Any) -> None:
    """With the auto set the breaker runs too. It gives routing back at L0 (route.upstream = primary) and
    the canary sets route.fp8_share: both knobs set the gate's one split. Before the arbiter linked them,
    each tick wrote both, each undoing the other, and both were audited every tick."""
    rig = await rig_factory(0.003, policy_set="auto")
    await rig.admin.post("/api/admin/canary", headers=AUTH)
    shares = []
    for seconds in (1.0, 1.0, 5.0, 5.0, 10.0, 10.0, 10.0):
        await rig.tick(seconds)
        shares.append(rig.fp8_weight())
    assert shares == pytest.approx([0.0, 0.05, 0.05, 0.25, 1.0, 1.0, 1.0])
    routing = [a for a in reversed(rig.sidecar.knobs.audit.recent(100)) if a["knob"].startswith("route.")]
    assert [(a["knob"], a["to"]) for a in routing] == [
        ("route.fp8_share", 0.05),
        ("route.fp8_share", 0.25),
        ("route.fp8_share", 1.0),
    ]


async def test_an_operator_pin_on_the_route_holds_against_the_canarys_share(rig_factory: Any) -> None:
    rig = await rig_factory(0.003)
    await rig.admin.post("/api/admin/canary", headers=AUTH)
    await rig.tick()
    await rig.tick()
    assert rig.fp8_weight() == pytest.approx(0.05)
    rig.sidecar.knobs.actuation.pins["route.upstream"] = "primary"
    for _ in range(3):
        await rig.tick()
        assert rig.fp8_weight() == 0.0
    routing = [
        a["knob"] for a in reversed(rig.sidecar.knobs.audit.recent(100)) if a["knob"].startswith("route.")
    ]
    assert routing == ["route.fp8_share", "route.upstream"]  # the pin applied once, not fought every tick


async def test_an_fp8_perplexity_one_percent_higher_is_refused(rig_factory: Any) -> None:
    rig = await rig_factory(0.01)
    await rig.admin.post("/api/admin/canary", headers=AUTH)
    for _ in range(3):
        await rig.tick()
    status = await (await rig.admin.get("/api/admin/canary", headers=AUTH)).json()
    assert status["phase"] == "rolled_back"
    assert "fp8 refused" in status["reason"] and "+1.00%" in status["reason"]
    assert rig.fp8_weight() == 0.0
    assert rig.sidecar.knobs.gate.pool.weights["primary"] == 1.0


async def test_5xx_answers_through_the_gate_during_a_step_roll_fp8_back(rig_factory: Any) -> None:
    rig = await rig_factory(0.003, failure_limit=0)
    await rig.admin.post("/api/admin/canary", headers=AUTH)
    for _ in range(3):
        await rig.tick()
    assert rig.fp8_weight() == pytest.approx(0.05)
    gate_url = f"http://127.0.0.1:{rig.sidecar.cfg.gate.listen_port}"
    async with aiohttp.ClientSession() as http:
        for url in rig.sidecar.cfg.gate.upstreams.values():
            await http.post(f"{url}/sim/faults", json={"error_rate": 1.0, "error_status": 500})
        for _ in range(4):
            async with http.post(f"{gate_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
                assert r.status >= 500
    await rig.tick()
    status = await (await rig.admin.get("/api/admin/canary", headers=AUTH)).json()
    assert status["phase"] == "rolled_back" and "5xx 100%" in status["reason"], status
    assert rig.fp8_weight() == 0.0


async def test_an_operator_abort_rolls_back_to_no_fp8(rig_factory: Any) -> None:
    rig = await rig_factory(0.003)
    await rig.admin.post("/api/admin/canary", headers=AUTH)
    for _ in range(3):
        await rig.tick()
    assert rig.fp8_weight() == pytest.approx(0.05)
    aborted = await (await rig.admin.delete("/api/admin/canary", headers=AUTH)).json()
    assert (aborted["phase"], aborted["reason"]) == ("rolled_back", "aborted by operator")
    await rig.tick()
    assert rig.fp8_weight() == 0.0


async def test_the_canary_routes_need_the_bearer_token(rig_factory: Any) -> None:
    rig = await rig_factory(0.003)
    assert (await rig.admin.post("/api/admin/canary")).status == 401
    assert (await rig.admin.get("/api/admin/canary", headers={"Authorization": "Bearer wrong"})).status == 401
    assert rig.sidecar.loop.policy_state("canary") is None  # nothing started


async def test_a_failed_measurement_is_an_error_reading_and_is_retried(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, {"primary": "http://127.0.0.1:9", "fp8": "http://127.0.0.1:9"}, retry_s=5)
    state = CanaryState("gate", 0, 100.0, 0, "measuring perplexity")
    wall = [0.0]
    meter = PerplexityMeter(
        cfg.canary, dict(cfg.gate.upstreams), ("some text here",), lambda: state, lambda: wall[0]
    )
    try:
        assert (await meter.collect(101.0)).status is SourceStatus.NO_DATA
        assert meter._task is not None
        await meter._task
        reading = await meter.collect(102.0)
        assert reading.status is SourceStatus.ERROR
        assert reading.error is not None and "upstream 'primary'" in reading.error
        assert meter._task is None  # not retried before retry_s
        wall[0] = 5.0
        await meter.collect(103.0)
        assert meter._task is not None  # retried
    finally:
        await meter.close()


def test_an_unreadable_validation_file_is_a_config_error_at_start(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, {"primary": "http://127.0.0.1:9", "fp8": "http://127.0.0.1:9"})
    (tmp_path / "validation.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(config.ConfigError, match=r"canary\.validation_file validation set .* holds no texts"):
        LiveCanary(cfg)


@pytest.mark.parametrize(
    ("canary", "gate", "message"),
    [
        ({"enabled": True, "validation_file": "v"}, {}, "canary.enabled needs gate.enabled"),
        ({"enabled": True}, {"enabled": True}, "canary.validation_file is required"),
        (
            {"enabled": True, "validation_file": "v"},
            {"enabled": True},
            "canary.candidate 'fp8' is not one of",
        ),
        ({"steps": [0.5, 0.25]}, {}, "canary.steps must be strictly increasing"),
    ],
)
def test_canary_config_is_validated(canary: dict[str, Any], gate: dict[str, Any], message: str) -> None:
    with pytest.raises(config.ConfigError, match=message.replace(".", r"\.")):
        config.build({"canary": canary, "gate": gate})


async def test_the_started_sidecar_serves_the_canary_routes(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, {"primary": "http://127.0.0.1:9", "fp8": "http://127.0.0.1:9"})
    sidecar = Sidecar(cfg, collectors=[])
    await sidecar.start()
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{cfg.agent.listen_port}/api/admin/canary"
            answer = await http.get(url, headers=AUTH)
            assert answer.status == 200 and (await answer.json())["phase"] == "idle"
            # and, with the gate, its upstreams (why one is out: here nothing listens on port 9)
            upstreams = await (
                await http.get(f"http://127.0.0.1:{cfg.agent.listen_port}/api/upstreams")
            ).json()
            assert sorted(upstreams) == ["fp8", "primary"] and upstreams["primary"]["weight"] == 1.0
    finally:
        await sidecar.stop()


async def test_without_the_canary_its_route_is_a_404(aiohttp_client: Any, tmp_path: Path) -> None:
    audit = AuditLog(config.AuditConfig(path=None), CollectorRegistry())
    app = web.Application()
    add_admin_routes(app, Actuation("observe", audit), audit, TOKEN)
    client = await aiohttp_client(app)
    response = await client.post("/api/admin/canary", headers=AUTH)
    assert response.status == 404
    assert "canary.enabled" in (await response.json())["error"]


def test_each_upstream_is_asked_for_the_model_the_gate_sends_it(tmp_path: Path) -> None:
    """An upstream serving another name (``gate.upstream_models``) answers 404 to ``canary.model``."""
    urls = {"primary": "http://127.0.0.1:9", "fp8": "http://127.0.0.1:9"}
    data = _cfg(tmp_path, urls, model="llama-3-8b").model_dump()
    data["gate"]["upstream_models"] = {"fp8": "llama-3-8b-fp8"}
    canary = LiveCanary(config.build(data))
    assert canary.meter.models == {"primary": "llama-3-8b", "fp8": "llama-3-8b-fp8"}


async def test_the_perplexity_reads_carry_the_engines_own_key(tmp_path: Path) -> None:
    """An engine started with ``--api-key`` answers 401 to a read without its key: the canary sends the
    one in ``gate.upstream_api_key_file``, as the gate does."""
    seen: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"error": {"message": "no"}}, status=401)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    key = tmp_path / "engine-key"
    key.write_text("engine-secret-9\n")
    data = _cfg(tmp_path, {"primary": url, "fp8": url}, model="m").model_dump()
    data["gate"]["upstream_api_key_file"] = str(key)
    canary = LiveCanary(config.build(data))
    assert canary.meter.auth == {"Authorization": "Bearer engine-secret-9"}
    state = CanaryState("gate", 0, 100.0, 0, "measuring perplexity")
    meter = canary.meter
    meter.phase = lambda: state
    try:
        await meter.collect(101.0)
        assert meter._task is not None
        await meter._task
        assert (await meter.collect(102.0)).status is SourceStatus.ERROR  # the fake refuses all the same
    finally:
        await meter.close()
        await runner.cleanup()
    assert seen and set(seen) == {"Bearer engine-secret-9"}
