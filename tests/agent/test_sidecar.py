"""Process wiring: listeners (API, admin on its own loopback port), TLS, and a clean stop."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web

from agent import config
from agent.assembly import breaker_levels, build_policies, normal_route
from agent.engines.launcher import free_port as _free_port
from agent.gate.upstreams import engine_upstream
from agent.sidecar import Sidecar
from agent.state import AgentState
from detectors.snapshot import Reading, Snapshot, SourceStatus
from policies.base import Proposal


class OneValue:
    name = "engine"

    async def collect(self, now: float) -> Reading:
        return Reading("engine", now, SourceStatus.OK, {"engine.requests_running": 2.0})

    async def close(self) -> None:
        pass


def _cfg(tmp_path: Path, **agent: Any) -> config.Config:
    return config.build(
        {
            "agent": {"listen_port": _free_port(), "admin_listen_port": _free_port(), **agent},
            "audit": {"path": str(tmp_path / "audit.jsonl")},
            "forecast": {"enabled": False},
        }
    )


async def test_admin_routes_live_on_their_own_loopback_listener(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    sidecar = Sidecar(cfg, collectors=[OneValue()])
    await sidecar.start()
    try:
        async with aiohttp.ClientSession() as http:
            main = f"http://127.0.0.1:{cfg.agent.listen_port}"
            admin = f"http://127.0.0.1:{cfg.agent.admin_listen_port}"
            assert (await http.get(f"{main}/healthz")).status == 200
            assert (await http.get(f"{main}/api/actions")).status == 404  # not on the API listener
            actions = await http.get(f"{admin}/api/actions")
            assert actions.status == 200 and actions.headers["Server"] == "servepilot"  # no version
    finally:
        await sidecar.stop()


async def test_admin_can_share_a_loopback_api_listener(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, admin_listen_port=None)
    sidecar = Sidecar(cfg, collectors=[OneValue()])
    await sidecar.start()
    try:
        async with aiohttp.ClientSession() as http:
            response = await http.get(f"http://127.0.0.1:{cfg.agent.listen_port}/api/actions")
            assert response.status == 200
    finally:
        await sidecar.stop()


def test_admin_on_the_api_listener_is_refused_when_that_listener_is_not_loopback() -> None:
    with pytest.raises(config.ConfigError, match=r"agent\.admin_listen_port must be set"):
        config.build({"agent": {"listen_host": "0.0.0.0", "admin_listen_port": None}})


async def test_the_api_is_served_over_tls_when_a_certificate_is_configured(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    cfg = _cfg(tmp_path, tls_cert_file=str(cert_file), tls_key_file=str(key_file))
    sidecar = Sidecar(cfg, collectors=[OneValue()])
    await sidecar.start()
    try:
        client_ctx = ssl.create_default_context()
        ca.configure_trust(client_ctx)
        async with aiohttp.ClientSession() as http:
            response = await http.get(f"https://127.0.0.1:{cfg.agent.listen_port}/healthz", ssl=client_ctx)
            assert response.status == 200
            with pytest.raises(aiohttp.ClientError):
                await http.get(f"http://127.0.0.1:{cfg.agent.listen_port}/healthz")
    finally:
        await sidecar.stop()


async def test_mutual_tls_answers_only_clients_with_a_certificate_its_ca_signed(tmp_path: Path) -> None:
    """With agent.tls_client_ca_file: a client certificate the CA signed gets /metrics and /api/state; no
    certificate gets 403 there but the kubelet's probes still answer (they cannot present one); a
    certificate from another CA fails the handshake."""
    server_ca, client_ca, stranger_ca = trustme.CA(), trustme.CA(), trustme.CA()
    cert_file, key_file, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "clients.pem"
    served = server_ca.issue_cert("127.0.0.1")
    served.cert_chain_pems[0].write_to_path(str(cert_file))
    served.private_key_pem.write_to_path(str(key_file))
    client_ca.cert_pem.write_to_path(str(ca_file))
    cfg = _cfg(
        tmp_path, tls_cert_file=str(cert_file), tls_key_file=str(key_file), tls_client_ca_file=str(ca_file)
    )

    def client(ca: trustme.CA | None) -> ssl.SSLContext:
        context = ssl.create_default_context()
        server_ca.configure_trust(context)
        if ca is not None:
            ca.issue_cert("prometheus.monitoring.svc").configure_cert(context)
        return context

    sidecar = Sidecar(cfg, collectors=[OneValue()])
    await sidecar.start()
    base = f"https://127.0.0.1:{cfg.agent.listen_port}"
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/metrics", "/api/state"):
                response = await http.get(base + path, ssl=client(client_ca))
                assert response.status == 200, path
                response = await http.get(base + path, ssl=client(None))
                assert response.status == 403, path
                assert "agent.tls_client_ca_file" in (await response.json())["error"]
            for path in ("/healthz", "/readyz", "/engine/livez"):
                response = await http.get(base + path, ssl=client(None))
                assert response.status in (200, 503), path  # readyz is 503 before the first tick
            with pytest.raises(aiohttp.ClientError):
                await http.get(base + "/metrics", ssl=client(stranger_ca))
    finally:
        await sidecar.stop()


async def test_a_renewed_certificate_is_served_without_a_restart(tmp_path: Path) -> None:
    """cert-manager renews the Secret and the kubelet swaps its files: the sidecar's watch loads the new
    pair into the live listener (agent.tls_watch_s). A pair that does not match (caught between two
    writes) is refused and the old one serves on."""
    first, second = trustme.CA(), trustme.CA()
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"

    def install(cert: trustme.LeafCert, key: trustme.LeafCert | None = None) -> None:
        cert.cert_chain_pems[0].write_to_path(str(cert_file))
        (key or cert).private_key_pem.write_to_path(str(key_file))

    def trusting(ca: trustme.CA) -> ssl.SSLContext:
        context = ssl.create_default_context()
        ca.configure_trust(context)
        return context

    install(first.issue_cert("127.0.0.1"))
    cfg = _cfg(tmp_path, tls_cert_file=str(cert_file), tls_key_file=str(key_file), tls_watch_s=0.02)
    sidecar = Sidecar(cfg, collectors=[OneValue()])
    await sidecar.start()
    url = f"https://127.0.0.1:{cfg.agent.listen_port}/healthz"
    try:
        assert sidecar.tls is not None
        async with aiohttp.ClientSession() as http:
            assert (await http.get(url, ssl=trusting(first))).status == 200
            renewed = second.issue_cert("127.0.0.1")
            install(renewed)
            async with asyncio.timeout(10):  # the watch's next look, 20 ms away
                while sidecar.tls.reloads == 0:
                    await asyncio.sleep(0.01)
            assert (await http.get(url, ssl=trusting(second))).status == 200
            with pytest.raises(aiohttp.ClientError):
                await http.get(url, ssl=trusting(first))
            install(trustme.CA().issue_cert("127.0.0.1"), key=renewed)  # a certificate without its key
            assert not sidecar.tls.reload_if_changed()
            assert "agent.tls_cert_file" in sidecar.tls.last_error and sidecar.tls.reloads == 1
            assert (await http.get(url, ssl=trusting(second))).status == 200
            metrics = await (await http.get(url.replace("healthz", "metrics"), ssl=trusting(second))).text()
            assert f'servepilot_tls_files_current{{file="{cert_file}"}} 0.0' in metrics  # the alert's
            assert f'servepilot_tls_reloads_total{{file="{cert_file}"}} 1.0' in metrics
    finally:
        await sidecar.stop()


def test_mutual_tls_needs_tls_and_a_readable_ca(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match=r"agent.*tls_client_ca_file needs tls_cert_file"):
        config.build({"agent": {"tls_client_ca_file": "/etc/ca.pem"}})
    from agent.tls import server_context

    ca = trustme.CA()
    served = ca.issue_cert("127.0.0.1")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    served.cert_chain_pems[0].write_to_path(str(cert_file))
    served.private_key_pem.write_to_path(str(key_file))
    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(config.ConfigError, match=r"agent\.tls_client_ca_file cannot load the CA"):
        server_context(str(cert_file), str(key_file), str(tmp_path / "bad.pem"))
    with pytest.raises(config.ConfigError, match=r"agent\.tls_client_ca_file cannot load the CA"):
        server_context(str(cert_file), str(key_file), str(tmp_path / "missing.pem"))


async def test_an_unreadable_certificate_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "bad.pem").write_text("not a certificate")
    cfg = _cfg(tmp_path, tls_cert_file=str(tmp_path / "bad.pem"), tls_key_file=str(tmp_path / "bad.pem"))
    sidecar = Sidecar(cfg, collectors=[OneValue()])
    try:
        with pytest.raises(config.ConfigError, match=r"agent\.tls_cert_file cannot load"):
            await sidecar.start()
    finally:
        await sidecar.stop()


async def test_a_leak_finding_asks_the_probe_for_a_memory_recording_and_links_it(tmp_path: Path) -> None:
    from aiohttp import web

    from detectors.base import Finding, Severity

    asked: list[str] = []

    async def evidence(request: web.Request) -> web.Response:
        asked.append(request.query.get("duration_s", ""))
        return web.json_response({"file": "/var/evidence/snap-1.pickle"}, status=202)

    app = web.Application()
    app.router.add_post("/evidence/memory", evidence)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    probe_port = runner.addresses[0][1]

    class Leak:
        name = "memory_leak"

        def update(self, snapshot: Any) -> list[Finding]:
            return [
                Finding("memory_leak", "probe.reserved_bytes", Severity.WARNING, 0.9, "leak", snapshot.now)
            ]

    cfg = config.build(
        {
            "agent": {"listen_port": _free_port(), "admin_listen_port": None},
            "probe": {"url": f"http://127.0.0.1:{probe_port}/metrics"},
            "audit": {"path": None},
        }
    )
    sidecar = Sidecar(cfg, collectors=[OneValue()])
    sidecar.loop.detectors = [Leak()]  # type: ignore[list-item]
    try:
        await sidecar.loop.tick(100.0)
        assert sidecar._evidence_task is not None
        await sidecar._evidence_task
        state = await sidecar.loop.tick(101.0)
        assert asked == ["60"]  # once, not every tick (cooldown)
        assert state.findings[0].evidence["memory_snapshot"] == "/var/evidence/snap-1.pickle"
    finally:
        await sidecar.stop()
        await runner.cleanup()


def _act_cfg(tmp_path: Path) -> config.Config:
    return config.build(
        {
            "agent": {"listen_port": _free_port(), "admin_listen_port": None},
            "gate": {
                "enabled": True,
                "listen_port": _free_port(),
                "upstreams": {"primary": "http://127.0.0.1:9", "fp8": "http://127.0.0.1:9"},
                "split": {"primary": 1.0},
                "max_in_flight": 4,
            },
            "actuators": {"mode": "act"},
            "audit": {"path": str(tmp_path / "audit.jsonl")},
            "probe": {"enabled": False},
        }
    )


async def test_an_operator_pin_holds_even_when_no_policy_proposes_the_knob(tmp_path: Path) -> None:
    sidecar = Sidecar(_act_cfg(tmp_path), collectors=[])
    await sidecar.knobs.start()
    try:
        sidecar.knobs.actuation.pins["batch.max_in_flight"] = 7
        await sidecar.loop.tick(1.0)
        assert sidecar.knobs.gate.limit == 7
        assert await sidecar.knobs._gate_upstream() == "primary"  # read back from the gate's real split
    finally:
        await sidecar.stop()


async def test_a_breaker_level_forced_through_the_admin_api_reaches_the_breaker_policy(
    tmp_path: Path,
) -> None:
    sidecar = Sidecar(_act_cfg(tmp_path), collectors=[OneValue()])
    await sidecar.knobs.start()
    try:
        sidecar.knobs.actuation.forced["breaker.level"] = 2
        await sidecar.loop.tick(1.0)
        await sidecar.loop.tick(2.0)
        state = sidecar.loop.policy_state("breaker")
        assert (state.level, state.forced) == (2, 2)
        del sidecar.knobs.actuation.forced["breaker.level"]
        await sidecar.loop.tick(3.0)
        assert sidecar.loop.policy_state("breaker").forced is None
    finally:
        await sidecar.stop()


async def test_a_split_over_replicas_survives_a_calm_breaker_and_comes_back_after_l2(tmp_path: Path) -> None:
    """The breaker's L0 used to route everything to ``primary``, undoing a configured split over replicas
    at the first tick; it now gives routing back to the configured split (``default``)."""
    cfg = _act_cfg(tmp_path)
    upstreams = {
        "primary": "http://127.0.0.1:9",
        "replica": "http://127.0.0.1:9",
        "fp8": "http://127.0.0.1:9",
    }
    split = {"primary": 1.0, "replica": 1.0}
    cfg = cfg.model_copy(
        update={"gate": cfg.gate.model_copy(update={"upstreams": upstreams, "split": split})}
    )
    assert normal_route(cfg) == "default"
    sidecar = Sidecar(cfg, collectors=[OneValue()])
    await sidecar.knobs.start()
    pool = sidecar.knobs.gate.pool
    try:
        for now in (1.0, 2.0):
            await sidecar.loop.tick(now)
            assert pool.weights == {"primary": 0.5, "replica": 0.5, "fp8": 0.0}
        assert not [a for a in sidecar.knobs.audit.recent(10) if a["knob"] == "route.upstream"]
        sidecar.knobs.actuation.forced["breaker.level"] = 2
        await sidecar.loop.tick(3.0)  # the force reaches the breaker's state
        await sidecar.loop.tick(4.0)  # and the breaker routes
        assert pool.weights == {"primary": 0.0, "replica": 0.0, "fp8": 1.0}
        del sidecar.knobs.actuation.forced["breaker.level"]
        sidecar.loop.set_policy_state("breaker", None)  # as after a recovery: back at L0
        await sidecar.loop.tick(5.0)
        assert pool.weights == {"primary": 0.5, "replica": 0.5, "fp8": 0.0}
    finally:
        await sidecar.stop()


@pytest.mark.parametrize(
    ("upstreams", "levels"),
    [
        (None, (0, 1)),
        ({"primary": "http://127.0.0.1:9"}, (0, 1)),
        ({"primary": "http://127.0.0.1:9", "fp8": "http://127.0.0.1:9"}, (0, 1, 2)),
        ({"primary": "http://127.0.0.1:9", "small": "http://127.0.0.1:9"}, (0, 1, 3)),
        ({"primary": "http://a:1", "fp8": "http://b:1", "small": "http://c:1"}, (0, 1, 2, 3)),
    ],
)
def test_the_breaker_gets_the_levels_the_gates_upstreams_allow(
    upstreams: dict[str, str] | None, levels: tuple[int, ...]
) -> None:
    gate = {"enabled": False} if upstreams is None else {"enabled": True, "upstreams": upstreams}
    cfg = config.build({"gate": gate, "policies": {"set": "auto"}})
    assert breaker_levels(cfg) == levels
    [breaker] = [p for p in build_policies(cfg) if p.name == "breaker"]
    assert breaker.levels == levels


async def test_a_forced_level_this_gate_cannot_route_is_dropped_not_raised(tmp_path: Path) -> None:
    """E.g. saved with the state file before the fp8 upstream left the config."""
    cfg = _act_cfg(tmp_path)
    cfg = cfg.model_copy(
        update={"gate": cfg.gate.model_copy(update={"upstreams": {"primary": "http://127.0.0.1:9"}})}
    )
    sidecar = Sidecar(cfg, collectors=[OneValue()])
    await sidecar.knobs.start()
    try:
        sidecar.knobs.actuation.forced["breaker.level"] = 2
        await sidecar.loop.tick(1.0)
        assert "breaker.level" not in sidecar.knobs.actuation.forced
        assert sidecar.loop.policy_state("breaker").level in (0, 1)
    finally:
        await sidecar.stop()


class Latency:
    """An engine whose mean ITL the test sets (TTFT well inside the SLO)."""

    name = "engine"

    def __init__(self) -> None:
        self.itl_s = 0.01

    async def collect(self, now: float) -> Reading:
        values = {
            "engine.requests_running": 2.0,
            "engine.requests_waiting": 0.0,
            "engine.itl_seconds.mean": self.itl_s,
            "engine.ttft_seconds.p99": 0.1,
        }
        return Reading("engine", now, SourceStatus.OK, values)

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("knob", ["locked_clocks", "power_limit"])
async def test_the_energy_policy_walks_the_gpu_down_while_latency_has_room_and_back_up_at_risk(
    tmp_path: Path, knob: str
) -> None:
    cfg = config.build(
        {
            "agent": {"listen_port": _free_port(), "admin_listen_port": None},
            "actuators": {
                "mode": "act",
                "gpu": knob,
                "gpu_backend": "simulated",
                "gpu_state_file": str(tmp_path / "gpu.json"),
            },
            "policies": {"energy": True},
            "audit": {"path": None},
            "probe": {"enabled": False},
            "forecast": {"enabled": False},
        }
    )
    engine = Latency()
    sidecar = Sidecar(cfg, collectors=[engine])
    gpu = sidecar.knobs.gpu
    gpu.problem = None  # the simulated backend needs no privilege; the check still runs for real NVML
    [energy] = [p for p in sidecar.loop.policies if p.name == "energy"]
    # the ladder runs from the simulated A100's top (1410 MHz, or its 400 W default limit) down to 45%
    assert energy.levels_mhz[0] == gpu.top() and energy.levels_mhz[-1] == pytest.approx(
        0.45 * gpu.top(), abs=1
    )
    await sidecar.knobs.start()
    try:
        for t in range(0, 300, 10):  # ITL at a tenth of the SLO: one level lower per 30 s dwell
            await sidecar.loop.tick(float(t))
        low = gpu.current()
        assert low is not None and low < gpu.top()
        engine.itl_s = 0.2  # twice the SLO: back up at once (two levels, the SLO guard's step)
        await sidecar.loop.tick(300.0)
        assert gpu.current() > low
        moves = [a for a in sidecar.knobs.audit.recent(100) if a["policy"] == "energy"]
        assert moves and all(a["result"] == "ok" for a in moves)
    finally:
        await sidecar.stop()


def test_the_configured_ladder_and_schedule_reach_the_energy_policy() -> None:
    schedule = {
        "timezone": "Europe/Paris",
        "windows": [{"days": ["mon"], "start": "09:00", "end": "18:00", "mode": "peak"}],
    }
    cfg = config.build(
        {
            "actuators": {"gpu": "power_limit", "gpu_backend": "simulated"},
            "policies": {"energy": True, "energy_levels": [300, 250, 200], "schedule": schedule},
        }
    )
    [energy] = [p for p in build_policies(cfg) if p.name == "energy"]
    assert energy.levels_mhz == (300.0, 250.0, 200.0) and energy.knob == "gpu.power_limit_w"
    assert energy.schedule is not None
    assert energy.schedule.mode_at(1796634000.0) == "peak"  # Monday 2026-12-07 09:00 UTC = 10:00 in Paris
    assert energy.schedule.mode_at(1796605200.0) == "offpeak"  # the same day, 02:00 in Paris


def test_an_unreadable_gpu_range_leaves_the_energy_policy_out(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def bounds(self) -> tuple[float, float]:
            raise RuntimeError("NVML: GPU is lost")

    cfg = config.build({"actuators": {"gpu": "locked_clocks"}, "policies": {"energy": True}})
    assert [p.name for p in build_policies(cfg, Broken()) if p.name == "energy"] == []
    assert "energy policy off: cannot read the GPU's locked_clocks range: NVML: GPU is lost" in caplog.text


async def test_without_a_gate_quiet_ticks_in_act_mode_audit_nothing(tmp_path: Path) -> None:
    """The breaker at L0 used to propose route.upstream=primary every tick; with no gate the knob is unbound
    and each tick wrote an error to the audit log (and servepilot_actions_total{result="error"})."""
    cfg = config.build(
        {
            "agent": {"listen_port": _free_port(), "admin_listen_port": None},
            "actuators": {"mode": "act"},
            "audit": {"path": None},
            "probe": {"enabled": False},
            "forecast": {"enabled": False},
        }
    )
    sidecar = Sidecar(cfg, collectors=[OneValue()])
    await sidecar.knobs.start()
    try:
        for t in (1.0, 2.0, 3.0):
            await sidecar.loop.tick(t)
        assert sidecar.knobs.audit.recent(10) == []
    finally:
        await sidecar.stop()


def _controlled(url: str) -> config.Config:
    return config.build(
        {
            "agent": {"listen_port": _free_port(), "admin_listen_port": None},
            "control": {"enabled": True, "url": url},
            "actuators": {"mode": "act"},
            "audit": {"path": None},
            "probe": {"enabled": False},
            "forecast": {"enabled": False},
        }
    )


async def test_without_a_gate_the_batch_knob_is_the_engines_max_num_seqs(sim_engine: tuple[Any, str]) -> None:
    """The engine's own cap is the effective batch when nothing sits in front of it (as in the replay)."""
    from policies import knobs as policy_knobs
    from policies.base import Proposal

    server, url = sim_engine
    sidecar = Sidecar(_controlled(url), collectors=[OneValue()])
    await sidecar.start()
    try:
        assert policy_knobs.BATCH in sidecar.knobs.actuation.knobs
        # auto starts from what the engine runs with, not from policies.initial_batch (64)
        [auto] = [p for p in sidecar.loop.policies if p.name == "batch_auto"]
        assert auto.initial == 256
        action = await sidecar.knobs.actuation.execute(Proposal("batch_auto", policy_knobs.BATCH, 48, "test"))
        assert action is not None and action.result == "ok", action
        assert server.core.settings.max_num_seqs == 48  # under the control lease, like any engine setting
        await sidecar.stop()
        # a clean stop hands the engine back at once (control.release_on_stop), not lease_s later
        assert server.core.settings.max_num_seqs == 256 and server.control.lease_expires_at is None
    finally:
        await sidecar.stop()


