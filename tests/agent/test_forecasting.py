"""LiveForecaster in virtual time: snapshots are built by hand, ``now`` is passed in, nothing sleeps."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from agent.config import ForecastConfig
from agent.exporter import translate
from agent.forecast_state import Track
from agent.forecasting import LiveForecaster
from detectors.snapshot import Reading, Snapshot, SourceStatus

MONDAY_S = 1_715_558_400.0  # 2024-05-13 00:00 UTC


def _cfg(tmp_path: Path | None = None, **changes: object) -> ForecastConfig:
    base: dict[str, object] = {
        "enabled": True,
        "models": ("last_value", "level_shape"),
        "backtest_days": 0.25,
        "state_path": str(tmp_path / "forecast.json") if tmp_path else None,
    }
    return ForecastConfig.model_validate(base | changes)


def _rate(minute: int) -> float:
    """Requests per second with a daily cycle (10 at night, 30 in the afternoon)."""
    return 20.0 + 10.0 * math.sin(2 * math.pi * (minute % 1440) / 1440 - math.pi / 2)


def _snap(now: float, rps: float | None, p99: float = 0.5, **extra: float) -> Snapshot:
    values = {"engine.ttft_seconds.p99": p99, "engine.prompt_tokens_per_second": 100.0 * (rps or 0)}
    values |= {"engine.generation_tokens_per_second": 50.0 * (rps or 0)} | extra
    if rps is not None:
        values["engine.requests_finished_per_second"] = rps
    reading = Reading("engine", now, SourceStatus.OK, values)
    return Snapshot.from_readings(now, {"engine": reading})


def _feed(forecaster: LiveForecaster, first: int, minutes: int, noise: float = 0.0) -> float:
    """One tick per minute (second 30 of each minute); returns the time of the last tick."""
    rng = np.random.default_rng(first)
    now = 0.0
    for minute in range(first, first + minutes):
        now = MONDAY_S + 60.0 * minute + 30.0
        forecaster.observe(_snap(now, max(0.0, _rate(minute) + rng.normal(0, noise))))
    return now


def test_a_minute_is_the_mean_of_the_ticks_inside_it() -> None:
    track = Track("requests_per_second", keep=100)
    for second, value in ((0, 1.0), (20, 2.0), (40, 6.0)):
        assert not track.add(10, value) or second == 0
    assert track.add(11, 5.0)
    assert track.last_closed == 3.0 and track.values == [3.0]


def test_a_minute_without_samples_is_missing_not_zero() -> None:
    track = Track("requests_per_second", keep=100)
    for minute, value in ((0, 4.0), (1, None), (2, 8.0), (3, 1.0)):
        track.add(minute, value)
    assert math.isnan(track.values[1])
    series, _ = track.series()
    assert series is not None and series.values.tolist() == [4.0, 6.0, 8.0]  # interpolated, not zero


def test_history_before_a_long_outage_is_not_used_for_fitting() -> None:
    track = Track("requests_per_second", keep=1000)
    for minute in [*range(0, 30), *range(40, 70), 70]:
        track.add(minute, 1.0)
    series, end = track.series()
    assert series is not None and series.start_s == 40 * 60.0 and len(series) == 30 and end == 70


def test_no_data_before_the_first_minute_closes() -> None:
    forecaster = LiveForecaster(_cfg())
    now = _feed(forecaster, 0, 1)
    assert forecaster.signals(now).status is SourceStatus.NO_DATA


def test_no_forecast_signals_before_a_model_is_fitted() -> None:
    """Nor a capacity: 30 minutes with nothing waiting say what the replica served, not what it can."""
    forecaster = LiveForecaster(_cfg())
    now = _feed(forecaster, 0, 30)
    assert forecaster.signals(now).status is SourceStatus.NO_DATA


def test_signals_cover_every_horizon_and_quantile_and_map_to_the_exported_families() -> None:
    forecaster = LiveForecaster(_cfg())
    now = _feed(forecaster, 0, 1440 + 120)
    forecaster.refit(now)
    reading = forecaster.signals(now)
    for target in ("requests_per_second", "tokens_per_second"):
        for h in (5, 15, 30, 60):
            low, mid, high = (reading.values[f"forecast.{target}.h{h}m.q{q}"] for q in ("0.1", "0.5", "0.9"))
            assert low <= mid <= high
    assert reading.info["forecast.selected"] == "level_shape"  # too little history to backtest: fallback
    name = translate("forecast.requests_per_second.h30m.q0.5")
    assert name.name == "servepilot_forecast_requests_per_second"
    assert dict(name.labels) == {"horizon": "1800", "quantile": "0.5"}


def test_the_30_minute_forecast_follows_the_daily_cycle() -> None:
    forecaster = LiveForecaster(_cfg())
    now = _feed(forecaster, 0, 1440 + 300)  # 05:00 on day two: traffic is rising
    forecaster.refit(now)
    minute = 1440 + 300
    forecast = forecaster.signals(now).values["forecast.requests_per_second.h30m.q0.5"]
    assert forecast == pytest.approx(_rate(minute + 30), rel=0.05)
    assert forecast > _rate(minute - 1) * 1.05  # more than the last value: the shape is used


def test_refit_with_enough_history_backtests_every_candidate_and_selects() -> None:
    forecaster = LiveForecaster(_cfg())
    now = _feed(forecaster, 0, 2 * 1440 + 15 * 24 + 60 + 10, noise=1.0)
    forecaster.refit(now)
    reading = forecaster.signals(now)
    mase = {k: v for k, v in reading.values.items() if k.startswith("forecast.backtest_mase.")}
    assert set(mase) == {"forecast.backtest_mase.last_value.h30m", "forecast.backtest_mase.level_shape.h30m"}
    assert reading.info["forecast.selected"] == "level_shape"
    assert mase["forecast.backtest_mase.level_shape.h30m"] < mase["forecast.backtest_mase.last_value.h30m"]


def test_new_minutes_move_the_forecast_without_a_refit() -> None:
    forecaster = LiveForecaster(_cfg())
    now = _feed(forecaster, 0, 1440 + 120)
    forecaster.refit(now)
    start = forecaster.tracks["requests_per_second"].forecast.start_s  # type: ignore[union-attr]
    _feed(forecaster, 1440 + 120, 10)
    moved = forecaster.tracks["requests_per_second"].forecast.start_s  # type: ignore[union-attr]
    assert moved == start + 600.0


def test_a_long_outage_pauses_the_model_until_the_next_refit() -> None:
    forecaster = LiveForecaster(_cfg())
    now = _feed(forecaster, 0, 1440 + 120)
    forecaster.refit(now)
    now = _feed(forecaster, 1440 + 140, 3)  # 20 minutes without data
    assert forecaster.tracks["requests_per_second"].model is None
    assert forecaster.refit_due(now)


def test_capacity_is_the_highest_rate_served_saturated_within_the_slo() -> None:
    forecaster = LiveForecaster(_cfg(ttft_slo_s=1.0))
    minutes = ((10.0, 0.5), (50.0, 3.0), (30.0, 0.9), (20.0, 0.2))
    for minute, (rps, p99) in enumerate(minutes):
        forecaster.observe(_snap(MONDAY_S + 60 * minute, rps, p99, **{"gate.queue_depth": 3.0}))
    assert forecaster.capacity_rps == 30.0  # 50 rps broke the SLO; the last minute is still open


def test_a_minute_with_nothing_waiting_for_most_of_it_teaches_no_capacity() -> None:
    """Capacity is what a replica serves when work waits for it: at 40 rps with an empty queue it served
    what came, and reporting 40 as its capacity made every forecast above 40 'above capacity' (the alert
    stood pending in every live run at a load the engine served with room to spare)."""
    forecaster = LiveForecaster(_cfg(ttft_slo_s=1.0))
    start = MONDAY_S
    for second in range(0, 60, 10):  # a burst queues on 2 of 6 ticks: not saturated
        queued = {"engine.requests_waiting": 4.0} if second < 20 else {}
        forecaster.observe(_snap(start + second, 40.0, 0.3, **queued))
    for second in range(60, 120, 10):  # the gate's queue held work on 4 of 6 ticks: saturated
        queued = {"gate.queue_depth": 2.0} if second < 100 else {}
        forecaster.observe(_snap(start + second, 25.0, 0.3, **queued))
    forecaster.observe(_snap(start + 120, 25.0, 0.3))
    assert forecaster.capacity_rps == 25.0
    assert forecaster.signals(start + 120).values["forecast.capacity_requests_per_second"] == 25.0


def test_a_minute_the_breaker_held_above_l0_teaches_no_capacity() -> None:
    """At L3 the small model's upstream answered 60 rps: learned as the replica's capacity, it would stand
    (the highest minute only rises) and the advice ask for too few replicas once the breaker stepped
    back. The next minute, at L0 again, is learned."""
    from types import MappingProxyType

    from agent.state import AgentState
    from policies.breaker import BreakerState

    forecaster = LiveForecaster(_cfg(ttft_slo_s=1.0))
    for minute, (rps, level) in enumerate(((60.0, 3), (25.0, 0), (25.0, 0))):
        breaker = MappingProxyType({"breaker": BreakerState(level=level)})
        for second in range(0, 60, 10):
            snapshot = _snap(MONDAY_S + 60 * minute + second, rps, 0.5, **{"gate.queue_depth": 3.0})
            forecaster.on_state(AgentState(snapshot=snapshot, policy_states=breaker))
    assert forecaster.capacity_rps == 25.0


def test_requests_the_gate_shed_are_demand_but_not_capacity() -> None:
    """A saturated replica that answers 20 rps and sheds 10 (queue full, deadlines passed) has a demand
    of 30 to forecast and a capacity of 20; a line's rate limit is neither (not in gate.shed_per_second)."""
    forecaster = LiveForecaster(_cfg(ttft_slo_s=1.0))
    overloaded = {
        "gate.le1k.requests_per_second": 20.0,
        "gate.shed_per_second": 10.0,
        "gate.rejected_per_second": 15.0,
        "gate.queue_depth": 12.0,
    }
    for second in range(0, 70, 10):
        forecaster.observe(_snap(MONDAY_S + second, 20.0, 0.8, **overloaded))
    assert forecaster.tracks["requests_per_second"].values == [30.0]
    assert forecaster.capacity_rps == 20.0


