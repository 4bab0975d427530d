"""One pass over everything a config points at, read-only, with one line per check: ``servepilot check``.

A sidecar that starts with a wrong engine URL, a container without the NVIDIA driver mounted or a probe
on the wrong port still runs: its ``/metrics`` says ``servepilot_collector_success 0`` and the reason is in
the log. Setting a pod up, an operator wants the answers before that, in one screen: each source the
config enables is collected once with the sidecar's own collectors (so a pass here means the sidecar
reads the same thing), the engine's control API is discovered (nothing is set, no lease is taken), the
GPU actuator's permission and bounds are read, each gate upstream's health path is fetched, with
the routes it serves that the gate admits and those it would pass through unlimited, and each alert
receiver is reached without being sent an alert.

A failed check is ``error``; ``no_data`` means the source answered with nothing to report yet (a probe in a
process without CUDA), which does not fail the run.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from agent.config import Config
from detectors.snapshot import Reading, SourceStatus


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check, for a table row or a JSON object."""

    name: str
    status: str
    """``ok``, ``no_data`` or ``error``."""
    detail: str
    """What was found (engine and model, GPU count, knobs...) or the one-line reason it failed."""
    duration_s: float
    target: str = ""
    """The URL or device checked."""

    @property
    def failed(self) -> bool:
        return self.status == SourceStatus.ERROR.value

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _reading_detail(reading: Reading) -> str:
    if reading.status is not SourceStatus.OK:
        return reading.error or reading.status.value
    parts = [f"{key} {value}" for key, value in sorted(reading.info.items()) if value]
    parts.append(f"{len(reading.values)} signals")
    return ", ".join(parts)


def _target(collector: object) -> str:
    for attribute in ("url", "urls"):
        value = getattr(collector, attribute, None)
        if isinstance(value, str):
            return value
        if isinstance(value, Sequence) and value:
            return ", ".join(str(v) for v in value)
    return ""


def slots_advice(cfg: Config, values: Mapping[str, float]) -> str | None:
    """What a llama.cpp with few slots behind the gate needs said (None when nothing). The batch policy
    brings the gate's limit down to what the slots take, but not under ``policies.batch_min``, which the
    arbiter holds every batch value to: with 1-3 slots the rest of those 8 wait in llama.cpp's own FIFO
    queue, out of reach of the gate's priorities and deadlines, however the policy decides."""
    from policies.batch_auto import slots_take

    slots = values.get("engine.slots_total")
    if not slots or not cfg.gate.enabled or cfg.policies.set == "none":
        return None
    take = slots_take(slots, cfg.gate.high_reserved_ratio)
    if take >= cfg.policies.batch_min:
        return None
    return (
        f"its {slots:.0f} slot(s) take {take:.0f} requests from the gate, under policies.batch_min "
        f"{cfg.policies.batch_min}: {cfg.policies.batch_min - take:.0f} would wait in llama.cpp's own "
        f"queue, past the gate's priorities (set policies.batch_min to {take:.0f} or below)"
    )


async def check_sources(cfg: Config) -> list[CheckResult]:
    """Collect once from every source the config enables (engine, llama.cpp slots, NVML, probe)."""
    return [result for result, _ in await _collect_sources(cfg)]


async def _collect_sources(cfg: Config) -> list[tuple[CheckResult, Reading]]:
    """Each source's row and the reading it was made from (what it found, e.g. which engine).

    NVML is sampled in the background like in the sidecar, so it is read after three sample periods, to
    have samples to aggregate."""
    from agent.assembly import build_collectors
    from agent.engine_gpus import from_probe, indices_of

    collectors = build_collectors(cfg)
    try:
        if cfg.nvml.backend != "off":
            await asyncio.sleep(3 * cfg.nvml.sample_interval_s)
        read = []
        for collector in collectors:
            started = time.perf_counter()
            reading = await collector.collect(time.time())
            read.append((collector, reading, time.perf_counter() - started))
        # the GPUs the probe names as the engine's, marked in the NVML row: on a shared node, this pod's
        probe = next((r for _, r, _ in read if r.source == "probe" and r.status is SourceStatus.OK), None)
        ours = from_probe(probe.info) if probe is not None else ()
        results = []
        for collector, reading, took in read:
            detail = _reading_detail(reading)
            gpus = getattr(collector, "gpu_info", ())
            if gpus and reading.status is SourceStatus.OK:
                # which index is which GPU: the engine's own UUIDs (nvidia-smi -L in its container) name
                # the indices for nvml.gpus and actuators.gpus on a node shared with other pods
                engine = indices_of(ours, {gpu.index: gpu.uuid for gpu in gpus})[0]
                detail += "; " + ", ".join(
                    f"GPU {gpu.index} {gpu.uuid}" + (" (engine)" if gpu.index in engine else "")
                    for gpu in gpus
                )
            if reading.status is SourceStatus.OK and (advice := slots_advice(cfg, reading.values)):
                detail += "; " + advice
            row = CheckResult(collector.name, reading.status.value, detail, took, _target(collector))
            results.append((row, reading))
        return results
    finally:
        for collector in collectors:
            await collector.close()