async def test_an_engine_that_comes_up_after_the_sidecar_is_controlled_once_it_answers() -> None:
    """Seen live: the engine started 8 s after the sidecar (in a pod the engine loads its weights for
    minutes) and the sidecar never asked again: no engine knob, no token budget, for the life of the
    process. Now it asks again in the background and the levers join when the engine answers."""
    from aiohttp import web

    from simulator.engine import make_core
    from simulator.server import SimServer

    port = _free_port()
    sidecar = Sidecar(_controlled(f"http://127.0.0.1:{port}"), collectors=[OneValue()])
    await sidecar.start()
    runner = None
    try:
        assert sidecar.knobs.actuation.knobs == [] and sidecar._control_task is not None
        up = sidecar.exporter.registry.get_sample_value
        assert up("servepilot_engine_control_up") == 0.0
        server = SimServer(make_core("a100-80g", "llama-2-7b", "fp16", 256))
        runner = web.AppRunner(server.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        for _ in range(100):  # the first retry is 1 s after start
            if sidecar._control_task.done():
                break
            await asyncio.sleep(0.05)
        assert sidecar._control_task.done()
        assert "engine.max_num_batched_tokens" in sidecar.knobs.actuation.knobs
        assert any(p.name == "token_budget" for p in sidecar.loop.policies)
        assert up("servepilot_engine_control_up") == 1.0
    finally:
        await sidecar.stop()
        if runner is not None:
            await runner.cleanup()


async def test_an_engine_that_serves_no_control_api_is_not_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from aiohttp import web

    runner = web.AppRunner(web.Application())  # answers 404 to every path: no control API, for good
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    sidecar = Sidecar(_controlled(f"http://127.0.0.1:{runner.addresses[0][1]}"), collectors=[OneValue()])
    try:
        await sidecar.start()
        assert sidecar._control_task is None and sidecar.knobs.control is None
        assert "engine control unavailable: no engine control API found" in caplog.text
        assert "asking again" not in caplog.text
    finally:
        await sidecar.stop()
        await runner.cleanup()


async def test_stopping_while_the_engine_never_answered_ends_the_retries() -> None:
    sidecar = Sidecar(_controlled(f"http://127.0.0.1:{_free_port()}"), collectors=[OneValue()])
    await sidecar.start()
    task = sidecar._control_task
    assert task is not None and not task.done()
    await sidecar.stop()
    assert task.done()


async def test_a_pin_is_held_to_what_the_engine_takes_and_the_policies_bounds(
    sim_engine: tuple[Any, str],
) -> None:
    """The checks behind POST /api/admin/pin, as the sidecar wires them: the engine's published knob types
    and ranges, the arbiter's bounds (policies.batch_min/max on the effective batch), and aliases too."""
    _, url = sim_engine
    sidecar = Sidecar(_controlled(url), collectors=[OneValue()])
    await sidecar.start()
    try:
        check = sidecar.knobs.actuation.check
        assert check("engine.max_num_batched_tokens", 2048) is None
        assert "max_num_seqs must be a number" in str(check("engine.max_num_seqs", "abc"))
        assert check("batch.max_in_flight", 48) is None  # the engine's max_num_seqs, no gate in front
        assert check("batch.max_in_flight", 100000) == "batch.max_in_flight must be in [8, 512], got 100000"
        assert "must be one of" in str(check("engine.precision", "int3"))
        assert str(check("gate.limit", 32)).startswith("no knob 'gate.limit' is bound here; bound knobs: ")
    finally:
        await sidecar.stop()


async def test_without_a_gpu_actuator_the_energy_ladder_drives_the_engines_clock(
    sim_engine: tuple[Any, str],
) -> None:
    """actuators.gpu off, the engine's control API offers sm_clock_mhz (the simulator's does): the energy
    policy joins after discovery, over the published range, and its proposals set the engine's clock."""
    from policies import knobs as policy_knobs
    from policies.base import Proposal
    from policies.energy import Energy

    server, url = sim_engine
    data = _controlled(url).model_dump()
    data["policies"]["energy"] = True
    sidecar = Sidecar(config.build(data), collectors=[OneValue()])
    await sidecar.start()
    try:
        [energy] = [p for p in sidecar.loop.policies if isinstance(p, Energy)]
        top = server.core.gpu.clock_max_mhz
        assert energy.levels_mhz[0] == top and energy.levels_mhz[-1] == pytest.approx(0.45 * top, abs=1)
        [budget] = [p for p in sidecar.loop.policies if p.name == "token_budget"]
        assert budget.itl_floor == budget.lower  # as build_set sets it beside the energy policy
        level = energy.levels_mhz[3]
        action = await sidecar.knobs.actuation.execute(
            Proposal("energy", policy_knobs.SM_CLOCK, level, "test")
        )
        assert action is not None and action.result == "ok", action
        assert server.core.settings.sm_clock_mhz == level
        await sidecar.stop()
        assert server.core.settings.sm_clock_mhz == top  # the lease ended with the sidecar
    finally:
        await sidecar.stop()


async def test_engine_knobs_move_under_the_arbiters_step_limit_and_cooldown(
    sim_engine: tuple[Any, str],
) -> None:
    """The arbiter bounds a move by the value in force. For engine knobs it had none (the knob values
    listed only the gate's and the GPU's), so a cut of the engine's max_num_seqs from 256 to 16 went
    through in one tick, past the 50% step limit, and the token budget's 5 s cooldown never applied."""
    from policies import knobs as policy_knobs
    from policies.arbiter import PRIORITY

    def at(now: float) -> Snapshot:
        return Snapshot.from_readings(now, {})

    server, url = sim_engine
    sidecar = Sidecar(_controlled(url), collectors=[OneValue()])
    await sidecar.start()
    try:
        cut = Proposal("batch_auto", policy_knobs.BATCH, 16, "test", PRIORITY["throughput"])
        await sidecar._act([cut], at(1000.0))
        assert server.core.settings.max_num_seqs == 128  # half a step, not 16
        values = sidecar.knobs.values()  # what the arbiter and /api/state see
        assert values["engine.max_num_seqs"] == values[policy_knobs.BATCH] == 128
        budget = policy_knobs.TOKEN_BUDGET
        await sidecar._act(
            [Proposal("token_budget", budget, 4096, "test", PRIORITY["throughput"])], at(1001.0)
        )
        assert server.core.settings.max_num_batched_tokens == 4096
        again = Proposal("token_budget", budget, 2048, "test", PRIORITY["throughput"])
        await sidecar._act([again], at(1002.0))
        assert server.core.settings.max_num_batched_tokens == 4096  # not again within the 5 s cooldown
        await sidecar._act([again], at(1007.0))
        assert server.core.settings.max_num_batched_tokens == 2048
    finally:
        await sidecar.stop()


async def test_without_a_gate_the_breakers_first_cut_halves_the_engines_cap(
    sim_engine: tuple[Any, str],
) -> None:
    """Without a gate the batch is the engine's max_num_seqs; the tick publishes it as gate.limit (as the
    replay does), so L1 halves 256 to 128. Without the signal the breaker assumed 32 and cut to 16."""
    server, url = sim_engine
    sidecar = Sidecar(_controlled(url), collectors=[OneValue()])
    await sidecar.start()
    try:
        sidecar.knobs.actuation.forced["breaker.level"] = 1
        for now in (1000.0, 1001.0, 1002.0):
            await sidecar.loop.tick(now)
        assert server.core.settings.max_num_seqs == 128
        assert sidecar.loop.state.snapshot.get("gate.limit") == 128.0
    finally:
        await sidecar.stop()


async def test_a_policys_number_reaches_an_integer_engine_knob_as_an_integer(
    sim_engine: tuple[Any, str],
) -> None:
    """Policies speak floats: the token budget halves 8192 to 4096.0, a 50% step of 9 gives 13.5. The
    engine's control API refuses JSON 4096.0 for an integer knob (422); the binding sends 4096 and 14."""
    from policies import knobs as policy_knobs
    from policies.base import Proposal

    server, url = sim_engine
    sidecar = Sidecar(_controlled(url), collectors=[OneValue()])
    await sidecar.start()
    try:
        execute = sidecar.knobs.actuation.execute
        action = await execute(Proposal("token_budget", "engine.max_num_batched_tokens", 4096.0, "test"))
        assert action is not None and action.result == "ok", action
        assert server.core.settings.max_num_batched_tokens == 4096
        action = await execute(Proposal("batch_auto", policy_knobs.BATCH, 13.5, "test"))
        assert action is not None and action.result == "ok", action
        assert server.core.settings.max_num_seqs == 14
    finally:
        await sidecar.stop()


def test_an_unreadable_webhook_secret_is_a_config_error_not_a_traceback(tmp_path: Path) -> None:
    """`servepilot run` turns a ConfigError into exit code 2 and one line; this was a ValueError traceback."""
    cfg = config.build(
        {
            "webhooks": {
                "enabled": True,
                "generic_url": "http://127.0.0.1:9/hook",
                "secret_file": str(tmp_path / "missing"),
                "queue_path": str(tmp_path / "outbox.sqlite"),
            },
            "audit": {"path": None},
        }
    )
    with pytest.raises(config.ConfigError, match=r"^webhooks\.secret_file '.*missing': No such file"):
        Sidecar(cfg, collectors=[OneValue()])


def test_an_outbox_that_cannot_be_opened_is_a_config_error_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    cfg = config.build(
        {
            "webhooks": {
                "enabled": True,
                "alertmanager_url": "http://127.0.0.1:9",
                "queue_path": str(tmp_path / "file" / "outbox.sqlite"),
            },
            "audit": {"path": None},
        }
    )
    with pytest.raises(config.ConfigError, match=r"^webhooks\.queue_path cannot open webhook outbox"):
        Sidecar(cfg, collectors=[OneValue()])


async def _app(completions: Any) -> tuple[web.AppRunner, str]:
    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, shutdown_timeout=0.5)  # the hung handlers are not waited for
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_the_engine_stall_finding_sends_what_the_hung_engine_holds_to_the_next_upstream(
    tmp_path: Path,
) -> None:
    """The gate proves a hang by a frozen stream; an engine hung while it holds only non-streamed requests
    gives it none. The sidecar's engine_stall detector (2 requests held, nothing moving for 60 s) tells
    the gate upstream that is this engine (its URL is ``engine.url``), which sends them to ``small``."""

    async def hangs(request: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def answers(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "from small"}]})

    (hung, hung_url), (small, small_url) = await _app(hangs), await _app(answers)
    cfg = config.build(
        {
            "agent": {"listen_port": _free_port(), "admin_listen_port": None},
            "engine": {"url": hung_url + "/"},  # the same engine, written another way
            "gate": {
                "enabled": True,
                "listen_port": _free_port(),
                "upstreams": {"primary": hung_url, "small": small_url},
                "split": {"primary": 1.0},
                "health_interval_s": 0.1,
            },
            "audit": {"path": str(tmp_path / "audit.jsonl")},
            "probe": {"enabled": False},
            "forecast": {"enabled": False},
        }
    )
    sidecar = Sidecar(cfg, collectors=[OneValue()])  # 2 requests running, no token ever
    await sidecar.knobs.start()
    gate = f"http://127.0.0.1:{cfg.gate.listen_port}/v1/completions"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            body = {"model": "m", "prompt": "p", "max_tokens": 4}
            held = [asyncio.create_task(http.post(gate, json=body)) for _ in range(2)]
            for t in range(1, 60):
                await sidecar.loop.tick(float(t))
            await asyncio.sleep(0.3)  # health rounds: nothing streams, so nothing is judged
            assert not any(task.done() for task in held)
            state = await sidecar.loop.tick(62.0)
            assert [f.detector for f in state.findings if f.detector == "engine_stall"] == ["engine_stall"]
            for task in held:
                resp = await asyncio.wait_for(task, 10)
                assert resp.status == 200 and "from small" in await resp.text()
            assert not sidecar.knobs.gate.pool.upstreams["primary"].healthy
    finally:
        await sidecar.stop()
        await hung.cleanup()
        await small.cleanup()


