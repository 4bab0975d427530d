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
further out during the rest still reports. The maximum of the last ``rest`` raw novelties is kept as a
monotonic deque (Lemire's running maximum: entries ``(i, r)`` with decreasing ``r``; a new ``r`` drops every
entry it dominates, the front leaves when it is ``rest`` points old), so it costs O(1) amortised per point
instead of a ``max`` over ``rest`` values.

**Re-quantisation.** Every ``requant_every`` points the range of the window is measured again; when the
bin width changes by more than a factor ``tolerance`` or the bottom moves by more than one bin, the bins
are re-cut and the counts rebuilt from the window (O(history), rare). Between re-cuts the bins are fixed,
so "seen before" keeps its meaning. The check falls on the points ``n`` with
``n % requant_every == phase_`` (after the first cut at ``warmup``): a detector that runs one
scorer per signal on the same tick gives each a different phase (see
:func:`staggered_factory`), so the O(history) checks and re-cuts of ~80 signals do
not all land on one tick. Memory per signal: the window (``history`` floats and ints) and at most
``history`` counters; cost O(1) per point plus the amortised check and re-cut (vectorised), ~5 us in
CPython.

**Long memory.** ``history`` counts points, so its reach depends on the sampling step: on NAB's 5-minute
data 5000 points are 17 days, on the agent's 1 s ticks 83 minutes, less than a night. Each morning's
traffic then climbed to levels the window had forgotten, and every load signal raised a new alarm: on the
Azure 2024 coding week sampled at 1 s, 307 rising edges in 7 days (about 44 a day), of which the
one-alarm-a-day budget let through the first each day and so had nothing left for a real fault that
followed. So the scorer also remembers, for ``memory_s`` of time (7 days), which levels the signal visited:
per ``memory_step_s`` (30 minutes) of data, one value from each bin it occupied. Once every point of such
a step has left the window, its values count as seen (an occupied bin scores 0) and widen the range the
bins are cut from; they are forgotten when ``memory_s`` older than the newest point. A level last visited
within a week is not new. On that week the rising edges fall to 24, 19 of them on the first day while
the scorer learns the daily cycle; a window of the whole week in points, 90 times the state, gives 21
(``bench/novelty_memory.py`` prints the table). Data sampled more coarsely than ``memory_s / history``
(NAB's) never leaves a step behind the window inside ``memory_s``, so the memory holds nothing and the
scores are those of the window alone (the NAB figures are unchanged). Cost: a dict store per point
(3.9 -> 4.3 us); a tuple of a few floats per step, 26 KiB more per signal pickled after a week.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from detectors.streaming import ScorerBase

FIRST_CUT_SPREAD = 8
"""Staggered scorers make their first cut over this many points before the warm-up ends."""


class LevelNoveltyScorer(ScorerBase):
    """Scores values that land in a bin of the running range no recent value occupied (see the module
    docstring). All parameters are shared by every signal: nothing is tuned per series."""

    #: Offset of the re-cut schedule, set per instance by :func:`staggered_factory`. State, not a
    #: parameter: it travels with a pickled scorer and does not make two scorers' parameters differ
    #: (agent/persist.py restores baselines only when the parameters match).
    phase_: int = 0

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
        memory_s: float = 7 * 86400.0,
        memory_step_s: float = 1800.0,
    ) -> None:
        """``memory_s``: how long levels the window has dropped are still remembered (0: not at all);
        ``memory_step_s``: the resolution in time of that memory (module docstring, "Long memory")."""
        if memory_s < 0 or memory_step_s <= 0:
            raise ValueError(
                f"memory needs memory_s >= 0 and memory_step_s > 0, got {memory_s}, {memory_step_s}"
            )
        super().__init__(warmup=warmup)
        self.levels = levels
        self.history = history
        self.rest = rest
        self.requant_every = requant_every
        self.tolerance = tolerance
        self.base = base
        self.decay = decay
        self.search = search
        self.memory_s = memory_s
        self.memory_step_s = memory_step_s

    def _state(self) -> None:
        if not hasattr(self, "values_"):
            # The window as a ring of floats: contiguous, so the periodic range check reads 40 kB
            # instead of chasing 5,000 float objects scattered over the heap (~0.5 ms of cache misses).
            self.values_ = np.zeros(self.history)
            self.head_ = 0  # where the next value goes
            self.filled_ = 0
            self.symbols_: deque[int] = deque(maxlen=self.history)
            self.counts_: dict[int, int] = {}
            self.lo_: float | None = None
            self.width_ = 1.0
            # Running maximum of the last ``rest`` raw novelties: (point index, raw), raws decreasing.
            self.peaks_: deque[tuple[int, float]] = deque()
            self.learned_ = 0
        if not hasattr(self, "remembered_"):  # also for a scorer pickled before the long memory
            self._memory_state()

    def _memory_state(self) -> None:
        #: the step being filled: when it began, and per bin it visited, a value from that bin
        self.step_t_: float | None = None
        self.step_levels_: dict[int, float] = {}
        #: closed steps with points still in the window: (closed at, points learned then, values)
        self.pending_: deque[tuple[float, int, tuple[float, ...]]] = deque()
        #: closed steps wholly behind the window and younger than ``memory_s``, oldest first
        self.memory_: deque[tuple[float, int, tuple[float, ...]]] = deque()
        #: per bin, how many remembered values sit in it (only occupied bins, as ``counts_``)
        self.remembered_: dict[int, int] = {}

    def _symbol(self, x: float) -> int:
        if self.lo_ is None:
            return 0
        # Clamped so a value 1e300 away cannot overflow the int conversion.
        return math.floor(max(-1e9, min(1e9, (x - self.lo_) / self.width_)))

    def _raw(self, x: float) -> float:
        """Novelty of ``x`` before the rest period: 0 if its bin is occupied, else by distance."""
        return 0.0 if self.lo_ is None else self._raw_at(self._symbol(x))

    def _raw_at(self, s: int) -> float:
        """Novelty of a value in bin ``s`` (bins already cut)."""
        counts, remembered = self.counts_, self.remembered_
        if s in counts or s in remembered:  # both hold only occupied bins (see _count)
            return 0.0
        distance = self.search
        for d in range(1, self.search):
            if s - d in counts or s + d in counts or s - d in remembered or s + d in remembered:
                distance = d
                break
        return 1.0 - (1.0 - self.base) * self.decay ** (distance - 1)

    def _rested(self, raw: float) -> float:
        """``raw`` if it exceeds every raw novelty of the last ``rest`` points, else 0."""
        peaks = self.peaks_
        if self.rest > 0 and peaks and raw <= peaks[0][1]:
            return 0.0
        return raw

    def _score(self, t: float, x: float) -> float:
        self._state()
        return self._rested(self._raw(x))

    def _learn(self, t: float, x: float) -> None:
        self._update(t, x)

    def _update(self, t: float, x: float) -> float:
        self._state()
        # One symbol serves scoring and learning: the bins cannot change between the two.
        s = self._symbol(x)
        raw = 0.0 if self.lo_ is None else self._raw_at(s)
        score = self._rested(raw)
        n = self.learned_
        if self.rest > 0:
            peaks = self.peaks_
            while peaks and peaks[-1][1] <= raw:
                peaks.pop()
            peaks.append((n, raw))
            if peaks[0][0] <= n - self.rest:
                peaks.popleft()
        symbols = self.symbols_
        if len(symbols) == self.history:
            _count(self.counts_, symbols[0], -1)
        head = self.head_
        self.values_[head] = x
        self.head_ = head + 1 if head + 1 < self.history else 0
        if self.filled_ < self.history:
            self.filled_ += 1
        symbols.append(s)
        counts = self.counts_
        counts[s] = counts.get(s, 0) + 1
        self.learned_ = n = n + 1
        if self.memory_s > 0:
            self._keep(t, s, x, n)
        # The first cut comes up to FIRST_CUT_SPREAD - 1 points before the warm-up ends, by phase, so
        # that ~80 staggered scorers do not all cut on the same tick; scoring still starts at ``warmup``.
        if n == max(1, self.warmup - self.phase_ % FIRST_CUT_SPREAD) or (
            n > self.warmup and n % self.requant_every == self.phase_ % self.requant_every
        ):
            self._requantise()
        return score

    def _keep(self, t: float, s: int, x: float, n: int) -> None:
        """Fold the point just learned into the long memory and move the memory along: a step closes
        after ``memory_step_s`` of data (or when time steps back before it began), joins the memory once
        its last point has left the window, and leaves it ``memory_s`` after it closed."""
        start = self.step_t_
        if start is None:
            self.step_t_ = t
        elif t >= start + self.memory_step_s or t < start:
            self.pending_.append((t, n - 1, tuple(self.step_levels_.values())))
            self.step_t_, self.step_levels_ = t, {}
        self.step_levels_[s] = x
        pending, memory = self.pending_, self.memory_
        while pending and pending[0][1] <= n - self.history:
            step = pending.popleft()
            memory.append(step)
            self._remember(step[2], 1)
        while memory and memory[0][0] < t - self.memory_s:
            self._remember(memory.popleft()[2], -1)

    def _remember(self, values: tuple[float, ...], delta: int) -> None:
        for value in values:
            _count(self.remembered_, self._symbol(value), delta)

    def __getstate__(self) -> dict[str, object]:
        # Plain floats on disk: agent/persist.py's restricted unpickler admits no numpy reconstructor.
        state = dict(self.__dict__)
        if isinstance(state.get("values_"), np.ndarray):
            state["values_"] = self.values_.tolist()
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        if "values_" not in state:
            return
        values = list(state["values_"])  # type: ignore[call-overload]
        if "head_" not in state:  # saved before the ring: a deque of the window, oldest first
            self.head_, self.filled_ = len(values) % self.history, len(values)
            values += [0.0] * (self.history - len(values))
        self.values_ = np.array(values, dtype=np.float64)
        recent = self.__dict__.pop("recent_raw_", None)
        if recent is not None:  # saved before the running maximum: rebuild it from the raw novelties
            self.peaks_ = deque()
            start = self.learned_ - len(recent)
            for i, raw in enumerate(recent):
                while self.peaks_ and self.peaks_[-1][1] <= raw:
                    self.peaks_.pop()
                self.peaks_.append((start + i, raw))

    def _window(self) -> npt.NDArray[np.float64]:
        """The last ``history`` learned values, oldest first (the order of ``symbols_``)."""
        if self.filled_ < self.history:
            return self.values_[: self.filled_]
        return np.concatenate((self.values_[self.head_ :], self.values_[: self.head_]))

    def _requantise(self) -> None:
        """Re-cut the bins from the window's range when it has changed enough (module docstring).

        Vectorised (the window is up to ``history`` values): the same IEEE operations as :meth:`_symbol`
        element by element, so the symbols are identical to the scalar path's.
        """
        values = self._window()
        lo, hi = float(values.min()), float(values.max())
        remembered = [value for step in self.memory_ for value in step[2]]
        if remembered:  # a level visited within memory_s keeps its place in the range
            lo, hi = min(lo, min(remembered)), max(hi, max(remembered))
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
        symbols = np.floor(np.clip((values - self.lo_) / self.width_, -1e9, 1e9)).astype(np.int64)
        self.symbols_ = deque(symbols.tolist(), maxlen=self.history)
        occupied, counts = np.unique(symbols, return_counts=True)
        self.counts_ = dict(zip(occupied.tolist(), counts.tolist(), strict=True))
        self.remembered_ = {}
        for step in self.memory_:
            self._remember(step[2], 1)
        levels = self.step_levels_
        self.step_levels_ = {}
        for value in levels.values():  # the open step's levels, under the new bins
            self.step_levels_[self._symbol(value)] = value


def _count(table: dict[int, int], s: int, delta: int) -> None:
    """Add ``delta`` to bin ``s``'s count; a bin at 0 leaves ``table``, which holds occupied bins only."""
    n = table.get(s, 0) + delta
    if n > 0:
        table[s] = n
    else:
        table.pop(s, None)


def staggered_factory() -> Callable[[], LevelNoveltyScorer]:
    """A factory of default novelty scorers for one-scorer-per-signal detectors: the k-th scorer it makes
    gets ``phase_ = k``, so each range check and re-cut falls on its own point instead of every signal's
    landing on the same tick. Deterministic: the phase depends only on the order the scorers are made
    in. A single series (``servepilot detect``) uses phase 0."""
    counter = itertools.count()

    def make() -> LevelNoveltyScorer:
        scorer = LevelNoveltyScorer()
        scorer.phase_ = next(counter)
        return scorer

    return make
