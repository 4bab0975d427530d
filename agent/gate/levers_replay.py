"""Virtual-time replays of the gate's levers on the simulator's engine core (no sockets, no clock).

Used by the tests and by ``docs/levers.md`` to show what a lever buys on a real trace:

* :func:`replay_isolation` feeds a trace to two identical engine replicas, either split at random
  (the gate without isolation: every replica sees every length) or split by prompt length (long
  prompts to the long-context replica), and returns each request's TTFT;
* :func:`replay_cache` feeds a trace with repeats to one replica through :class:`ResponseCache`'s
  admission rule and returns TTFT, GPU-seconds and the hit ratio with and without the cache.

Routing is decided at arrival and the replicas share nothing, so each replica runs on its own in one
pass (``simulator.workload``'s event loop: jump when idle, fast-forward decode up to the next arrival).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from simulator.engine import EngineCore, make_core
from simulator.scheduler import Request

#: A core factory: the same profile for every replica of a replay.
CoreFactory = Callable[[], EngineCore]


def default_core() -> EngineCore:
    """One A100-80G serving Llama-3-8B in fp16 with vLLM's default batch (8k context: the Azure code
    trace has prompts up to 7.4k tokens, beyond Llama-2's 4k)."""
    return make_core("a100-80g", "llama-3-8b", "fp16", 256)


def run_core(
    core: EngineCore, arrivals: NDArray[np.float64], *, max_steps: int = 4096
) -> NDArray[np.float64]:
    """Run ``arrivals`` (rows of arrival_s, prompt_tokens, output_tokens; sorted) on ``core`` to the
    end and return each request's TTFT in seconds (first token minus arrival)."""
    live: list[Request] = []
    index, n = 0, len(arrivals)
    now = float(arrivals[0, 0]) if n else core.time
    while index < n or core.has_work():
        next_time = float(arrivals[index, 0]) if index < n else None
        if next_time is not None and (not core.has_work() or next_time <= core.time):
            now = max(now, next_time)
            while index < n and arrivals[index, 0] <= now:
                at, prompt, output = arrivals[index]
                live.append(core.submit(f"r{index}", max(1, int(prompt)), max(1, int(output)), float(at)))
                index += 1
            continue
        core.step(now, max_steps=max_steps, until=next_time)
        now = core.time
    return np.array([req.first_token - req.arrival for req in live], dtype=np.float64)


@dataclass(frozen=True)
class IsolationResult:
    """Per-request TTFT (s) and which requests were long, for one routing."""

    ttft_s: NDArray[np.float64]
    long: NDArray[np.bool_]

    def p99(self, long: bool) -> float:
        """P99 TTFT of the long (``True``) or short (``False``) requests."""
        return float(np.percentile(self.ttft_s[self.long == long], 99))


def replay_isolation(
    arrivals: NDArray[np.float64],
    threshold_tokens: int,
    *,
    isolate: bool,
    make: CoreFactory = default_core,
    seed: int = 0,
) -> IsolationResult:
    """Two replicas; with ``isolate`` prompts >= ``threshold_tokens`` go to replica 1 and the rest to
    replica 0, without it each request picks a replica uniformly at random (the gate's 50/50 split)."""
    long = arrivals[:, 1] >= threshold_tokens
    if isolate:
        pool = long.astype(np.int64)
    else:
        pool = np.random.default_rng(seed).integers(0, 2, size=len(arrivals))
    ttft = np.empty(len(arrivals), dtype=np.float64)
    for replica in (0, 1):
        mask = pool == replica
        if mask.any():
            ttft[mask] = run_core(make(), arrivals[mask])
    return IsolationResult(ttft, long)


def compress(arrivals: NDArray[np.float64], speedup: float, limit: int | None = None) -> NDArray[np.float64]:
    """The first ``limit`` rows with arrival times measured from the first and divided by ``speedup``
    (a busier hour from a quiet one, keeping the trace's burst shape and lengths)."""
    rows = arrivals[:limit].copy() if limit is not None else arrivals.copy()
    rows[:, 0] = (rows[:, 0] - rows[0, 0]) / speedup
    return rows


@dataclass(frozen=True)
class CacheReplay:
    """One run of :func:`replay_cache`: per-request TTFT, which were hits, and the engine's totals."""

    ttft_s: NDArray[np.float64]
    hit: NDArray[np.bool_]
    busy_s: float
    energy_j: float
    engine_tokens: int

    @property
    def hit_ratio(self) -> float:
        return float(self.hit.mean()) if len(self.hit) else 0.0


