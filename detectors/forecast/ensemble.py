"""An equal-weight ensemble behind the same Forecaster Protocol, so the agent can run what the selector
picked whether it is one model or several.

Point forecast: the mean of the members' point forecasts. Quantiles: the mean of the members' quantiles
at each level (Vincentisation), which keeps intervals as wide as the members agree they should be.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import ArrayLike

from detectors.forecast.base import Forecast, Forecaster
from detectors.forecast.series import Series


class Ensemble:
    """Fits, updates and forecasts every member; combines their forecasts with equal weights."""

    def __init__(self, members: Sequence[Forecaster], name: str | None = None) -> None:
        if not members:
            raise ValueError("an ensemble needs at least one member")
        self.members = list(members)
        self.name = name or "ensemble(" + "+".join(m.name for m in self.members) + ")"

    def fit(self, series: Series) -> Ensemble:
        for member in self.members:
            member.fit(series)
        return self

    def update(self, points: Iterable[tuple[float, float]]) -> None:
        batch = list(points)
        for member in self.members:
            member.update(batch)

    def extend(self, values: ArrayLike) -> None:
        for member in self.members:
            member.extend(values)

    def forecast(self, steps: int) -> Forecast:
        forecasts = [member.forecast(steps) for member in self.members]
        levels = set.intersection(*(set(f.quantiles) for f in forecasts))
        return Forecast(
            forecasts[0].start_s,
            forecasts[0].step_s,
            np.mean([f.mean for f in forecasts], axis=0),
            {q: np.mean([f.quantiles[q] for f in forecasts], axis=0) for q in sorted(levels)},
        )
