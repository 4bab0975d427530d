"""A small LSTM quantile forecaster (torch, CPU, imported lazily so the agent starts without it).

For a forecast from origin ``t`` (values ``y_0 .. y_{t-1}`` known) the network sees

* the last ``lookback`` values ``z = (log1p(y) - mu) / sd`` with the hour of day (sin, cos) of each step,
  read by a one-layer LSTM;
* the same window one season earlier, ``z_{t-m} .. z_{t-m+H-1}`` (yesterday's shape of the next hour),
  relative to the last value and relative to ``z_{t-m-1}`` (yesterday's change from this time of day);
  zeros when less than a season is known;
* the calendar of the origin: hour of day and day of week as sin/cos, and a weekend flag.

A linear head outputs ``H x Q`` values read as ``z_{t+k} - z_{t-1}`` at each quantile ``q``, trained with
the pinball loss ``max(q * e, (q - 1) * e)``, so intervals are learned directly; crossing quantiles are
sorted. Training is seeded and single-threaded by default (reproducible on a shared machine). With
``warm_start=True`` a second ``fit`` continues from the current weights for ``retrain_epochs`` on the most
recent ``train_window_s`` (incremental retraining). ``save`` writes atomically (temp file + ``os.replace``,
detectors/atomic_file.py); ``LSTMForecaster.load`` restores a forecaster that gives identical forecasts.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from detectors.atomic_file import write_atomically
from detectors.forecast.base import DEFAULT_QUANTILES, BaseForecaster
from detectors.forecast.naive import DAY_S
from detectors.forecast.series import FloatArray

_CALENDAR = 5


def calendar_features(times_s: FloatArray) -> FloatArray:
    """(n, 5): sin/cos hour of day, sin/cos day of week, weekend flag (times are read as UTC)."""
    day = 2 * np.pi * (times_s % DAY_S) / DAY_S
    weekday = (np.floor(times_s / DAY_S) + 3) % 7  # 1970-01-01 was a Thursday; Monday = 0
    week = 2 * np.pi * weekday / 7
    weekend = (weekday >= 5).astype(np.float64)
    return np.stack([np.sin(day), np.cos(day), np.sin(week), np.cos(week), weekend], axis=1)


def _build_network(lookback: int, horizon: int, hidden: int, n_quantiles: int) -> Any:
    import torch
    from torch import nn

    class Network(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(input_size=3, hidden_size=hidden, batch_first=True)
            self.head = nn.Sequential(
                nn.Linear(hidden + 2 * horizon + _CALENDAR, 2 * hidden),
                nn.ReLU(),
                nn.Linear(2 * hidden, horizon * n_quantiles),
            )

        def forward(self, seq: torch.Tensor, lag: torch.Tensor, cal: torch.Tensor) -> torch.Tensor:
            _, (state, _) = self.lstm(seq)
            out: torch.Tensor = self.head(torch.cat([state[-1], lag, cal], dim=1))
            return out.view(-1, horizon, n_quantiles)

    return Network()


class LSTMForecaster(BaseForecaster):
    """Multi-horizon LSTM with learned quantiles; forecasts at most ``horizon`` steps."""

    name = "lstm"

    def __init__(
        self,
        *,
        lookback: int = 60,
        horizon: int = 60,
        hidden: int = 32,
        epochs: int = 15,
        retrain_epochs: int = 5,
        batch_size: int = 256,
        learning_rate: float = 3e-3,
        period_s: float = DAY_S,
        train_window_s: float = 7 * DAY_S,
        warm_start: bool = True,
        day_of_week: bool = True,
        seed: int = 0,
        threads: int = 1,
        quantiles: Sequence[float] = DEFAULT_QUANTILES,
        max_gap_steps: int = 5,
    ) -> None:
        super().__init__(quantiles, max_gap_steps)
        self.lookback, self.horizon, self.hidden = lookback, horizon, hidden
        self.epochs, self.retrain_epochs, self.batch_size = epochs, retrain_epochs, batch_size
        self.learning_rate, self.period_s, self.train_window_s = learning_rate, period_s, train_window_s
        self.warm_start, self.seed, self.threads = warm_start, seed, threads
        self.day_of_week = day_of_week

    @property
    def min_history(self) -> int:  # type: ignore[override]
        return self.lookback + self.horizon + 1

    def get_params(self) -> dict[str, Any]:
        keys: tuple[str, ...] = ("lookback", "horizon", "hidden", "epochs", "retrain_epochs", "batch_size")
        keys += (
            "learning_rate",
            "period_s",
            "train_window_s",
            "warm_start",
            "day_of_week",
            "seed",
            "threads",
            "max_gap_steps",
        )
        return {key: getattr(self, key) for key in keys} | {"quantiles": list(self.quantiles)}

    # -- learning -------------------------------------------------------------------------------------------
    def _fit(self, values: FloatArray) -> None:
        import torch

        torch.set_num_threads(self.threads)
        self.period_steps_ = max(1, round(self.period_s / self.step_s_))
        log = np.log1p(np.maximum(values, 0.0))
        warm = self.warm_start and hasattr(self, "network_")
        if not warm:
            self.mu_, self.sd_ = float(log.mean()), float(log.std()) or 1.0
            torch.manual_seed(self.seed)
            self.network_ = _build_network(self.lookback, self.horizon, self.hidden, len(self.quantiles))
            self.fits_ = 0
        z = (log - self.mu_) / self.sd_
        times = self.start_s_ + self.step_s_ * np.arange(len(z), dtype=np.float64)
        window = round(self.train_window_s / self.step_s_) if warm else len(z)
        first = max(self.lookback, len(z) - window)
        if len(z) - self.horizon - self.period_steps_ >= self.period_steps_:
            first = max(first, self.period_steps_ + 1)  # a day of samples with a full seasonal lag suffices
        origins = np.arange(first, len(z) - self.horizon + 1)
        if origins.size == 0:
            raise ValueError(f"{self.name}: too little history to train (need > {self.min_history} points)")
        self._train(z, times, origins, self.retrain_epochs if warm else self.epochs)
        self.fits_ += 1
        self.history_ = z[-(self.period_steps_ + self.lookback) :].copy()

    def _train(self, z: FloatArray, times: FloatArray, origins: np.ndarray[Any, Any], epochs: int) -> None:
        import torch

        seq, lag, cal = (torch.from_numpy(a).float() for a in self._inputs(z, times, origins))
        offsets = origins[:, None] + np.arange(self.horizon)[None, :]
        target = torch.from_numpy(z[offsets] - z[origins - 1][:, None]).float()
        levels = torch.tensor(self.quantiles).float()
        generator = torch.Generator().manual_seed(self.seed + getattr(self, "fits_", 0))
        optimiser = torch.optim.Adam(self.network_.parameters(), lr=self.learning_rate)
        self.network_.train()
        for _ in range(epochs):
            for batch in torch.randperm(len(origins), generator=generator).split(self.batch_size):  # type: ignore[no-untyped-call]
                error = target[batch].unsqueeze(-1) - self.network_(seq[batch], lag[batch], cal[batch])
                loss = torch.maximum(levels * error, (levels - 1) * error).mean()
                optimiser.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                optimiser.step()
        self.network_.eval()

    def _inputs(
        self, z: FloatArray, times: FloatArray, origins: np.ndarray[Any, Any]
    ) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Encoder sequence (n, L, 3), seasonal-lag window (n, H) and origin calendar (n, 5)."""
        steps = origins[:, None] + np.arange(-self.lookback, 0)[None, :]
        step_times = times[0] + self.step_s_ * steps
        day = 2 * np.pi * (step_times % DAY_S) / DAY_S
        seq = np.stack([z[steps], np.sin(day), np.cos(day)], axis=2)
        lag_index = origins[:, None] - self.period_steps_ + np.arange(self.horizon)[None, :]
        known = (lag_index >= 0) & (lag_index < origins[:, None])
        lagged = z[np.clip(lag_index, 0, None)]
        anchor = z[np.clip(origins - self.period_steps_ - 1, 0, None)][:, None]
        lag = np.concatenate(
            (np.where(known, lagged - z[origins - 1][:, None], 0.0), np.where(known, lagged - anchor, 0.0)),
            axis=1,
        )
        cal = calendar_features(times[0] + self.step_s_ * origins.astype(np.float64))
        if not self.day_of_week:
            cal[:, 2:] = 0.0
        return seq, lag, cal

    # -- streaming ------------------------------------------------------------------------------------------
    def _extend(self, values: FloatArray) -> None:
        z = (np.log1p(np.maximum(values, 0.0)) - self.mu_) / self.sd_
        self.history_ = np.concatenate((self.history_, z))[-(self.period_steps_ + self.lookback) :]

    def _predict(self, steps: int) -> tuple[FloatArray, dict[float, FloatArray]]:
        import torch

        if steps > self.horizon:
            raise ValueError(f"{self.name} forecasts at most {self.horizon} steps, asked for {steps}")
        torch.set_num_threads(self.threads)
        z = self.history_
        first_time = self.end_s - self.step_s_ * len(z)
        times = first_time + self.step_s_ * np.arange(len(z), dtype=np.float64)
        seq, lag, cal = (torch.from_numpy(a).float() for a in self._inputs(z, times, np.array([len(z)])))
        with torch.no_grad():
            out = self.network_(seq, lag, cal)[0].numpy().astype(np.float64)[:steps]
        out = np.sort(out, axis=1) + z[-1]
        values = np.expm1(np.clip(out * self.sd_ + self.mu_, -50.0, 50.0))
        quantiles = {q: values[:, i] for i, q in enumerate(self.quantiles)}
        median = int(np.argmin([abs(q - 0.5) for q in self.quantiles]))
        return values[:, median], quantiles

    # -- persistence ----------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the whole forecaster state atomically: a crash leaves the old file or the new one."""
        import torch

        self._check_fitted()
        state = {
            "params": self.get_params(),
            "network": self.network_.state_dict(),
            "history": torch.from_numpy(self.history_.copy()),
            "scalars": {key: getattr(self, key) for key in _SCALARS},
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        write_atomically(path, buffer.getvalue(), prefix=".lstm-")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LSTMForecaster:
        """Restore a forecaster written by :meth:`save` (``weights_only``: no code is unpickled)."""
        import torch

        state = torch.load(path, weights_only=True)
        params = dict(state["params"])
        forecaster = cls(**params)
        for key, value in state["scalars"].items():
            setattr(forecaster, key, value)
        forecaster.network_ = _build_network(
            forecaster.lookback, forecaster.horizon, forecaster.hidden, len(forecaster.quantiles)
        )
        forecaster.network_.load_state_dict(state["network"])
        forecaster.network_.eval()
        forecaster.history_ = state["history"].numpy().astype(np.float64)
        return forecaster


_SCALARS = (
    "start_s_",
    "step_s_",
    "n_seen_",
    "last_value_",
    "gaps_filled_",
    "mu_",
    "sd_",
    "period_steps_",
    "fits_",
)