def test_the_engine_upstream_is_the_one_whose_url_is_the_engines() -> None:
    def cfg(engine: str, gate: dict[str, Any]) -> config.Config:
        return config.build({"engine": {"url": engine}, "gate": gate})

    upstreams = {"fp8": "http://127.0.0.1:8001", "primary": "http://127.0.0.1:8000/"}
    assert (
        engine_upstream(cfg("http://127.0.0.1:8000", {"enabled": True, "upstreams": upstreams})) == "primary"
    )
    assert engine_upstream(cfg("http://127.0.0.1:9000", {"enabled": True, "upstreams": upstreams})) is None
    # loopback by any name is the same engine; another host with the same port is not
    for engine in ("http://localhost:8000", "http://[::1]:8000", "http://127.0.0.2:8000/engine"):
        assert engine_upstream(cfg(engine, {"enabled": True, "upstreams": upstreams})) == "primary", engine
    assert engine_upstream(cfg("http://10.0.0.5:8000", {"enabled": True, "upstreams": upstreams})) is None
    assert engine_upstream(cfg("https://127.0.0.1:8000", {"enabled": True, "upstreams": upstreams})) is None
    assert engine_upstream(cfg("http://127.0.0.1:8000", {"enabled": False, "upstreams": upstreams})) is None


