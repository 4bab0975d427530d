"""Runs the demo: simulator, sidecar and load generator on one event loop, with a clean shutdown.

Everything stops within a few seconds of Ctrl-C or ``--duration``: the load generator first (in-flight
streams are cancelled), then the sidecar, then the simulator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import numpy as np
from aiohttp import web

from agent import config, eventloop
from agent.demo_view import Control, finding_counts
from agent.loadgen import LoadGenerator
from agent.sidecar import Sidecar
from agent.stop_signals import StopSignals

log = logging.getLogger(__name__)

TRACE = "azure_llm_2023_conv.csv.gz"


def bundled_trace() -> np.ndarray:
    """The bundled Azure 2023 conversation trace as rows of (arrival_s, prompt_tokens, output_tokens)."""
    from agent.traces import read_requests

    with resources.as_file(resources.files("agent.data").joinpath(TRACE)) as path:
        return read_requests(path)


DEMO_DRAFT_COST = 0.05
"""What a draft token costs the simulated engine with ``--spec-tokens``: a draft model's pass, 5% of a
step; the demo's sidecar prices drafts the same (``detectors.spec_draft_cost_ratio``)."""


class _Simulator:
    """The simulated engine on its own aiohttp runner, so the demo can stop it cleanly."""

    def __init__(self, args: argparse.Namespace, faults: dict[str, float]) -> None:
        from agent.cli import UsageError
        from simulator.engine import make_core
        from simulator.faults import FaultError
        from simulator.server import SimServer
        from simulator.specdec import SpecDecodeConfig

        try:
            # vLLM's priority policy: the gate passes each request's class (demo.ENGINE_PRIORITY)
            spec = SpecDecodeConfig(args.spec_tokens, draft_cost=DEMO_DRAFT_COST)
            core = make_core(args.gpu, args.model, scheduling_policy="priority", spec=spec)
            core.set_faults(core.faults.updated(faults), core.time)
        except (ValueError, KeyError, FaultError) as error:
            raise UsageError(str(error).strip("'\"")) from None
        self.server = SimServer(core)
        self.model_name = self.server.model_name
        self.description = f"{core.model.served_name} on {core.gpu.name}"
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        self._runner = web.AppRunner(self.server.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def _real_engine(args: argparse.Namespace) -> tuple[Any, dict[str, int]]:
    """A real CPU engine (llama.cpp or vLLM) in the engine's place; a missing install is a usage error."""
    from agent.cli import UsageError
    from agent.engines.demo import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, RealEngine
    from agent.engines.launcher import EngineError

    try:
        engine = RealEngine(args.engine, spec_tokens=args.spec_tokens)
        await engine.start("127.0.0.1", args.engine_port)
    except EngineError as error:
        raise UsageError(str(error)) from None
    return engine, {"max_prompt_tokens": MAX_PROMPT_TOKENS, "max_output_tokens": MAX_OUTPUT_TOKENS}


def _ms(seconds: float | None) -> str:
    return "- ms" if seconds is None else f"{seconds * 1000:.0f} ms"


def _ttft_p99(get: Callable[[str], float | None], gen: LoadGenerator) -> str:
    """The engine's TTFT p99; where the engine reports none (llama.cpp has no TTFT histogram), the load
    generator's own over its last 512 answers, marked as the client's: it includes the gate's queue."""
    engine = get("engine.ttft_seconds.p99")
    client = gen.stats.ttft_quantile(0.99) if engine is None else None
    return _ms(engine) if client is None else f"{_ms(client)} (client)"


def _status_line(sidecar: Sidecar, gen: LoadGenerator, elapsed: float) -> str:
    snap = sidecar.loop.state.snapshot
    get = snap.get if snap is not None else (lambda _n: None)

    def fmt(name: str, scale: float = 1.0, digits: int = 0) -> str:
        value = get(name)
        return "-" if value is None else f"{value * scale:.{digits}f}"

    line = (
        f"[{elapsed:5.0f} s] sent {gen.stats.sent} ok {gen.stats.ok} shed {gen.stats.shed} "
        f"failed {gen.stats.failed} | "
        f"running {fmt('engine.requests_running')} waiting {fmt('engine.requests_waiting')} "
        f"kv {fmt('engine.kv_cache_usage_ratio', 100)}% "
        f"gen {fmt('engine.generation_tokens_per_second')} tok/s "
        f"ttft p99 {_ttft_p99(get, gen)} | "
        f"gpu0 util {fmt('nvml.gpu0.utilization_ratio.mean', 100)}% "
        f"{fmt('nvml.gpu0.power_watts.mean')} W {fmt('nvml.gpu0.sm_clock_hz.mean', 1e-6)} MHz | "
        f"findings {finding_counts(sidecar.loop.state.findings)}"
    )
    if gen.stats.classes:  # a priority mix: what each class met, client-side
        line += " | ttft p99 " + ", ".join(
            f"{name} {_ms(stats.ttft_quantile(0.99))} (shed {stats.shed})"
            for name, stats in gen.stats.classes.items()
        )
    if sidecar.knobs.gate is not None:  # --mode advise|act: what servepilot decided, newest last
        actions = sidecar.knobs.audit.recent(1)
        last = f"{actions[0]['knob']} {actions[0]['from']} -> {actions[0]['to']}" if actions else "none yet"
        line += f" | gate limit {fmt('gate.limit')}, last action: {last}"
    return line


async def _main(
    args: argparse.Namespace,
    faults: dict[str, float],
    cfg_data: dict[str, Any],
    priority_mix: dict[str, float] | None,
) -> int:
    cfg = config.build(cfg_data)
    signals = StopSignals()
    signals.install(asyncio.get_running_loop())
    stop = signals.stop

    limits: dict[str, int] = {}
    if args.engine == "sim":
        sim: Any = _Simulator(args, faults)
        await sim.start("127.0.0.1", args.engine_port)
    else:
        sim, limits = await _real_engine(args)
    sidecar = Sidecar(cfg)
    # with the gate on (--mode advise|act) the load goes through it, as clients would in the pod
    target = f"http://{cfg.gate.listen_host}:{cfg.gate.listen_port}" if cfg.gate.enabled else cfg.engine.url
    gen = LoadGenerator(
        target,
        bundled_trace(),
        model=sim.model_name,
        speed=args.speed,
        rate_scale=args.rate_scale,
        priority_mix=priority_mix,
        **limits,
    )
    started = time.monotonic()
    load_task: asyncio.Task[None] | None = None
    try:
        await sidecar.start()
        load_task = asyncio.create_task(gen.run(stop), name="demo-load")
        url = f"http://{cfg.agent.listen_host}:{cfg.agent.listen_port}"
        await _show(args, sidecar, gen, started, url, stop)
    finally:
        stop.set()
        if load_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(load_task, timeout=2.0)
        await sidecar.stop(signals.hurry)
        await sim.stop()
    print(
        f"servepilot demo: stopped after {time.monotonic() - started:.0f} s; "
        f"{gen.stats.ok} requests completed, {gen.stats.shed} shed (429/503 with Retry-After), "
        f"{gen.stats.failed} failed; "
        f"the sidecar ran {sidecar.loop.state.stats.ticks} ticks",
        file=sys.stderr,
    )
    return 0


async def _show(
    args: argparse.Namespace,
    sidecar: Sidecar,
    gen: LoadGenerator,
    started: float,
    url: str,
    stop: asyncio.Event,
) -> None:
    deadline = started + args.duration if args.duration > 0 else float("inf")
    live_view = not args.no_view and sys.stdout.isatty()
    if live_view:
        from rich.live import Live

        from agent.demo_view import render

        with Live(refresh_per_second=2, screen=False, transient=False) as live:
            while not stop.is_set() and time.monotonic() < deadline:
                live.update(
                    render(
                        sidecar.loop.state,
                        gen.stats,
                        time.monotonic() - started,
                        url,
                        _control(sidecar),
                    )
                )
                await _wait(stop, min(0.5, deadline - time.monotonic()))
        return
    gate = sidecar.cfg.gate
    via = f", gate on http://{gate.listen_host}:{gate.listen_port}" if gate.enabled else ""
    print(f"servepilot demo: agent on {url}/metrics, engine on {sidecar.cfg.engine.url}{via}", flush=True)
    next_line = started + 5.0
    while not stop.is_set() and time.monotonic() < deadline:
        await _wait(stop, min(next_line, deadline) - time.monotonic())
        if time.monotonic() >= next_line:
            print(_status_line(sidecar, gen, time.monotonic() - started), flush=True)
            next_line += 5.0


def _control(sidecar: Sidecar) -> Control | None:
    """What the view shows of actuation: nothing in observe mode (no gate, no decisions to show)."""
    if sidecar.cfg.actuators.mode == "observe" and not sidecar.cfg.gate.enabled:
        return None
    return Control(sidecar.cfg.actuators.mode, sidecar.knobs.audit.recent(6))


async def _wait(stop: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=max(0.0, timeout))


def run_demo(
    args: argparse.Namespace,
    faults: dict[str, float],
    cfg_data: dict[str, Any],
    priority_mix: dict[str, float] | None = None,
) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        run_loop = eventloop.runner(cfg_data.get("agent", {}).get("event_loop", "auto"))
        return run_loop(_main(args, faults, cfg_data, priority_mix))
    except OSError as error:
        print(f"servepilot demo: cannot start: {error}", file=sys.stderr)
        return 1
