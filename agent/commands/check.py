"""``servepilot check --config FILE``: read every source, API and permission the config points at, once."""

from __future__ import annotations

import argparse
import json
import os


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "check",
        help="check once that every source, API and permission the config names answers (read only)",
        description="Collect once from the engine's /metrics, NVML and the allocator probe with the "
        "sidecar's own collectors, discover the engine's control API, read the GPU actuator's permission "
        "and bounds, and fetch each gate upstream's health path: whatever the config enables. Nothing is "
        "changed. Prints one line per check; exit 0 when none failed, 1 when one did, 2 for a bad config.",
    )
    parser.add_argument("--config", "-c", required=True, help="YAML config file (see examples/)")
    parser.add_argument("--json", action="store_true", help="print the results as a JSON list")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from agent import config
    from agent.preflight import render, run_checks

    cfg = config.load(args.config, os.environ)
    logging.basicConfig(level=logging.ERROR)  # each failure is a row of the table, not also a log line
    results = asyncio.run(run_checks(cfg))
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        print(render(results))
    return 1 if any(r.failed for r in results) else 0