async def test_a_gate_with_no_upstream_at_the_engines_url_is_said_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The stall finding reaches the gate only through that URL: without a match it silently could not."""
    cfg = _act_cfg(tmp_path)  # upstreams on port 9, the engine on 8000
    with caplog.at_level(logging.WARNING, logger="agent.sidecar"):
        Sidecar(cfg, collectors=[])
    assert "no gate upstream has engine.url (http://127.0.0.1:8000)" in caplog.text
    caplog.clear()
    engine = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"url": "http://localhost:9"})})
    with caplog.at_level(logging.WARNING, logger="agent.sidecar"):
        Sidecar(engine, collectors=[])
    assert "no gate upstream" not in caplog.text


def _roles(sidecar: Sidecar) -> dict[str, str]:
    samples = sidecar.exporter.registry.collect()
    return {
        s.labels["upstream"]: s.labels["role"]
        for m in samples
        if m.name == "servepilot_gate_upstream_role"
        for s in m.samples
    }


def test_the_gate_exports_which_upstream_is_this_engine_whatever_its_name(tmp_path: Path) -> None:
    """servepilot_gate_upstream_role carries what the inhibition rules mute on, not the name primary."""
    cfg = _act_cfg(tmp_path)
    engine = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"url": "http://localhost:9"})})
    gate = engine.gate.model_copy(
        update={
            "upstreams": {"vllm": "http://127.0.0.1:9", "fp8": "http://127.0.0.1:10"},
            "split": {"vllm": 1.0},
        }
    )
    assert _roles(Sidecar(engine.model_copy(update={"gate": gate}), collectors=[])) == {
        "vllm": "engine",
        "fp8": "other",
    }
    assert _roles(Sidecar(cfg, collectors=[])) == {"primary": "other", "fp8": "other"}  # engine on 8000


def test_a_disabled_detector_does_not_run(tmp_path: Path) -> None:
    cfg = _act_cfg(tmp_path)
    names = {d.name for d in Sidecar(cfg, collectors=[]).loop.detectors}
    assert {"general", "multivariate"} <= names
    quiet = cfg.model_copy(
        update={"detectors": config.build({"detectors": {"disabled": ["general"]}}).detectors}
    )
    assert {d.name for d in Sidecar(quiet, collectors=[]).loop.detectors} == names - {"general"}


def test_the_engine_s_decode_tokens_per_step_reach_its_upstream_at_the_gate(tmp_path: Path) -> None:
    """Each tick tells the gate's upstream that is this engine how many tokens its stream events bring
    (engine.decode_tokens_per_step, published while it drafts), and forgets it once the signal is gone."""
    cfg = _act_cfg(tmp_path)
    engine = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"url": "http://localhost:9"})})
    sidecar = Sidecar(engine, collectors=[])
    gate = sidecar.knobs.gate
    assert gate is not None

    def tick(values: dict[str, float]) -> None:
        reading = Reading("engine", 1.0, SourceStatus.OK, {"engine.requests_running": 1.0, **values})
        snapshot = Snapshot.from_readings(1.0, {"engine": reading})
        sidecar._tell_gate_of_the_engine(AgentState(snapshot=snapshot))

    tick({"engine.decode_tokens_per_step": 2.84})
    assert gate.tokens_per_event == {"primary": 2.84}
    tick({})
    assert gate.tokens_per_event == {}


async def test_a_reload_retunes_the_running_policies_and_the_knob_follows_the_new_bounds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SLO targets and batch bounds reach the policies, the arbiter, the gate's verdicts and the exported
    SLO without a restart (agent/reload.py); each policy keeps its state, and a limit left outside the
    narrowed bounds is brought inside at the next tick (the arbiter clamps to the bounds after its step
    limit), once."""
    import yaml

    raw: dict[str, Any] = {
        "agent": {"listen_port": _free_port(), "admin_listen_port": None},
        "gate": {
            "enabled": True,
            "listen_port": _free_port(),
            "upstreams": {"primary": "http://127.0.0.1:9"},
            "max_in_flight": 64,
        },
        "actuators": {"mode": "act"},
        "audit": {"path": str(tmp_path / "audit.jsonl")},
        "probe": {"enabled": False},
        "forecast": {"enabled": False},
        "policies": {"set": "auto", "ttft_slo_s": 2.0, "itl_slo_s": 0.1, "batch_max": 512},
    }
    path = tmp_path / "servepilot.yaml"
    path.write_text(yaml.safe_dump(raw))
    sidecar = Sidecar(config.load(path, {}), collectors=[OneValue()], config_path=str(path))
    await sidecar.knobs.start()
    gate = sidecar.knobs.gate
    try:
        await sidecar.loop.tick(1.0)
        assert gate.limit == 64  # two running, nothing queued: the controller holds
        breaker_state = sidecar.loop.policy_state("breaker")
        sidecar.knobs.actuation.pins["batch.max_in_flight"] = 64  # an operator's, inside [8, 512]
        assert gate.stats.slo_by_priority == {}
        raw["policies"].update(
            ttft_slo_s=1.0, batch_max=16, initial_batch=16, slo_by_priority={"low": {"ttft_s": 20.0}}
        )
        path.write_text(yaml.safe_dump(raw))
        with caplog.at_level(logging.WARNING, logger="agent.sidecar"):
            result = sidecar.reload("SIGHUP")
        assert result.result == "applied", result.message
        assert sidecar.cfg.policies.batch_max == 16
        [auto] = [p for p in sidecar.loop.policies if p.name == "batch_auto"]
        assert (auto.ttft_slo_s, auto.upper, auto.initial) == (1.0, 16.0, 16.0)
        assert sidecar.loop.policy_state("breaker") is breaker_state  # state carried over, not reset
        assert gate.stats.slo == (1.0, 0.1)
        assert gate.stats.slo_by_priority == {"low": (20.0, 0.1)}  # its ITL is the policies' own
        assert sidecar.exporter.registry.get_sample_value("servepilot_slo_ttft_seconds") == 1.0
        [tails] = [d for d in sidecar.loop.detectors if d.name == "tail_latency"]
        assert tails.slo_s == {"ttft": 1.0, "itl": 0.1}  # was 2.0 at start: the reload reaches the detector
        assert sidecar.knobs.actuation.bounds("batch.max_in_flight", 32) is not None  # a new pin: refused
        assert sidecar.knobs.actuation.pins == {}  # one outside the new bounds is dropped, as at a restart
        assert "pin batch.max_in_flight=64 dropped by the reload: " in caplog.text
        limits = []
        for now in (2.0, 3.0, 4.0):
            await sidecar.loop.tick(now)
            limits.append(gate.limit)
        assert limits == [16, 16, 16]
        moves = [a for a in sidecar.knobs.audit.recent(10) if a["knob"] == "batch.max_in_flight"]
        assert [(a["from"], a["to"]) for a in moves] == [(64, 16)]
        assert "outside the policy's bounds [8, 16]" in moves[0]["reason"]
    finally:
        await sidecar.stop()


