"""The ``servepilot`` command line. Subcommands live in :mod:`agent.commands`, one module each.

Exit codes: 0 success, 1 runtime failure, 2 bad input (config, arguments, files) with one line on stderr.
Heavy imports (numpy, torch, aiohttp) happen inside the subcommand, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: Subcommand modules, registered explicitly in this order (``servepilot --help`` lists them so).
COMMANDS: tuple[str, ...] = (
    "agent.commands.run",
    "agent.commands.check",
    "agent.commands.admin",
    "agent.commands.demo",
    "agent.commands.sim",
    "agent.commands.gate",
    "agent.commands.detect",
    "agent.commands.forecast",
    "agent.commands.replay",
    "agent.commands.specdec_eval",
    "agent.commands.validate_config",
)


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="servepilot",
        description="Autotuning sidecar for GPU LLM inference engines (vLLM, SGLang, llama.cpp).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def _version() -> str:
    from agent import version

    return version()


def main(argv: Sequence[str] | None = None) -> int:
    from agent.config import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, UsageError) as error:
        print(f"servepilot {args.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
