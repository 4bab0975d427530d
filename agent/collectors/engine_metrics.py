"""The inference engine's Prometheus ``/metrics``, mapped to canonical ``engine.*`` signals.

Three steps, as node_exporter splits them: :meth:`EngineMetricsCollector.collect` fetches (aiohttp, the
only I/O); :func:`parse` is pure and maps the text through the name table (``metric_names.yaml``) into a
:class:`Scrape` of canonical gauges, counters and merged histograms; :class:`SignalDeriver` (stateful,
``now`` passed in) turns a scrape into the flat values of a :class:`Reading`: gauges as they are, counters
as per-second rates, histograms as windowed P50/P95/P99 and mean.

Names are data: an engine rename is one alias line in the YAML, never an ``if`` here. An alias list is in
preference order and the first name present in the scrape wins, so a scrape that carries both the old
and the new name (vLLM V1 during deprecation) reads the new one.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import aiohttp

from agent.collectors.base import SCRAPE_HEADERS
from agent.collectors.derive import Trackers, WindowStats, tokens_per_observation
from agent.collectors.exposition import Counter, Exposition, Gauge, Histogram, parse_exposition
from agent.collectors.metric_mapping import (
    PROCESS_START,
    MetricMapping,
    SignalSpec,
    detect_engine,
    load_mappings,
)
from agent.config import EngineConfig
from agent.tls import engine_context
from detectors.snapshot import Reading, SourceStatus

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024  # a /metrics page is ~100 kB; anything near this is not one
MAX_SPLIT = 32
"""Label values one ``by`` signal is split into (vLLM's draft positions: num_speculative_tokens)."""
_LABEL_VALUE = re.compile(r"[A-Za-z0-9_-]{1,32}")
_PERCENTILES = {0.5: "p50", 0.95: "p95", 0.99: "p99"}
TOKENS_PER_STEP = "decode_tokens_per_step"
"""Published (``engine.decode_tokens_per_step``) while the table's ``per_token`` histogram is divided: the
decode tokens a request got per engine step over the window, 1 + its accepted drafts (absent at one,
without speculation). The gate counts a stream without usage by it (agent/gate/relay.py)."""
Series = Counter | Gauge | Histogram


@dataclass(frozen=True)
class Scrape:
    """One scrape mapped to canonical names (without the ``engine.`` prefix), before any rate or window."""

    observed_at: float
    engine: str
    gauges: Mapping[str, float] = field(default_factory=dict)
    counters: Mapping[str, float] = field(default_factory=dict)
    histograms: Mapping[str, Histogram] = field(default_factory=dict)
    model: str | None = None
    legacy_names: tuple[str, ...] = ()
    """Aliases in use that are not the first choice (an engine still on deprecated names)."""
    errors: tuple[str, ...] = ()
    dropped: int = 0
    series: int = 0
    started_at: float | None = None
    """When the engine process started (``process_start_time_seconds``), where it says."""

    @property
    def empty(self) -> bool:
        return not (self.gauges or self.counters or self.histograms)


def _aggregate(values: list[float], how: str) -> float:
    if how == "mean":
        return sum(values) / len(values)
    if how == "max":
        return max(values)
    return sum(values)


def _merge(name: str, series: Sequence[Histogram], errors: list[str]) -> Histogram:
    """Sum the buckets of every label set that shares the first set's bounds."""
    first = series[0]
    counts = list(first.counts)
    total_sum = first.sum
    for other in series[1:]:
        if other.bounds != first.bounds:
            errors.append(f"{other.name}: label set {dict(other.labels)} has other buckets, skipped")
            continue
        counts = [a + b for a, b in zip(counts, other.counts, strict=True)]
        total_sum = None if total_sum is None or other.sum is None else total_sum + other.sum
    return Histogram(
        name,
        (),
        first.bounds,
        tuple(counts),
        counts[-1] if first.count is not None else None,
        total_sum,
        first.observed_at,
    )


def _find(spec: SignalSpec, expo: Exposition) -> tuple[int, Sequence[Series]] | None:
    """The first alias present in the scrape (its rank and series); aliases are in preference order."""
    for rank, alias in enumerate(spec.aliases):
        series: Sequence[Series]
        if spec.type == "histogram":
            series = expo.histograms.get(alias, ())
        else:
            series = expo.counters.get(alias, ()) if spec.type == "counter" else ()
            # a counter whose TYPE line was lost parses as untyped, which lands among the gauges
            series = series or expo.gauges.get(alias, ()) or expo.gauges.get(alias.removesuffix("_total"), ())
        if series:
            return rank, series
    return None


def _split(spec: SignalSpec, series: Sequence[Series], errors: list[str]) -> dict[str, list[Series]]:
    """The series of a ``by`` signal grouped as ``<name>.<by><value>``. A series without the label, with
    a value that cannot be part of a signal name, or past :data:`MAX_SPLIT` values is left out, said once
    in ``errors``: a label that explodes must not grow the snapshot without bound."""
    by = spec.by or ""
    groups: dict[str, list[Series]] = {}
    skipped: list[str] = []
    for one in series:
        value = dict(one.labels).get(by)
        name = f"{spec.name}.{by}{value}"
        if value is None or not _LABEL_VALUE.fullmatch(value):
            skipped.append(repr(value))
        elif name in groups or len(groups) < MAX_SPLIT:
            groups.setdefault(name, []).append(one)
        else:
            skipped.append(repr(value))
    if skipped:
        errors.append(
            f"{spec.aliases[0]}: {len(skipped)} series left out of the split by {by!r} (first {skipped[0]}; "
            f"at most {MAX_SPLIT} values of [A-Za-z0-9_-])"
        )
    return groups


def parse(text: str, mapping: MetricMapping, now: float) -> Scrape:
    """Map one ``/metrics`` body through ``mapping``. Pure; never raises on bad text."""
    expo = parse_exposition(text, now, mapping.wanted)
    errors = list(expo.errors)
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    histograms: dict[str, Histogram] = {}
    legacy: list[str] = []
    models: set[str] = set()
    for spec in mapping.signals:
        found = _find(spec, expo)
        if found is None:
            continue
        rank, series = found
        if spec.type == "histogram":
            histograms[spec.name] = _merge(spec.name, [h for h in series if isinstance(h, Histogram)], errors)
        else:
            target = counters if spec.type == "counter" else gauges
            groups = _split(spec, series, errors) if spec.by else {spec.name: list(series)}
            for name, group in groups.items():
                values = [s.value * spec.scale for s in group if not isinstance(s, Histogram)]
                if spec.valid is not None:
                    values = [v for v in values if spec.valid[0] <= v <= spec.valid[1]]
                if values:
                    target[name] = _aggregate(values, spec.aggregate)
            if not any(name in target for name in groups):
                continue
        if rank:
            legacy.append(spec.aliases[rank])
        if mapping.model_label:
            models.update(dict(s.labels).get(mapping.model_label, "") for s in series)
    models.discard("")
    started = [one.value for one in expo.gauges.get(PROCESS_START, ()) if not isinstance(one, Histogram)]
    return Scrape(
        observed_at=now,
        engine=mapping.engine,
        gauges=MappingProxyType(gauges),
        counters=MappingProxyType(counters),
        histograms=MappingProxyType(histograms),
        model=",".join(sorted(models)) or None,
        legacy_names=tuple(legacy),
        errors=tuple(errors),
        dropped=expo.dropped,
        series=expo.series_count,
        started_at=max(started) if started else None,
    )


class SignalDeriver:
    """Scrapes in, flat ``engine.*`` values out: rates, windowed quantiles, ratios, window means."""

    def __init__(self, mapping: MetricMapping, window_s: float) -> None:
        self.mapping = mapping
        self.trackers = Trackers(window_s)
        #: the engine process's start time at the last scrape that said it, and restarts seen by it
        self.started_at: float | None = None
        self.restarts = 0

    def update(self, scrape: Scrape, now: float) -> dict[str, float]:
        self._follow_restarts(scrape.started_at)
        values: dict[str, float] = {}
        if self.started_at is not None:  # its moves are restarts (the general detector reads them so)
            values[PROCESS_START] = self.started_at
        for name, value in scrape.gauges.items():
            values[name] = value
        for name, value in scrape.counters.items():
            rate = self.trackers.rate(name, value, now)
            if rate is not None:
                values[name] = rate
        windows: dict[str, WindowStats] = {}
        for name, hist in scrape.histograms.items():
            stats = self.trackers.histogram(name, hist.bounds, hist.counts, hist.sum, now)
            if stats is not None:
                windows[name] = stats
        for spec in self.mapping.signals:
            if spec.per_token is not None:
                per_step = self._per_token(spec.name, spec.per_token, windows, scrape, now)
                if per_step is not None:
                    values[TOKENS_PER_STEP] = per_step
        for name, stats in windows.items():
            for q, value in stats.quantiles.items():
                values[f"{name}.{_PERCENTILES[q]}"] = value
            if stats.mean is not None:
                values[f"{name}.mean"] = stats.mean
        for spec in self.mapping.signals:
            if spec.type == "ratio":
                self._ratio(spec, values)
            elif spec.type == "difference" and spec.of is not None:
                self._difference(spec, spec.of, values)
            elif spec.type == "window_mean" and spec.of is not None and spec.of in scrape.gauges:
                values[spec.name] = self.trackers.mean(spec.name, scrape.gauges[spec.of], now)
        self.trackers.prune(now)
        return {f"engine.{name}": value for name, value in values.items()}

    def _follow_restarts(self, started_at: float | None) -> None:
        """Start every window over when the engine process restarted. A restart shows in a counter that
        went down, but not in one that had counted little before and more since (a histogram's buckets
        that all grew back past their old counts): that one would keep its old base while the others
        start from zero, and windows read together (ITL per token: tokens, first tokens and ITL
        observations over one span) would no longer cover the same span. The next scrape is the new
        base of all."""
        if started_at is None:
            return
        if self.started_at is not None and abs(started_at - self.started_at) > 1e-3:
            self.trackers.clear()
            self.restarts += 1
            log.info("the engine restarted (its process start time changed): every window starts over")
        self.started_at = started_at

    def _per_token(
        self,
        name: str,
        per_token: tuple[str, str],
        windows: dict[str, WindowStats],
        scrape: Scrape,
        now: float,
    ) -> float | None:
        """Histogram ``name``'s window read per token (:mod:`agent.collectors.derive`): divided by the
        decode tokens per observation, ``(tokens - first tokens) / observations``, with the token
        counter's window spanning the histogram's. Left as it is where that cannot be told (no token
        counter or first-token window, windows that differ after a gap or a reset) or where
        :func:`~agent.collectors.derive.tokens_per_observation` finds nothing to divide. The token
        counter's window is kept on every scrape, the histogram's first included. Returns the tokens
        per observation it divided by, None where it did not."""
        tokens, first = per_token
        counted = scrape.counters.get(tokens)
        increase = self.trackers.increase(tokens, counted, now) if counted is not None else None
        stats, firsts = windows.get(name), windows.get(first)
        if stats is None or increase is None or firsts is None:
            return None
        span, generated = increase
        if abs(span - stats.window_s) > 1e-9 or abs(firsts.window_s - stats.window_s) > 1e-9:
            return None
        per_step = tokens_per_observation(generated, firsts.count, stats.count)
        if per_step is None:
            return None
        quantiles = {q: value / per_step for q, value in stats.quantiles.items()}
        mean = stats.mean / per_step if stats.mean is not None else None
        windows[name] = replace(stats, mean=mean, quantiles=MappingProxyType(quantiles))
        return per_step

    @staticmethod
    def _difference(spec: SignalSpec, of: str, values: dict[str, float]) -> None:
        if of in values and all(n in values for n in spec.less):
            values[spec.name] = max(0.0, values[of] - sum(values[n] for n in spec.less))

    @staticmethod
    def _ratio(spec: SignalSpec, values: dict[str, float]) -> None:
        if not all(n in values for n in (*spec.numerator, *spec.denominator)):
            return
        denominator = sum(values[n] for n in spec.denominator)
        if denominator > 0:
            values[spec.name] = min(1.0, max(0.0, sum(values[n] for n in spec.numerator) / denominator))


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class EngineMetricsCollector:
    """Scrapes the engine's ``/metrics`` once per :meth:`collect`. Never raises out of ``collect``.

    ``session`` is borrowed when given (the caller closes it) and owned otherwise. ``timer`` measures the
    scrape's duration only; the observation time is always the ``now`` passed in.
    """

    name = "engine"
    ahead_of_tick = True  # read over HTTP: the loop starts it agent.scrape_lead_s before the tick

    def __init__(
        self,
        cfg: EngineConfig,
        session: aiohttp.ClientSession | None = None,
        *,
        mappings: Mapping[str, MetricMapping] | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg = cfg
        self.url = cfg.url + cfg.metrics_path
        self._tls = engine_context(cfg)  # a file that does not load fails here, at start-up
        self._session = session
        self._owns_session = session is None
        self._mappings = dict(mappings) if mappings is not None else load_mappings()
        self._timer = timer
        self._mapping: MetricMapping | None = None if cfg.kind == "auto" else self._mappings[cfg.kind]
        self._deriver: SignalDeriver | None = None

    async def collect(self, now: float) -> Reading:
        started = self._timer()
        try:
            text = await self._fetch()
        except Exception as error:  # every failure is a Reading, never an exception out of the tick
            return Reading.failed(self.name, now, self._explain(error), self._timer() - started)
        try:
            return self._reading(text, now, started)
        except Exception as error:  # a bug in mapping must not fail the tick either
            return Reading.failed(
                self.name, now, f"parse failed: {_one_line(error)}", self._timer() - started
            )

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None

    async def _fetch(self) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._tls))
            self._owns_session = True
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
        async with self._session.get(self.url, timeout=timeout, headers=SCRAPE_HEADERS) as response:
            if response.status != 200:
                raise _HttpStatus(response.status, response.reason or "")
            body = bytearray()
            async for chunk in response.content.iter_chunked(64 * 1024):
                body.extend(chunk)
                if len(body) > MAX_BODY_BYTES:
                    raise ValueError(f"body larger than {MAX_BODY_BYTES} bytes")
            return body.decode(response.charset or "utf-8", errors="replace")

    def _explain(self, error: BaseException) -> str:
        if isinstance(error, asyncio.TimeoutError):
            return f"timeout after {self.cfg.timeout_s:g} s scraping {self.url}"
        if isinstance(error, _HttpStatus):
            return f"HTTP {error.status} {error.reason} from {self.url}".replace("  ", " ")
        if isinstance(error, aiohttp.ClientConnectorError):
            return f"cannot connect to {self.url}: {_one_line(error.os_error)}"
        return f"scraping {self.url} failed: {_one_line(error)}"

    def _reading(self, text: str, now: float, started: float) -> Reading:
        if not text.strip():
            return Reading.empty(self.name, now, f"empty body from {self.url}", self._timer() - started)
        mapping = self._mapping or detect_engine(text, self._mappings)
        if mapping is None:
            return self._unrecognised(text, now, started)
        if self._deriver is None or self._deriver.mapping is not mapping:
            self._deriver = SignalDeriver(mapping, self.cfg.quantile_window_s)
        scrape = parse(text, mapping, now)
        duration = self._timer() - started
        if scrape.empty:
            if scrape.errors:
                return Reading.failed(
                    self.name, now, f"{len(scrape.errors)} bad lines, first: {scrape.errors[0]}", duration
                )
            return Reading.empty(self.name, now, f"no known {mapping.engine} metrics in scrape", duration)
        values = self._deriver.update(scrape, now)
        info = {"engine": mapping.engine}
        if scrape.model:
            info["model"] = scrape.model
        if scrape.legacy_names:
            info["legacy_names"] = ",".join(scrape.legacy_names)
        # a partly bad body still counts as a good scrape; what was lost is said here, in one line
        warnings = []
        if scrape.errors:
            warnings.append(f"{len(scrape.errors)} bad lines, first: {scrape.errors[0]}")
        if scrape.dropped:
            warnings.append(f"{scrape.dropped} non-finite or sentinel samples dropped")
        if warnings:
            info["parse_warnings"] = "; ".join(warnings)
        return Reading(self.name, now, SourceStatus.OK, values, duration_s=duration, info=info)

    def _unrecognised(self, text: str, now: float, started: float) -> Reading:
        """No engine prefix in the body: garbage is an error, someone else's metrics are "no data"."""
        probe = parse_exposition(text, now)
        duration = self._timer() - started
        if probe.errors and not probe.series_count:
            return Reading.failed(
                self.name, now, f"not Prometheus text from {self.url}: {probe.errors[0]}", duration
            )
        prefixes = ", ".join(p for m in self._mappings.values() for p in m.prefixes)
        why = f"no engine metrics ({prefixes}) among {probe.series_count} series from {self.url}"
        return Reading.empty(self.name, now, why, duration)


class _HttpStatus(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status} {reason}")
        self.status = status
        self.reason = reason
