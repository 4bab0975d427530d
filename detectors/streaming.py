"""Conventions for univariate streaming anomaly scorers, and the registry of scorers by name.

A *scorer* turns one series ``(t_0, x_0), (t_1, x_1), ...`` into anomaly scores in [0, 1], one per
point, causally: river's ``score_one`` then ``learn_one``. The rules every scorer follows (and
``tests/detectors/test_contract.py`` checks for every registered one):

* **Score first, then learn.** ``score_one(t, x)`` must not change state; ``learn_one(t, x)`` folds the
  point in. ``update(t, x)`` does both and returns the score; it is the fast path and must return exactly
  what ``score_one`` would have.
* **Causal.** The score of point i depends only on points 0..i. Nothing is ever revised.
* **Warm-up scores 0.** Until a scorer has learned ``warmup`` finite points it returns 0.0.
* **Bad points score 0 and teach nothing.** A NaN or infinite ``x`` (or ``t``) returns 0.0 and is not
  learned, so a gap in the data never poisons the state.
* **Time is data, never a clock.** ``t`` is seconds on any origin. Gaps are just larger steps, and ``t``
  may repeat or step back (NAB files do at daylight-saving changes): a scorer must not assume a fixed
  step or strictly increasing time.
* **Scores are finite and in [0, 1]**; :func:`clamp_score` is applied on the way out.
* **Deterministic.** Any randomness comes from a ``seed`` parameter.
* scikit-learn estimator conventions: ``__init__`` only stores parameters, learned state ends in ``_``.

Turning scores into alarms is a separate wrapper (:mod:`detectors.thresholds`); feeding a scorer from
snapshots is :class:`detectors.general.GeneralAnomalyDetector`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt


@runtime_checkable
class StreamingScorer(Protocol):
    """A univariate streaming anomaly scorer (see the module docstring for the contract)."""

    def score_one(self, t: float, x: float) -> float:
        """The anomaly score of ``x`` observed at ``t`` given everything learned so far; no state change."""
        ...

    def learn_one(self, t: float, x: float) -> None:
        """Fold ``(t, x)`` into the state."""
        ...

    def update(self, t: float, x: float) -> float:
        """``score_one`` then ``learn_one``; returns the score."""
        ...


def clamp_score(score: float) -> float:
    """``score`` clipped into [0, 1]; NaN becomes 0 so a numerical accident never raises an alarm."""
    if not math.isfinite(score):
        return 1.0 if score == math.inf else 0.0
    return min(1.0, max(0.0, score))


class ScorerBase:
    """Implements the contract's bookkeeping so a scorer only writes the maths.

    Subclasses implement ``_score(t, x)`` (pure) and ``_learn(t, x)``; they may override ``_update`` when
    scoring and learning share work, as long as it returns what ``_score`` would. Non-finite input,
    warm-up and clamping are handled here.
    """

    warmup: int

    def __init__(self, warmup: int = 0) -> None:
        self.warmup = warmup

    # -- subclass hooks -------------------------------------------------------------------------
    def _score(self, t: float, x: float) -> float:
        raise NotImplementedError

    def _learn(self, t: float, x: float) -> None:
        raise NotImplementedError

    def _update(self, t: float, x: float) -> float:
        score = self._score(t, x)
        self._learn(t, x)
        return score

    # -- the contract ---------------------------------------------------------------------------
    @property
    def n_seen(self) -> int:
        """Finite points learned so far."""
        return getattr(self, "n_seen_", 0)

    def score_one(self, t: float, x: float) -> float:
        if not (math.isfinite(t) and math.isfinite(x)):
            return 0.0
        score = self._score(t, x)
        return 0.0 if self.n_seen < self.warmup else clamp_score(score)

    def learn_one(self, t: float, x: float) -> None:
        if not (math.isfinite(t) and math.isfinite(x)):
            return
        self._learn(t, x)
        self.n_seen_ = self.n_seen + 1

    def update(self, t: float, x: float) -> float:
        if not (math.isfinite(t) and math.isfinite(x)):
            return 0.0
        warm = self.n_seen >= self.warmup
        score = self._update(t, x)
        self.n_seen_ = self.n_seen + 1
        return clamp_score(score) if warm else 0.0


def score_series(
    scorer: StreamingScorer, times: Iterable[float], values: Iterable[float]
) -> npt.NDArray[np.float64]:
    """Run ``scorer`` over a whole series in order (the offline path of ``servepilot detect``)."""
    return np.fromiter(
        (scorer.update(float(t), float(x)) for t, x in zip(times, values, strict=True)), dtype=np.float64
    )


@dataclass(frozen=True)
class ScorerRegistration:
    factory: Callable[[], StreamingScorer]
    default_enabled: bool
    description: str


#: Univariate scorers by name, filled by :func:`detectors.registry.register_defaults`. The contract test
#: runs over every entry; ``servepilot detect --detector NAME`` picks from it.
SCORERS: dict[str, ScorerRegistration] = {}


def register_scorer(
    name: str, factory: Callable[[], StreamingScorer], *, default_enabled: bool, description: str
) -> None:
    """Add a scorer under ``name``; a duplicate name is a programming error."""
    if name in SCORERS:
        raise ValueError(f"scorer {name!r} is already registered")
    SCORERS[name] = ScorerRegistration(factory, default_enabled, description)
