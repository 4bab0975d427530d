"""Collector for the allocator probe that runs inside the engine (see :mod:`agent.probe`, docs/probe.md).

Fetch and parse are split: :meth:`ProbeCollector.collect` does the HTTP (one GET per tensor-parallel
rank, concurrently), :func:`parse` is pure and turns one scrape into a :class:`Reading`. Signals::

    probe.<metric>                   summed over devices (fragmentation recomputed from the sums)
    probe.device<i>.<metric>         per CUDA device

with ``<metric>`` one of allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes,
peak_allocated_bytes, peak_reserved_bytes, fragmentation_ratio, alloc_retries_total, ooms_total. The
summed peaks are sums of per-device peaks (upper bounds: devices need not peak together).

Status: a probe that answers with ``servepilot_probe_cuda_available 0`` is ``no_data`` (nothing to
measure yet, e.g. the model is still loading); timeouts, refused connections, HTTP errors, garbage or
``servepilot_probe_up 0`` are ``error`` with one line. With several ranks the reading is all-or-nothing,
because a sum over half the GPUs would look like a memory drop to the detectors.

Which GPUs the engine runs on: a probe that serves ``servepilot_probe_device_info{device, uuid}`` puts
them in the reading's info as ``gpu_uuids`` (comma-separated, as NVML names them), only when every rank
named every device it reports on; a partial list would make the sidecar let go of a GPU the engine uses
(:mod:`agent.engine_gpus`).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from agent import engine_gpus
from agent.collectors.base import SCRAPE_HEADERS
from agent.collectors.exposition import Counter, Gauge, parse_exposition
from agent.config import ProbeConfig
from agent.probe.stats import fragmentation
from detectors.snapshot import Reading, SourceStatus

SOURCE = "probe"
MAX_BODY_BYTES = 1 << 20
_PREFIX = "servepilot_probe_"

#: Sample name (after the prefix) -> signal metric name. Names are data; the probe and the simulator
#: serve exactly these.
METRICS: dict[str, str] = {
    "allocated_bytes": "allocated_bytes",
    "reserved_bytes": "reserved_bytes",
    "active_bytes": "active_bytes",
    "inactive_split_bytes": "inactive_split_bytes",
    "peak_allocated_bytes": "peak_allocated_bytes",
    "peak_reserved_bytes": "peak_reserved_bytes",
    "fragmentation_ratio": "fragmentation_ratio",
    "alloc_retries_total": "alloc_retries_total",
    "ooms_total": "ooms_total",
}
_SUMMED = tuple(m for m in METRICS.values() if m != "fragmentation_ratio")


class ProbeFormatError(ValueError):
    """The text is not a servepilot probe exposition; the message is one line."""


@dataclass(frozen=True)
class ProbeScrape:
    """One probe endpoint's answer, before merging ranks."""

    up: bool
    cuda_available: bool
    devices: dict[int, dict[str, float]] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    #: device -> GPU UUID (``servepilot_probe_device_info``); empty from probes that predate it
    uuids: dict[int, str] = field(default_factory=dict)


def parse_scrape(text: str) -> ProbeScrape:
    """Parse probe exposition text. Raises :class:`ProbeFormatError` on garbage or a non-probe endpoint.

    Parsing goes through :func:`agent.collectors.exposition.parse_exposition` (prometheus_client's parser
    with the series-key memo), like the engine's scrape: it runs every tick.
    """
    exposition = parse_exposition(text, 0.0)
    series: list[Gauge | Counter] = [g for gs in exposition.gauges.values() for g in gs]
    series += [c for cs in exposition.counters.values() for c in cs]
    up: float | None = None
    cuda = 0.0
    devices: dict[int, dict[str, float]] = {}
    info: dict[str, str] = {}
    uuids: dict[int, str] = {}
    for sample in series:
        name = sample.name.removeprefix(_PREFIX)
        labels = dict(sample.labels)
        if name == "up":
            up = sample.value
        elif name == "cuda_available":
            cuda = sample.value
        elif name == "info":
            info = {k: v for k, v in labels.items() if k in ("pid", "torch_version")}
        elif name == "device_info":
            uuid = labels.get("uuid", "").strip()
            if uuid and "," not in uuid:
                uuids[_device(labels)] = uuid
        elif name in METRICS and math.isfinite(sample.value):
            devices.setdefault(_device(labels), {})[METRICS[name]] = float(sample.value)
    if up is None:
        if exposition.errors:
            raise ProbeFormatError(f"not Prometheus text: {exposition.errors[0][:120]}")
        raise ProbeFormatError("no servepilot_probe_up sample: not a servepilot probe endpoint")
    return ProbeScrape(up == 1, cuda == 1, devices, info, uuids)


def _device(labels: dict[str, str]) -> int:
    raw = labels.get("device", "")
    if not raw.isdigit():
        raise ProbeFormatError(f"bad device label {raw!r}: expected a CUDA device index")
    return int(raw)


