"""Every series a dashboard or a rule queries, and which component exports it.

One list, so "does this series exist?" has one answer. ``tests/dashboards/test_series.py`` checks it
three ways: series marked ``agent`` must be in the golden ``/metrics`` of the agent, ``vllm``/``sglang``
ones in the real engine scrapes under ``tests/fixtures/expo/``, and the rest must be marked *planned*
with the component that will export them (:data:`PLANNED`, reported so the list shrinks as features
land). Every metric name found in a PromQL expression (parsed with ``promql_parser``) must be listed
here or be produced by one of our recording rules.

Names are sample names as PromQL sees them (``_total``, ``_bucket`` included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Source = Literal["agent", "vllm", "sglang", "prometheus", "planned"]


@dataclass(frozen=True)
class Series:
    name: str
    source: Source
    note: str = ""


def _agent(*names: str) -> list[Series]:
    return [Series(n, "agent") for n in names]


AGENT: list[Series] = _agent(
    "servepilot_collector_success",
    "servepilot_collector_status",
    "servepilot_collector_data_age_seconds",
    "servepilot_engine_up",
    "servepilot_nvml_up",
    "servepilot_gpu_utilization_ratio",
    "servepilot_gpu_memory_bandwidth_utilization_ratio",
    "servepilot_gpu_sm_clock_hz",
    "servepilot_gpu_memory_clock_hz",
    "servepilot_gpu_temperature_celsius",
    "servepilot_gpu_power_watts",
    "servepilot_gpu_power_limit_watts",
    "servepilot_gpu_energy_joules",
    "servepilot_gpu_memory_used_bytes",
    "servepilot_gpu_memory_total_bytes",
    "servepilot_gpu_throttle_active",
    "servepilot_engine_ttft_seconds",
    "servepilot_engine_itl_seconds",
    "servepilot_engine_requests_running",
    "servepilot_engine_requests_waiting",
    "servepilot_engine_kv_cache_usage_ratio",
    "servepilot_engine_generation_tokens_per_second",
    "servepilot_engine_spec_acceptance_ratio",
    "servepilot_engine_spec_accepted_by_position_per_second",
    "servepilot_engine_spec_drafts_per_second",
    "servepilot_engine_prompt_tokens_per_second",
    "servepilot_engine_process_start_time_seconds",  # where the engine says it (vLLM, SGLang)
    "servepilot_allocator_reserved_bytes",
    "servepilot_finding_active",
    "servepilot_finding_score",
    "servepilot_findings_raised_total",
    "servepilot_findings_suppressed_total",
    "servepilot_detector_errors_total",
    "servepilot_policy_errors_total",
    "servepilot_knob_value",
    "servepilot_tick_duration_seconds_bucket",
    "servepilot_build_info",
    "servepilot_webhook_deliveries_total",
    "servepilot_webhook_oldest_pending_age_seconds",
    # forecasts (forecast.enabled; once a model is fitted: restored state or enough live minutes)
    "servepilot_forecast_requests_per_second",
    "servepilot_forecast_capacity_requests_per_second",
    # decisions: breaker policy state, audited actions, the configured SLO targets
    "servepilot_breaker_level",
    "servepilot_actions_total",
    "servepilot_actuation_paused",
    "servepilot_actuation_mode",
    "servepilot_engine_control_up",
    "servepilot_actuator_waiting",  # the GPU actuator before the probe names the engine's GPUs
    "servepilot_config_last_reload_successful",
    "servepilot_gate_access_log_dropped_total",  # gate.access_log
    "servepilot_tls_files_current",  # a TLS context, the API's or a client's (agent.tls_*, *.tls_*)
    "servepilot_slo_ttft_seconds",
    "servepilot_slo_itl_seconds",
    "servepilot_policy_itl_target_seconds",  # the ITL the policies steer to (agent/itl_steering.py)
    # the admission gate's own series (gate.enabled)
    "servepilot_gate_ttft_seconds_bucket",
    "servepilot_gate_limit",
    "servepilot_gate_requests_total",
    "servepilot_gate_tokens_total",
    "servepilot_gate_unauthorized_total",  # gate.require_api_key
    "servepilot_gate_refused_total",
    "servepilot_gate_answered_total",
    "servepilot_gate_slo_bad_total",
    "servepilot_gate_queue_wait_seconds_bucket",
    "servepilot_gate_held_seconds_bucket",
    "servepilot_gate_held_seconds_count",
    "servepilot_gate_in_flight",
    "servepilot_gate_queue_depth",
    "servepilot_gate_line_waiting",
    "servepilot_gate_upstream_up",
    "servepilot_gate_upstream_role",
    "servepilot_gate_split_ratio",
    "servepilot_gate_late_requests",
    "servepilot_gate_upstream_ejections_total",
    "servepilot_gate_resent_total",
    "servepilot_gate_retried_total",
    "servepilot_gate_websockets",
    "servepilot_gate_peers",
    "servepilot_gate_stream_usage_refused_total",
    "servepilot_gate_blind_seconds_total",
    "servepilot_config_reloads_total",
)

ENGINE: list[Series] = [
    Series("vllm:num_requests_running", "vllm"),
    Series("vllm:generation_tokens_total", "vllm"),
    Series("vllm:request_success_total", "vllm"),
    Series("vllm:time_to_first_token_seconds_bucket", "vllm"),
    Series("vllm:time_to_first_token_seconds_count", "vllm"),
    Series("vllm:e2e_request_latency_seconds_bucket", "vllm"),
    Series("sglang:generation_tokens_total", "sglang"),
    Series("sglang:time_to_first_token_seconds_bucket", "sglang"),
    Series("sglang:time_to_first_token_seconds_count", "sglang"),
    Series("sglang:e2e_request_latency_seconds_bucket", "sglang"),
]

PROMETHEUS: list[Series] = [Series("up", "prometheus", "scrape health, added by Prometheus to every target")]

#: Series that components still being built will export. Shrinks as features land (empty: all are real).
PLANNED: list[Series] = []

ALL: dict[str, Series] = {s.name: s for s in [*AGENT, *ENGINE, *PROMETHEUS, *PLANNED]}

#: Labels Prometheus attaches to every scraped series (target labels), usable in any selector.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container"})
