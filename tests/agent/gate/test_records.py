"""Length buckets, per-request records, Prometheus histograms in a passed registry, windowed signals."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from agent.gate.records import GateStats, LengthBuckets, RequestRecord, tokens_per_gap


def test_default_bucket_names_and_edges() -> None:
    buckets = LengthBuckets()
    assert buckets.names == ("le256", "le1k", "le4k", "gt4k")
    assert [buckets.name(n) for n in (1, 256, 257, 1024, 4096, 4097)] == [
        "le256", "le256", "le1k", "le1k", "le4k", "gt4k",
    ]  # fmt: skip


def test_custom_edges_name_their_buckets() -> None:
    assert LengthBuckets((100, 2048)).names == ("le100", "le2k", "gt2k")


def _record(prompt: float, ttft: float, **kw: object) -> RequestRecord:
    rec = RequestRecord(
        "default", "normal", "/v1/completions", prompt, arrived=0.0, ttft_s=ttft, e2e_s=ttft * 4
    )
    rec.engine_class = "normal"  # admitted: an answer's record
    for key, value in kw.items():
        setattr(rec, key, value)
    return rec


def test_quantiles_per_bucket_over_the_window() -> None:
    stats = GateStats(CollectorRegistry(), LengthBuckets(), window_s=60, start=0.0)
    for i in range(100):
        stats.record(_record(100, ttft=(i + 1) / 100, itl_s=[0.01, 0.03]), now=10.0)
    values = stats.values(30.0)
    assert values["gate.le256.ttft_seconds.p50"] == pytest.approx(0.505)
    assert values["gate.le256.ttft_seconds.p99"] == pytest.approx(0.9901)
    assert values["gate.le256.itl_seconds.p95"] == pytest.approx(0.03)
    assert values["gate.le256.requests_per_second"] == pytest.approx(100 / 30)
    assert "gate.gt4k.ttft_seconds.p50" not in values  # no data is absence, never NaN


def test_old_samples_leave_the_window() -> None:
    stats = GateStats(CollectorRegistry(), LengthBuckets(), window_s=60, start=0.0)
    stats.record(_record(5000, ttft=1.0), now=10.0)
    values = stats.values(71.0)
    assert "gate.gt4k.ttft_seconds.p50" not in values and values["gate.gt4k.requests_per_second"] == 0


def test_rejections_count_towards_the_rejected_rate_only() -> None:
    stats = GateStats(CollectorRegistry(), LengthBuckets(), window_s=10, start=0.0)
    for _ in range(5):
        stats.record(_record(10, ttft=0.1, outcome="rejected"), now=20.0)
    values = stats.values(20.0)
    assert values["gate.rejected_per_second"] == pytest.approx(0.5)
    assert values["gate.le256.requests_per_second"] == 0


def test_refusals_for_want_of_capacity_are_shed_and_a_lines_rate_limit_is_not() -> None:
    """The forecaster counts shed requests as demand (more replicas would have served them); a request a
    business line's quota refused would be refused on any number of replicas."""
    stats = GateStats(CollectorRegistry(), LengthBuckets(), window_s=10, start=0.0)
    for refused, outcome in (
        ("queue_full", "rejected"),
        ("shed", "rejected"),
        ("queue_timeout", "expired"),
        ("request_rate", "rejected"),
        ("token_rate", "rejected"),
    ):
        stats.record(_record(10, ttft=0.1, outcome=outcome, refused=refused), now=20.0)
    values = stats.values(20.0)
    assert values["gate.rejected_per_second"] == pytest.approx(0.5)
    assert values["gate.shed_per_second"] == pytest.approx(0.3)


def test_histograms_go_to_the_passed_registry_not_the_global_one() -> None:
    registry = CollectorRegistry()
    GateStats(registry, LengthBuckets()).record(_record(2000, ttft=0.2), now=1.0)
    assert registry.get_sample_value("servepilot_gate_ttft_seconds_count", {"bucket": "le4k"}) == 1
    assert REGISTRY.get_sample_value("servepilot_gate_ttft_seconds_count", {"bucket": "le4k"}) is None


def test_each_sequences_own_gaps_count_as_inter_token_latency() -> None:
    """With ``n`` = 2 the relay takes each sequence's gaps from its own events (agent/gate/sequences.py),
    so they are inter-token latencies like a single sequence's and go into the histogram and quantiles."""
    registry = CollectorRegistry()
    stats = GateStats(registry, LengthBuckets(), window_s=60, start=0.0)
    stats.record(_record(10, ttft=0.1, itl_s=[0.1] * 18, choices=2), now=1.0)
    stats.record(_record(10, ttft=0.1, itl_s=[0.1] * 9), now=1.0)
    assert registry.get_sample_value("servepilot_gate_itl_seconds_count", {"bucket": "le256"}) == 27
    values = stats.values(1.0)
    assert values["gate.le256.itl_seconds.p50"] == pytest.approx(0.1)
    assert registry.get_sample_value("servepilot_gate_ttft_seconds_count", {"bucket": "le256"}) == 2


