"""``servepilot check``: every source and API a config names, read once against the real simulator."""

from __future__ import annotations

import dataclasses
import json
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from agent import config
from agent.cli import main
from agent.preflight import CheckResult, render, run_checks, slots_advice
from detectors.snapshot import Reading, SourceStatus
from simulator.engine import make_core
from simulator.server import SimServer


@pytest.fixture
async def sim_url() -> AsyncIterator[str]:
    server = SimServer(make_core("a100-80g", "llama-2-7b", "fp16", 256), speed=10.0)
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


def _closed_port() -> int:
    with socket.socket() as sock:  # free a moment ago, and nothing listens on it now
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _engine_only(port: int) -> str:
    """A config whose only source is an engine at ``port`` (NVML and the probe off)."""
    return (
        f"engine: {{url: 'http://127.0.0.1:{port}'}}\nnvml: {{backend: 'off'}}\nprobe: {{enabled: false}}\n"
    )


def _full_config(url: str, dead_upstream: str) -> config.Config:
    return config.build(
        {
            "engine": {"kind": "vllm", "url": url},
            "nvml": {"backend": "simulated", "simulated_url": url, "sample_interval_s": 0.05},
            "probe": {"enabled": True, "url": f"{url}/sim/probe/metrics"},
            "control": {"enabled": True, "url": url},
            "actuators": {"gpu": "power_limit", "gpu_backend": "simulated"},
            "gate": {"enabled": True, "upstreams": {"primary": url, "fp8": dead_upstream}},
        }
    )


async def test_every_enabled_part_is_checked_once_and_a_dead_upstream_fails(sim_url: str) -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    results = {r.name: r for r in await run_checks(_full_config(sim_url, dead))}
    assert list(results) == [
        "engine",
        "nvml",
        "probe",
        "control",
        "gpu_actuator",
        "upstream primary",
        "routes primary",
        "upstream fp8",
        "engine upstream",
        "client keys",
        "gate peers",
    ]
    assert {name for name, r in results.items() if r.failed} == {"upstream fp8"}
    # the simulator serves no OpenAPI document (its control API's spec is in the repository): not a failure
    assert results["routes primary"].status == "no_data" and "HTTP 404" in results["routes primary"].detail
    assert results["engine upstream"].detail.startswith("upstream primary is engine.url")
    assert "engine vllm" in results["engine"].detail and results["engine"].target == f"{sim_url}/metrics"
    assert "gpus 1" in results["nvml"].detail
    # which index is which GPU, for pinning nvml.gpus / actuators.gpus by the engine's own UUIDs
    sim_gpu = uuid.uuid5(uuid.NAMESPACE_URL, "servepilot-sim/0/0")  # simulator/telemetry.py
    assert results["nvml"].detail.endswith(f"; GPU 0 GPU-{sim_gpu} (engine)"), results["nvml"].detail
    assert "torch_version" in results["probe"].detail
    assert results["control"].detail.startswith("generic API, knobs max_num_seqs=256")
    assert results["gpu_actuator"].detail == "power_limit on GPU 0: power limit 100-400 W (simulated)"
    assert results["upstream primary"].detail == "healthy, serves meta-llama/Llama-2-7b-hf"
    assert results["upstream fp8"].target == f"{dead}/health"
    table = render(list(results.values())).splitlines()
    assert len(table) == 12 and table[-1] == "11 checks, 1 failed"