def with_repeats(
    arrivals: NDArray[np.float64],
    repeat_share: float,
    popular: int = 200,
    zipf_s: float = 1.1,
    deterministic_share: float = 0.6,
    seed: int = 0,
) -> tuple[NDArray[np.float64], list[str], NDArray[np.bool_]]:
    """Model repeats on a trace without prompt text: each request is, with probability ``repeat_share``,
    one of ``popular`` prompts picked with Zipf(``zipf_s``) popularity (the prompt keeps the lengths of
    the trace row it first took), else a unique prompt. A request is deterministic (cacheable) with
    probability ``deterministic_share``. Returns (arrivals with repeat lengths, keys, cacheable)."""
    rng = np.random.default_rng(seed)
    rows = arrivals.copy()
    n = len(rows)
    ranks = np.arange(1, popular + 1, dtype=np.float64)
    weights = ranks**-zipf_s
    picks = rng.choice(popular, size=n, p=weights / weights.sum())
    repeat = rng.random(n) < repeat_share
    lengths: dict[int, NDArray[np.float64]] = {}
    keys: list[str] = []
    for i in range(n):
        if repeat[i]:
            shape = lengths.setdefault(int(picks[i]), rows[i, 1:].copy())
            rows[i, 1:] = shape
            keys.append(f"popular-{picks[i]}")
        else:
            keys.append(f"unique-{i}")
    return rows, keys, rng.random(n) < deterministic_share


def replay_cache(
    arrivals: NDArray[np.float64],
    keys: list[str],
    cacheable: NDArray[np.bool_],
    *,
    enabled: bool,
    ttl_s: float = 300.0,
    make: CoreFactory = default_core,
    max_steps: int = 4096,
) -> CacheReplay:
    """One replica behind the gate's cache, in virtual time. A request's response is stored when it
    completes (if the Bloom filter admitted its key) and is served to later arrivals of the same key
    within ``ttl_s``; a hit's TTFT is 0 here (the gate answers from memory in about a millisecond on
    loopback, far below the engine's scale). Uses :class:`ResponseCache` itself, on a virtual clock."""
    from prometheus_client import CollectorRegistry

    from agent.config import GateConfig
    from agent.gate.cache import ResponseCache

    virtual = [0.0]
    cache = ResponseCache(
        GateConfig(cache_enabled=True, cache_ttl_s=ttl_s), CollectorRegistry(), wall_clock=lambda: virtual[0]
    )
    core = make()
    energy0, busy0, tokens0 = (
        core.gpu_counters.energy_j,
        core.gpu_counters.busy_s,
        core.stats.generation_tokens,
    )
    n = len(arrivals)
    ttft = np.zeros(n, dtype=np.float64)
    hit = np.zeros(n, dtype=np.bool_)
    live: dict[str, tuple[int, Request, bool]] = {}
    index = 0
    now = float(arrivals[0, 0]) if n else core.time
    while index < n or core.has_work():
        next_time = float(arrivals[index, 0]) if index < n else None
        if next_time is not None and (not core.has_work() or next_time <= core.time):
            now = max(now, next_time)
            while index < n and arrivals[index, 0] <= now:
                at, prompt, output = arrivals[index]
                virtual[0] = float(at)
                admitted = False
                if enabled and cacheable[index]:
                    if cache.get(keys[index]) is not None:
                        hit[index] = True
                        index += 1
                        continue
                    admitted = cache.admit(keys[index])
                rid = f"r{index}"
                req = core.submit(rid, max(1, int(prompt)), max(1, int(output)), float(at))
                live[rid] = (index, req, admitted)
                index += 1
            continue
        result = core.step(now, max_steps=max_steps, until=next_time)
        now = core.time
        for done in result.finished:
            i, req, admitted = live.pop(done.request_id)
            ttft[i] = req.first_token - req.arrival
            if admitted:
                virtual[0] = result.end
                cache.put(keys[i], b"x" * (64 + 4 * done.output_tokens), "application/json", False,
                          result.end - req.arrival, "")  # fmt: skip
    return CacheReplay(
        ttft,
        hit,
        core.gpu_counters.busy_s - busy0,
        core.gpu_counters.energy_j - energy0,
        core.stats.generation_tokens - tokens0,
    )
