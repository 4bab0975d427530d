"""``servepilot run --config FILE``: the sidecar itself."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from agent import logs


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run the sidecar next to an engine",
        description="Run the servepilot sidecar: collect NVML, engine and allocator-probe readings every "
        "agent.interval_s, run the detectors and serve /metrics, /healthz, /readyz and /api/state. "
        "SIGHUP (or POST /api/admin/reload) re-reads the config file and applies the gate's business-line "
        "rules without a restart; a file that changes anything else is refused (docs/gate.md). SIGTERM or "
        "Ctrl-C stops cleanly: the gate drains (gate.drain_s), the state is saved, every setting goes back "
        "to its default; a second one cuts the drain short.",
    )
    parser.add_argument("--config", "-c", required=True, help="YAML config file (see examples/)")
    logs.add_arguments(parser, "info")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # a SIGHUP (config reload) that arrives while the sidecar imports and builds itself must not end
    # the process, which is SIGHUP's default; serve() installs the reload handler once it can reload
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from agent import config, eventloop
    from agent.exporter import without_created_series
    from agent.sidecar import serve
    from agent.stop_signals import StopSignals

    cfg = config.load(args.config, os.environ)
    without_created_series()
    run_loop = eventloop.runner(cfg.agent.event_loop)  # before logging: a bad choice is exit 2
    logs.setup(args)

    async def main() -> None:
        signals = StopSignals()
        signals.install(asyncio.get_running_loop())
        await serve(cfg, signals.stop, hurry=signals.hurry, config_path=args.config, environ=os.environ)

    try:
        run_loop(main())
    except OSError as error:  # e.g. the listen port is taken
        logging.getLogger("servepilot").error("cannot start: %s", error)
        return 1
    return 0
