"""SleepWake: never sleeps in flight; wakes (reload included) before the forecast rise.

The scenario runs in virtual time against the simulator's :class:`SleepModel` (the modelled reload
delay): demand is zero until ``RISE`` and then ramps up; the 30-minute upper forecast is an oracle (the
true rate 30 minutes ahead), so the test checks the rule, not a forecaster.
"""

from __future__ import annotations

import pytest

from detectors.snapshot import Reading, Snapshot, SourceStatus
from policies.sleep import SLEEPING, SleepState, SleepWake
from simulator.sleep import SleepModel

RISE = 6 * 3600.0
HORIZON = 1800.0


def _rate(t: float) -> float:
    return 0.0 if t < RISE else min(5.0, (t - RISE) / 600.0)


def _snap(now: float, in_flight: float = 0.0, forecast: float | None = None, **extra: float) -> Snapshot:
    values = {"gate.in_flight": in_flight, "gate.queue_depth": 0.0, **extra}
    if forecast is not None:
        values["forecast.requests_per_second.h30m.q0.9"] = forecast
    return Snapshot.from_readings(now, {"t": Reading("t", now, SourceStatus.OK, values)})


def test_wake_completes_before_the_forecast_rise() -> None:
    policy, engine = SleepWake(min_idle_s=600), SleepModel(wake_delay_s=120.0)
    state: SleepState | None = None
    woke_at = None
    for t in range(0, int(RISE) + 3600, 60):
        now = float(t)
        in_flight = 1.0 if _rate(now) > 0 else 0.0
        state, proposals = policy.decide(_snap(now, in_flight, _rate(now + HORIZON)), [], state, now)
        for p in proposals:
            if p.value == 1.0:
                engine.sleep(int(in_flight), now)
            elif engine.asleep:
                engine.wake_up(now)
                woke_at = now
    assert engine.sleeps == 1 and woke_at is not None
    assert engine.ready_at <= RISE and not engine.is_sleeping(RISE)


def test_never_sleeps_while_requests_are_in_flight() -> None:
    policy = SleepWake(min_idle_s=0)
    state = None
    for t in range(0, 7200, 60):
        state, proposals = policy.decide(_snap(float(t), in_flight=1.0, forecast=0.0), [], state, float(t))
        assert not proposals and not state.sleeping


def test_engine_waiting_requests_block_sleep_even_when_the_gate_is_idle() -> None:
    policy = SleepWake(min_idle_s=0)
    _, proposals = policy.decide(_snap(0.0, 0.0, 0.0, **{"engine.requests_waiting": 2.0}), [], None, 0.0)
    assert proposals == []


def test_unknown_in_flight_is_not_idle() -> None:
    snap = Snapshot.from_readings(0.0, {"t": Reading("t", 0.0, SourceStatus.OK, {"x": 1.0})})
    state, proposals = SleepWake(min_idle_s=0).decide(snap, [], None, 0.0)
    assert proposals == [] and not state.sleeping


def test_sleeps_only_after_min_idle_with_a_low_forecast() -> None:
    policy = SleepWake(min_idle_s=600)
    state, early = policy.decide(_snap(0.0, forecast=0.0), [], None, 0.0)
    state, late = policy.decide(_snap(600.0, forecast=0.0), [], state, 600.0)
    assert early == [] and [(p.knob, p.value) for p in late] == [(SLEEPING, 1.0)]


def test_no_forecast_means_no_sleep_and_wakes_a_sleeper() -> None:
    policy = SleepWake(min_idle_s=0)
    _, idle = policy.decide(_snap(0.0), [], None, 0.0)
    _, wake = policy.decide(_snap(0.0), [], SleepState(True, None), 0.0)
    assert idle == [] and wake[0].value == 0.0 and "fail safe" in wake[0].reason


def test_waiting_request_wakes_at_once() -> None:
    _, wake = SleepWake().decide(
        _snap(0.0, forecast=0.0, **{"gate.queue_depth": 1.0}), [], SleepState(True, None), 0.0
    )
    assert wake[0].value == 0.0 and "waiting" in wake[0].reason


def test_thresholds_need_hysteresis() -> None:
    with pytest.raises(ValueError, match="sleep_below_rps < wake_above_rps"):
        SleepWake(sleep_below_rps=1.0, wake_above_rps=0.5)
