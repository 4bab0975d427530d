"""Small numerical pieces shared by the domain detectors (leak, scheduler, tail latency, thermal).

Kept apart from :mod:`detectors.thresholds` and :mod:`detectors.baseline` (the general-purpose scorers'
toolkit) because these are the specific tools the domain detectors explain their findings with: an
online linear model with forgetting, a k-of-n persistence gate, a robust slope, and helpers that find
per-GPU signal names in a flat snapshot.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from detectors.base import Finding
from detectors.snapshot import Snapshot

FloatArray = npt.NDArray[np.float64]
T = TypeVar("T")

_GPU = re.compile(r"^nvml\.gpu(\d+)\.")


def gpu_indices(snapshot: Snapshot) -> list[int]:
    """GPU indices that appear in any ``nvml.gpu<i>.*`` signal of ``snapshot``, sorted."""
    found = {int(m.group(1)) for name in snapshot.values if (m := _GPU.match(name))}
    return sorted(found)


class PerNameSet(Generic[T]):
    """``compute(snapshot)``, recomputed only when the snapshot's *set* of signal names changes.

    For the per-name decisions a detector makes over the whole scrape (which names match its pattern,
    which GPUs exist): a tick normally carries the same ~320 names as the one before, so the regex
    scan runs once per change of the name set instead of every tick. ``compute`` must depend only on
    the names, not on the values.
    """

    def __init__(self, compute: Callable[[Snapshot], T]) -> None:
        self.compute = compute
        self._keys: frozenset[str] | None = None
        self._value: T | None = None

    def __call__(self, snapshot: Snapshot) -> T:
        keys = snapshot.values.keys()
        if self._keys is None or keys != self._keys:
            self._value = self.compute(snapshot)
            self._keys = frozenset(keys)
        return self._value  # type: ignore[return-value]


def mean_of(snapshot: Snapshot, names: Iterable[str]) -> float | None:
    """Mean of the signals in ``names`` that are present, or ``None`` when none is."""
    values = [v for n in names if (v := snapshot.get(n)) is not None]
    return sum(values) / len(values) if values else None


def finite(value: float | None) -> bool:
    """True for a real number (not ``None``, NaN or infinity)."""
    return value is not None and math.isfinite(value)


class RecursiveLeastSquares:
    r"""Online linear regression with exponential forgetting.

    Model :math:`y_t = w^\top x_t + \varepsilon_t`. With forgetting factor :math:`\lambda \in (0, 1]`
    (effective memory :math:`1/(1-\lambda)` observations) the standard RLS update is

    .. math::
        k_t = \frac{P_{t-1} x_t}{\lambda + x_t^\top P_{t-1} x_t}, \quad
        w_t = w_{t-1} + k_t (y_t - w_{t-1}^\top x_t), \quad
        P_t = \frac{P_{t-1} - k_t x_t^\top P_{t-1}}{\lambda}.

    :math:`P` starts at :math:`\delta I` (a weak prior around :math:`w = 0`). The residual scale is an
    exponentially weighted mean of squared *prior* residuals (scored before learning), so
    ``residual_std`` measures honest one-step-ahead error. ``P`` is symmetrised and bounded each step
    so a long run of identical inputs (an idle engine) cannot make it blow up.
    """

    def __init__(self, n_features: int, forgetting: float = 0.999, delta: float = 100.0) -> None:
        self.n_features = n_features
        self.forgetting = forgetting
        self.delta = delta
        # Plain floats, not numpy: with 2-4 features numpy's per-call overhead (~14 us a step) dwarfs
        # the arithmetic (~3 us in CPython); tests check the two agree.
        self._w: list[float] = [0.0] * n_features
        self._p: list[list[float]] = [
            [delta if i == j else 0.0 for j in range(n_features)] for i in range(n_features)
        ]
        self.n_: int = 0
        self.resid_var_: float = 0.0

    @property
    def w_(self) -> FloatArray:
        """The weights :math:`w` (a copy)."""
        return np.array(self._w)

    @property
    def p_(self) -> FloatArray:
        """The scaled inverse covariance :math:`P` (a copy)."""
        return np.array(self._p)

    def predict(self, x: Sequence[float] | FloatArray) -> float:
        """:math:`w^\\top x` under the current weights."""
        xs = x.tolist() if isinstance(x, np.ndarray) else x
        return _dot(self._w, xs)

    @property
    def residual_std(self) -> float:
        """Exponentially weighted RMS of the one-step-ahead residuals seen so far."""
        return math.sqrt(self.resid_var_)

    def learn(self, x: Sequence[float] | FloatArray, y: float) -> None:
        """Fold one observation in; non-finite input is ignored."""
        xs: list[float] = x.tolist() if isinstance(x, np.ndarray) else [float(v) for v in x]
        if not (math.isfinite(y) and all(math.isfinite(v) for v in xs)):
            return
        lam, p, w = self.forgetting, self._p, self._w
        err = y - _dot(w, xs)
        alpha = max(0.01, 1.0 - lam) if self.n_ >= 10 else 1.0 / (self.n_ + 1)
        self.resid_var_ += alpha * (err * err - self.resid_var_)
        px = [_dot(row, xs) for row in p]
        denom = lam + _dot(xs, px)
        gain = [v / denom for v in px]
        self._w = [wi + gi * err for wi, gi in zip(w, gain, strict=True)]
        n = self.n_features
        q = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        # Symmetrise, and bound the covariance: forgetting with unexciting input ("wind-up") would grow
        # it without limit.
        bound = 1e6 * self.delta
        for i in range(n):
            qi = q[i]
            for j in range(i, n):
                v = 0.5 * (qi[j] + q[j][i])
                v = bound if v > bound else -bound if v < -bound else v
                qi[j] = q[j][i] = v
        self._p = q
        self.n_ += 1


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    total = 0.0
    for ai, bi in zip(a, b, strict=True):
        total += ai * bi
    return total


class KOfN:
    """Alarm persistence: raise only when at least ``k`` of the last ``n`` checks were positive.

    One bad tick is noise; three of five is a condition. The same gate clears the alarm, so a finding
    does not flap when the signal hovers at its threshold.
    """

    def __init__(self, k: int = 3, n: int = 5) -> None:
        if not 1 <= k <= n:
            raise ValueError(f"k must be in [1, n], got k={k}, n={n}")
        self.k = k
        self.n = n
        self._hits: deque[bool] = deque(maxlen=n)
        self.since_: float | None = None

    def push(self, hit: bool, now: float) -> bool:
        """Record one check at ``now``; return whether the alarm is active."""
        self._hits.append(hit)
        active = sum(self._hits) >= self.k
        if active and self.since_ is None:
            self.since_ = now
        elif not active:
            self.since_ = None
        return active

    @property
    def hits(self) -> int:
        """Positive checks among the last ``n``."""
        return sum(self._hits)

    def since(self, default: float) -> float:
        """When the current alarm episode started (``default`` when none is active)."""
        return self.since_ if self.since_ is not None else default


class WindowMax:
    """The largest value pushed over the last ``window_s`` (the newest included), in O(1) amortised time
    per push: a deque of the values not yet surpassed, oldest and largest first."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._kept: deque[tuple[float, float]] = deque()

    def push(self, now: float, value: float) -> float:
        """Add ``value`` at ``now``; the window's maximum."""
        kept = self._kept
        while kept and kept[-1][1] <= value:
            kept.pop()
        kept.append((now, value))
        while kept[0][0] <= now - self.window_s:
            kept.popleft()
        return kept[0][1]


