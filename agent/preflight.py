"""One pass over everything a config points at, read-only, with one line per check: ``servepilot check``.

A sidecar that starts with a wrong engine URL, a container without the NVIDIA driver mounted or a probe
on the wrong port still runs: its ``/metrics`` says ``servepilot_collector_success 0`` and the reason is in
the log. Setting a pod up, an operator wants the answers before that, in one screen: each source the
config enables is collected once with the sidecar's own collectors (so a pass here means the sidecar
reads the same thing), the engine's control API is discovered (nothing is set, no lease is taken), the
GPU actuator's permission and bounds are read, and each gate upstream's health path is fetched.

A failed check is ``error``; ``no_data`` means the source answered with nothing to report yet (a probe in a
process without CUDA), which does not fail the run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

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


async def check_sources(cfg: Config, *, settle_s: float | None = None) -> list[CheckResult]:
    """Collect once from every source the config enables (engine, llama.cpp slots, NVML, probe).

    NVML is sampled in the background like in the sidecar, so it is read after ``settle_s`` (three sample
    periods by default) to have samples to aggregate."""
    from agent.sidecar import build_collectors

    collectors = build_collectors(cfg)
    try:
        if cfg.nvml.backend != "off":
            await asyncio.sleep(3 * cfg.nvml.sample_interval_s if settle_s is None else settle_s)
        results = []
        for collector in collectors:
            started = time.perf_counter()
            reading = await collector.collect(time.time())
            results.append(
                CheckResult(
                    collector.name,
                    reading.status.value,
                    _reading_detail(reading),
                    time.perf_counter() - started,
                    _target(collector),
                )
            )
        return results
    finally:
        for collector in collectors:
            await collector.close()


async def check_control(cfg: Config) -> CheckResult:
    """Discover the engine's control API and read its settings: no value is set, no lease is taken."""
    from agent.control.base import ControlError
    from agent.control.client import ControlClient

    client = ControlClient(cfg.control, retries=0)
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


def check_gpu_actuator(cfg: Config) -> CheckResult:
    """Whether this process may drive ``actuators.gpu``, and within which bounds (read only)."""
    from agent.actuators.gpu_backend import (
        GpuControlError,
        NvmlGpuBackend,
        SimulatedGpuBackend,
        permission_problem,
    )

    started = time.perf_counter()
    name, knob = "gpu_actuator", cfg.actuators.gpu
    simulated = cfg.actuators.gpu_backend == "simulated"
    problem = None if simulated else permission_problem()
    if problem is not None:
        return CheckResult(name, "error", problem, time.perf_counter() - started, knob)
    try:
        backend = (
            SimulatedGpuBackend(state_file=cfg.actuators.gpu_state_file) if simulated else NvmlGpuBackend()
        )
        indices = list(cfg.actuators.gpus) or backend.gpu_indices()
        if not indices:
            raise GpuControlError("no GPU found")
        first = indices[0]
        if knob == "power_limit":
            low, high = backend.power_limit_bounds_w(first)
            bounds = f"power limit {low:g}-{high:g} W"
        else:
            low, high = backend.clock_bounds_mhz(first)
            bounds = f"SM clock {low:g}-{high:g} MHz"
    except (GpuControlError, OSError, ValueError) as error:
        return CheckResult(name, "error", str(error), time.perf_counter() - started, knob)
    detail = f"{knob} on GPUs {', '.join(map(str, indices))}: {bounds}" + (
        " (simulated)" if simulated else ""
    )
    return CheckResult(name, "ok", detail, time.perf_counter() - started, knob)


async def check_upstreams(cfg: Config) -> list[CheckResult]:
    """GET each gate upstream's health path, as the gate's health checks do."""
    timeout = aiohttp.ClientTimeout(total=cfg.gate.connect_timeout_s)
    results = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for name, base in cfg.gate.upstreams.items():
            url = base + cfg.gate.health_path
            started = time.perf_counter()
            try:
                async with session.get(url) as response:
                    await response.read()
                    ok = response.status < 400
                    detail = f"HTTP {response.status}"
            except (aiohttp.ClientError, TimeoutError) as error:
                ok, detail = False, f"{type(error).__name__}: {' '.join(str(error).split())}".rstrip(": ")
            results.append(
                CheckResult(
                    f"upstream {name}", "ok" if ok else "error", detail, time.perf_counter() - started, url
                )
            )
    return results


async def run_checks(cfg: Config) -> list[CheckResult]:
    """Every check the config calls for, in a fixed order: sources, control, GPU actuator, upstreams."""
    results = await check_sources(cfg)
    if cfg.control.enabled:
        results.append(await check_control(cfg))
    if cfg.actuators.gpu != "off":
        results.append(await asyncio.to_thread(check_gpu_actuator, cfg))  # NVML init can take seconds
    if cfg.gate.enabled:
        results.extend(await check_upstreams(cfg))
    return results


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
