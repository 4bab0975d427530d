"""Sleep and wake: put an idle replica to sleep off-peak, wake it ahead of the forecast load. Pure.

Where the engine offers it (vLLM's sleep mode, SGLang's memory release), a sleeping replica frees its
GPU memory and idles at low power; waking reloads the weights, which takes ``wake_delay_s`` (tens of
seconds to minutes). So the rule looks ahead, not at the present:

* **never sleep while anything is in flight**: every in-flight signal that is present must be 0
  (gate in flight and queue, engine running and waiting), and at least one must be present, since
  unknown is not idle;
* sleep after ``min_idle_s`` of continuous idleness, and only when the upper forecast for the next
  ``horizon`` (``forecast.requests_per_second.h30m.q0.9`` by default) is below ``sleep_below_rps``;
  no forecast, no sleep;
* wake when that upper forecast reaches ``wake_above_rps`` (> ``sleep_below_rps``: hysteresis), when the
  forecast disappears (fail safe), or at once when a request is waiting (the forecast was wrong).

With a 30-minute horizon the wake-up starts about 30 minutes before the forecast rise, far more than
any reload takes. The policy proposes the absolute knob value ``engine.sleeping`` (1 asleep, 0 awake)
every tick it holds an opinion (level-based); waking uses the SLO guard's priority, sleeping energy's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from detectors.base import Finding
from detectors.snapshot import Snapshot
from policies.arbiter import PRIORITY
from policies.base import Proposal

SLEEPING = "engine.sleeping"
IN_FLIGHT_SIGNALS = (
    "gate.in_flight",
    "gate.queue_depth",
    "engine.requests_running",
    "engine.requests_waiting",
)
DEMAND_SIGNALS = ("gate.queue_depth", "engine.requests_waiting")


@dataclass(frozen=True)
class SleepState:
    sleeping: bool
    idle_since: float | None


@dataclass(frozen=True)
class SleepWake:
    """Thresholds in requests per second on the upper forecast; times in seconds."""

    sleep_below_rps: float = 0.05
    wake_above_rps: float = 0.2
    min_idle_s: float = 600.0
    forecast_signal: str = "forecast.requests_per_second.h30m.q0.9"
    name: str = "sleep_wake"

    def __post_init__(self) -> None:
        if not 0 <= self.sleep_below_rps < self.wake_above_rps:
            raise ValueError("thresholds must satisfy 0 <= sleep_below_rps < wake_above_rps")
        if self.min_idle_s < 0:
            raise ValueError(f"min_idle_s must be >= 0, got {self.min_idle_s}")

    def decide(
        self, snapshot: Snapshot, findings: Sequence[Finding], state: SleepState | None, now: float
    ) -> tuple[SleepState, list[Proposal]]:
        """Sleep, wake or hold; see the module docstring for the rule."""
        state = state or SleepState(False, None)
        forecast = snapshot.get(self.forecast_signal)
        if forecast is not None and not math.isfinite(forecast):
            forecast = None
        if state.sleeping:
            demand = any((snapshot.get(s) or 0.0) > 0 for s in DEMAND_SIGNALS)
            if demand or forecast is None or forecast >= self.wake_above_rps:
                why = (
                    "requests are waiting"
                    if demand
                    else "no forecast (fail safe)"
                    if forecast is None
                    else f"forecast {forecast:.3g} req/s >= {self.wake_above_rps:g} within the horizon"
                )
                return SleepState(False, None), [self._proposal(0.0, f"wake: {why}", PRIORITY["slo_guard"])]
            return state, [
                self._proposal(1.0, "stay asleep: forecast below the wake threshold", PRIORITY["energy"])
            ]
        present = [snapshot.get(s) for s in IN_FLIGHT_SIGNALS if snapshot.get(s) is not None]
        idle = bool(present) and all(v == 0 for v in present)
        if not idle:
            return SleepState(False, None), []
        since = state.idle_since if state.idle_since is not None else now
        if now - since >= self.min_idle_s and forecast is not None and forecast < self.sleep_below_rps:
            reason = (
                f"idle for {now - since:.0f} s and forecast {forecast:.3g} req/s < {self.sleep_below_rps:g}"
            )
            return SleepState(True, None), [self._proposal(1.0, f"sleep: {reason}", PRIORITY["energy"])]
        return SleepState(False, since), []

    def _proposal(self, value: float, reason: str, priority: int) -> Proposal:
        return Proposal(self.name, SLEEPING, value, reason, priority)