async def check_control(cfg: Config) -> CheckResult:
    """Discover the engine's control API and read its settings: no value is set, no lease is taken."""
    from agent.control.base import ControlError
    from agent.control.client import ControlClient
    from agent.tls import engine_context

    client = ControlClient(cfg.control, retries=0, tls=engine_context(cfg.engine))
    started = time.perf_counter()
    try:
        caps = await client.start()
        settings = await client.read()
    except (ControlError, OSError, ValueError) as error:
        return CheckResult("control", "error", str(error), time.perf_counter() - started, cfg.control.url)
    finally:
        await client.close()
    knobs = ", ".join(f"{name}={settings.get(name)}" for name in caps.knobs)
    detail = f"{caps.adapter} API, knobs {knobs or 'none'}, leases {'yes' if caps.leases else 'no'}"
    return CheckResult("control", "ok", detail, time.perf_counter() - started, cfg.control.url)


def check_gpu_actuator(cfg: Config, probe: Reading | None = None) -> CheckResult:
    """Whether the sidecar's GPU actuator could drive ``actuators.gpu``, on which GPUs and within which
    bounds: the actuator itself is built (its permission check and bounds), without its lease watchdog;
    nothing is set. ``probe``: the probe's reading, which names the engine's GPUs the actuator keeps to
    when ``actuators.gpus`` is empty (agent/engine_gpus.py)."""
    from prometheus_client import CollectorRegistry

    from agent.actuators.gpu import GpuActuator, backend_for, describe_gpus
    from agent.actuators.gpu_backend import GpuControlError
    from agent.engine_gpus import from_probe

    started = time.perf_counter()
    name, knob = "gpu_actuator", cfg.actuators.gpu
    followed = False
    try:
        actuator = GpuActuator(
            cfg.actuators,
            backend_for(cfg.actuators),
            CollectorRegistry(),
            watchdog=False,
            follow_engine=cfg.probe.enabled,
        )
        if actuator.problem is not None:
            return CheckResult(name, "error", actuator.problem, time.perf_counter() - started, knob)
        if actuator.waiting and probe is not None and probe.status is SourceStatus.OK:
            uuids = from_probe(probe.info)
            actuator.follow(uuids or None)
            followed = bool(uuids)
        if not actuator.indices:
            raise GpuControlError("no GPU found")
        low, high = actuator.bounds()
    except (GpuControlError, OSError, ValueError) as error:
        return CheckResult(name, "error", str(error), time.perf_counter() - started, knob)
    if actuator.waiting:  # the engine's GPUs are not among these (error), or the probe has not said yet
        status = "error" if followed else "no_data"
        return CheckResult(name, status, actuator.waiting, time.perf_counter() - started, knob)
    bounds = f"power limit {low:g}-{high:g} W" if knob == "power_limit" else f"SM clock {low:g}-{high:g} MHz"
    detail = f"{knob} on {describe_gpus(actuator.indices)}: {bounds}"
    if cfg.actuators.gpu_backend == "simulated":
        detail += " (simulated)"
    if followed:
        detail += "; the engine's, as the probe names them"
    if actuator.drives_every_visible_gpu:
        detail += "; all the GPUs this container sees (actuators.gpus is empty; on a shared node, name them)"
    return CheckResult(name, "ok", detail, time.perf_counter() - started, knob)


async def _served_models(session: aiohttp.ClientSession, base: str) -> list[str] | None:
    """The model ids ``base`` lists at ``/v1/models`` (OpenAI's shape), or None when it lists none."""
    try:
        async with session.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as response:
            doc = await response.json(content_type=None) if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]