async def test_a_reload_out_of_act_mode_hands_everything_back_and_into_act_takes_it_again(
    tmp_path: Path, sim_engine: tuple[Any, str]
) -> None:
    """``actuators.mode`` without a restart (which would take the gate, the pod's data path, down):
    advise for weeks, then act. Leaving act puts back what servepilot set, as a restart would: the
    gate's limit, the GPU's power limit and the engine's knob under its lease, none left where nobody
    tends it. Operator pins stand in for the policies, so every value is known."""
    import yaml

    server, url = sim_engine
    raw: dict[str, Any] = {
        "agent": {"listen_port": _free_port(), "admin_listen_port": None},
        "gate": {
            "enabled": True,
            "listen_port": _free_port(),
            "upstreams": {"primary": url},
            "max_in_flight": 64,
        },
        "engine": {"url": url},
        "control": {"enabled": True, "url": url},
        "actuators": {
            "mode": "act",
            "gpu": "power_limit",
            "gpu_backend": "simulated",
            "gpu_state_file": str(tmp_path / "gpu.json"),
        },
        "policies": {"set": "none"},
        "audit": {"path": None},
        "probe": {"enabled": False},
        "forecast": {"enabled": False},
    }
    path = tmp_path / "servepilot.yaml"
    path.write_text(yaml.safe_dump(raw))
    sidecar = Sidecar(config.load(path, {}), collectors=[OneValue()], config_path=str(path))
    gate, gpu = sidecar.knobs.gate, sidecar.knobs.gpu
    gpu.problem = None  # the simulated backend needs no privilege
    await sidecar.knobs.start()

    def now_set() -> tuple[int, float | None, int]:
        return gate.limit, gpu.current(), server.core.settings.max_num_seqs

    async def reload_mode(mode: str) -> None:
        raw["actuators"]["mode"] = mode
        path.write_text(yaml.safe_dump(raw))
        assert sidecar.reload("SIGHUP").result == "applied"

    try:
        default = now_set()
        assert default == (64, 400.0, 256)
        pins = {"batch.max_in_flight": 16, "gpu.power_limit_w": 250, "engine.max_num_seqs": 32}
        sidecar.knobs.actuation.pins.update(pins)
        await sidecar.loop.tick(1.0)
        assert now_set() == (16, 250.0, 32) and server.control.lease_expires_at is not None
        await reload_mode("advise")
        metric = sidecar.exporter.registry.get_sample_value
        assert metric("servepilot_actuation_mode", {"mode": "advise"}) == 1.0
        assert metric("servepilot_actuation_mode", {"mode": "act"}) == 0.0
        assert sidecar._hand_back_task is not None
        await sidecar._hand_back_task
        assert now_set() == default and server.control.lease_expires_at is None  # the lease ended at once
        again = await sidecar.knobs.hand_back()  # nothing held any more: the log names only what was
        assert len(again) == 1 and again[0].startswith("the gate to its configured limit 64")
        await sidecar.loop.tick(2.0)  # advised only: nothing moves
        assert now_set() == default
        assert {a["result"] for a in sidecar.knobs.audit.recent(3)} == {"advised"}
        await reload_mode("act")
        await sidecar.loop.tick(3.0)
        assert now_set() == (16, 250.0, 32) and server.control.lease_expires_at is not None  # a new lease
    finally:
        await sidecar.stop()
    assert now_set()[1:] == default[1:]  # and a stop hands the GPU and the engine back (the gate is gone)


