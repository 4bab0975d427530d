"""Turning anomaly scores into alarms: a separate, testable wrapper (river's thresholders).

A scorer says *how unusual* each point is; an alarm is a decision to bother a human. Three rules sit
between them, applied per signal:

* **Threshold**: a point is a *hit* when ``score >= threshold``.
* **Persistence (k-of-n)**: the alarm condition holds while at least ``k`` of the last ``n`` points are
  hits, so one stray spike does not page anyone (``k = n = 1`` disables it).
* **False-alarm budget**: each new alarm (a rising edge of the condition) spends one token from a
  bucket that refills at ``max_alarms_per_day / 86400`` tokens per second up to ``burst``. With the
  defaults a signal raises at most one alarm per day on average, however noisy its scores; an edge that
  finds the bucket empty is *suppressed* (counted, not raised).

Time comes in as ``t`` (seconds); it may repeat or step back, which refills nothing.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

SECONDS_PER_DAY = 86_400.0


class AlarmBudget:
    """The false-alarm budget alone, for a detector with its own hit and persistence rules (and the base
    of :class:`Thresholder`): the bucket refills ``max_alarms_per_day / 86400`` tokens a second up to
    ``burst``; each new alarm asks :meth:`spend` for one, and one that finds none is suppressed (counted
    in ``suppressed_total_``)."""

    def __init__(self, max_alarms_per_day: float = 1.0, burst: float = 1.0) -> None:
        if max_alarms_per_day < 0 or burst < 1:
            raise ValueError(
                f"budget needs max_alarms_per_day >= 0 and burst >= 1, got {max_alarms_per_day}, {burst}"
            )
        self.max_alarms_per_day = max_alarms_per_day
        self.burst = burst
        self.tokens_ = burst
        self.last_t_: float | None = None
        self.suppressed_total_ = 0

    def _refill(self, t: float) -> None:
        """Add the tokens earned since the last call; time that repeats or steps back refills nothing."""
        if self.last_t_ is not None and t > self.last_t_:
            rate = self.max_alarms_per_day / SECONDS_PER_DAY
            self.tokens_ = min(self.burst, self.tokens_ + (t - self.last_t_) * rate)
        if self.last_t_ is None or t > self.last_t_:
            self.last_t_ = t

    def _take(self) -> bool:
        """Spend a token if there is one; count the alarm as suppressed if not."""
        if self.tokens_ >= 1.0:
            self.tokens_ -= 1.0
            return True
        self.suppressed_total_ += 1
        return False

    def spend(self, t: float) -> bool:
        """A new alarm at ``t``: True (a token spent) when the budget allows it."""
        if math.isfinite(t):
            self._refill(t)
        return self._take()


@dataclass(frozen=True)
class AlarmEvent:
    """The outcome of one :meth:`Thresholder.update`.

    ``raised`` is true only on the point where a new alarm starts; ``firing`` stays true while the
    k-of-n condition holds; ``suppressed`` marks a rising edge dropped because the budget was spent.
    """

    t: float
    score: float
    raised: bool
    firing: bool
    suppressed: bool = False


class Thresholder(AlarmBudget):
    """Threshold + k-of-n persistence + per-signal false-alarm budget (see the module docstring)."""

    def __init__(
        self,
        threshold: float = 0.9,
        k: int = 2,
        n: int = 3,
        max_alarms_per_day: float = 1.0,
        burst: float = 1.0,
    ) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if not 1 <= k <= n:
            raise ValueError(f"persistence needs 1 <= k <= n, got k={k}, n={n}")
        super().__init__(max_alarms_per_day, burst)
        self.threshold = threshold
        self.k = k
        self.n = n
        self.hits_: deque[bool] = deque(maxlen=n)
        self.firing_ = False
        self.raised_total_ = 0

    def update(self, t: float, score: float) -> AlarmEvent:
        """Feed the score observed at ``t``; a non-finite score counts as no hit."""
        suppressed = self.suppressed_total_
        raised = self.push(t, score)
        return AlarmEvent(t, score, raised, self.firing_, self.suppressed_total_ > suppressed)

    def push(self, t: float, score: float) -> bool:
        """:meth:`update` without the event: whether a new alarm was raised. The general detector's path
        (one call per signal per tick, where building an event nobody reads cost a third of the time)."""
        if math.isfinite(t):
            self._refill(t)
        hits = self.hits_
        hits.append(math.isfinite(score) and score >= self.threshold)
        condition = sum(hits) >= self.k
        raised = False
        if condition and not self.firing_ and self._take():
            raised = True
            self.raised_total_ += 1
        self.firing_ = condition
        return raised