def test_a_capacity_saved_before_saturation_counted_is_learned_again(tmp_path: Path) -> None:
    """A state file of the old rule (``capacity_rps``: every minute counted, a lower bound) keeps its
    history but not its capacity."""
    first = LiveForecaster(_cfg(tmp_path))
    _feed(first, 0, 10)
    first.capacity_rps = 12.0
    first.save()
    path = tmp_path / "forecast.json"
    document = json.loads(path.read_text())
    document["capacity_rps"] = document.pop("saturated_capacity_rps")
    path.write_text(json.dumps(document))
    second = LiveForecaster(_cfg(tmp_path))
    assert second.restore()
    assert second.capacity_rps == 0.0
    assert second.tracks["requests_per_second"].values == first.tracks["requests_per_second"].values


def _served_by(now: float, rps: float, p99: float, model: str | None, gpu: str | None = None) -> Snapshot:
    """A saturated tick (work queued in the gate) of an engine serving ``model`` on ``gpu``; None: that
    source did not answer this tick."""
    values = {"engine.requests_finished_per_second": rps, "engine.ttft_seconds.p99": p99}
    values["gate.queue_depth"] = 3.0
    engine = (
        Reading("engine", now, SourceStatus.OK, values, info={"engine": "vllm", "model": model})
        if model is not None
        else Reading.failed("engine", now, "connection refused")
    )
    readings = {"engine": engine}
    if gpu is not None:
        readings["nvml"] = Reading("nvml", now, SourceStatus.OK, {}, info={"gpus": "1", "gpu_names": gpu})
    return Snapshot.from_readings(now, readings)


