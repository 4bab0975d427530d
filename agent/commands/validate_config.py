"""``servepilot validate-config FILE``: check a config file and print the effective settings."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "validate-config",
        help="check a config file (exit 2 with one line naming the bad field)",
        description="Validate a servepilot YAML config, with SERVEPILOT_<SECTION>__<FIELD> environment "
        "overrides applied, and print the effective configuration. Exit codes: 0 valid, 2 invalid (one "
        "line naming the field), 3 with --against when the change needs a restart.",
    )
    parser.add_argument("file", nargs="?", help="YAML config file")
    parser.add_argument("--json", action="store_true", help="print the effective config as JSON")
    parser.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    parser.add_argument(
        "--reference", action="store_true", help="print the reference of every setting (Markdown) and exit"
    )
    parser.add_argument(
        "--against",
        metavar="RUNNING",
        help="compare with the config a sidecar runs: list the changed fields and say whether a reload "
        "(SIGHUP, POST /api/admin/reload) applies them; exit 3 when a restart is needed",
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
    if args.against:
        return _against(config.load(args.against, os.environ), cfg, args)
    if args.quiet:
        return 0
    if args.json:
        print(json.dumps(_without_secrets(cfg.model_dump(mode="json")), indent=2, sort_keys=True))
    else:
        print(f"{args.file}: ok")
    return 0


def _without_secrets(dump: dict[str, Any]) -> dict[str, Any]:
    """The effective config with each secret (agent/reload.py ``SECRET``: the gate's API keys, which may
    come from the environment or a mounted file) shown as the reload shows it: how many, never what."""
    from agent.reload import SECRET, shown

    for path in SECRET:
        section, _, name = path.partition(".")
        if name in dump.get(section, {}):
            dump[section][name] = shown(path, dump[section][name])
    return dump


def _against(running: Any, new: Any, args: argparse.Namespace) -> int:
    """What a reload of ``new`` would do to a sidecar running ``running`` (agent/reload.py)."""
    from agent.reload import changed_fields, needs_restart, shown

    changes = changed_fields(running, new)
    cold = needs_restart(changes)
    if not args.quiet:
        for path, (before, after) in changes.items():
            mark = "restart" if path in cold else "reload "
            print(f"{mark}  {path}: {shown(path, before)!r} -> {shown(path, after)!r}")
        if not changes:
            print(f"{args.file}: no change against {args.against}")
        elif cold:
            print(f"{args.file}: {len(cold)} of {len(changes)} change(s) need a restart; a reload refuses it")
        else:
            print(f"{args.file}: {len(changes)} change(s), all applied by a reload")
    return 3 if cold else 0