ENGINE_STARTED = "engine.process_start_time_seconds"
"""The engine's process start time (agent/collectors/engine_metrics.py, where its ``/metrics`` says it:
vLLM, SGLang): when it moves, the engine restarted."""


class RestartWatch:
    """When the engine last restarted (its process start time moved), from the snapshots fed to it. A
    restarted engine runs cold for minutes: its load falls and comes back, its levels move, its
    throughput per batch is lower, and the detectors that see it say so as the restart's, not a fault's."""

    __slots__ = ("restarted_at", "started")

    def __init__(self) -> None:
        self.started: float | None = None
        self.restarted_at: float | None = None

    def feed(self, snapshot: Snapshot) -> bool:
        """True on the tick the start time moved; the first one seen is no restart."""
        started = snapshot.get(ENGINE_STARTED)
        if started is None:
            return False
        before, self.started = self.started, started
        if before is None or started == before:
            return False
        self.restarted_at = snapshot.now
        return True

    def within(self, now: float, window_s: float) -> float | None:
        """Seconds since the last restart when under ``window_s``, else None."""
        if self.restarted_at is None or now - self.restarted_at >= window_s:
            return None
        return now - self.restarted_at


class LastHit:
    """What a :class:`KOfN` alarm shows on a check it holds through: its last positive check's finding.

    Three of the last five checks keep the alarm up, so two of its ticks may measure a value back inside
    the threshold. A finding built from that value read as a contradiction ("12% wasted, threshold 15%";
    "throughput 3% *above* expected is -3% below") and had score 0, so the exported score and the
    webhook dropped while the alarm stood. The last hit's finding is shown instead, unchanged but for a
    note of the value now (in the summary and as ``evidence["now"]``) and ``evidence["held"] = "yes"``.
    """

    def __init__(self) -> None:
        self.finding: Finding | None = None

    def clear(self) -> None:
        """The gate is down: forget the last hit (called instead of :meth:`show`, so a tick with no alarm
        builds nothing)."""
        self.finding = None

    def show(self, gate: KOfN, hit: bool, build: Callable[[], Finding], now: str) -> Finding:
        """The finding for a check while ``gate`` is up: ``build()`` on a hit, the last hit held on a miss.
        ``now`` says what this check measured."""
        if hit or self.finding is None:
            self.finding = build()
            return self.finding
        last = self.finding
        return dataclasses.replace(
            last,
            summary=f"{last.summary} (alarm held: {gate.hits} of the last {gate.n} checks; now {now})",
            evidence={**last.evidence, "held": "yes", "now": now},
        )


def robust_slope(t: FloatArray, y: FloatArray, alpha: float = 0.95) -> tuple[float, float, float]:
    """Theil-Sen slope of ``y`` against ``t`` with its ``alpha`` confidence interval (Sen 1968).

    The slope is the median of all pairwise slopes :math:`(y_j - y_i)/(t_j - t_i)`, so up to ~29% of
    outlying points (a burst, a step that is later released) cannot drag it. Returns
    ``(slope, low, high)``.
    """
    # imported here: scipy.stats takes ~0.7 s to import, which every start-up (the CLI, the sidecar building
    # its detectors while the demo's in-process simulator waits on the same event loop) would pay at once
    from scipy.stats import theilslopes

    result = theilslopes(y, t, alpha)
    return float(result.slope), float(result.low_slope), float(result.high_slope)
