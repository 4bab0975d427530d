"""``servepilot gate``: run the admission gate alone, in front of one or more upstreams.

The sidecar (``servepilot run``) starts the gate itself when ``gate.enabled`` is set; this command is for
running the proxy without the rest of the agent (benchmarks, a first deployment in front of an engine).

Started with ``--config``, it reloads the file's business-line rules on ``SIGHUP`` (and when the file
changes, with ``agent.config_watch_s``), as ``servepilot run`` does (agent/reload.py): the command-line
overrides are applied to the re-read file too, so they never count as a change that needs a restart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from agent import logs

if TYPE_CHECKING:
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from agent.config import Config
    from agent.gate.proxy import Gate
    from agent.reload import Reloader


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "gate",
        help="run the admission gate (reverse proxy) alone",
        description="Run servepilot's admission gate in front of an OpenAI-compatible engine, with the "
        "gate section of --config (or the defaults) and the overrides given here. SIGTERM or Ctrl-C "
        "drains it (gate.shutdown_delay_s, then gate.drain_s); a second one cuts the drain short.",
    )
    _arguments(parser)
    parser.set_defaults(func=run)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (its gate section is used)")
    parser.add_argument("--upstream", action="append", default=[], metavar="[NAME=]URL", help="upstream(s)")
    parser.add_argument("--host", help="listen address (default gate.listen_host)")
    parser.add_argument("--port", type=int, help="listen port (default gate.listen_port)")
    parser.add_argument("--max-in-flight", type=int, help="in-flight limit (default gate.max_in_flight)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="port of the gate's own /metrics, /healthz and /readyz, on agent.listen_host (default "
        "agent.listen_port, 9400; 0 picks a free one)",
    )
    parser.add_argument("--no-metrics", action="store_true", help="serve no metrics port")
    logs.add_arguments(parser, "warning")


def _with_overrides(file_cfg: Config | None, args: argparse.Namespace) -> Config:
    """The file's config (or the defaults) with the command line's gate overrides, gate enabled."""
    from agent import config

    data = file_cfg.model_dump() if file_cfg is not None else {}
    gate: dict[str, object] = dict(data.get("gate", {}))
    if args.upstream:
        ups = {}
        for i, spec in enumerate(args.upstream):
            name, _, url = spec.rpartition("=") if not spec.startswith("http") else ("", "", spec)
            ups[name or ("primary" if i == 0 else f"upstream{i}")] = url
        gate["upstreams"], gate["split"] = ups, {next(iter(ups)): 1.0}
    if args.max_in_flight is not None:
        gate["max_in_flight"] = args.max_in_flight
    return config.build({**data, "gate": {**gate, "enabled": True}})


def run(args: argparse.Namespace) -> int:
    if args.config:  # SIGHUP reloads it: one arriving while the gate starts must not end it (the default)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from agent import config, eventloop
    from agent.cli import UsageError
    from agent.exporter import without_created_series

    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if port is not None and not 0 <= port <= 65535:
            raise UsageError(f"{flag} must be in [0, 65535], got {port}")
    cfg = _with_overrides(config.load(args.config, os.environ) if args.config else None, args)
    run_loop = eventloop.runner(cfg.agent.event_loop)
    logs.setup(args)
    without_created_series()
    try:
        run_loop(_serve(cfg, args))
    except OSError as error:
        logging.getLogger("servepilot").error("cannot start the gate: %s", error)
        return 1
    return 0


async def _serve(cfg: Config, args: argparse.Namespace) -> None:
    from prometheus_client import CollectorRegistry

    from agent import build_info
    from agent.config import priority_targets
    from agent.gate.proxy import Gate
    from agent.gate.upstreams import engine_upstream
    from agent.stop_signals import StopSignals, ignore_hangup_until_exit, ignore_hangup_while_stopping
    from agent.tls import TlsFilesCollector
    from agent.tls import watch as watch_tls

    signals = StopSignals()
    loop = asyncio.get_running_loop()
    signals.install(loop)
    stop = signals.stop
    registry = CollectorRegistry()
    build_info.register(registry)
    registry.register(TlsFilesCollector(lambda: None))  # the upstreams' client TLS, watched below
    # judged by the SLO the sidecar uses (policies.*_slo_s), so SLO-bad and late counts work here too
    gate = Gate(cfg.gate, registry)
    gate.set_slo(cfg.policies.ttft_slo_s, cfg.policies.itl_slo_s, priority_targets(cfg.policies))
    gate.mark_engine(engine_upstream(cfg))
    watch: asyncio.Task[None] | None = None
    if args.config:
        reloader = _reloader(cfg, args, gate, registry)
        loop.add_signal_handler(signal.SIGHUP, reloader.reload, "SIGHUP")
        if cfg.agent.config_watch_s > 0:
            watch = asyncio.create_task(_watch(reloader, cfg.agent.config_watch_s, stop))
    tls_watch = None
    if cfg.agent.tls_watch_s > 0:  # renewed upstream client certificates, as in the sidecar
        tls_watch = asyncio.create_task(watch_tls(cfg.agent.tls_watch_s, stop))
    bound = await gate.start(args.host, args.port)
    metrics: web.AppRunner | None = None
    try:
        shown = ""
        if not args.no_metrics:
            metrics, port = await _serve_metrics(cfg, args, gate, registry)
            shown = f"; its metrics: http://{cfg.agent.listen_host}:{port}/metrics"
        from agent.heap import settle_after_start_up

        settle_after_start_up()
        where = f"http://{args.host or cfg.gate.listen_host}:{bound}"
        started = f"servepilot gate: {where} -> {dict(cfg.gate.upstreams)}{shown}"
        if args.log_format == "json":  # stdout and stderr are one stream in a pod: a record, not a line
            logging.getLogger("servepilot").info(started)
        else:
            print(started, flush=True)
        await stop.wait()
    finally:
        stop.set()  # ends the TLS watch
        if args.config:
            ignore_hangup_while_stopping(loop)
        if tls_watch is not None:
            await tls_watch
        if watch is not None:
            watch.cancel()
        await gate.stop(signals.hurry)
        if metrics is not None:
            await metrics.cleanup()
        if args.config:
            ignore_hangup_until_exit(loop)


async def _serve_metrics(
    cfg: Config, args: argparse.Namespace, gate: Gate, registry: CollectorRegistry
) -> tuple[web.AppRunner, int]:
    """The gate's own metrics port: every path of the gate's port belongs to the upstream."""
    from aiohttp import web

    from agent.api import build_gate_app

    runner = web.AppRunner(
        build_gate_app(registry, gate.pool, lambda: gate.shutting_down), access_log=None, handle_signals=False
    )
    await runner.setup()
    port = cfg.agent.listen_port if args.metrics_port is None else args.metrics_port
    try:
        await web.TCPSite(runner, cfg.agent.listen_host, port).start()
    except OSError as error:
        await runner.cleanup()
        where = f"{cfg.agent.listen_host}:{port}"
        why = error.strerror or str(error)
        raise OSError(f"its metrics port {where}: {why} (--metrics-port, --no-metrics)") from error
    return runner, int(runner.addresses[0][1])


def _reloader(cfg: Config, args: argparse.Namespace, gate: Gate, registry: CollectorRegistry) -> Reloader:
    """SIGHUP and the file watch re-read ``--config`` with the same command-line overrides."""
    from agent import config
    from agent.audit import AuditLog
    from agent.config import priority_targets
    from agent.reload import Reloader

    def read(path: Path, environ: Mapping[str, str]) -> Config:
        return _with_overrides(config.load(path, environ), args)

    return Reloader(
        args.config,
        os.environ,
        cfg,
        registry,
        AuditLog(cfg.audit, registry),
        apply_gate=gate.set_admission_rules,
        # no policies run here: of that section only the SLO counts, for the gate's verdicts
        apply_policies=lambda p: gate.set_slo(p.ttft_slo_s, p.itl_slo_s, priority_targets(p)),
        read=read,
    )


async def _watch(reloader: Reloader, every_s: float, stop: asyncio.Event) -> None:
    """Reload when the file's content changes (``agent.config_watch_s``)."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_s)
        if not stop.is_set() and reloader.file_changed():
            reloader.reload("file changed")


if __name__ == "__main__":  # ``python -m agent.commands.gate`` before the CLI lists it
    import sys

    _parser = argparse.ArgumentParser(prog="servepilot gate")
    _arguments(_parser)
    sys.exit(run(_parser.parse_args()))
