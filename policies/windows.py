"""Wrappers that add time windows and hysteresis around any policy, so policies stay simple.

After concurrency-limits' ``WindowedLimit``: the wrapped policy is asked only once per ``window_s`` (its
proposals in between are the last ones repeated), and :class:`Hysteresis` drops a numeric proposal whose
relative change from the last one passed through is below ``band``. Both keep their own state next to the
inner policy's, in one immutable pair, so the loop's state handling stays uniform.

:func:`rolling_sum` is the windowed counter the breaker's burn rates use: per-bucket sums in a tuple;
:func:`smoothed` the time-decayed average the breaker and the batch controller read preemptions through.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from detectors.base import Finding
from detectors.snapshot import Snapshot
from policies.base import Policy, Proposal

Buckets = tuple[tuple[int, float, float], ...]


@dataclass(frozen=True)
class WrapperState:
    inner: Any
    last_at: float | None
    last: tuple[Proposal, ...]


@dataclass(frozen=True)
class _Wrapper:
    """A policy around another one: it keeps the inner policy's name (and so its arbiter priority)."""

    inner: Policy

    @property
    def name(self) -> str:
        return self.inner.name


@dataclass(frozen=True)
class Windowed(_Wrapper):
    """Ask ``inner`` at most once per ``window_s``; repeat its last proposals in between."""

    window_s: float

    def decide(
        self, snapshot: Snapshot, findings: Sequence[Finding], state: WrapperState | None, now: float
    ) -> tuple[WrapperState, list[Proposal]]:
        state = state or WrapperState(None, None, ())
        if state.last_at is not None and now - state.last_at < self.window_s:
            return state, list(state.last)
        inner, proposals = self.inner.decide(snapshot, findings, state.inner, now)
        return WrapperState(inner, now, tuple(proposals)), proposals


@dataclass(frozen=True)
class Hysteresis(_Wrapper):
    """Drop numeric proposals within ``band`` (relative) of the last one let through for that knob."""

    band: float

    def decide(
        self, snapshot: Snapshot, findings: Sequence[Finding], state: WrapperState | None, now: float
    ) -> tuple[WrapperState, list[Proposal]]:
        state = state or WrapperState(None, None, ())
        inner, proposals = self.inner.decide(snapshot, findings, state.inner, now)
        previous = {p.knob: p.value for p in state.last}
        passed: list[Proposal] = []
        for p in proposals:
            before = previous.get(p.knob)
            if (
                isinstance(p.value, float | int)
                and isinstance(before, float | int)
                and abs(p.value - before) <= self.band * abs(before)
            ):
                continue
            passed.append(p)
        kept = {p.knob: p for p in state.last} | {p.knob: p for p in passed}
        return WrapperState(inner, now, tuple(kept.values())), passed


def smoothed(previous: float, at: float | None, now: float, value: float, tau_s: float) -> float:
    """Exponential average of ``value`` with time constant ``tau_s`` over irregular ticks. The first tick
    (``at`` is ``None``) only starts the clock: one tick's value is no rate to act on, so it returns 0."""
    alpha = math.exp(-max(0.0, now - at) / tau_s) if at is not None else 1.0
    return previous * alpha + value * (1.0 - alpha)


def rolling_sum(
    buckets: Buckets, now: float, bucket_s: float, keep_s: float, good: float, bad: float
) -> Buckets:
    """Add (``good``, ``bad``) at ``now`` to per-bucket sums and drop buckets older than ``keep_s``."""
    key = int(now // bucket_s)
    oldest = key - int(keep_s // bucket_s)
    kept = [b for b in buckets if b[0] >= oldest]
    if kept and kept[-1][0] == key:
        _, g, b = kept[-1]
        kept[-1] = (key, g + good, b + bad)
    else:
        kept.append((key, good, bad))
    return tuple(kept)


def window_totals(
    buckets: Buckets, now: float, bucket_s: float, window_s: float, since: float = -1e300
) -> tuple[float, float]:
    """(good, bad) summed over the buckets of the last ``window_s`` that start at or after ``since``."""
    first = int((now - window_s) // bucket_s) + 1
    floor = int(since // bucket_s) if since > -1e300 else first
    lo = max(first, floor)
    good = bad = 0.0
    for key, g, b in buckets:
        if key >= lo:
            good += g
            bad += b
    return good, bad
