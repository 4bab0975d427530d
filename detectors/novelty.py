"""Level novelty: has the signal ever been at this level within the recent history?

The range of the last ``history`` values is cut into ``levels`` equal bins of width
``w = (max - min) / levels`` (plus half a bin of margin each side), and each value becomes the integer
symbol ``s = floor((x - lo) / w)`` (values beyond the range get symbols beyond ``0..levels``). The scorer
keeps, per symbol, how many of the last ``history`` values fell in it. A value whose bin is occupied is
normal (score 0); one whose bin is empty scores by its distance ``d >= 1`` (in bins) to the nearest
occupied bin::

    novelty(x) = 1 - (1 - base) * decay ** (d - 1)        (base at d = 1, -> 1 as d grows)

so a new level one bin away from anything seen scores ``base`` and one far outside the range ~1. This is
the "facts never seen in this context" idea of the Contextual Anomaly Detector (Smirnov, NAB's CAD OSE)
reduced to order 0, with a running range instead of CAD's whole-file range (which looks ahead). Longer
contexts (the last k symbols, k = 1..6) were measured on NAB and added nothing at the best threshold,
so they are not kept; see docs/detectors.md.

**Rest period** (also CAD's): a raw novelty is reported only if it exceeds every raw novelty of the
previous ``rest`` points, else 0. One excursion to a new level is one high score, not a run of them
(NAB, like an on-call engineer, pays for every extra alarm and rewards only the earliest one); a jump
further out during the rest still reports.

**Re-quantisation.** Every ``requant_every`` points the range of the window is measured again; when the
bin width changes by more than a factor ``tolerance`` or the bottom moves by more than one bin, the bins
are re-cut and the counts rebuilt from the window (O(history), rare). Between re-cuts the bins are fixed,
so "seen before" keeps its meaning. Memory per signal: the window (``history`` floats and ints) and at
most ``history`` counters; cost O(1) per point plus the amortised re-cut, ~5 us in CPython.
"""

from __future__ import annotations

import math
from collections import deque

from detectors.streaming import ScorerBase


class LevelNoveltyScorer(ScorerBase):
    """Scores values that land in a bin of the running range no recent value occupied (see the module
    docstring). All parameters are shared by every signal: nothing is tuned per series."""

    def __init__(
        self,
        levels: int = 20,
        history: int = 5000,
        warmup: int = 150,
        rest: int = 200,
        requant_every: int = 300,
        tolerance: float = 1.5,
        base: float = 0.9,
        decay: float = 0.5,
        search: int = 64,
    ) -> None:
        super().__init__(warmup=warmup)
        self.levels = levels
        self.history = history
        self.rest = rest
        self.requant_every = requant_every
        self.tolerance = tolerance
        self.base = base
        self.decay = decay
        self.search = search

    def _state(self) -> None:
        if not hasattr(self, "values_"):
            self.values_: deque[float] = deque(maxlen=self.history)
            self.symbols_: deque[int] = deque(maxlen=self.history)
            self.counts_: dict[int, int] = {}
            self.lo_: float | None = None
            self.width_ = 1.0
            self.recent_raw_: deque[float] = deque(maxlen=max(1, self.rest))
            self.learned_ = 0

    def _symbol(self, x: float) -> int:
        if self.lo_ is None:
            return 0
        # Clamped so a value 1e300 away cannot overflow the int conversion.
        return math.floor(max(-1e9, min(1e9, (x - self.lo_) / self.width_)))

    def _raw(self, x: float) -> float:
        """Novelty of ``x`` before the rest period: 0 if its bin is occupied, else by distance."""
        if self.lo_ is None:
            return 0.0
        s = self._symbol(x)
        if self.counts_.get(s, 0) > 0:
            return 0.0
        distance = self.search
        for d in range(1, self.search):
            if self.counts_.get(s - d, 0) > 0 or self.counts_.get(s + d, 0) > 0:
                distance = d
                break
        return 1.0 - (1.0 - self.base) * self.decay ** (distance - 1)

    def _rested(self, raw: float) -> float:
        if self.rest > 0 and self.recent_raw_ and raw <= max(self.recent_raw_):
            return 0.0
        return raw

    def _score(self, t: float, x: float) -> float:
        self._state()
        return self._rested(self._raw(x))

    def _learn(self, t: float, x: float) -> None:
        self._update(t, x)

    def _update(self, t: float, x: float) -> float:
        self._state()
        raw = self._raw(x)
        score = self._rested(raw)
        if self.rest > 0:
            self.recent_raw_.append(raw)
        if len(self.symbols_) == self.history:
            self._count(self.symbols_[0], -1)
        s = self._symbol(x)
        self.values_.append(x)
        self.symbols_.append(s)
        self._count(s, +1)
        self.learned_ += 1
        if self.learned_ == self.warmup or (
            self.learned_ > self.warmup and self.learned_ % self.requant_every == 0
        ):
            self._requantise()
        return score

    def _count(self, s: int, delta: int) -> None:
        n = self.counts_.get(s, 0) + delta
        if n > 0:
            self.counts_[s] = n
        else:
            self.counts_.pop(s, None)

    def _requantise(self) -> None:
        """Re-cut the bins from the window's range when it has changed enough (module docstring)."""
        lo, hi = min(self.values_), max(self.values_)
        # A flat window still gets a finite bin: 0.1% of its magnitude, or 1e-9 around zero.
        width = (hi - lo) / self.levels if hi > lo else max(abs(hi), 1e-6) * 1e-3
        if self.lo_ is not None:
            ratio = width / self.width_
            if (
                1.0 / self.tolerance < ratio < self.tolerance
                and abs(lo - 0.5 * width - self.lo_) < self.width_
            ):
                return
        self.lo_, self.width_ = lo - 0.5 * width, width
        self.symbols_ = deque((self._symbol(v) for v in self.values_), maxlen=self.history)
        self.counts_ = {}
        for s in self.symbols_:
            self._count(s, +1)