def merge(scrapes: Sequence[ProbeScrape], now: float, duration_s: float = 0.0) -> Reading:
    """One Reading from every rank's scrape (rank order). All-or-nothing: see the module docstring."""
    for rank, scrape in enumerate(scrapes):
        where = f"rank {rank}: " if len(scrapes) > 1 else ""
        if not scrape.up:
            return Reading.failed(
                SOURCE, now, f"{where}probe could not read the allocator (servepilot_probe_up 0)", duration_s
            )
        if not scrape.cuda_available:
            why = f"{where}CUDA is not initialised in the probed process (model not loaded yet?)"
            return Reading.empty(SOURCE, now, why, duration_s)
        if not scrape.devices:
            return Reading.empty(SOURCE, now, f"{where}probe reports no CUDA device in use", duration_s)
    per_rank = [(r, dev, vals) for r, s in enumerate(scrapes) for dev, vals in sorted(s.devices.items())]
    unique = len({dev for _, dev, _ in per_rank}) == len(per_rank)
    values: dict[str, float] = {}
    totals = dict.fromkeys(_SUMMED, 0.0)
    for position, (_, dev, vals) in enumerate(per_rank):
        index = dev if unique else position  # workers that each see "device 0" are numbered by rank
        for metric, value in vals.items():
            values[f"probe.device{index}.{metric}"] = value
            if metric in totals:
                totals[metric] += value
    values.update({f"probe.{metric}": total for metric, total in totals.items()})
    values["probe.fragmentation_ratio"] = fragmentation(totals["allocated_bytes"], totals["reserved_bytes"])
    info = dict(scrapes[0].info)
    if len(scrapes) > 1:
        info["pid"] = ",".join(s.info.get("pid", "?") for s in scrapes)
    if not unique:
        info["device_numbering"] = "rank_order"
    gpus = engine_gpu_uuids(scrapes)
    if gpus:
        info[engine_gpus.INFO_KEY] = ",".join(gpus)
    return Reading(SOURCE, now, SourceStatus.OK, values, duration_s=duration_s, info=info)


def engine_gpu_uuids(scrapes: Sequence[ProbeScrape]) -> list[str]:
    """The engine's GPUs by UUID in rank and device order, or [] unless every rank named every device it
    reports allocator stats for (a partial list would hide one of the engine's GPUs)."""
    found: list[str] = []
    for scrape in scrapes:
        if not scrape.uuids or any(dev not in scrape.uuids for dev in scrape.devices):
            return []
        found += [uuid for _, uuid in sorted(scrape.uuids.items()) if uuid not in found]
    return found


def parse(text: str, now: float) -> Reading:
    """Pure: one probe's exposition text -> a Reading observed at ``now``. Never raises."""
    try:
        return merge([parse_scrape(text)], now)
    except ProbeFormatError as error:
        return Reading.failed(SOURCE, now, str(error))


def rank_urls(url: str, ranks: int) -> list[str]:
    """Rank k's probe is on the base URL's port + k (the plugin binds base + LOCAL_RANK)."""
    if ranks == 1:
        return [url]
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return [urlunsplit(parts._replace(netloc=f"{host}:{port + k}")) for k in range(ranks)]


class ProbeCollector:
    """Scrapes the allocator probe(s) once per tick. ``collect`` never raises; ``close`` frees the session."""

    name = SOURCE
    ahead_of_tick = True  # read over HTTP: the loop starts it agent.scrape_lead_s before the tick

    def __init__(self, cfg: ProbeConfig, session: aiohttp.ClientSession | None = None) -> None:
        self.cfg = cfg
        self.urls = rank_urls(cfg.url, cfg.ranks)
        self._session = session
        self._owns_session = session is None
        self._timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)

    async def collect(self, now: float) -> Reading:
        started = time.perf_counter()
        try:
            scrapes = await asyncio.gather(*(self._scrape(url) for url in self.urls))
        except _ScrapeError as error:
            return Reading.failed(SOURCE, now, str(error), time.perf_counter() - started)
        except Exception as error:  # a bug or an unexpected client error must not fail the tick
            message = f"unexpected {type(error).__name__}: {_one_line(error)}"
            return Reading.failed(SOURCE, now, message, time.perf_counter() - started)
        return merge(scrapes, now, time.perf_counter() - started)

    async def _scrape(self, url: str) -> ProbeScrape:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.get(url, timeout=self._timeout, headers=SCRAPE_HEADERS) as response:
                if response.status != 200:
                    reason = f"{response.status} {response.reason or ''}".strip()
                    raise _ScrapeError(f"{url} answered HTTP {reason}")
                body = await _read_capped(response, MAX_BODY_BYTES + 1)
        except TimeoutError:
            raise _ScrapeError(f"timed out after {self.cfg.timeout_s:g} s fetching {url}") from None
        except aiohttp.ClientConnectorError as error:
            errno = error.os_error.errno
            reason = os.strerror(errno) if errno else _one_line(error)
            raise _ScrapeError(f"cannot connect to {url}: {reason}") from None
        except aiohttp.ClientError as error:
            raise _ScrapeError(f"fetching {url} failed: {type(error).__name__}: {_one_line(error)}") from None
        if len(body) > MAX_BODY_BYTES:
            raise _ScrapeError(f"{url} sent more than {MAX_BODY_BYTES} bytes: not a servepilot probe")
        try:
            return parse_scrape(body.decode("utf-8", errors="replace"))
        except ProbeFormatError as error:
            raise _ScrapeError(f"{url}: {error}") from None

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None


class _ScrapeError(Exception):
    """A failed scrape, already phrased as the one line the Reading carries."""


async def _read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most ``limit`` bytes of the body: a wrong URL pointing at a huge file must not eat memory."""
    body = bytearray()
    while len(body) < limit:
        chunk = await response.content.read(limit - len(body))
        if not chunk:
            break
        body += chunk
    return bytes(body)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:200] if text else type(error).__name__
