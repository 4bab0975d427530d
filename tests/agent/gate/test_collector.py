"""The gate's collector: its signals, and this tick's answers for the breaker and the canary."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry

from agent.config import GateConfig
from agent.gate.collector import GateCollector
from agent.gate.proxy import Gate
from agent.gate.records import RequestRecord
from policies import knobs


def _record(outcome: str, ttft: float | None, e2e: float = 1.0, tokens: float = 11.0) -> RequestRecord:
    return RequestRecord(
        "default", "normal", "/v1/completions", 10, 0.0, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens,
        outcome=outcome,
    )  # fmt: skip


async def test_each_tick_counts_that_ticks_answers_errors_and_slo_misses() -> None:
    gate = Gate(GateConfig(enabled=True, upstreams={"primary": "http://127.0.0.1:9"}), CollectorRegistry())
    gate.stats.slo = (2.0, 0.1)
    collector = GateCollector(gate)
    first = await collector.collect(1.0)
    assert [first.values[k] for k in (knobs.GATE_REQUESTS, knobs.GATE_ERRORS, knobs.GATE_SLO_BAD)] == [
        0,
        0,
        0,
    ]
    for rec in (
        _record("ok", 0.1),  # within: TTFT 0.1 s, (1.0 - 0.1) / 10 = 90 ms per token
        _record("ok", 4.0, e2e=5.0),  # TTFT over 2 s
        _record("ok", 0.1, e2e=3.1),  # 300 ms per token over 100 ms
        _record("upstream_error", None),  # a 5xx misses the SLO too
        _record("client_error", 0.1),  # answered, the client's fault: not a miss
        _record("rejected", None),  # refused before the upstream: not an answer
        _record("disconnected", 0.1),  # the client left: not an answer
    ):
        gate.stats.record(rec, 1.5)
    reading = await collector.collect(2.0)
    assert reading.values[knobs.GATE_REQUESTS] == 5
    assert reading.values[knobs.GATE_ERRORS] == 1
    assert reading.values[knobs.GATE_SLO_BAD] == 3
    assert (await collector.collect(3.0)).values[knobs.GATE_REQUESTS] == 0  # deltas, not totals


async def test_without_an_slo_only_failures_are_misses() -> None:
    gate = Gate(GateConfig(enabled=True, upstreams={"primary": "http://127.0.0.1:9"}), CollectorRegistry())
    collector = GateCollector(gate)
    gate.stats.record(_record("ok", 40.0, e2e=90.0), 1.0)
    gate.stats.record(_record("upstream_error", None), 1.0)
    reading = await collector.collect(2.0)
    assert (reading.values[knobs.GATE_REQUESTS], reading.values[knobs.GATE_SLO_BAD]) == (2, 1)


async def test_each_upstream_reports_its_own_answers_and_health() -> None:
    """What the canary checks its candidate by: the answers each upstream gave (after failover) and
    whether its health check passes."""
    upstreams = {"primary": "http://127.0.0.1:9", "fp8": "http://127.0.0.1:10"}
    gate = Gate(GateConfig(enabled=True, upstreams=upstreams), CollectorRegistry())
    gate.stats.slo = (2.0, 0.1)
    collector = GateCollector(gate)
    for upstream, rec in (
        ("primary", _record("ok", 0.1)),
        ("primary", _record("upstream_error", None)),
        ("fp8", _record("ok", 4.0, e2e=5.0)),
        ("", _record("upstream_error", None)),  # no upstream reachable: no upstream's answer
    ):
        rec.upstream = upstream
        gate.stats.record(rec, 1.0)
    gate.pool.mark("fp8", False, 1.0, "refused")
    values = (await collector.collect(2.0)).values
    assert _upstream(values, "primary") == [2, 1, 1, 1]
    assert _upstream(values, "fp8") == [1, 0, 1, 0]
    assert values[knobs.GATE_REQUESTS] == 4
    gate.pool.mark("fp8", True, 2.0)
    assert _upstream((await collector.collect(3.0)).values, "fp8") == [0, 0, 0, 1]  # deltas, not totals


def _upstream(values: Mapping[str, float], name: str) -> list[float]:
    return [values[knobs.upstream_signal(name, what)] for what in ("requests", "errors", "slo_bad", "up")]


async def test_an_answer_in_one_piece_is_judged_by_when_a_stream_meeting_the_slo_would_have_ended() -> None:
    """A non-streamed answer's client sees its first token with its last: with a 2 s TTFT and a 100 ms
    ITL SLO, 11 tokens may take 2 + 10 x 0.1 = 3 s; a pooling answer (no output tokens) the TTFT SLO."""
    gate = Gate(GateConfig(enabled=True, upstreams={"primary": "http://127.0.0.1:9"}), CollectorRegistry())
    gate.stats.slo = (2.0, 0.1)
    collector = GateCollector(gate)
    await collector.collect(1.0)
    for e2e, tokens in ((2.9, 11.0), (3.1, 11.0), (1.9, 0.0), (2.1, 0.0)):
        rec = _record("ok", None, e2e=e2e, tokens=tokens)
        rec.whole = True
        gate.stats.record(rec, 1.5)
    values = (await collector.collect(2.0)).values
    assert (values[knobs.GATE_REQUESTS], values[knobs.GATE_SLO_BAD]) == (4, 2)  # 3.1 s and 2.1 s


async def test_several_sequences_are_judged_each_by_its_own_share_of_the_tokens() -> None:
    """``n`` = 2: 20 tokens are two sequences of 10 decoding side by side. Streamed, a first token at
    0.1 s and the end at 1.2 s is 1.1 s / 9 = 122 ms per token for each: a miss (taken as one sequence of
    20 it looked like 58 ms). In one piece, 10 tokens each may take 2 + 9 x 0.1 = 2.9 s."""
    gate = Gate(GateConfig(enabled=True, upstreams={"primary": "http://127.0.0.1:9"}), CollectorRegistry())
    gate.stats.slo = (2.0, 0.1)
    collector = GateCollector(gate)
    await collector.collect(1.0)
    streamed = _record("ok", 0.1, e2e=1.2, tokens=20.0)
    whole_in, whole_late = (_record("ok", None, e2e=e2e, tokens=20.0) for e2e in (2.85, 2.95))
    for rec in (streamed, whole_in, whole_late):
        rec.choices = 2
    whole_in.whole = whole_late.whole = True
    for rec in (streamed, whole_in, whole_late):
        gate.stats.record(rec, 1.5)
    values = (await collector.collect(2.0)).values
    assert (values[knobs.GATE_REQUESTS], values[knobs.GATE_SLO_BAD]) == (3, 2)


async def test_what_waits_unanswered_at_this_pods_engine_is_published_for_the_stall_detector() -> None:
    """Requests sent to the engine upstream with no byte back yet: ``gate.engine_unanswered`` (the
    engine_stall detector counts them held where the engine does not). A stream that has had a byte, and
    a request at another upstream, are not; without a named engine upstream nothing is published."""
    from detectors.stall import ENGINE_UNANSWERED

    upstreams = {"primary": "http://127.0.0.1:9", "small": "http://127.0.0.1:10"}
    gate = Gate(GateConfig(enabled=True, upstreams=upstreams), CollectorRegistry())
    collector = GateCollector(gate)
    waiting, streaming, elsewhere = (_record("ok", None) for _ in range(3))
    gate.held.sent(waiting, "primary", True, 1.0)
    gate.held.sent(streaming, "primary", True, 1.0)
    gate.held.sent(elsewhere, "small", True, 1.0)
    streaming.heard_at = 1.5
    assert ENGINE_UNANSWERED not in (await collector.collect(2.0)).values
    gate.mark_engine("primary")
    assert (await collector.collect(3.0)).values[ENGINE_UNANSWERED] == 1.0
    gate.held.done(waiting)
    assert (await collector.collect(4.0)).values[ENGINE_UNANSWERED] == 0.0


async def test_each_class_reports_its_answers_and_misses_by_its_own_targets() -> None:
    """What the energy policy's per-class verdicts read: a high answer at 80 ms per token misses high's
    own 50 ms, the same answer in normal meets the SLO's 100 ms."""
    gate = Gate(GateConfig(enabled=True, upstreams={"primary": "http://127.0.0.1:9"}), CollectorRegistry())
    gate.stats.slo = (2.0, 0.1)
    gate.stats.slo_by_priority = {"high": (2.0, 0.05)}
    collector = GateCollector(gate)
    for priority in ("high", "high", "normal"):
        rec = _record("ok", 0.2)  # (1.0 - 0.2) / 10 = 80 ms per token
        rec.priority = priority
        gate.stats.record(rec, 1.0)
    gate.stats.attempt_failed("primary", "normal")  # a retried 5xx: an answer, not a miss
    values = (await collector.collect(2.0)).values
    assert (
        values[knobs.class_signal("high", "requests")] == 2
        and values[knobs.class_signal("high", "slo_bad")] == 2
    )
    assert values[knobs.class_signal("normal", "requests")] == 2
    assert values[knobs.class_signal("normal", "slo_bad")] == 0
    assert knobs.class_signal("low", "requests") not in values  # a class never answered says nothing
    again = (await collector.collect(3.0)).values
    assert again[knobs.class_signal("high", "requests")] == 0  # deltas, not totals
