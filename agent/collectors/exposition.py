"""Prometheus text exposition -> small typed values (counter, gauge, histogram), each stamped with ``now``.

Parsing is ``prometheus_client.parser``'s; this module adds what a sidecar needs around it:

* **Only the families asked for.** ``wanted`` names are kept and every other line is dropped *before*
  parsing (a full vLLM scrape is ~500 lines of which ~150 matter; the library's parser costs ~15 µs a
  line, so pre-filtering is most of the tick budget).
* **A bad line loses only itself.** The library stops at the first bad line, so on failure the text is
  re-parsed family by family, then line by line inside a broken family; each bad line becomes one error.
* **No NaN, no Inf, no sentinel** reaches a caller: non-finite samples and DCGM "blank" values
  (``DCGM_INT64_BLANK`` = 0x7ffffffffffffff0 and above for integer fields, ``DCGM_FP64_BLANK`` = 2**47 and
  above for float fields: both mean "no value") are dropped and counted. Sentinels are only checked on
  ``DCGM_``/``dcgm_`` families: other counters (vLLM's estimated FLOPs) legitimately exceed 2**47.
* ``...`` elision lines (documentation samples) are skipped; a missing final newline is fine.
* Untyped samples whose ``# TYPE`` line was separated from them (the DCGM README sample) get that type.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from types import MappingProxyType
from typing import TypeVar

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from agent.collectors.series_memo import SENTINEL_PREFIXES, Family, Labels, Series, SeriesMemo, series_of

DCGM_INT64_BLANK_MIN = 9223372036854775792  # DCGM_INT64_BLANK (0x7ffffffffffffff0) and the codes above it
DCGM_FP64_BLANK_MIN = float(2**47)  # DCGM_FP64_BLANK = 140737488355328.0
_SUFFIXES = ("_bucket", "_count", "_sum")
_MAX_ERRORS = 20
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Counter:
    """One counter series. ``name`` always ends in ``_total`` (the parser adds it where the text lacks it)."""

    name: str
    labels: Labels
    value: float
    observed_at: float


@dataclass(frozen=True, slots=True)
class Gauge:
    """One gauge series; untyped samples are gauges too (Prometheus treats them alike)."""

    name: str
    labels: Labels
    value: float
    observed_at: float


@dataclass(frozen=True, slots=True)
class Histogram:
    """One histogram series with cumulative bucket counts, ``bounds`` ascending.

    ``count`` is the ``+Inf`` bucket (added from ``_count`` when the bucket line is missing); ``None`` means
    the series was truncated before both, so its total is unknown and quantiles cannot be trusted.
    """

    name: str
    labels: Labels
    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    count: float | None
    sum: float | None
    observed_at: float


@dataclass(frozen=True)
class Exposition:
    """Everything that parsed, by metric name, plus one readable line per problem."""

    observed_at: float
    counters: Mapping[str, tuple[Counter, ...]] = field(default_factory=dict)
    gauges: Mapping[str, tuple[Gauge, ...]] = field(default_factory=dict)
    histograms: Mapping[str, tuple[Histogram, ...]] = field(default_factory=dict)
    errors: tuple[str, ...] = ()
    dropped: int = 0
    """Samples dropped because their value was NaN, ±Inf or a DCGM blank sentinel."""

    @property
    def series_count(self) -> int:
        return sum(len(s) for d in (self.counters, self.gauges, self.histograms) for s in d.values())


def is_blank_sentinel(name: str, value: float) -> bool:
    """True when ``value`` of metric ``name`` is a DCGM "no value" code rather than a measurement."""
    return name.startswith(SENTINEL_PREFIXES) and value >= DCGM_FP64_BLANK_MIN


def _base_name(name: str, wanted: Collection[str]) -> str:
    if name in wanted:
        return name
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _sample_name(line: str) -> str:
    end = line.find("{")
    if end < 0:
        end = line.find(" ")
    return line if end < 0 else line[:end]


_DECIDED: dict[frozenset[str], dict[str, bool]] = {}


def _decisions(wanted: Collection[str]) -> dict[str, bool]:
    """Sample name -> keep?, remembered across scrapes for one ``wanted`` set (bounded)."""
    key = wanted if isinstance(wanted, frozenset) else frozenset(wanted)
    decided = _DECIDED.get(key)
    if decided is None or len(decided) > 10_000:  # name churn must not grow it for ever
        if len(_DECIDED) > 16:
            _DECIDED.clear()
        decided = _DECIDED[key] = {}
    return decided


def _select(text: str, wanted: Collection[str] | None) -> tuple[list[tuple[int, str]], dict[str, str]]:
    """Numbered lines worth parsing, and the ``# TYPE`` declarations seen (for untyped samples).

    Samples come in runs of one name (a histogram's buckets, a counter's label sets), so after a
    ``name{...}`` line the lines that start with the same ``name{`` take the same decision on that prefix
    alone: their sample name is necessarily ``name`` again.
    """
    kept: list[tuple[int, str]] = []
    declared: dict[str, str] = {}
    decided = {} if wanted is None else _decisions(wanted)
    run, run_kept = "\0", False  # "name{" of the last sample line and its decision; no line starts with NUL
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.startswith(run):
            if run_kept:
                kept.append((number, raw.strip()))
            continue
        line = raw.strip()
        if not line or line == "...":
            continue
        if line[0] == "#":
            parts = line.split(None, 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                continue
            if parts[1] == "TYPE" and len(parts) == 4:
                declared[parts[2]] = parts[3].strip()
            if wanted is None or parts[2] in wanted:
                kept.append((number, line))
        elif wanted is None:
            kept.append((number, line))
        else:
            name = _sample_name(line)
            keep = decided.get(name)
            if keep is None:
                keep = decided[name] = _base_name(name, wanted) in wanted
            if keep:
                kept.append((number, line))
            if line.startswith(name + "{"):
                run, run_kept = name + "{", keep
    return kept, declared


def _blocks(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Split into metric families: a HELP/TYPE line for a new name starts a block."""
    blocks: list[list[tuple[int, str]]] = []
    current_name: str | None = None
    for number, line in lines:
        if line.startswith("#"):
            name = line.split(None, 3)[2]
            if name != current_name or not blocks:
                blocks.append([])
                current_name = name
        elif not blocks:
            blocks.append([])
        blocks[-1].append((number, line))
    return blocks


def _describe(number: int, line: str) -> str:
    shown = line if len(line) <= 60 else line[:57] + "..."
    return f"line {number}: cannot parse {shown!r}"


_MEMO = SeriesMemo()
USE_MEMO = True
"""Module switch so a test can compare the memo path with the library's plain path on every fixture."""


def _parse_memoised(lines: list[tuple[int, str]]) -> list[Family] | None:
    families: list[Family] = []
    try:
        for block in _blocks(lines):
            family = _MEMO.family([line for _, line in block])
            if family is None:
                return None
            families.append(family)
    except Exception:  # any surprise: the plain path below decides, with its salvage and error lines
        return None
    return families


def _parse_plain(lines: list[tuple[int, str]], errors: list[str]) -> list[Metric]:
    """Parse all at once; on failure salvage family by family, then line by line."""
    try:
        return list(text_string_to_metric_families("\n".join(line for _, line in lines)))
    except Exception:  # the library raises ValueError, IndexError... on bad text; all mean "salvage"
        pass
    families: list[Metric] = []
    for block in _blocks(lines):
        try:
            # list() first: a family that fails half-way must not leave half its samples behind
            families.extend(list(text_string_to_metric_families("\n".join(line for _, line in block))))
            continue
        except Exception:
            pass
        header = [line for _, line in block if line.startswith("#")]
        for number, line in block:
            if line.startswith("#"):
                continue
            try:
                families.extend(list(text_string_to_metric_families("\n".join([*header, line]))))
            except Exception:
                errors.append(_describe(number, line))
    return families


@dataclass
class _Parts:
    """The samples of one histogram series while its family is being read."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    count: float | None = None
    sum: float | None = None


_SCALAR_KINDS = frozenset(("counter", "gauge", "untyped", "unknown"))


class _Builder:
    """Accumulates typed series from parsed families, dropping unusable values.

    Both paths end in :meth:`add_samples`: the plain path converts the library's samples with
    :func:`_series_of`, the memo path hands over the same objects it keeps, so they cannot disagree.
    """

    def __init__(self, now: float, declared: Mapping[str, str]) -> None:
        self.now = now
        self.declared = declared
        self.counters: dict[str, list[Counter]] = {}
        self.gauges: dict[str, list[Gauge]] = {}
        self.histograms: dict[str, list[Histogram]] = {}
        self._parts: dict[str, dict[Labels, _Parts]] = {}
        self.errors: list[str] = []
        self.dropped = 0

    def add(self, family: Metric) -> None:
        """One family from the library's plain parse."""
        samples = [(series_of(s.name, s.labels), s.value) for s in family.samples]
        self.add_samples(family.name, family.type, samples)

    def add_samples(self, name: str, kind: str, samples: Iterable[tuple[Series, float]]) -> None:
        """The samples of family ``name`` of type ``kind``."""
        if kind in ("untyped", "unknown"):
            kind = self.declared.get(name, "untyped")
        if kind == "histogram":
            self._add_histogram(name, samples)
        elif kind in _SCALAR_KINDS:  # summaries, info and state sets carry nothing the brain uses
            self._add_scalars(kind == "counter", samples)

    def _add_scalars(self, counter: bool, samples: Iterable[tuple[Series, float]]) -> None:
        now, isfinite = self.now, math.isfinite
        for series, value in samples:
            if not isfinite(value) or (series.sentinel and value >= DCGM_FP64_BLANK_MIN):
                self.dropped += 1
                continue
            value = float(value)  # the library returns int for integer text
            name = series.name
            if counter:
                name = name if name.endswith("_total") else name + "_total"
                self.counters.setdefault(name, []).append(Counter(name, series.labels, value, now))
            else:
                self.gauges.setdefault(name, []).append(Gauge(name, series.labels, value, now))

    def _add_histogram(self, name: str, samples: Iterable[tuple[Series, float]]) -> None:
        # parts accumulate across families: line-by-line salvage yields one family per surviving line
        parts = self._parts.setdefault(name, {})
        sentinel = name.startswith(SENTINEL_PREFIXES)
        isfinite = math.isfinite
        for series, value in samples:
            found = parts.get(series.series)
            if found is None:
                found = parts[series.series] = _Parts()
            if not isfinite(value) or (sentinel and value >= DCGM_FP64_BLANK_MIN):
                self.dropped += 1
                continue
            value = float(value)
            part = series.part
            if part == "bucket":
                if series.bound is None:
                    self.errors.append(f"{name}: bucket bound le={series.le!r} is not a number")
                else:
                    found.buckets.append((series.bound, value))
            elif part == "count":
                found.count = value
            elif part == "sum":
                found.sum = value

    def finish(self) -> None:
        """Build the histograms once every family has been seen."""
        for name, parts in self._parts.items():
            for labels, series in parts.items():
                histogram = self._histogram(name, labels, series)
                if histogram is not None:
                    self.histograms.setdefault(name, []).append(histogram)
        self._parts.clear()

    def _histogram(self, name: str, labels: Labels, parts: _Parts) -> Histogram | None:
        buckets = sorted(parts.buckets)
        bounds = [b for b, _ in buckets]
        counts = [c for _, c in buckets]
        if any(later < earlier for earlier, later in pairwise(counts)):
            self.errors.append(f"{name}: bucket counts decrease, series dropped")
            return None
        if (not bounds or bounds[-1] != math.inf) and parts.count is not None:
            if counts and parts.count < counts[-1]:
                self.errors.append(f"{name}: _count below the last bucket, series dropped")
                return None
            bounds.append(math.inf)
            counts.append(parts.count)
        if not bounds:
            return None
        total = counts[-1] if bounds[-1] == math.inf else None
        return Histogram(name, labels, tuple(bounds), tuple(counts), total, parts.sum, self.now)


def _freeze(values: Mapping[str, list[T]]) -> Mapping[str, tuple[T, ...]]:
    return MappingProxyType({name: tuple(series) for name, series in values.items()})


def _expand(wanted: Iterable[str]) -> frozenset[str]:
    names: set[str] = set()
    for name in wanted:
        names.add(name)
        names.add(name.removesuffix("_total"))
        names.add(name if name.endswith("_total") else name + "_total")
    return frozenset(names)


_EXPANDED: dict[frozenset[str], frozenset[str]] = {}


def _wanted_names(wanted: Iterable[str]) -> frozenset[str]:
    """``wanted`` with and without ``_total``; computed once per distinct frozenset (a mapping's)."""
    if not isinstance(wanted, frozenset):
        return _expand(wanted)
    names = _EXPANDED.get(wanted)
    if names is None:
        if len(_EXPANDED) > 64:
            _EXPANDED.clear()
        names = _EXPANDED[wanted] = _expand(wanted)
    return names


def parse_exposition(text: str, now: float, wanted: Iterable[str] | None = None) -> Exposition:
    """Parse Prometheus text into typed series observed at ``now``. Never raises on bad text.

    ``wanted``: metric names to keep (histogram family names; counters with or without ``_total``);
    ``None`` keeps everything. Problems come back in ``Exposition.errors``, one line each.
    """
    names = None if wanted is None else _wanted_names(wanted)
    lines, declared = _select(text, names)
    builder = _Builder(now, declared)
    memoised = _parse_memoised(lines) if USE_MEMO else None
    if memoised is not None:
        for name, kind, samples in memoised:
            builder.add_samples(name, kind, samples)
    else:
        for family in _parse_plain(lines, builder.errors):
            builder.add(family)
    builder.finish()
    errors = builder.errors
    if len(errors) > _MAX_ERRORS:
        errors = [*errors[:_MAX_ERRORS], f"... and {len(errors) - _MAX_ERRORS} more errors"]
    return Exposition(
        observed_at=now,
        counters=_freeze(builder.counters),
        gauges=_freeze(builder.gauges),
        histograms=_freeze(builder.histograms),
        errors=tuple(errors),
        dropped=builder.dropped,
    )