async def test_an_upstream_serving_another_model_fails_until_upstream_models_names_it(sim_url: str) -> None:
    """Clients name the primary's model; routed to an upstream serving another one, they would get 404."""
    small = SimServer(make_core("a100-80g", "llama-3-8b", "fp16", 256), speed=10.0)  # another model
    runner = web.AppRunner(small.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    small_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    served = small.core.model.served_name

    async def small_check(**gate: object) -> CheckResult:
        cfg = config.build(
            {
                "engine": {"url": sim_url},
                "nvml": {"backend": "off"},
                "probe": {"enabled": False},
                "gate": {"enabled": True, "upstreams": {"primary": sim_url, "small": small_url}, **gate},
            }
        )
        results = {r.name: r for r in await run_checks(cfg)}
        assert not results["upstream primary"].failed
        return results["upstream small"]

    try:
        unmapped = await small_check()
        assert unmapped.failed and "requests routed here get 404" in unmapped.detail
        assert f"set gate.upstream_models.small: {served}" in unmapped.detail
        wrong = await small_check(upstream_models={"small": "meta-llama/Llama-2-7b-hf"})
        assert wrong.failed and wrong.detail.startswith(
            "gate.upstream_models.small is 'meta-llama/Llama-2-7b-hf'"
        )
        mapped = await small_check(upstream_models={"small": served})
        assert not mapped.failed and mapped.detail == f"healthy, serves {served}"
    finally:
        await runner.cleanup()


async def test_the_check_changes_nothing_on_the_engine(sim_url: str) -> None:
    """Discovery reads the control state; no knob moves and no lease is left behind."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{sim_url}/v1/control/state") as response:
            before = await response.json()
        await run_checks(_full_config(sim_url, sim_url))
        async with session.get(f"{sim_url}/v1/control/state") as response:
            after = await response.json()
    assert after["settings"] == before["settings"]
    assert after["lease"]["active"] is False and before["lease"]["active"] is False


def test_cli_exits_1_with_one_row_naming_the_dead_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = _closed_port()
    path = tmp_path / "pod.yaml"
    path.write_text(_engine_only(port))
    assert main(["check", "--config", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0].startswith("engine  error") and f"cannot connect to http://127.0.0.1:{port}/metrics" in out[0]
    )
    assert out[-1] == "1 checks, 1 failed"


def test_cli_json_lists_every_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pod.yaml"
    path.write_text(_engine_only(_closed_port()))
    assert main(["check", "--config", str(path), "--json"]) == 1
    [row] = json.loads(capsys.readouterr().out)
    assert row["name"] == "engine" and row["status"] == "error" and row["duration_s"] >= 0


def test_cli_bad_config_is_exit_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pod.yaml"
    path.write_text("engine: {url: 'ftp://engine'}\n")
    assert main(["check", "--config", str(path)]) == 2
    assert "engine.url" in capsys.readouterr().err


def test_a_gate_with_no_upstream_at_the_engines_url_is_said_but_does_not_fail() -> None:
    from agent import config
    from agent.preflight import check_engine_upstream

    cfg = config.build(
        {
            "engine": {"url": "http://127.0.0.1:8000"},
            "gate": {"upstreams": {"primary": "http://10.0.0.7:8000"}},
        }
    )
    row = check_engine_upstream(cfg)
    assert (row.status, row.failed) == ("no_data", False)
    assert "the engine_stall finding cannot take this engine out of the split" in row.detail


def test_no_data_is_shown_but_does_not_fail() -> None:
    row = CheckResult("probe", "no_data", "CUDA not initialised in the engine process", 0.001)
    assert not row.failed
    assert render([row]).splitlines()[-1] == "1 checks, 0 failed"


async def test_an_upstreams_routes_the_gate_would_pass_through_unlimited_are_named() -> None:
    """From the upstream's /openapi.json (vLLM 0.32's real route list, and one route a later release
    adds): every POST route is admitted or known harmless but the new one, which the check names without
    failing; admit_paths quiets it."""
    document = json.loads(
        (Path(__file__).parents[1] / "fixtures/gate/vllm-0.32.0-cpu-openapi-paths.json").read_text()
    )
    document["paths"]["/v1/newer"] = {"post": {"summary": "Newer"}}

    async def openapi(_: web.Request) -> web.Response:
        return web.json_response(document)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        for admit, named in (((), True), (("/v1/newer",), False)):
            gate = {"enabled": True, "upstreams": {"primary": url}, "admit_paths": list(admit)}
            sources = {"engine": {"url": url}, "nvml": {"backend": "off"}, "probe": {"enabled": False}}
            cfg = config.build({**sources, "gate": gate})
            row = {r.name: r for r in await run_checks(cfg)}["routes primary"]
            assert row.status == "ok" and not row.failed
            assert ("passed through unlimited, not known to the gate: /v1/newer" in row.detail) is named
            assert "/v1/messages" in row.detail and row.target == f"{url}/openapi.json"
    finally:
        await runner.cleanup()


def test_an_engine_priority_order_the_wrong_way_round_for_the_engine_fails() -> None:
    """The SGLang preset on vLLM would send high-priority requests to the back of vLLM's queue: an error.
    The order is judged for this pod's engine (``engine.kind``, or what the metrics check recognised)."""
    from agent.preflight import check_engine_priority

    def rows(kind: str | None, **orders: object) -> dict[str, CheckResult]:
        cfg = config.build(
            {
                "engine": {"url": "http://127.0.0.1:8000"},
                "gate": {
                    "enabled": True,
                    "upstreams": {"primary": "http://127.0.0.1:8000", "remote": "http://10.0.0.7:8000"},
                    "engine_priority": orders,
                },
            }
        )
        return {r.name: r for r in check_engine_priority(cfg, kind)}

    wrong = rows("vllm", primary="sglang", remote="sglang")
    assert (
        wrong["priority primary"].failed
        and "high-priority requests would go last" in wrong["priority primary"].detail
    )
    assert wrong["priority remote"].status == "ok"  # not this pod's engine: its kind is not known
    assert "higher first" in wrong["priority remote"].detail
    assert rows("vllm", primary="vllm")["priority primary"].status == "ok"
    sglang = rows("sglang", primary="vllm")["priority primary"]
    assert sglang.status == "ok" and "with --schedule-low-priority-values-first" in sglang.detail
    llama = rows("llamacpp", primary="vllm")["priority primary"]
    assert (llama.status, llama.failed) == ("no_data", False) and "has no effect" in llama.detail
    odd = rows(None, primary={"high": 1, "normal": 5, "low": 0})["priority primary"]
    assert odd.failed and "normal must lie between high and low" in odd.detail


