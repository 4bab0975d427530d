"""llama.cpp's ``/slots``: slot occupancy and context (KV) usage, which its ``/metrics`` does not carry.

llama.cpp's server decodes at most ``--parallel`` sequences at once, one per *slot*, each with its own
share of the context (``n_ctx`` tokens). Its Prometheus page has no KV-usage metric, and the windowed
gauges it does have reset on every scrape; ``/slots`` is an instantaneous, side-effect-free view, so this
collector reads it each tick. :func:`parse` is pure (tested on a saved real answer); the collector does
the HTTP. Signals, all ``engine.*`` so the brain reads them like any engine's:

====================================  ===========================================================
``engine.slots_total``                slots the server has (its ``--parallel``)
``engine.slots_busy``                 slots processing a request now
``engine.slots_busy_ratio``           busy / total
``engine.context_capacity_tokens``    sum of the slots' ``n_ctx``
``engine.context_used_tokens``        prompt + generated tokens of the busy slots
``engine.kv_cache_usage_ratio``       used / capacity: the canonical KV usage the policies guard on
``engine.slot_context_usage_ratio.max``  the fullest slot's fill: near 1 it shifts or truncates context
====================================  ===========================================================

Formats: builds since late 2024 report ``is_processing`` and a ``next_token`` list; older ones a
``state`` (0 idle) and a ``next_token`` object. Both are read. A server started without ``--slots``
answers 501, which is "no data" with the reason, not an error.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from agent.collectors.base import SCRAPE_HEADERS
from agent.config import EngineConfig
from agent.tls import engine_context
from detectors.snapshot import Reading, SourceStatus

SLOTS_PATH = "/slots"
MAX_BODY_BYTES = 4 * 1024 * 1024  # ~1.3 kB per slot; a body near this is not a slots answer


def _number(slot: Mapping[str, Any], key: str, where: str) -> float:
    value = slot.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}.{key} must be a number, got {value!r}")
    return float(value)


def _busy(slot: Mapping[str, Any]) -> bool:
    if "is_processing" in slot:
        return bool(slot["is_processing"])
    return bool(slot.get("state", 0))  # older builds: 0 idle, 1 processing


def _decoded(slot: Mapping[str, Any], where: str) -> float:
    nxt = slot.get("next_token")
    if isinstance(nxt, list):
        nxt = nxt[0] if nxt else {}
    if isinstance(nxt, dict) and "n_decoded" in nxt:
        return _number(nxt, "n_decoded", f"{where}.next_token")
    return _number(slot, "n_decoded", where)


def parse(text: str) -> dict[str, float]:
    """``/slots`` JSON -> flat ``engine.*`` values. Pure; ValueError (one line) on anything else."""
    try:
        doc = json.loads(text)
    except ValueError as error:
        raise ValueError(f"not JSON: {error}") from None
    if not isinstance(doc, list) or not all(isinstance(s, dict) for s in doc):
        raise ValueError(f"expected a JSON list of slot objects, got {type(doc).__name__}")
    capacity = used = busy = 0.0
    fullest = 0.0
    for index, slot in enumerate(doc):
        where = f"slot[{index}]"
        n_ctx = _number(slot, "n_ctx", where)
        capacity += n_ctx
        if not _busy(slot):
            continue
        busy += 1
        tokens = min(n_ctx, _number(slot, "n_prompt_tokens", where) + _decoded(slot, where))
        used += tokens
        if n_ctx > 0:
            fullest = max(fullest, tokens / n_ctx)
    total = float(len(doc))
    values = {
        "engine.slots_total": total,
        "engine.slots_busy": busy,
        "engine.context_capacity_tokens": capacity,
        "engine.context_used_tokens": used,
        "engine.slot_context_usage_ratio.max": fullest,
    }
    if total:
        values["engine.slots_busy_ratio"] = busy / total
    if capacity > 0:
        values["engine.kv_cache_usage_ratio"] = used / capacity
    return values


class LlamaCppSlotsCollector:
    """Reads ``<engine.url>/slots`` once per :meth:`collect`. Never raises out of ``collect``."""

    name = "llamacpp_slots"
    ahead_of_tick = True  # read over HTTP: the loop starts it agent.scrape_lead_s before the tick

    def __init__(
        self,
        cfg: EngineConfig,
        session: aiohttp.ClientSession | None = None,
        *,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg = cfg
        self.url = cfg.url + SLOTS_PATH
        self._tls = engine_context(cfg)  # a file that does not load fails here, at start-up
        self._session = session
        self._owns_session = session is None
        self._timer = timer

    async def collect(self, now: float) -> Reading:
        started = self._timer()
        try:
            status, text = await self._fetch()
        except Exception as error:  # every failure is a Reading, never an exception out of the tick
            return Reading.failed(self.name, now, self._explain(error), self._timer() - started)
        duration = self._timer() - started
        if status == 501:
            why = f"{self.url} is disabled (start the server with --slots)"
            return Reading.empty(self.name, now, why, duration)
        if status != 200:
            return Reading.failed(self.name, now, f"HTTP {status} from {self.url}", duration)
        try:
            values = parse(text)
        except ValueError as error:
            return Reading.failed(self.name, now, f"bad answer from {self.url}: {error}", duration)
        return Reading(
            self.name, now, SourceStatus.OK, values, duration_s=duration, info={"engine": "llamacpp"}
        )

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None

    async def _fetch(self) -> tuple[int, str]:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._tls))
            self._owns_session = True
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
        async with self._session.get(self.url, timeout=timeout, headers=SCRAPE_HEADERS) as response:
            body = await response.content.read(MAX_BODY_BYTES + 1)
            if len(body) > MAX_BODY_BYTES:
                raise ValueError(f"body larger than {MAX_BODY_BYTES} bytes")
            return response.status, body.decode("utf-8", errors="replace")

    def _explain(self, error: BaseException) -> str:
        if isinstance(error, TimeoutError):
            return f"timeout after {self.cfg.timeout_s:g} s reading {self.url}"
        if isinstance(error, aiohttp.ClientConnectorError):
            return f"cannot connect to {self.url}: {error.os_error}"
        text = " ".join(str(error).split())
        return f"reading {self.url} failed: {type(error).__name__}" + (f": {text}" if text else "")
