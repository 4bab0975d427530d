"""``servepilot detect``: offline anomaly scores for a ``timestamp,value`` CSV (or a tree of them).

Output is NAB-compatible: ``timestamp,value,anomaly_score``, one row per input row in file order
(duplicate and backwards timestamps kept, as NAB data has them), the input's line ending kept, scores
in [0, 1] computed causally by a registered streaming scorer. A row whose value is empty or NaN keeps its
place with score 0. Every file is read and checked before anything is written, so bad input (missing
file, bad header, unparseable value or timestamp) exits 2 with one line and leaves no partial output.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

STDOUT = "-"


class DetectInputError(ValueError):
    """Bad input, reported as one line (exit code 2)."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "detect",
        help="score a timestamp,value CSV (or a NAB-style tree) with a streaming anomaly detector",
        description="Write timestamp,value,anomaly_score (NAB format) for every row of --input, scored "
        "causally, to --output or standard output. With --input DIR --output DIR, every category/name.csv "
        "under DIR is scored.",
    )
    parser.add_argument(
        "--input",
        help="CSV file with a timestamp,value header (- for standard input), or a directory of them",
    )
    parser.add_argument(
        "--output",
        default=STDOUT,
        help="output CSV file (default: standard output), or directory when --input is one",
    )
    parser.add_argument("--detector", help="scorer name (default: the registry's default); see --list")
    parser.add_argument("--list", action="store_true", help="list the registered scorers and exit")
    parser.set_defaults(func=run)


@dataclass(frozen=True)
class Series:
    """One parsed input file: the raw text cells (echoed back) and the numbers scored."""

    rows: list[tuple[str, str]]
    times: list[float]
    values: list[float]
    newline: str


def parse_timestamp(text: str) -> float:
    """Seconds since the epoch. ISO 8601 (naive = UTC, as NAB's zone-less local times) or a number."""
    try:
        return float(text)
    except ValueError:
        pass
    stamp = datetime.fromisoformat(text)
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp()


def parse_value(text: str) -> float:
    """The value, or NaN for an empty cell or a literal nan (scored 0, row kept); else ValueError."""
    if text.strip() == "":
        return math.nan
    return float(text)


def read_series(text: str, where: str) -> Series:
    """Parse CSV text with a ``timestamp,value`` header (extra columns ignored). Pure; raises
    :class:`DetectInputError` naming ``where`` and the line."""
    first_break = text.find("\n")
    newline = "\r\n" if first_break > 0 and text[first_break - 1] == "\r" else "\n"
    reader = csv.reader(io.StringIO(text, newline=""))
    header = [h.strip().lower() for h in next(reader, [])]
    if "timestamp" not in header or "value" not in header:
        raise DetectInputError(f"{where}: header must contain timestamp and value, got {','.join(header)!r}")
    it, iv = header.index("timestamp"), header.index("value")
    rows: list[tuple[str, str]] = []
    times: list[float] = []
    values: list[float] = []
    for line, row in enumerate(reader, start=2):
        if not row:
            continue
        if len(row) <= max(it, iv):
            raise DetectInputError(f"{where}:{line}: expected {len(header)} fields, got {len(row)}")
        stamp, value = row[it].strip(), row[iv].strip()
        try:
            times.append(parse_timestamp(stamp))
        except ValueError:
            raise DetectInputError(f"{where}:{line}: unparseable timestamp {stamp!r}") from None
        try:
            values.append(parse_value(value))
        except ValueError:
            raise DetectInputError(f"{where}:{line}: unparseable value {value!r}") from None
        rows.append((stamp, value))
    return Series(rows, times, values, newline)


def render(series: Series, scores: list[float]) -> str:
    """NAB-format output text with the input's line ending."""
    lines = ["timestamp,value,anomaly_score"]
    lines += [
        f"{stamp},{value},{score:.9f}" for (stamp, value), score in zip(series.rows, scores, strict=True)
    ]
    return series.newline.join(lines) + series.newline


def score(series: Series, detector: str) -> list[float]:
    """Run a fresh scorer named ``detector`` over ``series`` in file order."""
    from detectors.streaming import SCORERS

    scorer = SCORERS[detector].factory()
    return [scorer.update(t, x) for t, x in zip(series.times, series.values, strict=True)]


def _read(path: Path) -> Series:
    try:
        text = path.read_bytes().decode("utf-8-sig")  # bytes: keep CRLF visible
    except OSError as error:
        raise DetectInputError(f"cannot read {str(path)!r}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise DetectInputError(f"{path}: not UTF-8 text") from None
    return read_series(text, str(path))


def _pairs(source: Path, target: Path | None) -> list[tuple[Path, Path | None]]:
    """(input, output) files; output None is standard output (a single input file only)."""
    if source.is_dir():
        if target is None:
            raise DetectInputError("--output DIR is required when --input is a directory")
        files = sorted(p for p in source.rglob("*.csv") if p.is_file())
        if not files:
            raise DetectInputError(f"no .csv files under {str(source)!r}")
        return [(p, target / p.relative_to(source)) for p in files]
    if not source.exists():
        raise DetectInputError(f"input {str(source)!r} does not exist")
    if target is not None and target.is_dir():
        raise DetectInputError(f"output {str(target)!r} is a directory but input is a file")
    return [(source, target)]


def _write(path: Path | None, text: str) -> None:
    if path is None:
        sys.stdout.write(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as handle:
        handle.write(text)
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    from agent.cli import UsageError
    from detectors.registry import DEFAULT_SCORER, register_defaults
    from detectors.streaming import SCORERS

    register_defaults()
    if args.list:
        for name, reg in sorted(SCORERS.items()):
            flag = "default" if name == DEFAULT_SCORER else ("on" if reg.default_enabled else "off")
            print(f"{name:<16} {flag:<8} {reg.description}")
        return 0
    if not args.input:
        raise UsageError("--input is required (or use --list)")
    detector = args.detector or DEFAULT_SCORER
    if detector not in SCORERS:
        raise UsageError(f"unknown detector {detector!r}; known: {', '.join(sorted(SCORERS))}")
    try:
        target = None if args.output == STDOUT else Path(args.output)
        if args.input == STDOUT:  # standard input, as "-" is in a pipe
            parsed = [(read_series(sys.stdin.read().removeprefix("\ufeff"), "<stdin>"), target)]
        else:
            parsed = [(_read(src), dst) for src, dst in _pairs(Path(args.input), target)]
    except DetectInputError as error:
        raise UsageError(str(error)) from None
    points, started = 0, time.process_time()
    for series, dst in parsed:
        _write(dst, render(series, score(series, detector)))
        points += len(series.rows)
    spent = time.process_time() - started
    per_point_us = 1e6 * spent / points if points else 0.0
    print(
        f"scored {points} points in {len(parsed)} file(s) with {detector}: {per_point_us:.1f} us/point",
        file=sys.stderr,
    )
    return 0
