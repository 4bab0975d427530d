"""The engine metric-name table (``metric_names.yaml``), loaded into typed, validated mappings.

Names are data (dcgm-exporter's field CSV, the Gateway API inference extension's metric-name config): this
module only reads and checks the table. A bad table is a one-line :class:`ValueError` naming the entry,
raised at start-up rather than discovered as a silently missing signal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast

import yaml

DEFAULT_TABLE = Path(__file__).with_name("metric_names.yaml")

SignalType = Literal["gauge", "counter", "histogram", "ratio", "window_mean", "difference"]
Aggregate = Literal["sum", "mean", "max"]
_TYPES = ("gauge", "counter", "histogram", "ratio", "window_mean", "difference")
_AGGREGATES = ("sum", "mean", "max")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


@dataclass(frozen=True, slots=True)
class SignalSpec:
    """One canonical signal (published as ``engine.<name>``) and where it comes from."""

    name: str
    type: SignalType
    aliases: tuple[str, ...] = ()
    aggregate: Aggregate = "sum"
    scale: float = 1.0
    valid: tuple[float, float] | None = None
    numerator: tuple[str, ...] = ()
    denominator: tuple[str, ...] = ()
    of: str | None = None
    less: tuple[str, ...] = ()
    """A difference's counter signals taken off ``of`` (vLLM's cached prompt tokens off all of them)."""
    by: str | None = None
    """A label to split on: one signal per label value, ``<name>.<by><value>`` (e.g. vLLM's accepted
    draft tokens ``.position0``, ``.position1``, ...), instead of one aggregate."""
    per_token: tuple[str, str] | None = None
    """(tokens counter, first-token histogram) of a histogram the engine observes once per engine step and
    request, however many tokens the step gave the request (vLLM's ITL: several under speculative
    decoding): its quantiles and mean are divided by the tokens per step over the window, so they read per
    token, as an engine that observes each token (SGLang) reports them (:mod:`agent.collectors.derive`)."""


#: prometheus_client's process collector, which vLLM's API server exports (SGLang's multiprocess registry
#: and llama.cpp do not): it changes when the engine process restarts.
PROCESS_START = "process_start_time_seconds"


@dataclass(frozen=True, slots=True)
class MetricMapping:
    """The table for one engine kind."""

    engine: str
    prefixes: tuple[str, ...]
    model_label: str | None
    signals: tuple[SignalSpec, ...]

    @property
    def wanted(self) -> frozenset[str]:
        """Every engine metric name this mapping reads, and the engine process's start time (a restart
        where no counter went down is still a restart): the parser keeps only these families."""
        return frozenset((PROCESS_START, *(alias for spec in self.signals for alias in spec.aliases)))


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where} must be a non-empty list of names, got {value!r}")
    return tuple(value)


def _signal(name: str, raw: Any, where: str) -> SignalSpec:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping, got {raw!r}")
    unknown = set(raw) - {
        "type", "aliases", "aggregate", "scale", "valid", "numerator", "denominator", "of", "less", "by",
        "per_token",
    }  # fmt: skip
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}")
    kind = raw.get("type")
    if kind not in _TYPES:
        raise ValueError(f"{where}.type must be one of {list(_TYPES)}, got {kind!r}")
    aggregate = raw.get("aggregate", "sum")
    if aggregate not in _AGGREGATES:
        raise ValueError(f"{where}.aggregate must be one of {list(_AGGREGATES)}, got {aggregate!r}")
    scale = raw.get("scale", 1.0)
    if not isinstance(scale, int | float) or isinstance(scale, bool) or scale <= 0:
        raise ValueError(f"{where}.scale must be a positive number, got {scale!r}")
    valid = raw.get("valid")
    if valid is not None:
        if not (
            isinstance(valid, list) and len(valid) == 2 and all(isinstance(v, int | float) for v in valid)
        ):
            raise ValueError(f"{where}.valid must be [low, high], got {valid!r}")
        valid = (float(valid[0]), float(valid[1]))
    by = raw.get("by")
    if by is not None and (kind not in ("gauge", "counter") or not isinstance(by, str)):
        raise ValueError(f"{where}.by splits a gauge or counter by a label name, got {by!r} on a {kind}")
    if by is not None and not _LABEL_NAME.fullmatch(by):
        raise ValueError(f"{where}.by must be a label name, got {by!r}")
    spec = SignalSpec(
        name,
        cast(SignalType, kind),
        aggregate=cast(Aggregate, aggregate),
        scale=float(scale),
        valid=valid,
        by=by,
        per_token=_per_token(raw.get("per_token"), kind, where),
    )
    if kind in ("gauge", "counter", "histogram"):
        return replace(spec, aliases=_strings(raw.get("aliases"), f"{where}.aliases"))
    if kind == "ratio":
        return replace(
            spec,
            numerator=_strings(raw.get("numerator"), f"{where}.numerator"),
            denominator=_strings(raw.get("denominator"), f"{where}.denominator"),
        )
    of = raw.get("of")
    if not isinstance(of, str):
        wanted = "counter" if kind == "difference" else "gauge"
        raise ValueError(f"{where}.of must name a {wanted} signal, got {of!r}")
    if kind == "difference":
        return replace(spec, of=of, less=_strings(raw.get("less"), f"{where}.less"))
    return replace(spec, of=of)


def _per_token(raw: Any, kind: str, where: str) -> tuple[str, str] | None:
    """``per_token: {tokens: <counter>, first_tokens: <histogram>}`` of a histogram, or None."""
    if raw is None:
        return None
    if kind != "histogram":
        raise ValueError(f"{where}.per_token applies to a histogram, not a {kind}")
    if not isinstance(raw, dict) or set(raw) != {"tokens", "first_tokens"}:
        raise ValueError(
            f"{where}.per_token must be {{tokens: <counter>, first_tokens: <histogram>}}, got {raw!r}"
        )
    tokens, first = raw["tokens"], raw["first_tokens"]
    if not (isinstance(tokens, str) and isinstance(first, str)):
        raise ValueError(f"{where}.per_token must name two signals, got {raw!r}")
    return tokens, first


def _check_references(engine: str, signals: tuple[SignalSpec, ...]) -> None:
    by_name = {s.name: s for s in signals}
    per_token = [s.name for s in signals if s.per_token is not None]
    if len(per_token) > 1:  # each would publish engine.decode_tokens_per_step
        raise ValueError(f"engines.{engine}: per_token on one histogram at most, got {per_token}")
    for spec in signals:
        if spec.per_token is not None:
            tokens, first = (by_name.get(name) for name in spec.per_token)
            if tokens is None or tokens.type != "counter" or tokens.by is not None:
                raise ValueError(
                    f"engines.{engine}.signals.{spec.name}.per_token.tokens: {spec.per_token[0]!r} is not a "
                    "counter signal without 'by'"
                )
            if first is None or first.type != "histogram":
                raise ValueError(
                    f"engines.{engine}.signals.{spec.name}.per_token.first_tokens: {spec.per_token[1]!r} is "
                    "not a histogram signal"
                )
        for ref in (*spec.numerator, *spec.denominator, *spec.less):
            if by_name.get(ref) is None or by_name[ref].type != "counter" or by_name[ref].by is not None:
                raise ValueError(
                    f"engines.{engine}.signals.{spec.name}: {ref!r} is not a counter signal without 'by'"
                )
        of = by_name.get(spec.of) if spec.of is not None else None
        wanted = "counter" if spec.type == "difference" else "gauge"
        if spec.of is not None and (of is None or of.type != wanted or of.by is not None):
            raise ValueError(
                f"engines.{engine}.signals.{spec.name}.of: {spec.of!r} is not a {wanted} signal without 'by'"
            )


def parse_mappings(data: Any) -> dict[str, MetricMapping]:
    """Validate a parsed table (the YAML's content) into mappings by engine kind."""
    engines = data.get("engines") if isinstance(data, dict) else None
    if not isinstance(engines, dict) or not engines:
        raise ValueError("metric table must have a non-empty 'engines' mapping")
    result: dict[str, MetricMapping] = {}
    for engine, raw in engines.items():
        where = f"engines.{engine}"
        if not isinstance(raw, dict) or not isinstance(raw.get("signals"), dict):
            raise ValueError(f"{where} must have a 'signals' mapping")
        model_label = raw.get("model_label")
        if model_label is not None and not isinstance(model_label, str):
            raise ValueError(f"{where}.model_label must be a label name or null, got {model_label!r}")
        signals = tuple(
            _signal(str(name), spec, f"{where}.signals.{name}") for name, spec in raw["signals"].items()
        )
        _check_references(str(engine), signals)
        prefixes = _strings(raw.get("prefixes"), f"{where}.prefixes")
        result[str(engine)] = MetricMapping(str(engine), prefixes, model_label, signals)
    return result


def load_mappings(path: str | Path | None = None) -> dict[str, MetricMapping]:
    """Read and validate the table at ``path`` (default: the packaged ``metric_names.yaml``)."""
    path = Path(path) if path is not None else DEFAULT_TABLE
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read metric table {str(path)!r}: {error}") from None
    return parse_mappings(data)


def detect_engine(text: str, mappings: Mapping[str, MetricMapping]) -> MetricMapping | None:
    """The mapping whose prefixes start the most lines of ``text``; ``None`` when no prefix occurs.

    ``str.count`` runs in C, so this costs microseconds even on a full scrape.
    """
    best: MetricMapping | None = None
    best_hits = 0
    for mapping in mappings.values():
        hits = sum(text.count("\n" + p) + text.startswith(p) for p in mapping.prefixes)
        if hits > best_hits:
            best, best_hits = mapping, hits
    return best