def test_the_window_mean_of_the_gaps_is_a_signal_the_statistic_of_the_itl_target() -> None:
    stats = GateStats(CollectorRegistry(), LengthBuckets(), window_s=60, start=0.0)
    stats.record(_record(10, ttft=0.1, itl_s=[0.01] * 9 + [0.5]), now=1.0)
    values = stats.values(1.0)
    assert values["gate.le256.itl_seconds.mean"] == pytest.approx(0.059)
    assert values["gate.le256.itl_seconds.p99"] > 0.4  # the one stall is the tail, not the mean
    assert "gate.le256.ttft_seconds.mean" not in values


def test_a_gap_that_brought_several_tokens_counts_as_each_tokens_share() -> None:
    """Speculative decoding sends a step's tokens in one event: a 97-token answer (its first token, then
    96) in 32 gaps of 30 ms is 10 ms a token, the mean the ITL target and missed_slo judge by; n = 2
    sequences of 11 tokens each in 10 gaps bring 2 a gap; without usage each event is one token and a
    gap stays a gap."""
    registry = CollectorRegistry()
    stats = GateStats(registry, LengthBuckets(), window_s=60, start=0.0)
    drafted = _record(10, ttft=0.1, itl_s=[0.03] * 32, output_tokens=97.0)
    drafted.e2e_s = 0.1 + 0.03 * 32
    assert tokens_per_gap(drafted) == 3.0
    stats.slo = (1.0, 0.012)
    assert not stats.missed_slo(drafted)  # 10 ms a token, under 12 ms
    stats.record(drafted, now=1.0)
    values = stats.values(1.0)
    assert values["gate.le256.itl_seconds.mean"] == pytest.approx(0.01)
    assert registry.get_sample_value("servepilot_gate_itl_seconds_sum", {"bucket": "le256"}) == pytest.approx(
        0.32
    )
    assert tokens_per_gap(_record(10, ttft=0.1, itl_s=[0.02] * 10, output_tokens=22.0, choices=2)) == 2.0
    assert tokens_per_gap(_record(10, ttft=0.1, itl_s=[0.02] * 10, output_tokens=11.0)) == 1.0
    assert tokens_per_gap(_record(10, ttft=0.1, itl_s=[0.02] * 10, output_tokens=5.0)) == 1.0  # never below


def test_a_batch_is_bucketed_by_the_length_of_one_of_its_prompts() -> None:
    """Sixteen 200-token prompts in one request are short prompts (le256), not a 3,200-token one."""
    registry = CollectorRegistry()
    stats = GateStats(registry, LengthBuckets(), window_s=60, start=0.0)
    stats.record(_record(3200, ttft=0.1, prompts=16, choices=16), now=1.0)
    assert registry.get_sample_value("servepilot_gate_ttft_seconds_count", {"bucket": "le256"}) == 1
    assert registry.get_sample_value("servepilot_gate_ttft_seconds_count", {"bucket": "le4k"}) is None
    prompt = registry.get_sample_value("servepilot_gate_tokens_total", {"line": "default", "kind": "prompt"})
    assert prompt == 3200  # the token count is the whole batch's


def test_a_request_no_engine_worked_on_counts_no_tokens() -> None:
    """Left while queued (never admitted) or refused by the engine before a token: the gate's prompt
    estimate is no token relayed. A stream that failed with a 4xx event after tokens did cost the engine."""
    registry = CollectorRegistry()
    stats = GateStats(registry, LengthBuckets(), window_s=60, start=0.0)
    queued = _record(900, ttft=0.0, outcome="disconnected", engine_class="")
    refused = _record(5000, ttft=0.0, outcome="client_error")
    failed_late = _record(40, ttft=0.1, outcome="client_error", output_tokens=3.0)
    assert queued.unprocessed and refused.unprocessed and not failed_late.unprocessed
    for rec in (queued, refused, failed_late):
        stats.record(rec, now=1.0)
    tokens = {
        kind: registry.get_sample_value("servepilot_gate_tokens_total", {"line": "default", "kind": kind})
        for kind in ("prompt", "output")
    }
    assert tokens == {"prompt": 40, "output": 3}
