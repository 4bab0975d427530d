"""``forecast``, ``policies``, ``canary`` and ``cost``: what the brain decides with, and against which SLO."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from agent.config.base import Section


class ForecastConfig(Section):
    """Traffic forecasting (issue 5): 1-minute request and token rates, forecast 5-60 minutes ahead,
    the model chosen by a rolling-origin backtest, and a replica recommendation. Off by default."""

    enabled: bool = Field(False, description="forecast request and token rates")
    horizons_min: tuple[int, ...] = Field((5, 15, 30, 60), description="published horizons, minutes")
    quantiles: tuple[float, ...] = Field((0.1, 0.5, 0.9), description="published quantiles")
    selection_horizon_min: int = Field(30, ge=1, le=240, description="horizon the backtest selects at")
    models: tuple[str, ...] = Field(
        ("last_value", "seasonal_naive_1d", "holt_winters", "arima", "level_shape", "lstm"),
        description="candidate forecasters (the LSTM is used only once it beats the baselines)",
    )
    refit_interval_s: float = Field(21600.0, ge=60, le=7 * 86400, description="backtest + refit period")
    history_days: float = Field(14.0, ge=1, le=60, description="1-minute history kept for refits")
    backtest_days: float = Field(2.0, ge=0.25, le=14, description="span the selection backtest scores")
    state_path: str | None = Field("servepilot-forecast.json", description="saved state; null: memory only")
    save_interval_s: float = Field(300.0, ge=10, le=86400, description="state is saved this often")
    ttft_slo_s: float | None = Field(
        None,
        gt=0,
        le=600,
        description="p99 TTFT within which a saturated minute counts toward capacity; null: "
        "policies.ttft_slo_s (and a reload's new value)",
    )
    replica_quantile: float = Field(0.9, gt=0, lt=1, description="forecast quantile replicas are sized for")
    target_utilization: float = Field(0.8, gt=0, le=1, description="share of learned capacity to plan for")
    min_replicas: int = Field(1, ge=0, le=10_000, description="smallest recommended replica count")
    max_replicas: int = Field(64, ge=1, le=10_000, description="largest recommended replica count")

    @field_validator("horizons_min")
    @classmethod
    def _horizons(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or min(value) < 1 or max(value) > 240:
            raise ValueError("must be minutes in [1, 240]")
        return tuple(sorted(set(value)))

    @field_validator("quantiles")
    @classmethod
    def _quantiles(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not value or any(not 0 < q < 1 for q in value):
            raise ValueError("must be levels in (0, 1)")
        return tuple(sorted(set(value)))


class PrioritySlo(Section):
    """A priority class's own latency targets; an unset one is the policies' own."""

    ttft_s: float | None = Field(
        None, gt=0, le=600, description="the class's time-to-first-token target; null: policies.ttft_slo_s"
    )
    itl_s: float | None = Field(
        None, gt=0, le=60, description="the class's mean inter-token latency target; null: policies.itl_slo_s"
    )


class PolicyConfig(Section):
    """Which decision rules run, against which latency SLO (actions still follow actuators.mode)."""

    set: Literal["none", "auto", "seed"] = Field(
        "auto",
        description="auto: SLO-aware batch + breaker (+ the gate's queue deadline; + the token budget where "
        "the engine offers it); seed: the published rule; none: observe only",
    )
    ttft_slo_s: float = Field(2.0, gt=0, le=600, description="time-to-first-token target (P99)")
    itl_slo_s: float = Field(0.1, gt=0, le=60, description="inter-token latency target (mean)")
    error_budget: float = Field(
        0.01,
        gt=0,
        lt=0.069,
        description="share of answers that may miss the SLO (1 - the objective): the breaker's burn rates "
        "are measured against it; write the alert rules with the same value (python -m dashboards.rules "
        "--error-budget)",
    )
    slo_by_priority: dict[Literal["high", "normal", "low"], PrioritySlo] = Field(
        default_factory=dict,
        description="class -> its own targets, by which the gate judges the answers of requests that "
        "arrived in it (the breaker's burn rate, the canary) and scales their queue deadline "
        "(gate.max_queue_wait_s x ttft_s / ttft_slo_s); e.g. a looser TTFT for low (batch) traffic",
    )
    itl_steering: Literal["global", "served_classes"] = Field(
        "served_classes",
        description="the ITL the batch, token-budget, energy and breaker policies steer the engine to: "
        "served_classes: the tightest target (slo_by_priority's or itl_slo_s) of the classes that sent "
        "requests through the gate within served_window_s (a batch decodes every class at one pace; "
        "itl_slo_s without class targets or the gate); global: itl_slo_s, class targets only judged",
    )
    served_window_s: float = Field(
        300.0, ge=1, le=86400, description="a class counts as served this long after its last request"
    )
    batch_min: int = Field(8, ge=1, le=65536, description="lowest effective batch the policies may set")
    batch_max: int = Field(512, ge=1, le=65536, description="highest effective batch the policies may set")
    initial_batch: int = Field(64, ge=1, le=65536, description="batch the auto policy starts from")
    energy: bool = Field(
        False,
        description="SLO-gated energy saving: step the GPU knob (actuators.gpu) down while latency has room, "
        "back up at once when it is at risk; needs actuators.gpu, or an engine control API with sm_clock_mhz",
    )
    energy_levels: tuple[float, ...] = Field(
        (),
        description="the energy ladder, high to low, in MHz (locked_clocks) or W (power_limit); empty: 8 "
        "even steps from the GPU's top down to 45% of it",
    )
    schedule: dict[str, Any] | None = Field(
        None,
        description="time of day: {timezone (required), windows: [{days, start, end, mode}], default}; "
        "in a window whose mode is peak the energy ladder stays at the top",
    )
    sleep: bool = Field(
        False,
        description="put the engine to sleep when idle and the upper traffic forecast is low, wake it ahead "
        "of the forecast rise; needs forecast.enabled and an engine control API that offers sleep",
    )
    sleep_below_rps: float = Field(
        0.05, ge=0, le=1e6, description="sleep only while the upper forecast stays below this (requests/s)"
    )
    wake_above_rps: float = Field(
        0.2, gt=0, le=1e6, description="wake when the upper forecast reaches this (requests/s)"
    )
    sleep_min_idle_s: float = Field(
        600.0, ge=0, le=86400, description="continuous idleness (nothing in flight or queued) before sleep"
    )

    @model_validator(mode="after")
    def _ordered(self) -> PolicyConfig:
        if self.batch_min > self.batch_max:
            raise ValueError(f"batch_min must be <= batch_max, got {self.batch_min} > {self.batch_max}")
        if not self.batch_min <= self.initial_batch <= self.batch_max:
            raise ValueError(
                f"initial_batch must lie in [batch_min, batch_max] = [{self.batch_min}, {self.batch_max}],"
                f" got {self.initial_batch}"
            )
        if self.sleep_below_rps >= self.wake_above_rps:
            raise ValueError("sleep_below_rps must be below wake_above_rps (the gap is the hysteresis)")
        return self

    @field_validator("energy_levels")
    @classmethod
    def _ladder(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(not math.isfinite(v) or v <= 0 for v in value) or list(value) != sorted(
            set(value), reverse=True
        ):
            raise ValueError("must be positive and strictly falling (high to low)")
        return value

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            from policies.schedule import Schedule

            Schedule.from_data(value)  # ScheduleError (a ValueError) names the field in one line
        return value


class CanaryConfig(Section):
    """The precision canary (issue 6): a perplexity gate, then a stepped fp8 rollout. Off by default;
    needs the gate (its split carries the fp8 share), and it starts only through POST /api/admin/canary."""

    enabled: bool = Field(False, description="run the precision canary policy and its perplexity gate")
    validation_file: str | None = Field(
        None, description="validation texts: one per line, or JSONL with a text field"
    )
    primary: str = Field("primary", description="gate upstream serving the reference precision")
    candidate: str = Field("fp8", description="gate upstream serving the fp8 candidate")
    model: str | None = Field(None, description="model name sent to both; null: the first of /v1/models")
    max_ppl_delta: float = Field(0.005, gt=0, lt=1, description="fp8 passes when its PPL rises by less")
    steps: tuple[float, ...] = Field((0.05, 0.25, 0.5, 1.0), description="fp8 traffic shares, in order")
    step_s: float = Field(300.0, ge=0.01, le=86400, description="healthy time before the next step")
    failure_limit: int = Field(2, ge=0, le=1000, description="failed checks tolerated before a rollback")
    gate_timeout_s: float = Field(600.0, ge=1, le=86400, description="no perplexity by then: rollback")
    timeout_s: float = Field(30.0, gt=0, le=600, description="HTTP timeout of one perplexity request")
    concurrency: int = Field(4, ge=1, le=256, description="perplexity requests in flight per upstream")
    retry_s: float = Field(30.0, ge=0.1, le=3600, description="a failed measurement is retried after")

    @field_validator("steps")
    @classmethod
    def _steps(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not value or any(not 0 < s <= 1 for s in value) or list(value) != sorted(set(value)):
            raise ValueError("must be strictly increasing shares in (0, 1]")
        return value


class CostConfig(Section):
    """Cost and energy per token, from measured throughput and power."""

    price_per_gpu_hour_usd: float | None = Field(
        None, ge=0, le=1000, description="price of one GPU-hour; null: no cost series, energy only"
    )
    window_s: float = Field(300.0, ge=10, le=86400, description="window of the per-token averages")


class DetectorsConfig(Section):
    """Which detectors run, and settings of those that depend on how the engine is deployed."""

    disabled: tuple[str, ...] = Field(
        (),
        description="detectors not to run, by name (general, memory_leak, fragmentation, "
        "scheduler_efficiency, tail_latency, multivariate, thermal, spec_decode, engine_stall); "
        "engine_stall off also ends the gate's stall ejection and the unready verdict",
    )

    spec_draft_cost_ratio: float = Field(
        0.1,
        ge=0,
        le=1,
        description="cost of one draft token in target forward passes, for the spec_decode detector's "
        "expected speedup: ~0.05-0.1 for a draft model, near 0 for n-gram lookup (verification only)",
    )

    @field_validator("disabled")
    @classmethod
    def _known_detectors(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            return value
        from detectors import base, registry  # numpy: only when a detector is named

        registry.register_defaults()
        unknown = [name for name in value if name not in base.REGISTRY]
        if unknown:
            raise ValueError(f"unknown detector {unknown[0]!r}; known: {', '.join(base.REGISTRY)}")
        return tuple(dict.fromkeys(value))


def priority_targets(policies: PolicyConfig) -> dict[str, tuple[float, float]]:
    """(TTFT, mean ITL) per class named in ``slo_by_priority``, an unset target filled in from the
    policies' own: what the gate judges that class's answers by."""
    return {
        name: (
            policies.ttft_slo_s if slo.ttft_s is None else slo.ttft_s,
            policies.itl_slo_s if slo.itl_s is None else slo.itl_s,
        )
        for name, slo in policies.slo_by_priority.items()
    }