def _model_problem(cfg: Config, name: str, served: list[str], reference: list[str]) -> str | None:
    """Why requests routed to upstream ``name`` would get 404 for their model, or None. Clients name the
    first upstream's model (the primary's); an upstream serving another model needs
    ``gate.upstream_models``, and the name given there must be one it serves."""
    mapped = cfg.gate.upstream_models.get(name)
    if mapped is not None:
        if mapped in served:
            return None
        return f"gate.upstream_models.{name} is {mapped!r}, but it serves {', '.join(served) or 'no model'}"
    if not reference or set(reference) & set(served):
        return None
    return (
        f"serves {', '.join(served)}, not {reference[0]} that clients name: requests routed here get 404;"
        f" set gate.upstream_models.{name}: {served[0]}"
    )


async def check_upstreams(cfg: Config) -> list[CheckResult]:
    """Each gate upstream's health path, judged as the gate's own health checks judge it (2xx); then the
    models it serves, against what clients ask for (the first upstream's) and ``gate.upstream_models``."""
    from agent.config import ConfigError
    from agent.gate.upstreams import probe_health, upstream_auth
    from agent.tls import gate_upstream_context

    results = []
    reference: list[str] = []
    try:
        tls = gate_upstream_context(cfg.gate)
        auth = upstream_auth(cfg.gate)  # an engine with --api-key lists its models to its key alone
    except ConfigError as error:
        return [CheckResult("upstreams", "error", str(error), 0.0)]
    connector = aiohttp.TCPConnector(ssl=tls)
    async with aiohttp.ClientSession(connector=connector, headers=auth) as session:
        for i, (name, base) in enumerate(cfg.gate.upstreams.items()):
            url = base + cfg.gate.health_path
            started = time.perf_counter()
            ok, problem = await probe_health(session, url)
            status, detail = ("ok", "healthy") if ok else ("error", problem)
            served = await _served_models(session, base) if ok else None
            if served is not None:
                if i == 0:
                    reference = served
                mismatch = _model_problem(cfg, name, served, reference)
                status, detail = (
                    ("error", mismatch) if mismatch else (status, f"healthy, serves {', '.join(served)}")
                )
            elapsed = time.perf_counter() - started
            results.append(CheckResult(f"upstream {name}", status, detail, elapsed, url))
            if ok:
                results.append(await _check_routes(session, cfg, name, base))
    return results


async def _check_routes(session: aiohttp.ClientSession, cfg: Config, name: str, base: str) -> CheckResult:
    """Which POST routes of upstream ``name`` the gate admits, from its ``/openapi.json``
    (agent/gate/routes.py). Never a failure: routes not known to the gate are named, for the operator to
    judge; an engine without the document (llama.cpp, the simulator) is ``no_data``."""
    from agent.gate.routes import classify

    url = base + "/openapi.json"
    started = time.perf_counter()
    status = "no_data"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}")
            detail = classify(await response.json(content_type=None), cfg.gate.admit_paths).summary()
            status = "ok"
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
        why = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}".rstrip(": ")
        detail = f"no OpenAPI document ({why}): which of its routes the gate admits is unchecked"
    return CheckResult(f"routes {name}", status, detail, time.perf_counter() - started, url)


async def check_webhooks(cfg: Config) -> list[CheckResult]:
    """Each alert receiver, reached as the sidecar would reach it (``webhooks.tls_*`` included) but sent
    nothing: Alertmanager answers ``GET /api/v2/status`` (its version and cluster state); the generic
    webhook takes no read-only request, so any HTTP answer to a GET (a 405 too) shows its name, port and
    TLS work. A secret or TLS file that does not load is an error naming its field."""
    from agent.config import ConfigError
    from agent.tls import webhook_context
    from agent.webhooks.dispatcher import sinks_from_config
    from agent.webhooks.sinks import AlertmanagerSink

    hooks = cfg.webhooks
    started = time.perf_counter()
    try:
        tls = webhook_context(hooks)
        sinks = sinks_from_config(hooks)
    except (ConfigError, ValueError) as error:
        return [CheckResult("webhooks", "error", str(error), time.perf_counter() - started)]
    results = []
    timeout = aiohttp.ClientTimeout(total=min(hooks.timeout_s, 10.0))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for sink in sinks:
            started = time.perf_counter()
            alertmanager = isinstance(sink, AlertmanagerSink)
            url = sink.url.removesuffix("/alerts") + "/status" if alertmanager else sink.url
            try:
                async with session.get(url, ssl=tls, allow_redirects=False) as r:
                    if alertmanager:
                        if r.status != 200:
                            raise ValueError(f"GET /api/v2/status answered HTTP {r.status}")
                        body = await r.json(content_type=None)
                        version = (body.get("versionInfo") or {}).get("version", "?")
                        cluster = (body.get("cluster") or {}).get("status", "?")
                        status, detail = "ok", f"Alertmanager {version}, cluster {cluster}"
                    elif r.status >= 500:
                        status, detail = "error", f"answered GET with HTTP {r.status}"
                    else:
                        status, detail = "ok", f"reachable (answered GET with HTTP {r.status}; nothing sent)"
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
                why = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
                status, detail = "error", why.rstrip(": ")
            results.append(
                CheckResult(f"webhook {sink.name}", status, detail, time.perf_counter() - started, url)
            )
    return results