def test_a_capacity_learned_with_another_model_is_learned_again(caplog: pytest.LogCaptureFixture) -> None:
    """The highest minute only rises: 30 rps learned on a 4B model would stay the capacity of the 32B
    model the replica serves after an upgrade, and the advice would ask for too few replicas."""
    forecaster = LiveForecaster(_cfg(ttft_slo_s=1.0))
    now = MONDAY_S
    for _ in range(2):  # a saturated minute at 30 rps, closed by the next one's first tick
        for second in range(0, 60, 10):
            forecaster.observe(_served_by(now + second, 30.0, 0.5, "qwen3-4b", "NVIDIA H100 80GB HBM3"))
        now += 60
    assert forecaster.capacity_rps == 30.0
    forecaster.observe(_served_by(now, 30.0, 0.5, None))  # the engine down a tick: nothing known changed
    forecaster.observe(_served_by(now, 30.0, 0.5, "qwen3-4b"))  # NVML silent a tick: neither
    assert forecaster.capacity_rps == 30.0
    with caplog.at_level("INFO", logger="agent.forecasting"):
        forecaster.observe(_served_by(now + 1, 8.0, 0.5, "qwen3-32b", "NVIDIA H100 80GB HBM3"))
    assert forecaster.capacity_rps == 0.0
    assert "learned with model qwen3-4b; this replica now serves with model qwen3-32b" in caplog.text
    assert "forecast.capacity_requests_per_second" not in forecaster.signals(now + 1).values
    now += 60
    for _ in range(2):
        for second in range(0, 60, 10):
            forecaster.observe(_served_by(now + second, 8.0, 0.5, "qwen3-32b", "NVIDIA H100 80GB HBM3"))
        now += 60
    assert forecaster.capacity_rps == 8.0


