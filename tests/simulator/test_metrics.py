"""Prometheus exposition of the engine and of the simulated probe."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from simulator.engine import make_core
from simulator.faults import FaultSwitches
from simulator.metrics import ProbeCollector, VllmCollector, registry_with, render

VLLM_FAMILIES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:iteration_tokens_total",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:cache_config_info",
}


def _families(text: bytes) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def test_engine_exposes_the_vllm_v1_families() -> None:
    core = make_core()
    assert set(_families(render(registry_with(VllmCollector(core, "m"))))) >= VLLM_FAMILIES


def test_engine_exposes_its_start_time_as_vllms_process_collector_does() -> None:
    """The sidecar tells a restart by it (agent/collectors/engine_metrics.py)."""
    text = render(registry_with(VllmCollector(make_core(), "m", started_at=1795968446.72))).decode()
    assert "\nprocess_start_time_seconds 1.79596844672e+09\n" in text


def test_two_simulators_do_not_share_a_registry() -> None:
    first, second = make_core(), make_core()
    first.stats.generation_tokens = 7
    text = render(registry_with(VllmCollector(second, "m"))).decode()
    assert 'vllm:generation_tokens_total{engine="0",model_name="m"} 0.0' in text


def test_probe_reports_fragmentation_and_info() -> None:
    core = make_core()
    core.set_faults(FaultSwitches(fragmentation_ratio=0.4), now=0.0)
    families = _families(render(registry_with(ProbeCollector(core, lambda: 0.0, pid=77))))
    ratio = families["servepilot_probe_fragmentation_ratio"].samples[0]  # type: ignore[attr-defined]
    assert ratio.labels == {"device": "0"} and abs(ratio.value - 0.4) < 1e-9
    info = families["servepilot_probe_info"].samples[0]  # type: ignore[attr-defined]
    assert info.labels["pid"] == "77"
    counters = {
        s.name
        for f in ("servepilot_probe_alloc_retries", "servepilot_probe_ooms")
        for s in families[f].samples
    }  # type: ignore[attr-defined]
    assert counters == {"servepilot_probe_alloc_retries_total", "servepilot_probe_ooms_total"}


def test_probe_names_each_device_s_gpu_as_the_real_probe_does() -> None:
    text = render(registry_with(ProbeCollector(make_core(), lambda: 0.0, pid=7, uuids=["GPU-b", "GPU-c"])))
    devices = {
        s.labels["device"]: s.labels["uuid"]
        for s in _families(text)["servepilot_probe_device_info"].samples  # type: ignore[attr-defined]
    }
    assert devices == {"0": "GPU-b", "1": "GPU-c"}


def test_probe_counts_an_oom_when_a_leak_fills_the_gpu() -> None:
    core = make_core()
    core.set_faults(FaultSwitches(leak_bytes_per_hour=100 * 1024**3, leak_step_bytes=1024**3), now=0.0)
    probe = ProbeCollector(core, lambda: 3600.0, pid=1)
    list(probe.collect())
    assert probe.ooms == 1 and probe.alloc_retries == 1
