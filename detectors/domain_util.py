"""Small numerical pieces shared by the domain detectors (leak, scheduler, tail latency, thermal).

Kept apart from :mod:`detectors.thresholds` and :mod:`detectors.baseline` (the general-purpose scorers'
toolkit) because these are the specific tools the domain detectors explain their findings with: an
online linear model with forgetting, a k-of-n persistence gate, a robust slope, and helpers that find
per-GPU signal names in a flat snapshot.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
from scipy.stats import theilslopes

from detectors.snapshot import Snapshot

FloatArray = npt.NDArray[np.float64]

_GPU = re.compile(r"^nvml\.gpu(\d+)\.")


def gpu_indices(snapshot: Snapshot) -> list[int]:
    """GPU indices that appear in any ``nvml.gpu<i>.*`` signal of ``snapshot``, sorted."""
    found = {int(m.group(1)) for name in snapshot.values if (m := _GPU.match(name))}
    return sorted(found)


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
        self.w_: FloatArray = np.zeros(n_features)
        self.p_: FloatArray = np.eye(n_features) * delta
        self.n_: int = 0
        self.resid_var_: float = 0.0

    def predict(self, x: Sequence[float] | FloatArray) -> float:
        """:math:`w^\\top x` under the current weights."""
        return float(np.dot(self.w_, np.asarray(x, dtype=np.float64)))

    @property
    def residual_std(self) -> float:
        """Exponentially weighted RMS of the one-step-ahead residuals seen so far."""
        return math.sqrt(self.resid_var_)

    def learn(self, x: Sequence[float] | FloatArray, y: float) -> None:
        """Fold one observation in; non-finite input is ignored."""
        xv = np.asarray(x, dtype=np.float64)
        if not (math.isfinite(y) and bool(np.all(np.isfinite(xv)))):
            return
        err = y - float(np.dot(self.w_, xv))
        alpha = max(0.01, 1.0 - self.forgetting) if self.n_ >= 10 else 1.0 / (self.n_ + 1)
        self.resid_var_ += alpha * (err * err - self.resid_var_)
        px = self.p_ @ xv
        gain = px / (self.forgetting + float(xv @ px))
        self.w_ = self.w_ + gain * err
        p = (self.p_ - np.outer(gain, px)) / self.forgetting
        p = 0.5 * (p + p.T)
        # Bound the covariance: forgetting with unexciting input ("wind-up") would grow it without limit.
        np.clip(p, -1e6 * self.delta, 1e6 * self.delta, out=p)
        self.p_ = p
        self.n_ += 1


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

    def since(self, default: float) -> float:
        """When the current alarm episode started (``default`` when none is active)."""
        return self.since_ if self.since_ is not None else default


def robust_slope(t: FloatArray, y: FloatArray, alpha: float = 0.95) -> tuple[float, float, float]:
    """Theil-Sen slope of ``y`` against ``t`` with its ``alpha`` confidence interval (Sen 1968).

    The slope is the median of all pairwise slopes :math:`(y_j - y_i)/(t_j - t_i)`, so up to ~29% of
    outlying points (a burst, a step that is later released) cannot drag it. Returns
    ``(slope, low, high)``.
    """
    result = theilslopes(y, t, alpha)
    return float(result.slope), float(result.low_slope), float(result.high_slope)