def _sglang_order_at(url: str) -> config.Config:
    """An engine at ``url`` (kind auto) behind the gate, sent SGLang's priority order."""
    return config.build(
        {
            "engine": {"url": url},
            "nvml": {"backend": "off"},
            "probe": {"enabled": False},
            "gate": {
                "enabled": True,
                "upstreams": {"primary": url},
                "engine_priority": {"primary": "sglang"},
            },
        }
    )


async def test_the_engine_recognised_by_its_metrics_judges_the_priority_order(sim_url: str) -> None:
    """``engine.kind: auto``: the simulator's scrape reads as vLLM's, so the SGLang order fails for it."""
    results = {r.name: r for r in await run_checks(_sglang_order_at(sim_url))}
    assert "engine vllm" in results["engine"].detail
    assert results["priority primary"].failed, results["priority primary"]
    # an engine that cannot be read is not recognised: the order is shown, not judged
    results = {r.name: r for r in await run_checks(_sglang_order_at(f"http://127.0.0.1:{_closed_port()}"))}
    assert results["engine"].failed and results["priority primary"].status == "ok"
    assert "not known here" in results["priority primary"].detail


def test_a_gpu_actuator_that_would_drive_every_visible_gpu_says_so(tmp_path: Path) -> None:
    from agent.actuators.gpu_backend import SimulatedGpuBackend
    from agent.preflight import check_gpu_actuator

    state = tmp_path / "gpus.json"
    SimulatedGpuBackend(count=2, state_file=state)
    actuators = {"gpu": "power_limit", "gpu_backend": "simulated", "gpu_state_file": str(state)}
    every = check_gpu_actuator(config.build({"actuators": actuators, "probe": {"enabled": False}}))
    assert every.status == "ok"
    assert every.detail == (
        "power_limit on GPUs 0, 1: power limit 100-400 W (simulated); all the GPUs this container sees "
        "(actuators.gpus is empty; on a shared node, name them)"
    )
    named = check_gpu_actuator(config.build({"actuators": {**actuators, "gpus": [1]}}))
    assert named.detail == "power_limit on GPU 1: power limit 100-400 W (simulated)"
    missing = check_gpu_actuator(config.build({"actuators": {**actuators, "gpus": [2]}}))
    assert missing.failed
    assert missing.detail == "actuators.gpus names GPU 2, but this container sees GPUs 0, 1"


def test_with_the_probe_on_the_gpu_actuator_row_names_the_engine_s_gpus(tmp_path: Path) -> None:
    from agent.actuators.gpu_backend import SimulatedGpuBackend
    from agent.preflight import check_gpu_actuator

    state = tmp_path / "gpus.json"
    node = SimulatedGpuBackend(count=3)
    for index, gpu in enumerate(node.gpus):
        gpu.uuid = f"GPU-{index}"
    state.write_text(json.dumps({"gpus": [dataclasses.asdict(g) for g in node.gpus]}))
    cfg = config.build(
        {"actuators": {"gpu": "power_limit", "gpu_backend": "simulated", "gpu_state_file": str(state)}}
    )

    def probe(**info: str) -> Reading:
        return Reading("probe", 0.0, SourceStatus.OK, {"probe.reserved_bytes": 1.0}, info=info)

    before = check_gpu_actuator(cfg)  # the probe not read (yet): nothing would be set
    assert before.status == "no_data"
    assert before.detail == (
        "waiting for the allocator probe to name the engine's GPUs among the GPUs 0, 1, 2 this container "
        "sees (or name them in actuators.gpus)"
    )
    ours = check_gpu_actuator(cfg, probe(gpu_uuids="GPU-2"))
    assert (ours.status, ours.detail) == (
        "ok",
        "power_limit on GPU 2: power limit 100-400 W (simulated); the engine's, as the probe names them",
    )
    elsewhere = check_gpu_actuator(cfg, probe(gpu_uuids="GPU-7"))
    assert elsewhere.failed and "the engine's GPUs (GPU-7) are not among the GPUs 0, 1, 2" in elsewhere.detail


