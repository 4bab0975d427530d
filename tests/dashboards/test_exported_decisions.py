"""The agent series that dashboards and alert rules read about decisions and targets: the breaker's
level (from the loop's policy state), the configured SLO targets, and forecasts restored from a seeded
state (the path the e2e test uses). Kept here, next to the golden surface they extend."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.config import ForecastConfig
from agent.exporter import Exporter
from agent.forecasting import LiveForecaster
from agent.loop import Loop
from agent.state import AgentState
from agent.store import Store
from detectors.base import Finding
from detectors.snapshot import Snapshot
from policies.base import Proposal
from policies.breaker import BreakerState
from tests.dashboards.forecast_seed import minute_rates, write_forecast_state


def _samples(exporter: Exporter) -> dict[str, float]:
    text = generate_latest(exporter.registry).decode()
    return {
        s.name + str(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_breaker_level_is_exported_from_the_breaker_policy_state() -> None:
    exporter = Exporter()
    exporter.publish(AgentState(policy_states=MappingProxyType({"breaker": BreakerState(level=2)})))
    assert _samples(exporter)["servepilot_breaker_level[]"] == 2.0


def test_breaker_level_is_absent_until_the_breaker_has_run() -> None:
    exporter = Exporter()
    exporter.publish(AgentState(policy_states=MappingProxyType({"batch_auto": object()})))
    assert not any(k.startswith("servepilot_breaker_level") for k in _samples(exporter))


def test_configured_slo_targets_are_exported_in_seconds() -> None:
    exporter = Exporter(slo={"ttft": 1.5, "itl": 0.05})
    exporter.publish(AgentState())
    samples = _samples(exporter)
    assert samples["servepilot_slo_ttft_seconds[]"] == 1.5
    assert samples["servepilot_slo_itl_seconds[]"] == 0.05


def test_exporter_without_slo_exports_no_target() -> None:
    exporter = Exporter()
    exporter.publish(AgentState())
    assert not any(k.startswith("servepilot_slo_") for k in _samples(exporter))


class _Counting:
    """A policy whose state counts its decisions."""

    name = "counting"

    def decide(
        self, snapshot: Snapshot, findings: list[Finding], state: int | None, now: float
    ) -> tuple[int, list[Proposal]]:
        return (state or 0) + 1, []


async def test_loop_publishes_each_policys_state_after_the_tick() -> None:
    loop = Loop([], Store(10, 100), interval_s=1.0, source_timeout_s=1.0, policies=[_Counting()])  # type: ignore[list-item]
    assert loop.policy_state("counting") is None
    await loop.tick(1.0)
    state = await loop.tick(2.0)
    assert loop.policy_state("counting") == 2
    assert state.policy_states["counting"] == 2


def test_seeded_state_gives_forecast_quantiles_and_capacity_at_once(tmp_path: Path) -> None:
    now = 1_700_000_000.0
    path = write_forecast_state(
        tmp_path / "f.json", now, minute_rates([[0.0, 1, 1], [30.0, 1, 1], [90.0, 1, 1]])
    )
    forecaster = LiveForecaster(ForecastConfig(enabled=True, state_path=str(path)))
    assert forecaster.restore()
    values = forecaster.signals(now).values
    assert values["forecast.capacity_requests_per_second"] == 5.0
    assert {"forecast.requests_per_second.h30m.q0.1", "forecast.requests_per_second.h30m.q0.9"} <= set(values)
    assert values["forecast.requests_per_second.h30m.q0.5"] > 0
