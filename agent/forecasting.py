"""The live forecaster: 1-minute request and token rates, forecasts 5-60 minutes ahead, replica advice.

Each tick the loop hands it the snapshot (:meth:`LiveForecaster.observe`, microseconds): the request rate
(demand: the sum of the gate's per-bucket rates plus ``gate.shed_per_second``, else
``engine.requests_finished_per_second``) and the token rate (``engine.prompt_tokens_per_second +
engine.generation_tokens_per_second``) are averaged into 1-minute points. When a minute closes the current
model is updated in O(1) and forecasts once; :meth:`signals` returns the cached result as a
:class:`Reading` named ``forecast``::

    forecast.requests_per_second.h30m.q0.5   forecast.tokens_per_second.h30m.q0.9  (each horizon x quantile)
    forecast.backtest_mase.<model>.h30m      forecast.recommended_replicas
    forecast.capacity_requests_per_second
    info: forecast.selected, forecast.tokens_selected

:meth:`refit` is the heavy part (rolling-origin backtest of the candidates on the recent history, selection,
fit on the whole history); it is thread-safe and meant for a thread executor, off the tick. The collector
face (:meth:`collect`) schedules it when due, so wiring is one collector plus one listener.

Capacity per replica is the highest 1-minute rate of requests served in a *saturated* minute (work waited,
in the gate's queue or the engine's, on at least half of its ticks) while ``engine.ttft_seconds.p99``
stayed within ``ttft_slo_s`` all minute. A minute with nothing waiting says only that the replica served
what came, not what it could: until 2026-12-06 every minute counted, so a replica never pushed reported its
busiest minute so far as its capacity. The upper forecast is above that whenever traffic grows, so
``ServepilotForecastAboveCapacity`` stood pending in every live run at a load the engine served with room
to spare, and the replica advice (and a fleet query on the smallest capacity any replica reports, as
deploy/keda had: a new replica learns the share it was given) asked for more replicas the more it had.
Until the replica has been saturated, no capacity and no advice are published; the recommendation is
``ceil(max_h q_{replica_quantile}(t+h) / (capacity * target_utilization))`` over the selection horizon,
clamped to ``[min_replicas, max_replicas]``.

A minute in which the breaker held a level above L0 teaches no capacity either: at L1 the batch was cut
(a capacity too low), at L2 and L3 the answers came from the fp8 or the small model's upstream (one too
high, which would ask for too few replicas once the breaker stepped back).

Capacity is the setup's it was learned on (detectors/serving_setup.py: the engine, its model, the GPU model),
kept with it in the state file. The highest minute only ever rises, so a capacity restored after the
replica moved to a larger model or a slower GPU would stay where the old setup put it, and the advice
would ask for too few replicas. When a part of the setup the sidecar sees differs from the one the
capacity was learned on, it is dropped (logged) and learned again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from agent.config import ForecastConfig
from agent.forecast_state import Track, load_state, state_document, write_atomically
from agent.state import AgentState
from detectors.forecast.backtest import rolling_origin
from detectors.forecast.base import Forecast, Forecaster
from detectors.forecast.ensemble import Ensemble
from detectors.forecast.select import default_factories, select
from detectors.forecast.series import GapError
from detectors.serving_setup import SetupWatch, describe
from detectors.snapshot import Reading, Snapshot, SourceStatus
from policies import knobs

log = logging.getLogger(__name__)

STEP_S = 60.0
#: A minute is saturated when work waited on at least this share of its ticks (capacity is learned there).
SATURATED_SHARE = 0.5
FALLBACK = ("level_shape", "holt_winters", "last_value")
TARGETS = ("requests_per_second", "tokens_per_second")


def served_rate(snapshot: Snapshot) -> float | None:
    """Requests per second answered: the gate's finished requests when it runs, else the engine's."""
    buckets = [
        v for k, v in snapshot.values.items() if k.startswith("gate.") and k.endswith(".requests_per_second")
    ]
    if buckets:
        return float(sum(buckets))
    return snapshot.get("engine.requests_finished_per_second")


def demand_rate(snapshot: Snapshot, served: float | None) -> float | None:
    """Demand, requests per second: those ``served`` and those the gate shed for want of capacity (its
    queue full, a deadline passed: ``gate.shed_per_second``), which more replicas would have served; not
    those a business line's rate limit refused. A replica that sheds a third of its load forecast only what
    it served until 2026-12-06, and the advice sized the fleet for the load it could already carry."""
    if served is None:
        return None
    return served + (snapshot.get("gate.shed_per_second") or 0.0)


def waiting(snapshot: Snapshot) -> float:
    """Requests waiting for the engine: in the gate's queue and in the engine's own."""
    return (snapshot.get(knobs.GATE_QUEUE) or 0.0) + (snapshot.get(knobs.WAITING) or 0.0)


def token_rate(snapshot: Snapshot) -> float | None:
    parts = [snapshot.get(f"engine.{k}_tokens_per_second") for k in ("prompt", "generation")]
    known = [p for p in parts if p is not None]
    return float(sum(known)) if known else None


class LiveForecaster:
    """See the module docstring. ``factories`` defaults to :func:`default_factories` filtered by config."""

    name = "forecast"

    def __init__(
        self,
        cfg: ForecastConfig,
        *,
        policy_ttft_slo_s: float = 2.0,
        factories: Mapping[str, Callable[[], Forecaster]] | None = None,
    ) -> None:
        self.cfg = cfg
        #: the p99 TTFT a saturated minute must stay within to count toward capacity: forecast.ttft_slo_s,
        #: else the SLO the policies steer to (``policy_ttft_slo_s``; the sidecar keeps it in step on a
        #: reload), so capacity is what the replica serves at the latency it is run for
        self.ttft_slo_s = cfg.ttft_slo_s if cfg.ttft_slo_s is not None else policy_ttft_slo_s
        self.max_h = max(max(cfg.horizons_min), cfg.selection_horizon_min)
        known = dict(factories or default_factories(horizon_steps=self.max_h))
        unknown = sorted(set(cfg.models) - set(known))
        if unknown:
            raise ValueError(f"forecast.models: unknown {unknown}; choose from {sorted(known)}")
        self.factories = {name: known[name] for name in cfg.models}
        self.fallback = {name: known[name] for name in FALLBACK if name in known}
        keep = round(cfg.history_days * 86400 / STEP_S)
        self.tracks = {name: Track(name, keep) for name in TARGETS}
        self.capacity_rps = 0.0
        #: what the replica serves with, as last seen: the setup ``capacity_rps`` belongs to
        self.setup = SetupWatch()
        self.last_refit_s: float | None = None
        self.last_save_s: float | None = None
        self._minute_ttft: float = 0.0
        #: this minute's ticks, those with work waiting, and the served rates summed over them
        self._minute_ticks = self._minute_waiting = self._minute_served_ticks = 0
        self._minute_served = 0.0
        self._minute_degraded = False
        self._lock = threading.Lock()
        self._refit_task: asyncio.Future[None] | None = None

    # -- every tick ------------------------------------------------------------------------------------------
    def observe(self, snapshot: Snapshot, degraded: bool = False) -> None:
        """Add this tick's rates to the current minute; closing a minute updates the models. ``degraded``:
        the breaker held a level above L0 at this tick (the minute then teaches no capacity)."""
        minute = math.floor(snapshot.now / STEP_S)
        served = served_rate(snapshot)
        with self._lock:
            changed = self.setup.update(snapshot)
            if changed and self.capacity_rps > 0:
                was, is_now = describe(changed)
                log.info(
                    "forecast: the capacity of %.3g requests/s was learned with %s; this replica now serves "
                    "with %s: it is learned again from its saturated minutes",
                    self.capacity_rps,
                    was,
                    is_now,
                )
                self.capacity_rps = 0.0
                self._restart_minute()  # the minute so far was the old setup's
            for track, value in zip(
                self.tracks.values(), (demand_rate(snapshot, served), token_rate(snapshot)), strict=True
            ):
                if track.add(minute, value):
                    self._on_minute(track)
            p99 = snapshot.get("engine.ttft_seconds.p99")
            if p99 is not None:
                self._minute_ttft = max(self._minute_ttft, p99)
            self._minute_ticks += 1
            self._minute_waiting += waiting(snapshot) > 0
            self._minute_degraded |= degraded
            if served is not None:
                self._minute_served += served
                self._minute_served_ticks += 1

    def _restart_minute(self) -> None:
        """Start the minute's capacity accounting afresh."""
        self._minute_ttft = self._minute_served = 0.0
        self._minute_ticks = self._minute_waiting = self._minute_served_ticks = 0
        self._minute_degraded = False

    def _on_minute(self, track: Track) -> None:
        if track.name == "requests_per_second":
            # capacity is what was served, not the demand (the track's minute): sheds are demand it missed
            saturated = self._minute_waiting >= SATURATED_SHARE * self._minute_ticks > 0
            learns = saturated and not self._minute_degraded and self._minute_ttft <= self.ttft_slo_s
            if self._minute_served_ticks and learns:
                self.capacity_rps = max(self.capacity_rps, self._minute_served / self._minute_served_ticks)
            self._restart_minute()
        if track.model is None:
            return
        try:
            track.catch_up()
            track.forecast = track.model.forecast(self.max_h + 1)
        except (GapError, ValueError) as error:  # a long outage: the model waits for the next refit
            log.info("forecast %s paused until refit: %s", track.name, error)
            track.model, track.forecast = None, None

    def on_state(self, state: AgentState) -> None:
        """Loop listener: ``loop.subscribe(forecaster.on_state)``."""
        if state.snapshot is not None:
            level = getattr(state.policy_states.get("breaker"), "level", 0)
            self.observe(state.snapshot, degraded=level > 0)

    def signals(self, now: float) -> Reading:
        """The latest forecasts as flat signals (cheap; computed when a minute closed)."""
        values: dict[str, float] = {}
        info: dict[str, str] = {}
        with self._lock:
            for track in self.tracks.values():
                if track.forecast is None:
                    continue
                info["forecast.selected" if track.name == TARGETS[0] else "forecast.tokens_selected"] = (
                    track.model_name
                )
                values.update(self._horizon_values(track.name, track.forecast, now))
                if track.name == TARGETS[0]:
                    for model, mase in track.backtest.items():
                        values[f"forecast.backtest_mase.{model}.h{self.cfg.selection_horizon_min}m"] = mase
            replicas = self._replicas(self.tracks[TARGETS[0]].forecast, now)
            if replicas is not None:
                values["forecast.recommended_replicas"] = replicas
            if self.capacity_rps > 0:
                values["forecast.capacity_requests_per_second"] = self.capacity_rps
        if not values:
            return Reading.empty(self.name, now, "forecast warming up (needs history and a fitted model)")
        return Reading(self.name, now, SourceStatus.OK, values, info=info)

    def _step_at(self, forecast: Forecast, t: float) -> int:
        return min(forecast.steps - 1, max(0, math.floor((t - forecast.start_s) / forecast.step_s)))

    def _horizon_values(self, target: str, forecast: Forecast, now: float) -> dict[str, float]:
        out = {}
        for h in self.cfg.horizons_min:
            k = self._step_at(forecast, now + 60.0 * h)
            for q in self.cfg.quantiles:
                band = forecast.quantiles.get(q)
                value = forecast.mean[k] if band is None and q == 0.5 else None if band is None else band[k]
                if value is not None and math.isfinite(value):
                    out[f"forecast.{target}.h{h}m.q{q:g}"] = float(value)
        return out

    def _replicas(self, forecast: Forecast | None, now: float) -> float | None:
        if forecast is None or self.capacity_rps <= 0:
            return None
        q = min(forecast.quantiles, key=lambda level: abs(level - self.cfg.replica_quantile), default=None)
        path = forecast.mean if q is None else forecast.quantiles[q]
        last = self._step_at(forecast, now + 60.0 * self.cfg.selection_horizon_min)
        peak = float(np.max(path[: last + 1]))
        need = math.ceil(peak / (self.capacity_rps * self.cfg.target_utilization) - 1e-9)
        return float(min(self.cfg.max_replicas, max(self.cfg.min_replicas, need)))

    # -- off the tick ----------------------------------------------------------------------------------------
    def refit_due(self, now: float) -> bool:
        missing = any(t.model is None and t.usable_length() > 1 for t in self.tracks.values())
        return self.last_refit_s is None or missing or now - self.last_refit_s >= self.cfg.refit_interval_s

    def refit(self, now: float) -> None:
        """Backtest, select and fit on a copy of the history, then swap the models in (thread-safe)."""
        for name, track in self.tracks.items():
            with self._lock:
                series, end_minute = track.series()
            if series is None:
                continue
            model, label, backtest = self._choose(series)
            if model is None:
                continue
            with self._lock:
                track.install(model, label, backtest, end_minute)
                try:
                    track.catch_up()
                    track.forecast = track.model.forecast(self.max_h + 1) if track.model else None
                except (GapError, ValueError) as error:
                    log.info("forecast %s: new model could not catch up: %s", name, error)
                    track.model, track.forecast = None, None
        self.last_refit_s = now

    def _choose(self, series: Any) -> tuple[Forecaster | None, str, dict[str, float]]:
        horizon = self.cfg.selection_horizon_min
        span = round(self.cfg.backtest_days * 86400 / STEP_S)
        initial = len(series) - span - self.max_h
        backtest: dict[str, float] = {}
        names: tuple[str, ...] = ()
        if initial >= 2 * 1440:  # every candidate (Holt-Winters needs two days) gets a fair start
            results = [
                rolling_origin(
                    f, series, horizon=self.max_h, initial=initial, stride=10, refit_every=1440, name=n
                )
                for n, f in self.factories.items()
            ]
            backtest = {r.name: round(r.mase(horizon), 4) for r in results if r.ok}
            try:
                names = select(results, horizon)[0].members
            except ValueError:
                names = ()
        for candidate in (names, *((n,) for n in self.fallback)):
            if not candidate:
                continue
            model = self.build(candidate)
            try:
                return model.fit(series), model.name, backtest
            except ValueError:
                continue
        return None, "", backtest

    def build(self, names: tuple[str, ...]) -> Forecaster:
        """A fresh model for one name or an equal-weight ensemble of several."""
        known = {**self.fallback, **self.factories}
        if len(names) == 1:
            return known[names[0]]()
        return Ensemble([known[n]() for n in names])

    # -- persistence -----------------------------------------------------------------------------------------
    def save(self, path: str | None = None) -> None:
        """Atomically write the minute history, capacity and selection (models are refitted on restore)."""
        target = path or self.cfg.state_path
        if target is None:
            return
        with self._lock:
            text = state_document(self.tracks, self.capacity_rps, self.last_refit_s, self.setup.seen)
        write_atomically(target, text)

    def restore(self, path: str | None = None) -> bool:
        """Load saved state and refit the saved selection on it (no backtest); False if there is none."""
        source = path or self.cfg.state_path
        if source is None:
            return False
        state = load_state(source, self.tracks)
        if state is None:
            return False
        self.capacity_rps, self.last_refit_s = state.capacity_rps, state.last_refit_s
        self.setup = SetupWatch(state.setup)
        for track in self.tracks.values():
            series, end_minute = track.series()
            if series is None or not track.model_name:
                continue
            try:
                model = self.build(tuple(track.members)).fit(series)
            except (KeyError, ValueError) as error:
                log.warning("forecast %s: saved model not restored: %s", track.name, error)
                continue
            track.install(model, track.model_name, track.backtest, end_minute)
            track.forecast = model.forecast(self.max_h + 1)
        return True

    # -- the collector face ----------------------------------------------------------------------------------
    async def collect(self, now: float) -> Reading:
        """Return the latest signals; start a refit in a thread when one is due. Never raises."""
        try:
            if self.refit_due(now) and (self._refit_task is None or self._refit_task.done()):
                self._refit_task = asyncio.get_running_loop().run_in_executor(None, self.refit, now)
            if self.last_save_s is None or now - self.last_save_s >= self.cfg.save_interval_s:
                self.last_save_s = now
                asyncio.get_running_loop().run_in_executor(None, self._save_quietly)
            return self.signals(now)
        except Exception as error:
            log.exception("forecast collect failed")
            return Reading.failed(self.name, now, f"forecast failed: {type(error).__name__}: {error}")

    def _save_quietly(self) -> None:
        try:
            self.save()
        except OSError as error:  # a full or read-only disk must not stop forecasting
            log.warning("forecast state not saved: %s", error)

    async def close(self) -> None:
        if self._refit_task is not None:
            await asyncio.wait({self._refit_task}, timeout=5.0)
        self._save_quietly()