class EngineDown:
    name = "engine"

    async def collect(self, now: float) -> Reading:
        return Reading.failed("engine", now, "HTTP 503")

    async def close(self) -> None:
        pass


async def test_a_reload_moves_the_webhook_to_a_new_receiver_with_a_rotated_secret(tmp_path: Path) -> None:
    """Receiver URL, signing secret and labels change by reload (agent/reload.py): the firing alert is
    resolved under its old labels and fired under the new ones, at the new receiver, which knows only the
    new secret; the old receiver hears nothing more."""
    import yaml

    from agent.webhooks.receiver import build_receiver_app

    old_app, old_log = build_receiver_app(b"old")
    new_app, new_log = build_receiver_app(b"new")
    runners = []
    urls = []
    for app in (old_app, new_app):
        runner = web.AppRunner(app)
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}/hook")
    secret = tmp_path / "webhook-secret"
    secret.write_text("whsec_b2xk\n")  # "old"
    raw: dict[str, Any] = {
        "agent": {"listen_port": _free_port(), "admin_listen_port": None},
        "audit": {"path": str(tmp_path / "audit.jsonl")},
        "probe": {"enabled": False},
        "forecast": {"enabled": False},
        "webhooks": {
            "enabled": True,
            "generic_url": urls[0],
            "secret_file": str(secret),
            "queue_path": str(tmp_path / "outbox.sqlite"),
            "source_down_after_s": 0,
            "resolve_after_s": 0,
            "labels": {"cluster": "eu-1"},
        },
    }
    path = tmp_path / "servepilot.yaml"
    path.write_text(yaml.safe_dump(raw))
    sidecar = Sidecar(config.load(path, {}), collectors=[EngineDown()], config_path=str(path))
    assert sidecar.webhooks is not None
    try:
        now = time.time()  # the outbox and the receivers go by the wall clock
        await sidecar.loop.tick(now)
        assert await sidecar.webhooks.deliver_due() == 1
        secret.write_text("whsec_b2xk whsec_bmV3\n")  # "old" and "new": a rotation in progress
        raw["webhooks"].update(generic_url=urls[1], labels={"cluster": "eu-2"})
        path.write_text(yaml.safe_dump(raw))
        assert sidecar.reloader is not None and sidecar.reloader.file_changed()
        result = sidecar.reload("SIGHUP")
        assert result.result == "applied", result.message
        assert set(result.changed) == {
            "webhooks.generic_url",
            "webhooks.labels.cluster",
            "webhooks.secret_file.content",
        }
        assert await sidecar.webhooks.deliver_due() == 1
        await sidecar.loop.tick(now + 1)  # still down: nothing new to send
        assert await sidecar.webhooks.deliver_due() == 0
    finally:
        await sidecar.stop()
        for runner in runners:
            await runner.cleanup()
    [fired] = old_log.messages
    assert [a["labels"]["source"] for a in fired["alerts"]] == ["engine"]
    assert old_log.rejected == [] and new_log.rejected == []
    [moved] = new_log.messages
    assert sorted((a["status"], a["labels"]["cluster"]) for a in moved["alerts"]) == [
        ("firing", "eu-2"),
        ("resolved", "eu-1"),
    ]


