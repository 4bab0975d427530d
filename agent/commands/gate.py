"""``servepilot gate``: run the admission gate alone, in front of one or more upstreams.

The sidecar (``servepilot run``) starts the gate itself when ``gate.enabled`` is set; this command is for
running the proxy without the rest of the agent (benchmarks, a first deployment in front of an engine).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Any


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "gate",
        help="run the admission gate (reverse proxy) alone",
        description="Run servepilot's admission gate in front of an OpenAI-compatible engine, with the "
        "gate section of --config (or the defaults) and the overrides given here.",
    )
    _arguments(parser)
    parser.set_defaults(func=run)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (its gate section is used)")
    parser.add_argument("--upstream", action="append", default=[], metavar="[NAME=]URL", help="upstream(s)")
    parser.add_argument("--host", help="listen address (default gate.listen_host)")
    parser.add_argument("--port", type=int, help="listen port (default gate.listen_port)")
    parser.add_argument("--max-in-flight", type=int, help="in-flight limit (default gate.max_in_flight)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    from agent import config
    from agent.cli import UsageError

    data = config.load(args.config, os.environ).model_dump() if args.config else {}
    gate: dict[str, object] = dict(data.get("gate", {}))
    if args.upstream:
        ups = {}
        for i, spec in enumerate(args.upstream):
            name, _, url = spec.rpartition("=") if not spec.startswith("http") else ("", "", spec)
            ups[name or ("primary" if i == 0 else f"upstream{i}")] = url
        gate["upstreams"], gate["split"] = ups, {next(iter(ups)): 1.0}
    if args.max_in_flight is not None:
        gate["max_in_flight"] = args.max_in_flight
    if args.port is not None and not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    cfg = config.build({**data, "gate": {**gate, "enabled": True}}).gate
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        _event_loop_runner()(_serve(cfg, args.host, args.port))
    except OSError as error:
        logging.getLogger("servepilot").error("cannot start the gate: %s", error)
        return 1
    return 0


def _event_loop_runner() -> Any:
    """``uvloop.run`` when uvloop is installed (about twice the relay rate per core), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


async def _serve(cfg: object, host: str | None, port: int | None) -> None:
    from prometheus_client import CollectorRegistry

    from agent.config import GateConfig
    from agent.gate.proxy import Gate

    assert isinstance(cfg, GateConfig)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    gate = Gate(cfg, CollectorRegistry())
    bound = await gate.start(host, port)
    from agent.heap import settle_after_start_up

    settle_after_start_up()
    print(f"servepilot gate: http://{host or cfg.listen_host}:{bound} -> {dict(cfg.upstreams)}", flush=True)
    try:
        await stop.wait()
    finally:
        await gate.stop()


if __name__ == "__main__":  # ``python -m agent.commands.gate`` before the CLI lists it
    import sys

    _parser = argparse.ArgumentParser(prog="servepilot gate")
    _arguments(_parser)
    sys.exit(run(_parser.parse_args()))
