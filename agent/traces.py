"""Readers for the request traces servepilot replays and forecasts (file I/O lives here, not in detectors).

* Azure LLM inference trace CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens``, one row per request,
  ``TIMESTAMP`` like ``2023-11-16 18:17:03.9799600`` (7 fractional digits, zone not stated: read as UTC).
* Mooncake JSONL: ``{"timestamp": <ms since start>, "input_length": .., "output_length": ..}`` per line.
* Rate series CSV: ``timestamp,count`` (ISO time or Unix seconds; a count per row).
* Azure 2024 10-s counts: header ``Time,TIMESTAMP`` where, despite the names, column 1 is the bin's time
  and column 2 the request count.

:func:`read_requests` gives per-request arrays; :func:`read_counts` gives a gap-explicit count series on a
step (an empty bin is a real zero for arrivals, so count series are zero-filled deliberately).
"""

from __future__ import annotations

import csv
import gzip
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import numpy as np
from numpy.typing import NDArray

from detectors.forecast.series import Series, fill_gaps, resample


class TraceError(ValueError):
    """A trace file that cannot be read; the message is one line naming the file and the problem."""


def _parse_time(text: str) -> float:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    if "." in text:  # Python's %f takes at most 6 digits; Azure writes 7
        head, _, fraction = text.partition(".")
        text = f"{head}.{fraction[:6]}"
    stamp = datetime.fromisoformat(text)
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()


def _unreadable(path: Path, error: OSError | UnicodeDecodeError) -> TraceError:
    """A file that could not be read as a trace, in one line naming it. A binary file (or a compressed
    one without its ``.gz``) said only "'utf-8' codec can't decode byte 0x8b in position 1"."""
    if isinstance(error, UnicodeDecodeError):
        kinds = "a trace is a CSV or JSONL file, gzip-compressed (.gz) or not"
        return TraceError(f"{path}: not UTF-8 text at byte {error.start}: {kinds}")
    return TraceError(f"{path}: {error.strerror or error}")


def _open(path: Path) -> TextIO:
    """Text stream of a trace file; ``.gz`` files (as bundled with the demo) are decompressed on the fly."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return path.open(encoding="utf-8", newline="")


#: The kinds of :func:`trace_kind` that count arrivals per step rather than list requests.
COUNT_KINDS = frozenset({"azure_counts", "counts"})


_FORMATS = (
    "a trace is Azure's TIMESTAMP,ContextTokens,GeneratedTokens or Time,TIMESTAMP CSV, a timestamp,count "
    "CSV, or Mooncake JSONL"
)


def trace_kind(path: Path) -> str:
    """What ``path`` holds, from its first line: ``azure`` or ``mooncake`` (one row per request),
    ``azure_counts`` or ``counts`` (arrivals per step). :class:`TraceError` when it cannot tell."""
    try:
        with _open(path) as stream:
            first = stream.readline().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise _unreadable(path, error) from error
    if first.startswith("{"):
        return "mooncake"
    columns = [c.strip() for c in first.split(",")]
    if columns[:3] == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
        return "azure"
    if columns == ["Time", "TIMESTAMP"]:
        return "azure_counts"
    if (
        len(columns) == 2
        and columns[0].lower() in ("timestamp", "time")
        and columns[1].lower() in ("count", "value")
    ):
        return "counts"
    if not first:
        raise TraceError(f"{path}: empty (no header line): {_FORMATS}")
    raise TraceError(f"{path}: unrecognised header {first[:80]!r}: {_FORMATS}")


def read_requests(path: str | Path) -> NDArray[np.float64]:
    """``(n, 3)`` array of (arrival_s, prompt_tokens, output_tokens), sorted by arrival, for an Azure
    trace CSV or a Mooncake JSONL. Arrival times are seconds (Unix for Azure, from trace start for
    Mooncake)."""
    path = Path(path)
    try:
        kind = trace_kind(path)
        rows: list[tuple[float, float, float]] = []
        if kind == "azure":
            with _open(path) as stream:
                reader = csv.reader(stream)
                next(reader)
                for line, row in enumerate(reader, start=2):
                    if row:
                        rows.append(
                            _row(path, line, lambda r=row: (_parse_time(r[0]), float(r[1]), float(r[2])))
                        )
        elif kind == "mooncake":
            with _open(path) as stream:
                for line, text in enumerate(stream, start=1):
                    if text.strip():
                        rows.append(_row(path, line, lambda t=text: _mooncake(json.loads(t))))
        else:
            raise TraceError(f"{path}: a count series has no per-request rows (use read_counts)")
    except (OSError, UnicodeDecodeError) as error:
        raise _unreadable(path, error) from error
    if not rows:
        raise TraceError(f"{path}: no requests")
    array = np.array(rows, dtype=np.float64)
    if not np.all(np.isfinite(array)):
        raise TraceError(f"{path}: non-finite values")
    return array[np.argsort(array[:, 0], kind="stable")]


def _mooncake(record: dict[str, float]) -> tuple[float, float, float]:
    return record["timestamp"] / 1000.0, float(record["input_length"]), float(record["output_length"])


def _row(path: Path, line: int, parse: object) -> tuple[float, float, float]:
    try:
        return parse()  # type: ignore[operator,no-any-return]
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise TraceError(f"{path}:{line}: cannot parse row ({error})") from error


def read_counts(path: str | Path, step_s: float | None = None) -> Series:
    """Requests per step as a gap-free :class:`Series`. Per-request traces are counted into ``step_s``
    bins (default 60 s); count files keep their own step unless ``step_s`` (a multiple of it) is given,
    in which case bins are summed. Missing bins are zero: for arrival counts an absent bin means none."""
    path = Path(path)
    try:
        kind = trace_kind(path)
        if kind in ("azure", "mooncake"):
            arrivals = read_requests(path)[:, 0]
            return fill_gaps(resample(arrivals, None, step_s or 60.0, how="sum"), "zero")
        times, counts = [], []
        with _open(path) as stream:
            reader = csv.reader(stream)
            next(reader)
            for line, row in enumerate(reader, start=2):
                if not row:
                    continue
                try:
                    times.append(_parse_time(row[0]))
                    counts.append(float(row[1]))
                except (ValueError, IndexError) as error:
                    raise TraceError(f"{path}:{line}: cannot parse row ({error})") from error
    except (OSError, UnicodeDecodeError) as error:
        raise _unreadable(path, error) from error
    if len(times) < 2:
        raise TraceError(f"{path}: need at least two rows")
    t, c = np.array(times), np.array(counts)
    if not (np.all(np.isfinite(c)) and np.all(c >= 0)):
        raise TraceError(f"{path}: counts must be finite and non-negative")
    native = float(np.median(np.diff(np.sort(t))))
    step = step_s or native
    if native <= 0 or step < native or abs(step / native - round(step / native)) > 1e-6:
        raise TraceError(f"{path}: step {step:g}s is not a multiple of the file's {native:g}s spacing")
    origin = float(np.floor(t.min() / step) * step)
    series = fill_gaps(resample(t, c, step, how="sum", start_s=origin), "zero")
    # Bins at the edges that hold fewer rows than a full step would are partial sums, not low traffic.
    rows = resample(t, None, step, how="sum", start_s=origin).values
    full = np.flatnonzero(rows >= round(step / native))
    if full.size == 0:
        raise TraceError(f"{path}: no complete {step:g}s bin")
    first, last = int(full[0]), int(full[-1]) + 1
    return Series.regular(series.start_s + first * step, step, series.values[first:last])
