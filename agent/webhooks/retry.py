"""Retry policy: which answers are worth another attempt, and how long to wait. Pure.

Temporary failures (connection refused or reset, timeouts, 408, 425, 429 and every 5xx) are retried
with exponential backoff and jitter; permanent ones (any other 4xx, a redirect on a POST) are not,
because sending the same bytes again cannot succeed and would only hide a misconfiguration.

Delay before attempt ``n + 1`` after ``n`` failures ("equal jitter")::

    d = min(max_s, base_s * 2 ** (n - 1))
    wait = d / 2 + U(0, d / 2)

so the wait still grows with every failure (unlike full jitter, which may retry at once) while agents
that failed together spread out over half the interval. A ``Retry-After`` of a 429/503 is honoured
when it is longer, up to ``max_s``.
"""

from __future__ import annotations

import random
from enum import StrEnum

_RETRYABLE_4XX = frozenset({408, 425, 429})


class Outcome(StrEnum):
    OK = "ok"
    RETRY = "retry"
    DROP = "dropped"


def classify(status: int | None) -> Outcome:
    """``status`` None means no HTTP answer at all (timeout, refused, reset)."""
    if status is None or status >= 500 or status in _RETRYABLE_4XX:
        return Outcome.RETRY
    if 200 <= status < 300:
        return Outcome.OK
    return Outcome.DROP


def backoff_s(failures: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Seconds to wait after the ``failures``-th consecutive failure (``failures`` >= 1)."""
    ceiling = min(max_s, base_s * 2.0 ** max(0, failures - 1))
    return ceiling / 2.0 + rng.uniform(0.0, ceiling / 2.0)


def retry_after_s(header: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header in its delta-seconds form; None for dates or garbage."""
    if not header:
        return None
    try:
        value = float(header.strip())
    except ValueError:
        return None
    return value if value >= 0 else None