async def test_on_a_shared_node_check_marks_the_engine_s_gpu_and_would_drive_it_alone(tmp_path: Path) -> None:
    """The simulator on a node of 3 GPUs, its engine on GPU 2: the probe's UUID reaches both rows."""
    server = SimServer(make_core("a100-80g", "llama-2-7b", "fp16", 256), node_gpus=3)
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        node = server.nvml.read(server.sim_now())["gpus"]
        state = tmp_path / "gpus.json"
        state.write_text(json.dumps({"gpus": [{"uuid": g["uuid"]} for g in node]}))
        cfg = config.build(
            {
                "engine": {"url": url},
                "nvml": {"backend": "simulated", "simulated_url": url},
                "probe": {"url": f"{url}/sim/probe/metrics"},
                "actuators": {"gpu": "power_limit", "gpu_backend": "simulated", "gpu_state_file": str(state)},
            }
        )
        rows = {r.name: r for r in await run_checks(cfg)}
    finally:
        await runner.cleanup()
    engine = node[2]["uuid"]
    assert rows["nvml"].detail.endswith(f"GPU 1 {node[1]['uuid']}, GPU 2 {engine} (engine)"), rows["nvml"]
    assert f"gpu_uuids {engine}" in rows["probe"].detail
    assert rows["gpu_actuator"].status == "ok"
    assert rows["gpu_actuator"].detail.startswith("power_limit on GPU 2: "), rows["gpu_actuator"]


#: The fields ``servepilot check`` reads from Alertmanager's ``GET /api/v2/status`` (its OpenAPI schema:
#: ``cluster.status`` and ``versionInfo.version``; the e2e test reads a real one).
AM_STATUS = {"cluster": {"status": "ready", "peers": []}, "versionInfo": {"version": "0.27.0"}, "uptime": "x"}


async def test_alert_receivers_are_reached_and_sent_nothing(tmp_path: Path) -> None:
    """Alertmanager answers its status; the generic receiver, over https with a private CA, answers a GET
    with 405 (reachable) and gets no POST; with the CA unknown (no tls_ca_file) its row is an error."""
    import ssl

    import trustme

    posts: list[str] = []

    async def status(_: web.Request) -> web.Response:
        return web.json_response(AM_STATUS)

    async def hook(request: web.Request) -> web.Response:
        posts.append(request.path)
        return web.json_response({})

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(served)
    am, receiver = web.Application(), web.Application()
    am.router.add_get("/api/v2/status", status)
    am.router.add_post("/api/v2/alerts", hook)
    receiver.router.add_post("/hook", hook)
    runners = [web.AppRunner(am), web.AppRunner(receiver)]
    for runner in runners:
        await runner.setup()
    await web.TCPSite(runners[0], "127.0.0.1", 0).start()
    await web.TCPSite(runners[1], "127.0.0.1", 0, ssl_context=served).start()
    (tmp_path / "secret").write_text("whsec_" + "a2V5" * 8)
    hooks = {
        "enabled": True,
        "alertmanager_url": f"http://127.0.0.1:{runners[0].addresses[0][1]}",
        "generic_url": f"https://127.0.0.1:{runners[1].addresses[0][1]}/hook",
        "secret_file": str(tmp_path / "secret"),
        "queue_path": str(tmp_path / "outbox.sqlite"),
    }
    sources = {
        "engine": {"url": "http://127.0.0.1:9"},
        "nvml": {"backend": "off"},
        "probe": {"enabled": False},
    }
    try:
        trusted = config.build({**sources, "webhooks": {**hooks, "tls_ca_file": str(tmp_path / "ca.pem")}})
        rows = {r.name: r for r in await run_checks(trusted)}
        assert rows["webhook alertmanager"].status == "ok"
        assert rows["webhook alertmanager"].detail == "Alertmanager 0.27.0, cluster ready"
        assert rows["webhook alertmanager"].target.endswith("/api/v2/status")
        assert rows["webhook generic"].status == "ok" and "HTTP 405" in rows["webhook generic"].detail
        untrusted = config.build({**sources, "webhooks": hooks})
        row = {r.name: r for r in await run_checks(untrusted)}["webhook generic"]
        assert row.failed and "certificate verify failed" in row.detail
        (tmp_path / "bad.pem").write_text("not a certificate")
        broken = config.build({**sources, "webhooks": {**hooks, "tls_ca_file": str(tmp_path / "bad.pem")}})
        row = {r.name: r for r in await run_checks(broken)}["webhooks"]
        assert row.failed and row.detail.startswith("webhooks.tls_ca_file cannot load")
    finally:
        for runner in runners:
            await runner.cleanup()
    assert posts == []  # nothing was sent to either receiver


