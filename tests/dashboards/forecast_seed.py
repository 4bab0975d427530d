"""Seed the live forecaster's saved state so forecasts exist from the first tick.

A live agent needs at least two closed minutes (and, for the seasonal models, days) before
``servepilot_forecast_*`` appears. Tests that check the exported surface cannot wait that long, so they
write the state file the agent restores at start (:meth:`agent.forecasting.LiveForecaster.restore`):
per-minute request rates from a real trace, the ``last_value`` model (the only candidate that fits a few
hours of history), a learned capacity, and ``last_refit_s = now`` so no backtest runs during the test.
This is the same path a restarted agent takes; nothing in the agent is bypassed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from agent.forecast_state import VERSION


def minute_rates(trace: np.ndarray, speed: float = 1.0) -> list[float]:
    """Requests per second in each minute of a ``[timestamp_s, in, out]`` trace replayed at ``speed``."""
    t = np.asarray(trace, dtype=float)[:, 0] / speed
    counts = np.bincount(((t - t[0]) // 60.0).astype(int))
    return [float(c) / 60.0 for c in counts]


def write_forecast_state(
    path: Path,
    now: float,
    rates: list[float],
    *,
    minutes: int = 240,
    capacity_rps: float = 5.0,
    tokens_per_request: float = 300.0,
    model: str = "last_value",
) -> Path:
    """Write ``minutes`` of history ending at the minute before ``now`` (``rates`` repeated)."""
    start = math.floor(now / 60.0) - minutes
    values = [rates[i % len(rates)] for i in range(minutes)]
    document = {
        "version": VERSION,
        "saturated_capacity_rps": capacity_rps,
        "last_refit_s": now,
        "tracks": {
            "requests_per_second": {"start_min": start, "values": values, "model_name": model},
            "tokens_per_second": {
                "start_min": start,
                "values": [v * tokens_per_request for v in values],
                "model_name": model,
            },
        },
    }
    path.write_text(json.dumps(document), encoding="utf-8")
    return path