def test_a_restored_capacity_is_kept_on_the_same_setup_and_dropped_on_another_gpu(tmp_path: Path) -> None:
    first = LiveForecaster(_cfg(tmp_path))
    first.observe(_served_by(MONDAY_S, 5.0, 0.5, "llama-3-8b", "NVIDIA A100-SXM4-80GB"))
    first.capacity_rps = 12.0
    first.save()
    document = json.loads((tmp_path / "forecast.json").read_text())
    assert document["capacity_setup"] == {
        "engine": "vllm",
        "model": "llama-3-8b",
        "gpu": "NVIDIA A100-SXM4-80GB",
    }
    second = LiveForecaster(_cfg(tmp_path))
    assert second.restore() and second.capacity_rps == 12.0
    second.observe(_served_by(MONDAY_S + 60, 5.0, 0.5, "llama-3-8b", "NVIDIA A100-SXM4-80GB"))
    assert second.capacity_rps == 12.0
    second.observe(_served_by(MONDAY_S + 61, 5.0, 0.5, "llama-3-8b", "NVIDIA L4"))
    assert second.capacity_rps == 0.0
    # a file saved before the setup was kept: its capacity stands, and takes the setup first seen
    del document["capacity_setup"]
    (tmp_path / "forecast.json").write_text(json.dumps(document))
    third = LiveForecaster(_cfg(tmp_path))
    assert third.restore() and third.capacity_rps == 12.0
    third.observe(_served_by(MONDAY_S + 60, 5.0, 0.5, "llama-3-8b", "NVIDIA L4"))
    assert third.capacity_rps == 12.0 and third.setup.seen["gpu"] == "NVIDIA L4"


def test_recommended_replicas_cover_the_upper_forecast_at_target_utilisation() -> None:
    forecaster = LiveForecaster(_cfg(target_utilization=0.5, replica_quantile=0.9))
    now = _feed(forecaster, 0, 1440 + 120)
    forecaster.refit(now)
    forecaster.capacity_rps = 4.0
    reading = forecaster.signals(now)
    track = forecaster.tracks["requests_per_second"]
    assert track.forecast is not None
    peak = float(track.forecast.quantiles[0.9][:31].max())
    assert reading.values["forecast.recommended_replicas"] == math.ceil(peak / 2.0)


def test_the_gate_rate_is_preferred_to_the_engine_rate() -> None:
    forecaster = LiveForecaster(_cfg())
    for minute in range(2):
        now = MONDAY_S + 60 * minute
        extra = {"gate.short.requests_per_second": 7.0, "gate.long.requests_per_second": 2.0}
        forecaster.observe(_snap(now, 1.0, **extra))
    assert forecaster.tracks["requests_per_second"].values == [9.0]


def test_save_and_restore_give_identical_forecasts(tmp_path: Path) -> None:
    first = LiveForecaster(_cfg(tmp_path))
    now = _feed(first, 0, 1440 + 200, noise=1.0)
    first.refit(now)
    first.capacity_rps = 12.0
    first.save()
    second = LiveForecaster(_cfg(tmp_path))
    assert second.restore()
    assert second.signals(now).values == first.signals(now).values
    assert second.signals(now).info == first.signals(now).info


def test_a_corrupt_state_file_starts_fresh(tmp_path: Path) -> None:
    (tmp_path / "forecast.json").write_text("{not json")
    forecaster = LiveForecaster(_cfg(tmp_path))
    assert not forecaster.restore()
    assert forecaster.tracks["requests_per_second"].values == []


def test_saving_leaves_no_temporary_files(tmp_path: Path) -> None:
    forecaster = LiveForecaster(_cfg(tmp_path))
    _feed(forecaster, 0, 10)
    forecaster.save()
    assert [p.name for p in tmp_path.iterdir()] == ["forecast.json"]
    assert json.loads((tmp_path / "forecast.json").read_text())["version"] == 1


def test_unknown_model_names_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match=r"forecast.models: unknown \['prophet'\]"):
        LiveForecaster(_cfg(models=("last_value", "prophet")))


async def test_collect_refits_in_a_thread_and_never_raises(tmp_path: Path) -> None:
    forecaster = LiveForecaster(_cfg(tmp_path))
    now = _feed(forecaster, 0, 1440 + 120)
    await forecaster.collect(now)
    assert forecaster._refit_task is not None  # scheduled in the executor, not run on the loop
    await asyncio.wait_for(forecaster._refit_task, timeout=30)
    second = await forecaster.collect(now + 1)
    assert second.status is SourceStatus.OK and "forecast.requests_per_second.h30m.q0.5" in second.values
    await forecaster.close()
    assert (tmp_path / "forecast.json").exists()
