"""``servepilot validate-config FILE``: check a config file and print the effective settings."""

from __future__ import annotations

import argparse
import json
import os


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "validate-config",
        help="check a config file (exit 2 with one line naming the bad field)",
        description="Validate a servepilot YAML config, with SERVEPILOT_<SECTION>__<FIELD> environment "
        "overrides applied, and print the effective configuration.",
    )
    parser.add_argument("file", nargs="?", help="YAML config file")
    parser.add_argument("--json", action="store_true", help="print the effective config as JSON")
    parser.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    parser.add_argument(
        "--reference", action="store_true", help="print the reference of every setting (Markdown) and exit"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent import config
    from agent.cli import UsageError

    if args.reference:
        print(config.reference_markdown())
        return 0
    if not args.file:
        raise UsageError("a config FILE is required (or --reference)")
    cfg = config.load(args.file, os.environ)
    if args.quiet:
        return 0
    if args.json:
        print(json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True))
    else:
        print(f"{args.file}: ok")
    return 0