async def run_checks(cfg: Config) -> list[CheckResult]:
    """Every check the config calls for, in a fixed order: sources, control, GPU actuator, upstreams,
    alert receivers."""
    sources = await _collect_sources(cfg)
    results = [result for result, _ in sources]
    if cfg.control.enabled:
        results.append(await check_control(cfg))
    if cfg.actuators.gpu != "off":
        probe = next((r for _, r in sources if r.source == "probe"), None)
        results.append(await asyncio.to_thread(check_gpu_actuator, cfg, probe))  # NVML init can take s
    if cfg.gate.enabled:
        results.extend(await check_upstreams(cfg))
        results.append(check_engine_upstream(cfg))
        # the engine its metrics were recognised as, where the config leaves it to them (auto)
        found = next((r.info.get("engine") for _, r in sources if r.source == "engine"), None)
        kind = cfg.engine.kind if cfg.engine.kind != "auto" else found
        results.extend(check_engine_priority(cfg, kind))
        results.append(check_client_keys(cfg))
        results.append(await check_peers(cfg))
        if cfg.gate.access_log is not None:
            results.append(check_access_log(cfg))
    if cfg.webhooks.enabled:
        results.extend(await check_webhooks(cfg))
    return results


def check_client_keys(cfg: Config) -> CheckResult:
    """How many API keys the gate holds (never which), and what a request without one meets: a 401
    (``gate.require_api_key``), or the default line. Required with none held fails: every client would
    be refused (a keys file emptied on purpose says so too)."""
    keys, where = len(cfg.gate.api_keys), cfg.gate.api_keys_file or ""
    held = f"{keys} API key{'s' if keys != 1 else ''}"
    if not cfg.gate.require_api_key:
        detail = f"{held}; not required: a request without one goes to line {cfg.gate.default_line!r}"
        return CheckResult("client keys", "ok", detail, 0.0, where)
    if not keys:
        return CheckResult(
            "client keys", "error", "required, and none held: every client is refused", 0.0, where
        )
    return CheckResult("client keys", "ok", f"{held}; required: 401 without one", 0.0, where)


async def check_peers(cfg: Config) -> CheckResult:
    """How many gates ``gate.peers_dns`` finds now, so each line's share is what the operator expects;
    a name that does not resolve fails (the gate would keep each line's whole rate). Without the field,
    says what that means for a deployment of several replicas."""
    from agent.gate.peers import PeerCount

    if not cfg.gate.peers_dns:
        detail = "gate.peers_dns not set: each gate gives every line its whole rate (N replicas: N times it)"
        return CheckResult("gate peers", "ok", detail, 0.0)
    started = time.perf_counter()
    peers = PeerCount(cfg.gate.peers_dns)
    count = await peers.refresh()
    took = time.perf_counter() - started
    if peers.error:
        detail = f"does not resolve ({peers.error}): each gate would keep every line's whole rate"
        return CheckResult("gate peers", "error", detail, took, cfg.gate.peers_dns)
    detail = f"{count} gate{'s' if count != 1 else ''} share the lines' rates: each enforces 1/{count}"
    return CheckResult("gate peers", "ok", detail, took, cfg.gate.peers_dns)


