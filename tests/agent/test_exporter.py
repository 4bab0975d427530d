from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.exporter import Exporter, Translation, translate
from agent.state import AgentState, TickStats
from detectors.base import Finding, Severity
from detectors.snapshot import Reading, Snapshot, SourceStatus


def _samples(exporter: Exporter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(exporter.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_translation_rules_map_flat_names_to_labelled_families() -> None:
    assert translate("nvml.gpu3.utilization_ratio.mean").name == "servepilot_gpu_utilization_ratio"
    assert translate("nvml.gpu3.utilization_ratio.mean").labels == (("agg", "mean"), ("gpu", "3"))
    assert translate("nvml.gpu0.process_used_bytes.pid42").labels == (("gpu", "0"), ("pid", "42"))
    assert translate("nvml.gpu0.throttle.sw_power_cap").labels == (("gpu", "0"), ("reason", "sw_power_cap"))
    assert translate("engine.ttft_seconds.p99").labels == (("quantile", "0.99"),)
    assert translate("engine.ttft_seconds.mean").name == "servepilot_engine_ttft_seconds_mean"
    assert translate("engine.requests_running").name == "servepilot_engine_requests_running"
    by_position = translate("engine.spec_accepted_by_position_per_second.position2")
    assert by_position == Translation(
        "servepilot_engine_spec_accepted_by_position_per_second",
        "Engine signal per speculative draft position (0 = the first drafted token).",
        (("position", "2"),),
    )
    assert translate("probe.device1.reserved_bytes").labels == (("device", "1"),)
    assert translate("probe.reserved_bytes").labels == (("device", "all"),)
    assert translate("weird.name-x").name == "servepilot_weird_name_x"  # type: ignore[union-attr]
    assert translate("cost.per_1k_tokens_usd").name == "servepilot_cost_per_1k_tokens"  # type: ignore[union-attr]
    assert translate("cost.energy_joules_per_token").name == "servepilot_energy_joules_per_token"  # type: ignore[union-attr]
    assert translate("gate.le1k.ttft_seconds.p99") is None  # the gate exports its own histograms


def test_metrics_show_sources_values_and_findings() -> None:
    exporter = Exporter()
    snap = Snapshot.from_readings(
        10.0,
        {
            "engine": Reading(
                "engine", 9.5, SourceStatus.OK, {"engine.ttft_seconds.p99": 0.25}, duration_s=0.003
            ),
            "nvml": Reading.failed("nvml", 10.0, "NVML library not found"),
            "probe": Reading("probe", 10.0, SourceStatus.OK, {"probe.fragmentation_ratio": 0.2}),
        },
    )
    finding = Finding("leak", "probe.reserved_bytes", Severity.CRITICAL, 0.9, "leak", 5.0)
    exporter.publish(
        AgentState(snapshot=snap, findings=(finding,), knobs={"batch": 16}, stats=TickStats(ticks=3))
    )
    samples = _samples(exporter)
    assert samples[("servepilot_engine_up", ())] == 1.0
    assert samples[("servepilot_nvml_up", ())] == 0.0
    assert samples[("servepilot_collector_success", (("collector", "nvml"),))] == 0.0
    nvml_status = {
        dict(labels)["status"]: value
        for (name, labels), value in samples.items()
        if name == "servepilot_collector_status" and dict(labels)["collector"] == "nvml"
    }
    assert nvml_status == {"ok": 0.0, "no_data": 0.0, "error": 1.0}
    assert samples[("servepilot_collector_duration_seconds", (("collector", "engine"),))] == 0.003
    assert samples[("servepilot_collector_data_age_seconds", (("collector", "engine"),))] == 0.5
    assert samples[("servepilot_engine_ttft_seconds", (("quantile", "0.99"),))] == 0.25
    assert samples[("servepilot_allocator_fragmentation_ratio", (("device", "all"),))] == 0.2
    key = (
        "servepilot_finding_active",
        (("detector", "leak"), ("severity", "critical"), ("signal", "probe.reserved_bytes")),
    )
    assert samples[key] == 1.0
    assert samples[("servepilot_knob_value", (("knob", "batch"),))] == 16.0
    assert samples[("servepilot_ticks_total", ())] == 3.0
    assert samples[("servepilot_tick_duration_seconds_count", ())] == 1.0


def test_detector_and_policy_errors_are_counted_per_name() -> None:
    """ServepilotBrainFailing (docs/alerts.md) reads both; a policy that raised was only in the log."""
    exporter = Exporter()
    stats = TickStats(ticks=9, detector_errors={"memory_leak": 2}, policy_errors={"breaker": 7})
    exporter.publish(AgentState(stats=stats))
    samples = _samples(exporter)
    assert samples[("servepilot_detector_errors_total", (("detector", "memory_leak"),))] == 2.0
    assert samples[("servepilot_policy_errors_total", (("policy", "breaker"),))] == 7.0


def test_empty_state_still_exposes_valid_text() -> None:
    exporter = Exporter()
    samples = _samples(exporter)
    assert ("servepilot_ticks_total", ()) in samples
    assert ("servepilot_engine_up", ()) not in samples


def test_a_collector_with_nothing_yet_is_no_data_not_an_error() -> None:
    """A forecast warming up answers with no values: success is 0, and the status says why."""
    exporter = Exporter()
    warming = Reading.empty("forecast", 10.0, "forecast warming up (needs history and a fitted model)")
    exporter.publish(AgentState(snapshot=Snapshot.from_readings(10.0, {"forecast": warming})))
    samples = _samples(exporter)
    assert samples[("servepilot_collector_success", (("collector", "forecast"),))] == 0.0
    status = {
        s: samples[("servepilot_collector_status", (("collector", "forecast"), ("status", s)))]
        for s in ("ok", "no_data", "error")
    }
    assert status == {"ok": 0.0, "no_data": 1.0, "error": 0.0}


def test_build_info_says_the_version_and_the_loop_that_serves_the_scrape() -> None:
    """servepilot_build_info{version, python_version, event_loop} 1: the loop is the one running the scrape
    (the agent's API handler), none outside one."""
    import asyncio
    import platform

    import agent

    registry = Exporter().registry

    def labels() -> dict[str, str]:
        (family,) = [f for f in text_string_to_metric_families(generate_latest(registry).decode())
                     if f.name == "servepilot_build_info"]  # fmt: skip
        (sample,) = family.samples
        assert sample.value == 1.0
        return dict(sample.labels)

    async def scraped_in_a_loop() -> dict[str, str]:
        return labels()

    outside = labels()
    assert outside == {
        "version": agent.version(),
        "python_version": platform.python_version(),
        "event_loop": "none",
    }
    assert asyncio.run(scraped_in_a_loop())["event_loop"] == "asyncio"
