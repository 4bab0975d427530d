"""Synthetic series with known structure, small enough for a 2-core CI."""

from __future__ import annotations

import numpy as np

from detectors.forecast.series import Series

STEP_S = 1800.0  # half-hour steps: a day is 48 points, so a week of data stays tiny
PER_DAY = 48
MONDAY_S = 1_715_558_400.0  # 2024-05-13 00:00 UTC


def seasonal(days: int, noise: float = 5.0, seed: int = 0) -> Series:
    """100 + 20 sin(daily) + N(0, noise^2): the 80% interval half-width is 1.2816 * noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(days * PER_DAY)
    values = 100 + 20 * np.sin(2 * np.pi * t / PER_DAY) + rng.normal(0, noise, t.size)
    return Series.regular(MONDAY_S, STEP_S, values)
