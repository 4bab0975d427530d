"""How the long-running commands (``run``, ``gate``) log: text for a terminal, or JSON lines for a cluster.

A pod's log goes to a collector (Loki, Fluent Bit, Cloud Logging) that reads one record per line. Text
logs break that twice: a traceback spreads one record over many lines, each read as a record of its
own, and the level and logger have to be parsed back out of the text. ``--log-format json`` writes each
record as one JSON object on one line (python-json-logger): ``time`` (UTC, RFC 3339), ``level``,
``logger``, ``message``, ``exc_info`` with the whole traceback, and whatever a call passes in
``extra``. The manifests under deploy/kubernetes set it.
"""

from __future__ import annotations

import argparse
import logging
import time

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_arguments(parser: argparse.ArgumentParser, level: str) -> None:
    """``--log-level`` (default ``level``) and ``--log-format``."""
    parser.add_argument("--log-level", default=level, choices=LEVELS)
    parser.add_argument(
        "--log-format",
        default="text",
        choices=FORMATS,
        help="text, or json: one JSON object a line (time, level, logger, message, exc_info), for a "
        "cluster's log collector (default text)",
    )


def json_formatter() -> logging.Formatter:
    """One record, one line: the time first, in UTC with milliseconds, as collectors parse it."""
    from pythonjsonlogger.json import JsonFormatter

    formatter = JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
    )
    formatter.converter = time.gmtime
    formatter.default_time_format = "%Y-%m-%dT%H:%M:%S"
    formatter.default_msec_format = "%s.%03dZ"
    return formatter


def setup(args: argparse.Namespace) -> None:
    """The root logger as :func:`add_arguments`'s flags say (as :func:`logging.basicConfig`, nothing where
    the root logger has a handler already)."""
    handler = logging.StreamHandler()
    handler.setFormatter(json_formatter() if args.log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    if args.log_format == "json":  # a library's warning is written on two lines of its own otherwise
        logging.captureWarnings(True)