def check_access_log(cfg: Config) -> CheckResult:
    """Whether the gate could write its access log there, without creating or touching the file."""
    from agent.gate.access_log import STDOUT

    target = cfg.gate.access_log
    assert target is not None
    started = time.perf_counter()
    if target == STDOUT:
        return CheckResult("access log", "ok", "to stdout", time.perf_counter() - started, target)
    path = Path(target)
    folder = path.parent
    if not folder.is_dir():
        problem = f"its folder {folder} does not exist"
    elif path.exists() and not (path.is_file() and os.access(path, os.W_OK)):
        problem = "it is not a file this process may write"
    elif not os.access(folder, os.W_OK | os.X_OK):
        problem = f"this process may not create files in {folder} (rotation does)"
    else:
        rotated = f"rotated at {cfg.gate.access_log_max_mb:g} MB, {cfg.gate.access_log_backups} kept"
        return CheckResult("access log", "ok", rotated, time.perf_counter() - started, target)
    return CheckResult("access log", "error", problem, time.perf_counter() - started, target)


def check_engine_priority(cfg: Config, kind: str | None) -> list[CheckResult]:
    """One row per upstream in ``gate.engine_priority``: whether its values rank the gate's classes the
    way the engine ranks them (``kind``, known for this pod's engine only). An order the wrong way round
    fails: the engine would serve high-priority requests last. Whether the engine runs priority
    scheduling at all is not visible from outside (vLLM with ``fcfs`` ignores the field), so it is said,
    not checked."""
    from agent.gate.upstreams import engine_upstream

    ours = engine_upstream(cfg)
    rows = []
    for name, values in cfg.gate.engine_priority.items():
        started = time.perf_counter()
        order = (values.high, values.normal, values.low)
        status, detail = _priority_verdict(name, order, kind if name == ours else None)
        rows.append(CheckResult(f"priority {name}", status, detail, time.perf_counter() - started))
    return rows


def _priority_verdict(name: str, order: tuple[int, int, int], engine: str | None) -> tuple[str, str]:
    """(status, detail) of upstream ``name``'s (high, normal, low) values for ``engine`` (None: unknown)."""
    high, normal, low = order
    shown = f"high {high}, normal {normal}, low {low}"
    lower_first = high < low
    if high == low or not min(high, low) <= normal <= max(high, low):
        return "error", f"{shown}: normal must lie between high and low, and high differ from low"
    if engine in ("llamacpp", "tgi"):
        return "no_data", f"{engine} takes no priority field: gate.engine_priority.{name} has no effect"
    if engine == "vllm" and not lower_first:
        why = "vLLM serves lower values first: high-priority requests would go last in its queue"
        return "error", f"{shown}, but {why} (use the vllm preset)"
    if engine == "vllm":
        return "ok", f"{shown}, lower first as vLLM ranks; vLLM must run --scheduling-policy priority"
    if engine == "sglang":
        flag = "with" if lower_first else "without"
        return "ok", (
            f"{shown}: right for SGLang run with --enable-priority-scheduling and {flag} "
            "--schedule-low-priority-values-first"
        )
    return (
        "ok",
        f"{shown} ({'lower' if lower_first else 'higher'} first); which engine it is is not known here",
    )


def check_engine_upstream(cfg: Config) -> CheckResult:
    """Which gate upstream is this pod's engine: where the ``engine_stall`` finding takes it out of the
    split (agent/gate/upstreams.py ``engine_upstream``). None is no error (a gate before remote
    replicas), but the hang of this engine then reaches the gate only through its own frozen streams."""
    from agent.gate.upstreams import engine_upstream

    started = time.perf_counter()
    name = engine_upstream(cfg)
    if name is not None:
        status, detail = "ok", f"upstream {name} is engine.url: a stall finding takes it out of the split"
    else:
        status = "no_data"
        detail = (
            "no upstream has engine.url: the engine_stall finding cannot take this engine out of the split"
        )
    return CheckResult("engine upstream", status, detail, time.perf_counter() - started, cfg.engine.url)


def render(results: Sequence[CheckResult]) -> str:
    """A fixed-width table: check, status, milliseconds, what was found or why it failed, and the target."""
    width = max((len(r.name) for r in results), default=5)
    lines = []
    for r in results:
        target = f"  [{r.target}]" if r.target and r.target not in r.detail else ""
        lines.append(f"{r.name:<{width}}  {r.status:<7}  {1000 * r.duration_s:7.1f} ms  {r.detail}{target}")
    failed = sum(r.failed for r in results)
    lines.append(f"{len(results)} checks, {failed} failed")
    return "\n".join(lines)
