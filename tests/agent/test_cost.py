"""CostTracker: cost per 1k tokens and energy per token over a window; never Inf or NaN."""

from __future__ import annotations

import math

import pytest

from agent.cost import CostTracker
from simulator.engine import make_core


def _tick(rate: float, *powers: float) -> dict[str, float]:
    values = {"engine.generation_tokens_per_second": rate}
    values.update({f"nvml.gpu{i}.power_watts.mean": p for i, p in enumerate(powers)})
    return values


def _feed(tracker: CostTracker, ticks: int, values: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in range(ticks + 1):
        out = tracker.update(values, float(t))
    return out


def test_cost_per_1k_tokens_from_price_and_throughput() -> None:
    # 2 GPUs at $3.60/h = $0.002/s; 1000 tokens/s -> $0.002 per 1k tokens
    out = _feed(CostTracker(3.60, window_s=60), 30, _tick(1000.0, 300.0, 300.0))
    assert out["cost.per_1k_tokens_usd"] == pytest.approx(0.002)


def test_energy_per_token_is_power_over_rate() -> None:
    out = _feed(CostTracker(None), 30, _tick(500.0, 350.0, 250.0))
    assert out["cost.energy_joules_per_token"] == pytest.approx(1.2) and "cost.per_1k_tokens_usd" not in out


def test_idle_engine_has_no_cost_signal() -> None:
    assert _feed(CostTracker(2.0), 30, _tick(0.0, 80.0)) == {}


def test_nan_rate_never_reaches_the_output() -> None:
    tracker = CostTracker(2.0)
    _feed(tracker, 10, _tick(1000.0, 300.0))
    out = tracker.update(_tick(math.nan, math.inf), 11.0)
    assert all(math.isfinite(v) for v in out.values())


def test_window_forgets_old_traffic() -> None:
    tracker = CostTracker(1.0, window_s=10)
    _feed(tracker, 20, _tick(1000.0, 300.0))
    out = {}
    for t in range(21, 40):
        out = tracker.update(_tick(100.0, 300.0), float(t))
    assert out["cost.energy_joules_per_token"] == pytest.approx(3.0)


def test_bad_price_is_refused() -> None:
    with pytest.raises(ValueError, match="price_per_gpu_hour_usd"):
        CostTracker(-1.0)


def test_energy_per_token_matches_the_simulated_gpu() -> None:
    """Fed the per-second rates a live scrape would see, the tracker agrees with the core's totals."""
    core = make_core("a100-80g", "llama-3-8b", "fp16", 64)
    for i in range(64):
        core.submit(f"r{i}", 512, 400, 0.0)
    tracker = CostTracker(None, window_s=3600, max_gap_s=5)
    out: dict[str, float] = {}
    tokens0, energy0 = core.stats.generation_tokens, core.gpu_counters.energy_j
    prev_tokens, prev_energy = tokens0, energy0
    tracker.update({}, 0.0)
    t = 0.0
    while core.has_work():
        t += 1.0
        core.step(core.time, max_steps=4096, until=t)
        tokens, energy = core.stats.generation_tokens, core.gpu_counters.energy_j
        out = tracker.update(_tick((tokens - prev_tokens) / 1.0, (energy - prev_energy) / 1.0), t)
        prev_tokens, prev_energy = tokens, energy
    truth = (core.gpu_counters.energy_j - energy0) / (core.stats.generation_tokens - tokens0)
    assert out["cost.energy_joules_per_token"] == pytest.approx(truth, rel=0.02)
