"""Counters and histograms the engine core keeps, with vLLM V1's bucket boundaries.

The core owns these plain numbers (no prometheus_client in the hot loop: a replay observes millions of
tokens); the HTTP face turns them into Prometheus families at scrape time. Boundaries are copied from a
real vLLM 0.32 scrape (``vllm:time_to_first_token_seconds`` etc.), so dashboards and the agent's quantile
code see the same buckets they would on a real engine.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_TIME_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """vLLM's ``build_1_2_5_buckets(max_model_len)``: 1, 2, 5, 10, 20, 50, ... up to ``limit``."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(out)
            out.append(float(value))
        exponent += 1


class Histogram:
    """Cumulative-at-read histogram: per-bucket counts (last one is +Inf), sum and count.

    Single values handed over as Python lists (:meth:`observe_list`, the engine's per-step inter-token
    gaps) wait in a buffer and are counted in one vectorised pass when ``counts``, ``sum`` or ``count``
    is read or the buffer is full: a replay hands over tens of thousands of small lists, and per-call
    numpy overhead was most of their cost.
    """

    __slots__ = ("_bounds_list", "_count", "_counts", "_pending", "_sum", "bounds")

    #: Buffered values are counted once this many wait (bounds the buffer's memory).
    FLUSH_AT = 65_536

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self._bounds_list = [float(b) for b in bounds]
        self._counts = np.zeros(len(bounds) + 1, dtype=np.int64)
        self._sum = 0.0
        self._count = 0
        self._pending: list[float] = []

    @property
    def counts(self) -> npt.NDArray[np.int64]:
        if self._pending:
            self._flush()
        return self._counts

    @property
    def sum(self) -> float:
        if self._pending:
            self._flush()
        return self._sum

    @property
    def count(self) -> int:
        if self._pending:
            self._flush()
        return self._count

    def observe(self, value: float, weight: int = 1) -> None:
        """Count ``value`` ``weight`` times (``le`` semantics: a value equal to a bound falls in it)."""
        self._counts[bisect.bisect_left(self._bounds_list, value)] += weight
        self._sum += value * weight
        self._count += weight

    def observe_many(self, values: npt.NDArray[np.float64], weight: int = 1) -> None:
        """Count every value in ``values`` ``weight`` times, vectorised."""
        if values.size == 0:
            return
        index = np.searchsorted(self.bounds, values, side="left")
        self._counts += np.bincount(index, minlength=self._counts.size) * weight
        self._sum += float(values.sum()) * weight
        self._count += int(values.size) * weight

    def observe_list(self, values: list[float]) -> None:
        """Count every value in ``values`` once, later (buffered; see the class docstring)."""
        pending = self._pending
        pending.extend(values)
        if len(pending) >= self.FLUSH_AT:
            self._flush()

    def _flush(self) -> None:
        values = np.array(self._pending, dtype=np.float64)
        self._pending = []
        self.observe_many(values)

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs ending with ``+Inf``, the exposition format's shape."""
        totals = np.cumsum(self.counts)
        labels = [str(b) for b in self._bounds_list] + ["+Inf"]
        return [(le, float(total)) for le, total in zip(labels, totals, strict=True)]

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (coarse; for tests and reports)."""
        if self.count == 0:
            return 0.0
        rank = q * self.count
        index = int(np.searchsorted(np.cumsum(self.counts), rank, side="left"))
        return self._bounds_list[index] if index < len(self._bounds_list) else float("inf")


FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class EngineStats:
    """Everything ``/metrics`` reports as a counter or histogram, in vLLM's units."""

    max_model_len: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0
    request_success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_TIME_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_TIME_BUCKETS))
    inference: Histogram = field(default_factory=lambda: Histogram(REQUEST_TIME_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: Histogram(REQUEST_TIME_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(REQUEST_TIME_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKEN_BUCKETS))
    request_preemptions: Histogram = field(default_factory=lambda: Histogram(PREEMPTION_BUCKETS))
    request_prompt_tokens: Histogram = field(init=False)
    request_generation_tokens: Histogram = field(init=False)
    request_max_tokens: Histogram = field(init=False)

    def __post_init__(self) -> None:
        token_buckets = buckets_1_2_5(self.max_model_len)
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_generation_tokens = Histogram(token_buckets)
        self.request_max_tokens = Histogram(token_buckets)
