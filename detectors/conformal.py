"""A sliding window of recent values kept sorted, for rank (conformal) p-values and quantiles.

For a new value ``a`` and the last ``n`` values ``v_1..v_n`` the upper-tail conformal p-value is
``p = (#{v_i >= a} + 1) / (n + 1)``: distribution-free, so the same threshold means the same thing on
CPU percent, bytes per second or temperatures. Insert and delete are ``bisect`` on a Python list
(O(n) memmove, microseconds for the few thousand values kept), lookups O(log n).
"""

from __future__ import annotations

import bisect
from collections import deque


class RankWindow:
    """The last ``size`` values, sorted (see the module docstring)."""

    def __init__(self, size: int = 3000) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self._sorted: list[float] = []
        self._fifo: deque[float] = deque()

    def __len__(self) -> int:
        return len(self._sorted)

    def p_upper(self, a: float) -> float:
        """Conformal p-value of ``a`` being this large (1.0 on an empty window)."""
        n = len(self._sorted)
        return (n - bisect.bisect_left(self._sorted, a) + 1) / (n + 1)

    def quantile(self, q: float) -> float:
        """The empirical ``q``-quantile (lower); the window must not be empty."""
        n = len(self._sorted)
        return self._sorted[min(n - 1, max(0, int(q * n)))]

    def add(self, a: float) -> None:
        bisect.insort(self._sorted, a)
        self._fifo.append(a)
        if len(self._fifo) > self.size:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
