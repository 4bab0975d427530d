"""Distribution change: relative entropy of the recent window against the long-run distribution.

Bins are the deciles of the long-run history (re-cut every ``refresh`` points), so under "nothing
changed" each of the ``B`` bins should hold 1/B of the recent window. With ``p_b`` the share of the last
``window`` values in bin b (add-half smoothed), the divergence is::

    D = sum_b p_b * log(p_b * B)        (= KL(recent || uniform over history deciles), >= 0)

A level shift, a new spike regime or a variance change moves mass between deciles and raises D;
a single outlier moves 1/window of it. This is the idea of Wang et al.'s relative-entropy detector
(NAB's "Relative Entropy"), made scale-free by the quantile binning.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

from detectors.conformal import RankWindow


class DistributionShift:
    """Streaming relative entropy of the last ``window`` values (see the module docstring)."""

    def __init__(self, window: int = 48, bins: int = 10, refresh: int = 50) -> None:
        self.window = window
        self.bins = bins
        self.refresh = refresh
        self.recent_: deque[float] = deque(maxlen=window)
        self.edges_: list[float] | None = None
        self.learned_ = 0

    def divergence(self, x: float) -> float:
        """D for the recent window with ``x`` appended (pure); 0 before bins exist."""
        if self.edges_ is None:
            return 0.0
        counts = [0] * self.bins
        values = list(self.recent_)[-(self.window - 1) :] if self.window > 1 else []
        values.append(x)
        for v in values:
            counts[bisect.bisect_right(self.edges_, v)] += 1
        total = len(values) + 0.5 * self.bins
        return sum((c + 0.5) / total * math.log((c + 0.5) / total * self.bins) for c in counts)

    def learn(self, x: float, history: RankWindow) -> None:
        """Append ``x``; re-cut the bins from ``history`` (the long-run values) every ``refresh`` points."""
        self.recent_.append(x)
        self.learned_ += 1
        if len(history) and (self.edges_ is None or self.learned_ % self.refresh == 0):
            self.edges_ = [history.quantile(i / self.bins) for i in range(1, self.bins)]
