"""deploy/kubernetes: every manifest validates against the Kubernetes schemas (offline, kubernetes-validate
bundles them), and the pod's pieces agree with each other and with servepilot's own config.

Schema validity alone would pass a pod whose sidecar scrapes the wrong port; the cross-checks below are
the wiring a reviewer would trace by hand: Service -> gate port, gate upstream -> engine's loopback
port, probe port, token files -> the Secret's mount, state files -> the writable volume.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from agent.config import Config, build
from agent.engines.launcher import free_port
from tests.deploy.conftest import ROOT

KUBE = ROOT / "deploy" / "kubernetes"
ENGINES = {"vllm": 8000, "sglang": 30000}
VERSIONS = ("1.30.0", "1.37.0")  # the oldest release with supported native features we use, the newest
KUSTOMIZE = {"Kustomization", "Component"}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests() -> list[Path]:
    return sorted(p for p in KUBE.rglob("*.yaml") if not any(d["kind"] in KUSTOMIZE for d in _docs(p)))


def _by_kind(engine: str, kind: str) -> dict[str, Any]:
    found = [d for p in (KUBE / engine).glob("*.yaml") for d in _docs(p) if d["kind"] == kind]
    assert len(found) == 1, f"{engine}: expected one {kind}, found {len(found)}"
    return found[0]


def _container(engine: str, name: str) -> dict[str, Any]:
    spec = _by_kind(engine, "Deployment")["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name)


def _config(engine: str, keys_file: str = "/dev/null") -> Config:
    """The ConfigMap's config; the API keys file it names (in the Secret's mount) is ``keys_file`` here."""
    data = yaml.safe_load(_by_kind(engine, "ConfigMap")["data"]["config.yaml"])
    return build(data, {"SERVEPILOT_GATE__API_KEYS_FILE": keys_file})


def _mounts(engine: str, container: str) -> dict[str, str]:
    """volume name -> mount path in ``container``."""
    return {m["name"]: m["mountPath"] for m in _container(engine, container)["volumeMounts"]}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", _manifests(), ids=lambda p: str(p.relative_to(KUBE)))
def test_manifest_validates_strictly(path: Path, version: str) -> None:
    for doc in _docs(path):
        if doc["metadata"]["name"] == "any-servepilot-deployment":
            continue  # a kustomize patch, validated merged below
        kubernetes_validate.validate(doc, version, strict=True)


def test_validation_needs_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("kubernetes-validate tried to open a connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    kubernetes_validate.validate(_by_kind("vllm", "Deployment"), "1.37.0", strict=True)


def test_a_wrong_field_is_rejected() -> None:
    """The validator is not a rubber stamp: a misspelt field fails strict validation."""
    doc = _by_kind("vllm", "Deployment")
    doc["spec"]["template"]["spec"]["containers"][1]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, "1.37.0", strict=True)


@pytest.mark.parametrize("folder", ["vllm", "sglang", "components/gpu-control"])
def test_kustomization_lists_exactly_the_files_beside_it(folder: str) -> None:
    directory = KUBE / folder
    kustomization = _docs(directory / "kustomization.yaml")[0]
    listed = set(kustomization.get("resources", [])) | {p["path"] for p in kustomization.get("patches", [])}
    present = {p.name for p in directory.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


@pytest.mark.parametrize("engine", ENGINES)
def test_configmap_holds_a_valid_servepilot_config(engine: str) -> None:
    cfg = _config(engine)
    assert cfg.engine.kind == engine and cfg.gate.enabled


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_listens_on_loopback_where_the_gate_and_scraper_look(engine: str) -> None:
    cfg, port = _config(engine), ENGINES[engine]
    args = _container(engine, engine)["args"]
    assert "--host=127.0.0.1" in args and f"--port={port}" in args
    for url in (cfg.engine.url, *cfg.gate.upstreams.values()):
        assert (urlsplit(url).hostname, urlsplit(url).port) == ("127.0.0.1", port)


def _services(engine: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The clients' Service and the headless one the gates count each other by."""
    found = [d for p in (KUBE / engine).glob("*.yaml") for d in _docs(p) if d["kind"] == "Service"]
    headless = [d for d in found if d["spec"].get("clusterIP") == "None"]
    clients = [d for d in found if d not in headless]
    assert len(clients) == 1 and len(headless) == 1, f"{engine}: expected a Service and a headless one"
    return clients[0], headless[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_service_targets_the_gate_port(engine: str) -> None:
    target = _services(engine)[0]["spec"]["ports"][0]["targetPort"]
    ports = {p["name"]: p["containerPort"] for p in _container(engine, "servepilot")["ports"]}
    assert ports[target] == _config(engine).gate.listen_port
    assert ports["servepilot"] == _config(engine).agent.listen_port


@pytest.mark.parametrize("engine", ENGINES)
def test_the_gates_count_each_other_by_a_headless_service_of_their_own_pods(engine: str) -> None:
    """``gate.peers_dns`` names the headless Service, which selects exactly the Deployment's pods (the
    clients' Service does too): its addresses are the gates sharing the lines' rates."""
    clients, headless = _services(engine)
    pod_labels = _by_kind(engine, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = headless["spec"]["selector"]
    assert selector == clients["spec"]["selector"]
    assert selector.items() <= pod_labels.items()
    assert _config(engine).gate.peers_dns == headless["metadata"]["name"]
    assert not headless["spec"].get("publishNotReadyAddresses")  # a pod not ready serves no one


@pytest.mark.parametrize("engine", ENGINES)
def test_sidecar_probes_use_healthz_and_readyz(engine: str) -> None:
    sidecar = _container(engine, "servepilot")
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"


@pytest.mark.parametrize("engine", ENGINES)
def test_the_engine_outlasts_the_gates_shutdown_and_the_pod_outlasts_both(engine: str) -> None:
    """Deleted, the pod leaves its Service as both containers get SIGTERM: the gate serves on for
    ``shutdown_delay_s`` while that reaches the nodes, then drains for up to ``drain_s``. The engine's
    preStop holds it up meanwhile (else the gate relays to nothing), and the grace period covers both."""
    gate = _config(engine).gate
    pre_stop = _container(engine, engine)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = _by_kind(engine, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert gate.shutdown_delay_s >= 3  # endpoint updates take seconds to reach every node
    assert gate.shutdown_delay_s + gate.drain_s <= float(pre_stop[1]) < grace


@pytest.mark.parametrize("engine", ENGINES)
def test_sidecar_drops_every_capability_and_runs_unprivileged(engine: str) -> None:
    context = _container(engine, "servepilot")["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["runAsNonRoot"] and context["runAsUser"] != 0
    assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"]


@pytest.mark.parametrize("engine", ENGINES)
def test_probe_port_and_ranks_match_the_engine(engine: str) -> None:
    cfg = _config(engine)
    env = {e["name"]: e.get("value") for e in _container(engine, engine)["env"]}
    assert urlsplit(cfg.probe.url).port == int(env["SERVEPILOT_PROBE_PORT"])
    assert env["PYTHONPATH"] == _mounts(engine, engine)["probe-plugin"]
    flags = ("--tensor-parallel-size=", "--tp-size=")
    tp = [a for a in _container(engine, engine)["args"] if a.startswith(flags)]
    assert tp == [tp[0].split("=")[0] + f"={cfg.probe.ranks}"]


@pytest.mark.parametrize("engine", ENGINES)
def test_token_files_live_in_the_mounted_secret(engine: str) -> None:
    cfg, secret = _config(engine), _by_kind(engine, "Secret")
    tokens_dir = Path(_mounts(engine, "servepilot")["tokens"])
    for path in (cfg.actuators.admin_token_file, cfg.webhooks.secret_file):
        assert path is not None and Path(path).parent == tokens_dir
        assert Path(path).name in secret["stringData"]


@pytest.mark.parametrize("engine", ENGINES)
def test_servepilot_admin_in_the_container_finds_the_admin_routes_on_loopback(engine: str) -> None:
    """The runbooks' ``kubectl exec POD -c servepilot -- servepilot admin -c <the args' config> ...``: the
    config it is given is the one the sidecar runs with, and it points at the loopback admin listener."""
    from agent.commands.admin import admin_url

    args = _container(engine, "servepilot")["args"]
    config_path = args[args.index("--config") + 1]
    mounted = _mounts(engine, "servepilot")
    assert any(config_path.startswith(path.rstrip("/") + "/") for path in mounted.values()), config_path
    assert admin_url(_config(engine)) == "http://127.0.0.1:9402"


@pytest.mark.parametrize("engine", ENGINES)
def test_state_files_live_on_the_writable_volume(engine: str) -> None:
    cfg = _config(engine)
    state_dir = Path(_mounts(engine, "servepilot")["state"])
    for path in (cfg.audit.path, cfg.webhooks.queue_path, cfg.forecast.state_path):
        assert path is not None and Path(path).parent == state_dir


@pytest.mark.parametrize("engine", ENGINES)
def test_gate_api_keys_are_a_file_of_the_mounted_secret(engine: str, tmp_path: Path) -> None:
    """A file, not an environment variable: re-read at each reload, so keys rotate without a restart, and
    not readable from /proc/<pid>/environ."""
    data = yaml.safe_load(_by_kind(engine, "ConfigMap")["data"]["config.yaml"])
    path = Path(data["gate"]["api_keys_file"])
    assert path.parent == Path(_mounts(engine, "servepilot")["tokens"])
    placeholder = _by_kind(engine, "Secret")["stringData"][path.name]
    (tmp_path / path.name).write_text(placeholder)
    assert _config(engine, str(tmp_path / path.name)).gate.api_keys == {}
    (tmp_path / path.name).write_text("sk-team-a-0123456789: team-a\n")  # what an operator puts there
    assert _config(engine, str(tmp_path / path.name)).gate.api_keys == {"sk-team-a-0123456789": "team-a"}
    env = {e["name"] for e in _container(engine, "servepilot")["env"]}
    assert not any("API_KEYS" in name for name in env)


def _merge(base: Any, patch: Any) -> Any:
    """A strategic merge for what the patch uses: maps merge, lists of named items merge by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(i, dict) for i in base + patch):
        merged = {i.get("name"): i for i in base}
        for item in patch:
            merged[item.get("name")] = _merge(merged.get(item.get("name")), item)
        return list(merged.values())
    return patch


@pytest.mark.parametrize("engine", ENGINES)
def test_gpu_control_component_adds_only_sys_admin(engine: str) -> None:
    patch = _docs(KUBE / "components" / "gpu-control" / "sidecar-sys-admin.yaml")[0]
    deployment = _by_kind(engine, "Deployment")
    merged = _merge(deployment, {"spec": patch["spec"]})
    kubernetes_validate.validate(merged, "1.37.0", strict=True)
    sidecar = next(c for c in merged["spec"]["template"]["spec"]["containers"] if c["name"] == "servepilot")
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    cfg = build({}, {k: v for k, v in env.items() if k.startswith("SERVEPILOT_ACTUATORS") and v})
    assert (cfg.actuators.mode, cfg.actuators.gpu) == ("act", "power_limit")
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"  # the merge kept the base's env


@pytest.mark.parametrize("engine", ENGINES)
async def test_the_engines_liveness_probe_restarts_it_only_on_the_sidecars_503(engine: str) -> None:
    """The probe script in the manifest, run as the kubelet runs it, against an engine and a sidecar on
    loopback: it fails when /health fails or when the sidecar says the engine has been hung for
    ``agent.engine_restart_stall_s``, and passes when the sidecar is down or does not know the route."""
    import asyncio
    import sys

    from aiohttp import web

    probe = _container(engine, engine)["livenessProbe"]["exec"]["command"]
    assert probe[:2] == ["python3", "-c"]
    cfg = _config(engine)
    assert cfg.agent.engine_restart_stall_s > 0
    engine_url, livez_url = f"http://127.0.0.1:{ENGINES[engine]}", f"http://127.0.0.1:{cfg.agent.listen_port}"
    assert f'"{engine_url}/health"' in probe[2] and f'"{livez_url}/engine/livez"' in probe[2]
    answers = {"health": 200, "livez": 200}

    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=answers["health" if request.path == "/health" else "livez"])

    app = web.Application()
    app.router.add_get("/health", answer)
    app.router.add_get("/engine/livez", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    here = f"http://127.0.0.1:{runner.addresses[0][1]}"
    closed = f"http://127.0.0.1:{free_port()}"

    async def run(sidecar: str) -> int:
        script = probe[2].replace(engine_url, here).replace(livez_url, sidecar)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stderr=asyncio.subprocess.DEVNULL
        )
        return await proc.wait()

    try:
        assert await run(here) == 0
        answers["livez"] = 503  # hung past the limit: restart
        assert await run(here) == 1
        assert await run(closed) == 0  # the sidecar is down: no verdict on the engine
        answers["livez"] = 404  # a sidecar without the route
        assert await run(here) == 0
        answers["health"] = 500  # the engine's own /health fails, whatever the sidecar says
        assert await run(here) != 0
    finally:
        await runner.cleanup()
