"""Turn cumulative engine series into the rates, windowed quantiles and means the brain uses.

Stateful but pure: every update takes ``now`` (seconds on the agent's clock, virtual in replay) and nothing
here reads a clock or does I/O. Each tracker keeps only what its window needs.

Counters (:class:`CounterRate`). With consecutive samples ``(t0, v0)`` and ``(t1, v1)``::

    rate = (v1 - v0) / (t1 - t0)          if v1 >= v0
    rate = v1 / (t1 - t0)                 if v1 <  v0   (a reset: the counter restarted from 0)

so a reset never yields a negative rate. No rate is given for the first sample, for a repeated or
backwards ``now``, or when the previous sample is older than ``max_gap_s`` (stale: the engine was
unreachable, and a rate over the gap would smear an outage into a plausible-looking number).

Histograms (:class:`WindowedHistogram`). Keep snapshots of the cumulative buckets ``C_t(le)``; over the
window ``W`` use ``D(le) = C_now(le) - C_base(le)`` where ``base`` is the newest snapshot at or before
``now - W`` (the oldest one while the window fills). Quantile ``q`` is Prometheus'
``histogram_quantile``: with rank ``r = q * D(+Inf)``, find the first bucket ``i`` with ``D_i >= r`` and
interpolate linearly between its lower and upper bound; a rank in the ``+Inf`` bucket returns the highest
finite bound. The window mean is ``(sum_now - sum_base) / D(+Inf)``. No observations in the window means
no quantiles (absent, never 0). A decrease of any bucket is a reset: history restarts from zero.

Per token (:class:`WindowedIncrease`). vLLM observes its inter-token latency once per engine step and
request, however many tokens the step gave the request: under speculative decoding a step brings
``1 + accepted`` tokens, and a gap of one step was read as one token's (2.8 tokens per step on the greedy
n-gram fixture, so a per-step mean of 4.38 ms for a per-token 1.54 ms, which is vLLM's own
``request_time_per_output_token``). SGLang observes each token (``interval / n`` in ``n`` buckets). So a
histogram the table marks ``per_token`` is divided by the tokens per step over the same window::

    k = (D(tokens) - D(first tokens)) / D(+Inf)

where ``D(tokens)`` is the generation-token counter's increase (:class:`WindowedIncrease`, the same base
rule) and ``D(first tokens)`` the first-token histogram's count: each request's first token comes from
its prefill and has no gap. The mean is then exact, ``D(sum) / decode tokens``; a quantile is the step's
gap spread evenly over its tokens (exact when every step brings the same number). Without speculation
``k`` is 1 and nothing changes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

QUANTILES: tuple[float, ...] = (0.5, 0.95, 0.99)
_MAX_SNAPSHOTS = 4096  # hard bound per tracker, whatever the scrape interval and window


def bucket_quantile(
    q: float, bounds: npt.NDArray[np.float64], cumulative: npt.NDArray[np.float64]
) -> float | None:
    """Prometheus' ``histogram_quantile(q, ...)`` on cumulative counts; ``None`` without observations.

    ``bounds`` ascending and ending in ``+Inf``; ``cumulative`` non-decreasing, same length.
    """
    total = float(cumulative[-1])
    if total <= 0 or not 0.0 <= q <= 1.0:
        return None
    rank = q * total
    i = int(np.searchsorted(cumulative, rank, side="left"))
    i = min(i, len(bounds) - 1)
    if math.isinf(bounds[i]):
        return float(bounds[i - 1]) if i > 0 else None
    upper = float(bounds[i])
    lower = float(bounds[i - 1]) if i > 0 else min(0.0, upper)
    below = float(cumulative[i - 1]) if i > 0 else 0.0
    inside = float(cumulative[i]) - below
    if inside <= 0:
        return upper
    return lower + (upper - lower) * (rank - below) / inside


MAX_TOKENS_PER_STEP = 64.0
"""Most decode tokens one step gives a request (1 + its draft length): more means the counts do not belong
together (a counter that restarted unseen inside the window), and a per-step histogram is left as it is."""


def tokens_per_observation(tokens: float, first_tokens: float, observations: float) -> float | None:
    """Decode tokens per observation of a per-step histogram over one window, ``(tokens - first tokens) /
    observations`` (module docstring, "Per token"); None where nothing is to be divided: no
    observations, one token or fewer each (no speculation), or more than :data:`MAX_TOKENS_PER_STEP`."""
    if observations <= 0:
        return None
    per_step = (tokens - first_tokens) / observations
    return per_step if 1.0 < per_step <= MAX_TOKENS_PER_STEP else None


class CounterRate:
    """Per-second rate of one monotone counter between consecutive samples (see module docstring)."""

    def __init__(self, max_gap_s: float) -> None:
        self.max_gap_s = max_gap_s
        self.last_: tuple[float, float] | None = None

    def update(self, value: float, now: float) -> float | None:
        previous = self.last_
        if previous is not None and now == previous[0]:
            return None  # a repeated tick: keep the first sample as the base
        self.last_ = (now, value)
        if previous is None:
            return None
        then, before = previous
        elapsed = now - then
        if elapsed < 0 or elapsed > self.max_gap_s:
            return None  # the clock went backwards, or the base is stale: restart from this sample
        increase = value - before if value >= before else value
        return increase / elapsed


@dataclass(frozen=True, slots=True)
class WindowStats:
    """What a histogram saw in its window: observations, their mean and quantiles."""

    window_s: float
    count: float
    mean: float | None
    quantiles: Mapping[float, float]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    at: float
    counts: npt.NDArray[np.float64]
    sum: float | None


class WindowedHistogram:
    """Quantiles and mean of one cumulative histogram over the last ``window_s`` seconds."""

    def __init__(self, window_s: float, max_gap_s: float | None = None) -> None:
        self.window_s = window_s
        self.max_gap_s = window_s if max_gap_s is None else max_gap_s
        self.bounds_: tuple[float, ...] = ()
        self.history_: deque[_Snapshot] = deque(maxlen=_MAX_SNAPSHOTS)

    def update(
        self, bounds: Sequence[float], counts: Sequence[float], total_sum: float | None, now: float
    ) -> WindowStats | None:
        current = _Snapshot(now, np.asarray(counts, dtype=np.float64), total_sum)
        if tuple(bounds) != self.bounds_:  # first sample, or the engine changed its buckets
            self.bounds_ = tuple(bounds)
            self.history_.clear()
        elif self.history_:
            last = self.history_[-1]
            if now <= last.at:
                return None
            if now - last.at > self.max_gap_s:
                self.history_.clear()
            elif bool(np.any(current.counts < last.counts)):
                # reset: observations since the restart are the counts themselves
                self.history_.clear()
                self.history_.append(_Snapshot(last.at, np.zeros_like(current.counts), 0.0))
        self.history_.append(current)
        self._prune(now)
        if len(self.history_) < 2 or not self.bounds_ or not math.isinf(self.bounds_[-1]):
            return None
        return self._stats(self.history_[0], current)

    def _prune(self, now: float) -> None:
        start = now - self.window_s
        while len(self.history_) > 2 and self.history_[1].at <= start:
            self.history_.popleft()

    def _stats(self, base: _Snapshot, current: _Snapshot) -> WindowStats | None:
        delta = current.counts - base.counts
        count = float(delta[-1])
        if count <= 0:
            return None
        bounds = np.asarray(self.bounds_, dtype=np.float64)
        quantiles = {}
        for q in QUANTILES:
            value = bucket_quantile(q, bounds, delta)
            if value is not None:
                quantiles[q] = value
        mean = None
        if current.sum is not None and base.sum is not None:
            mean = (current.sum - base.sum) / count
        return WindowStats(current.at - base.at, count, mean, MappingProxyType(quantiles))


class WindowedIncrease:
    """A counter's increase over the last ``window_s`` seconds, with :class:`WindowedHistogram`'s base
    rule, so that it covers the same span as a histogram updated on the same scrapes."""

    def __init__(self, window_s: float, max_gap_s: float | None = None) -> None:
        self.window_s = window_s
        self.max_gap_s = window_s if max_gap_s is None else max_gap_s
        self.history_: deque[tuple[float, float]] = deque(maxlen=_MAX_SNAPSHOTS)

    def update(self, value: float, now: float) -> tuple[float, float] | None:
        """``(span_s, increase)`` over the window; None until two samples, or for a repeated ``now``."""
        if self.history_:
            at, last = self.history_[-1]
            if now <= at:
                return None
            if now - at > self.max_gap_s:
                self.history_.clear()
            elif value < last:  # reset: what it counts since the restart is the value itself
                self.history_.clear()
                self.history_.append((at, 0.0))
        self.history_.append((now, value))
        start = now - self.window_s
        while len(self.history_) > 2 and self.history_[1][0] <= start:
            self.history_.popleft()
        if len(self.history_) < 2:
            return None
        base_at, base = self.history_[0]
        return now - base_at, value - base


class WindowedMean:
    """Arithmetic mean of a gauge's samples within the last ``window_s`` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.samples_: deque[tuple[float, float]] = deque(maxlen=_MAX_SNAPSHOTS)

    def update(self, value: float, now: float) -> float:
        if self.samples_ and now < self.samples_[-1][0]:
            self.samples_.clear()  # the clock went backwards: older samples are meaningless
        self.samples_.append((now, value))
        start = now - self.window_s
        while self.samples_[0][0] < start:
            self.samples_.popleft()
        return sum(v for _, v in self.samples_) / len(self.samples_)