def test_the_tail_detector_takes_the_windows_the_quantiles_are_of(tmp_path: Path) -> None:
    """Its queue feature is the deepest queue of each tail's window: the engine's quantiles are of
    ``engine.quantile_window_s``, the gate's of ``gate.stats_window_s``."""
    cfg = config.build(
        {
            "agent": {"listen_port": _free_port(), "admin_listen_port": _free_port()},
            "audit": {"path": str(tmp_path / "audit.jsonl")},
            "forecast": {"enabled": False},
            "engine": {"quantile_window_s": 30.0},
            "gate": {"stats_window_s": 90.0},
        }
    )
    sidecar = Sidecar(cfg, collectors=[OneValue()])
    [tails] = [d for d in sidecar.loop.detectors if d.name == "tail_latency"]
    assert (tails.window_s, tails.gate_window_s) == (30.0, 90.0)


def test_the_spec_decode_detector_prices_drafts_by_the_configured_cost(tmp_path: Path) -> None:
    """``detectors.spec_draft_cost_ratio``: near 0 beside n-gram drafting, whose drafts cost only their
    verification; the default 0.1 is a draft model's."""
    cfg = config.build(
        {
            "agent": {"listen_port": _free_port(), "admin_listen_port": _free_port()},
            "audit": {"path": str(tmp_path / "audit.jsonl")},
            "forecast": {"enabled": False},
            "detectors": {"spec_draft_cost_ratio": 0.02},
        }
    )
    [spec] = [d for d in Sidecar(cfg, collectors=[OneValue()]).loop.detectors if d.name == "spec_decode"]
    assert spec.draft_cost_ratio == 0.02
    assert config.build({}).detectors.spec_draft_cost_ratio == 0.1


