r"""Cost per 1k tokens and energy per token, from the snapshot the loop already builds. Pure.

Over a sliding window of ``window_s`` seconds (per-tick ratios swing wildly with batch composition),
with tick length :math:`\Delta t_i`, generation rate :math:`r_i` (``engine.generation_tokens_per_second``)
and board power :math:`P_i = \sum_g` ``nvml.gpu<g>.power_watts.mean``:

.. math::
    \text{tokens} = \sum_i r_i \Delta t_i, \qquad
    E = \sum_i P_i \Delta t_i, \qquad
    \text{cost per 1k} = 1000 \cdot \frac{\text{price}_{\text{GPU-h}} \cdot G \cdot \sum_i \Delta t_i / 3600}
                                          {\text{tokens}}, \qquad
    \text{energy per token} = E / \text{tokens}

``G`` is the number of GPUs seen in the snapshot (or ``gpus`` when NVML is absent). Tokens are generated
(output) tokens, the basis on which serving capacity is usually priced. The signals are absent, never
Inf or NaN, when the window holds fewer than ``min_tokens`` tokens (an idle engine has no meaningful cost
per token), and energy per token is absent without power readings.

Published as ``cost.per_1k_tokens_usd`` and ``cost.energy_joules_per_token`` (the exporter names them
``servepilot_cost_per_1k_tokens`` and ``servepilot_energy_joules_per_token``).
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Mapping

_POWER = re.compile(r"^nvml\.gpu(\d+)\.power_watts\.mean$")
GENERATION_RATE = "engine.generation_tokens_per_second"


class CostTracker:
    """Windowed cost and energy per token; ``update(values, now)`` once per tick."""

    def __init__(
        self,
        price_per_gpu_hour_usd: float | None,
        gpus: int = 1,
        window_s: float = 300.0,
        min_tokens: float = 100.0,
        max_gap_s: float = 30.0,
    ) -> None:
        if price_per_gpu_hour_usd is not None and not (
            math.isfinite(price_per_gpu_hour_usd) and price_per_gpu_hour_usd >= 0
        ):
            raise ValueError(f"price_per_gpu_hour_usd must be finite and >= 0, got {price_per_gpu_hour_usd}")
        if gpus < 1 or window_s <= 0:
            raise ValueError(f"gpus must be >= 1 and window_s > 0, got {gpus} and {window_s}")
        self.price = price_per_gpu_hour_usd
        self.gpus = gpus
        self.window_s = window_s
        self.min_tokens = min_tokens
        self.max_gap_s = max_gap_s
        # (end time, dt, tokens, joules or NaN, gpu count)
        self._ticks: deque[tuple[float, float, float, float, int]] = deque(maxlen=100_000)
        self._last: float | None = None

    def update(self, values: Mapping[str, float], now: float) -> dict[str, float]:
        """Account the tick ending at ``now`` and return the cost signals (possibly none)."""
        last, self._last = self._last, now
        rate = values.get(GENERATION_RATE)
        if last is None or now <= last or rate is None or not math.isfinite(rate) or rate < 0:
            return self._values(now)
        dt = min(now - last, self.max_gap_s)  # a long gap (agent paused) is not billed as traffic
        powers = [v for k, v in values.items() if _POWER.match(k) and math.isfinite(v) and v >= 0]
        joules = sum(powers) * dt if powers else math.nan
        self._ticks.append((now, dt, rate * dt, joules, len(powers) or self.gpus))
        return self._values(now)

    def _values(self, now: float) -> dict[str, float]:
        while self._ticks and self._ticks[0][0] <= now - self.window_s:
            self._ticks.popleft()
        tokens = sum(t[2] for t in self._ticks)
        if tokens < self.min_tokens:
            return {}
        out: dict[str, float] = {}
        if self.price is not None:
            gpu_hours = sum(t[1] * t[4] for t in self._ticks) / 3600.0
            out["cost.per_1k_tokens_usd"] = 1000.0 * self.price * gpu_hours / tokens
        metered = [t for t in self._ticks if not math.isnan(t[3])]
        metered_tokens = sum(t[2] for t in metered)
        if metered and metered_tokens >= self.min_tokens:
            out["cost.energy_joules_per_token"] = sum(t[3] for t in metered) / metered_tokens
        return out