class Trackers:
    """Trackers by signal name, created on first use and forgotten once stale.

    A signal that disappears from the scrape (renamed metric, engine swapped) must not keep stale
    state forever, nor revive it hours later as if no time had passed: :meth:`prune` drops trackers not
    updated within ``stale_after_s``.
    """

    def __init__(self, window_s: float, stale_after_s: float | None = None) -> None:
        self.window_s = window_s
        self.stale_after_s = window_s if stale_after_s is None else stale_after_s
        self.rates_: dict[str, CounterRate] = {}
        self.histograms_: dict[str, WindowedHistogram] = {}
        self.increases_: dict[str, WindowedIncrease] = {}
        self.means_: dict[str, WindowedMean] = {}
        self.seen_: dict[str, float] = {}

    def rate(self, name: str, value: float, now: float) -> float | None:
        self.seen_[name] = now
        tracker = self.rates_.setdefault(name, CounterRate(self.stale_after_s))
        return tracker.update(value, now)

    def histogram(
        self, name: str, bounds: Sequence[float], counts: Sequence[float], total_sum: float | None, now: float
    ) -> WindowStats | None:
        self.seen_[name] = now
        tracker = self.histograms_.setdefault(name, WindowedHistogram(self.window_s, self.stale_after_s))
        return tracker.update(bounds, counts, total_sum, now)

    def increase(self, name: str, value: float, now: float) -> tuple[float, float] | None:
        self.seen_[name] = now
        tracker = self.increases_.setdefault(name, WindowedIncrease(self.window_s, self.stale_after_s))
        return tracker.update(value, now)

    def mean(self, name: str, value: float, now: float) -> float:
        self.seen_[name] = now
        return self.means_.setdefault(name, WindowedMean(self.window_s)).update(value, now)

    def prune(self, now: float) -> None:
        for name, seen in list(self.seen_.items()):
            if now - seen > self.stale_after_s:
                del self.seen_[name]
                self.rates_.pop(name, None)
                self.histograms_.pop(name, None)
                self.increases_.pop(name, None)
                self.means_.pop(name, None)

    def clear(self) -> None:
        self.rates_.clear()
        self.histograms_.clear()
        self.increases_.clear()
        self.means_.clear()
        self.seen_.clear()
