"""The gate's tiered response cache for repeated deterministic requests. Off by default.

What may be cached (:func:`cache_key`): completions and chat completions that are deterministic,
``temperature == 0`` or an integer ``seed``, with no ``tools``/``functions`` (a tool call can have side
effects the client expects to happen again), from a business line allowed by ``cache_lines``, without
``Cache-Control: no-store``/``no-cache``. Anything else bypasses the cache, so a sampled request is
never answered from it.

Consistency: the key is a SHA-256 of the path and the canonical JSON body (sorted keys), so any change
in prompt or parameters is a different key. Entries live ``cache_ttl_s`` (wall time, so the on-disk tier
stays valid across restarts). Each entry carries the identity of the model that produced it (the
response's ``model`` and ``system_fingerprint``, OpenAI's field for "the backend changed", plus the
declared :meth:`ResponseCache.set_model_version`, which the gate sets to the upstream taking most of
the traffic); when a fresh upstream response shows a different identity, every older entry is stale and
is dropped on lookup: a model change invalidates. Each declared version keeps its own entries, so the
breaker routing everything to ``fp8`` and back does not throw away the primary's answers.

Tiers: an in-memory LRU bounded in bytes, and optionally a ``diskcache`` directory (SQLite index, LRU
eviction, its own size bound) behind it; a disk hit is promoted to memory. Admission: the
:class:`BloomFilter` admits an entry on its second sighting. Streamed responses are kept as their SSE
bytes and replayed event by event. Metrics ``servepilot_gate_cache_*`` go to the registry given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as PromCounter

from agent.config import GateConfig
from agent.gate.bloom import BloomFilter

log = logging.getLogger(__name__)

CACHEABLE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
HOT_KEYS_KEPT = 1024


def cache_key(
    path: str, body: bytes, line: str, headers: Mapping[str, str], allowed_lines: tuple[str, ...]
) -> str | None:
    """The request's cache key, or None when it must not be served from (or stored in) the cache."""
    if path not in CACHEABLE_PATHS or (allowed_lines and line not in allowed_lines):
        return None
    if any(word in headers.get("Cache-Control", "").lower() for word in ("no-store", "no-cache")):
        return None
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("tools") or doc.get("functions"):
        return None
    temperature, seed = doc.get("temperature", 1.0), doc.get("seed")
    seeded = isinstance(seed, int) and not isinstance(seed, bool)
    if not (temperature == 0 or seeded):  # OpenAI's default temperature is 1: absent means sampled
        return None
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{path}\n{canonical}".encode()).hexdigest()


def response_identity(payload: bytes, streaming: bool) -> str:
    """``model|system_fingerprint`` of a response (the first SSE event of a stream); '' if unreadable."""
    text = payload
    if streaming:
        start = payload.find(b"data:")
        end = payload.find(b"\n", start)
        text = payload[start + 5 : end if end >= 0 else len(payload)] if start >= 0 else b""
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(doc, dict):
        return ""
    return f"{doc.get('model', '')}|{doc.get('system_fingerprint') or ''}"


@dataclass(frozen=True, slots=True)
class Entry:
    """One cached response: what to send back and what it cost to make."""

    body: bytes
    content_type: str
    streaming: bool
    stored_at: float
    identity: str
    gpu_s: float

    def events(self) -> list[bytes]:
        """The SSE events of a streamed entry, each with its blank-line terminator, for replay."""
        parts = self.body.split(b"\n\n")
        return [p + b"\n\n" for p in parts if p.strip()]


@dataclass(slots=True)
class Fill:
    """A response on its way from upstream that may be stored: its bytes, bounded by ``limit``."""

    key: str
    store: bool  # admitted by the Bloom filter (second sighting)
    limit: int
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    head: bytes = b""  # the first bytes, kept even when not storing: they name the model

    def feed(self, chunk: bytes) -> None:
        if len(self.head) < 4096:
            self.head = (self.head + chunk)[:4096]
        self.size += len(chunk)
        if self.store and self.size <= self.limit:
            self.chunks.append(chunk)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks) if self.size <= self.limit else b""