async def test_a_stop_stage_that_raises_still_restores_the_gpu_and_closes_the_listener(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from agent import persist
    from agent.actuators.gpu_backend import SimulatedGpuBackend

    gpu_file = tmp_path / "gpu.json"
    cfg = config.build(
        {
            "agent": {
                "listen_port": _free_port(),
                "admin_listen_port": None,
                "state_path": str(tmp_path / "state.json"),
            },
            "actuators": {
                "mode": "act",
                "gpu": "power_limit",
                "gpu_backend": "simulated",
                "gpu_state_file": str(gpu_file),
            },
            "audit": {"path": None},
            "probe": {"enabled": False},
            "forecast": {"enabled": False},
        }
    )
    sidecar = Sidecar(cfg, collectors=[OneValue()])
    gpu = sidecar.knobs.gpu
    assert gpu is not None
    gpu.problem = None  # the simulated backend needs no privilege
    await sidecar.start()
    gpu.set(250.0)
    assert {g["power_limit_w"] for g in SimulatedGpuBackend.read_state(gpu_file)} == {250.0}

    def broken(*_: object) -> None:
        raise RuntimeError("a bug in capturing the state")

    monkeypatch.setattr(persist, "capture", broken)
    await sidecar.stop()
    assert {g["power_limit_w"] for g in SimulatedGpuBackend.read_state(gpu_file)} == {400.0}
    assert "stopping: ending the loop and saving the state failed; the stop goes on" in caplog.text
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as http:
            await http.get(f"http://127.0.0.1:{cfg.agent.listen_port}/healthz")


@pytest.mark.parametrize(("own", "at_start", "after_reload"), [(None, 1.0, 1.5), (3.0, 3.0, 3.0)])
async def test_capacity_is_learned_at_the_policies_slo_unless_the_forecast_names_its_own(
    tmp_path: Path, own: float | None, at_start: float, after_reload: float
) -> None:
    """forecast.ttft_slo_s was its own setting at 2 s: a replica run for a 1 s SLO learned as its
    capacity the load it served at twice the latency it is run for, and the fleet was sized on it."""
    import yaml

    raw: dict[str, Any] = {
        "agent": {"listen_port": _free_port(), "admin_listen_port": None},
        "audit": {"path": None},
        "probe": {"enabled": False},
        "forecast": {"enabled": True, "state_path": None, "ttft_slo_s": own},
        "policies": {"ttft_slo_s": 1.0},
    }
    path = tmp_path / "servepilot.yaml"
    path.write_text(yaml.safe_dump(raw))
    sidecar = Sidecar(config.load(path, {}), collectors=[OneValue()], config_path=str(path))
    assert sidecar.forecaster is not None and sidecar.forecaster.ttft_slo_s == at_start
    raw["policies"]["ttft_slo_s"] = 1.5
    path.write_text(yaml.safe_dump(raw))
    assert sidecar.reload("SIGHUP").result == "applied"
    assert sidecar.forecaster.ttft_slo_s == after_reload


async def test_a_control_loop_that_died_is_logged_at_the_stop_and_the_state_still_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(tmp_path, state_path=str(tmp_path / "state.json"))
    sidecar = Sidecar(cfg, collectors=[OneValue()])

    async def broken(_: asyncio.Event) -> None:
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr(sidecar.loop, "run", broken)
    await sidecar.start()
    await asyncio.sleep(0)  # the loop task runs, and fails
    await sidecar.stop()
    assert "servepilot-loop had failed" in caplog.text and "a bug in the loop" in caplog.text
    assert (tmp_path / "state.json").exists()


def test_the_breaker_burns_against_the_configured_error_budget_and_a_reload_of_it() -> None:
    """policies.error_budget: the breaker's burn rates measured against the budget the alert rules were
    written with (python -m dashboards.rules --error-budget), not a fixed 1 %."""
    import tempfile

    import yaml

    raw: dict[str, Any] = {
        "agent": {"listen_port": _free_port(), "admin_listen_port": None},
        "audit": {"path": None},
        "probe": {"enabled": False},
        "forecast": {"enabled": False},
        "policies": {"error_budget": 0.005},
    }
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "servepilot.yaml"
        path.write_text(yaml.safe_dump(raw))
        sidecar = Sidecar(config.load(path, {}), collectors=[OneValue()], config_path=str(path))
        [breaker] = [p for p in sidecar.loop.policies if p.name == "breaker"]
        assert breaker.slo_target == pytest.approx(0.995)
        raw["policies"]["error_budget"] = 0.02
        path.write_text(yaml.safe_dump(raw))
        result = sidecar.reload("SIGHUP")
        assert result.result == "applied", result.message
        [breaker] = [p for p in sidecar.loop.policies if p.name == "breaker"]
        assert breaker.slo_target == pytest.approx(0.98)