def test_the_access_log_row_says_whether_the_gate_could_write_there(tmp_path: Path) -> None:
    """Read only: the file is neither created nor touched."""
    from agent.preflight import check_access_log

    def row(target: str) -> tuple[str, str]:
        result = check_access_log(config.build({"gate": {"enabled": True, "access_log": target}}))
        return result.status, result.detail

    assert row("stdout") == ("ok", "to stdout")
    assert row(str(tmp_path / "access.jsonl")) == ("ok", "rotated at 100 MB, 5 kept")
    assert not (tmp_path / "access.jsonl").exists()
    assert row(str(tmp_path / "gone" / "access.jsonl")) == (
        "error",
        f"its folder {tmp_path / 'gone'} does not exist",
    )
    assert row(str(tmp_path)) == ("error", "it is not a file this process may write")


def test_the_client_keys_row_counts_them_and_says_what_a_keyless_request_meets(tmp_path: Path) -> None:
    """Never which keys: how many, and whether a request without one is refused."""
    from agent.preflight import check_client_keys

    def row(**gate: object) -> tuple[str, str]:
        result = check_client_keys(config.build({"gate": {"enabled": True, **gate}}))
        assert "sk-" not in result.detail
        return result.status, result.detail

    keys = {"sk-a": "chat", "sk-b": "batch"}
    assert row() == ("ok", "0 API keys; not required: a request without one goes to line 'default'")
    assert row(api_keys=keys, require_api_key=True) == ("ok", "2 API keys; required: 401 without one")
    emptied = tmp_path / "keys.yaml"
    emptied.write_text("")
    status, detail = row(api_keys_file=str(emptied), require_api_key=True)
    assert (status, detail) == ("error", "required, and none held: every client is refused")


async def test_the_gate_peers_row_says_how_many_share_the_rates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real lookup of ``localhost``; a name that does not resolve fails the row (the gates would give
    every line its whole rate)."""
    from agent.gate import peers
    from agent.preflight import check_peers

    found = peers.gates_in(await peers.resolve("localhost"))
    result = await check_peers(config.build({"gate": {"enabled": True, "peers_dns": "localhost"}}))
    assert (result.status, result.target) == ("ok", "localhost")
    assert result.detail.startswith(f"{found} gate") and result.detail.endswith(f"each enforces 1/{found}")

    async def unknown(name: str) -> set[str]:
        raise OSError(f"[Errno -2] Name or service not known: {name}")

    alone = await check_peers(config.build({"gate": {"enabled": True}}))
    assert alone.status == "ok" and "N replicas: N times it" in alone.detail

    monkeypatch.setattr(peers, "resolve", unknown)
    result = await check_peers(config.build({"gate": {"enabled": True, "peers_dns": "llm-vllm-gates"}}))
    assert result.status == "error" and "Name or service not known" in result.detail


def test_a_llamacpp_whose_slots_take_fewer_than_batch_min_is_told_what_to_set() -> None:
    """With 2 slots the batch policy would hold the gate's limit at 5 (2 + a slack of 2, over 0.8 for the
    high reserve), but the arbiter holds every batch value to batch_min (8): 3 requests wait in
    llama.cpp's FIFO queue, past the gate's priorities. 4 slots take 8: nothing to say."""
    cfg = config.build({"gate": {"enabled": True}})
    assert slots_advice(cfg, {"engine.slots_total": 2.0}) == (
        "its 2 slot(s) take 5 requests from the gate, under policies.batch_min 8: 3 would wait in "
        "llama.cpp's own queue, past the gate's priorities (set policies.batch_min to 5 or below)"
    )
    assert slots_advice(cfg, {"engine.slots_total": 4.0}) is None
    assert slots_advice(cfg, {}) is None  # not llama.cpp
    low = config.build({"gate": {"enabled": True}, "policies": {"batch_min": 5, "initial_batch": 5}})
    assert slots_advice(low, {"engine.slots_total": 2.0}) is None
    assert slots_advice(config.build({}), {"engine.slots_total": 2.0}) is None  # no gate: no limit