class ResponseCache:
    """Memory LRU + optional disk tier + Bloom admission + hot-key counts. Time from ``wall_clock``."""

    def __init__(
        self, cfg: GateConfig, registry: CollectorRegistry, *, wall_clock: Callable[[], float] = time.time
    ) -> None:
        self.cfg = cfg
        self.clock = wall_clock
        self.bloom = BloomFilter(cfg.cache_bloom_capacity, cfg.cache_bloom_error_rate)
        self._memory: OrderedDict[str, Entry] = OrderedDict()
        self.memory_bytes = 0
        self.identity = ""  # of the newest upstream response seen
        self.model_version = ""
        self.hot: Counter[str] = Counter()
        self.disk: Any = None
        if cfg.cache_dir is not None:
            import diskcache  # lazily: only the disk tier needs it

            self.disk = diskcache.Cache(
                cfg.cache_dir, size_limit=cfg.cache_disk_max_bytes, eviction_policy="least-recently-used"
            )
        self.requests = PromCounter(
            "servepilot_gate_cache_requests", "Cache lookups by result.", ["result"], registry=registry
        )
        self.saved_gpu = PromCounter(
            "servepilot_gate_cache_saved_gpu_seconds",
            "Upstream seconds the hits would have taken (the original request's time).",
            registry=registry,
        )
        self.served_bytes = PromCounter(
            "servepilot_gate_cache_served_bytes", "Response bytes served from the cache.", registry=registry
        )
        size = Gauge("servepilot_gate_cache_bytes", "Bytes held per tier.", ["tier"], registry=registry)
        size.labels("memory").set_function(lambda: self.memory_bytes)
        size.labels("disk").set_function(lambda: 0 if self.disk is None else self.disk.volume())
        entries = Gauge("servepilot_gate_cache_entries", "Entries in memory.", registry=registry)
        entries.set_function(lambda: len(self._memory))
        ratio = Gauge("servepilot_gate_cache_hit_ratio", "Hits over cacheable lookups.", registry=registry)
        ratio.set_function(self.hit_ratio)
        self._hits = self._misses = 0

    # --- consistency -----------------------------------------------------------------------------
    def set_model_version(self, version: str) -> None:
        """Declare the serving model's version (a canary or precision switch calls this): entries made
        under another version stop being served."""
        self.model_version = version

    def observe_identity(self, identity: str) -> None:
        """A fresh upstream response showed ``identity``; a change makes every older entry stale."""
        if identity and identity != self.identity:
            if self.identity:
                log.info(
                    "upstream model changed (%s -> %s): cache entries invalidated", self.identity, identity
                )
            self.identity = identity

    def _current(self) -> str:
        return f"{self.identity}#{self.model_version}"

    def _valid(self, entry: Entry) -> bool:
        return entry.identity == self._current() and self.clock() - entry.stored_at < self.cfg.cache_ttl_s

    # --- lookups and fills -------------------------------------------------------------------------
    def _slot(self, key: str) -> str:
        """Where ``key`` lives under the declared model version: each version keeps its own entries, so
        routing away and back finds the first version's answers still there (until their TTL)."""
        return f"{key}@{self.model_version}" if self.model_version else key

    def get(self, key: str) -> Entry | None:
        """A valid entry for ``key`` (memory first, then disk, promoted), counting a hit or a miss."""
        key = self._slot(key)
        entry = self._memory.get(key)
        if entry is None and self.disk is not None:
            raw = self.disk.get(key)
            entry = Entry(*raw) if isinstance(raw, tuple) else None
            if entry is not None and self._valid(entry):
                self._put_memory(key, entry)
        if entry is not None and not self._valid(entry):
            self._drop(key)
            entry = None
        if entry is None:
            self._misses += 1
            self.requests.labels("miss").inc()
            return None
        self._memory.move_to_end(key)
        self._hits += 1
        self.hot[key] += 1
        if len(self.hot) > HOT_KEYS_KEPT * 4:  # bounded: keep the heaviest hitters only
            self.hot = Counter(dict(self.hot.most_common(HOT_KEYS_KEPT)))
        self.requests.labels("hit").inc()
        self.saved_gpu.inc(entry.gpu_s)
        self.served_bytes.inc(len(entry.body))
        return entry

    def bypass(self) -> None:
        """Count a request that may not use the cache."""
        self.requests.labels("bypass").inc()

    def admit(self, key: str) -> bool:
        """Record a sighting of a missed key; True (store its response) from the second sighting on."""
        return self.bloom.add(key.encode())

    def put(
        self, key: str, body: bytes, content_type: str, streaming: bool, gpu_s: float, identity: str
    ) -> bool:
        """Store a fresh 200 response; False when it is too large or another model made it."""
        self.observe_identity(identity)
        if len(body) > self.cfg.cache_max_entry_bytes or not body:
            return False
        key = self._slot(key)
        entry = Entry(body, content_type, streaming, self.clock(), self._current(), gpu_s)
        self._put_memory(key, entry)
        if self.disk is not None:
            self.disk.set(key, dataclasses.astuple(entry), expire=self.cfg.cache_ttl_s)
        return True

    def _put_memory(self, key: str, entry: Entry) -> None:
        self._drop_memory(key)
        self._memory[key] = entry
        self.memory_bytes += len(entry.body)
        while self.memory_bytes > self.cfg.cache_max_bytes and self._memory:
            _, old = self._memory.popitem(last=False)
            self.memory_bytes -= len(old.body)

    def _drop_memory(self, key: str) -> None:
        old = self._memory.pop(key, None)
        if old is not None:
            self.memory_bytes -= len(old.body)

    def _drop(self, key: str) -> None:
        self._drop_memory(key)
        if self.disk is not None:
            self.disk.delete(key)

    # --- signals -----------------------------------------------------------------------------------
    def hit_ratio(self) -> float:
        total = self._hits + self._misses
        return self._hits / total if total else 0.0

    def hot_keys(self, n: int = 10) -> list[tuple[str, int]]:
        """The ``n`` keys served most often (hot-key discovery), as (key prefix, hits)."""
        return [(key[:16], hits) for key, hits in self.hot.most_common(n)]

    def values(self) -> dict[str, float]:
        """Flat signals: ``gate.cache.{hit_ratio,bytes,entries}``."""
        return {
            "gate.cache.hit_ratio": self.hit_ratio(),
            "gate.cache.bytes": float(self.memory_bytes),
            "gate.cache.entries": float(len(self._memory)),
        }

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
