"""Token buckets and business-line resolution, in virtual time."""

from __future__ import annotations

import pytest

from agent.config import GateConfig, GateLineConfig
from agent.gate.admission import Priority
from agent.gate.ratelimit import (
    LineLimiter,
    LineLimits,
    LineResolver,
    TokenBucket,
    duration,
    retry_after_header,
)


def test_bucket_rate_is_within_2_percent_of_configured_over_60_s() -> None:
    bucket = TokenBucket(1000 / 60, 2000, now=0.0)
    t = 0.0
    while bucket.take(1, t) == 0.0:  # drain the burst first
        pass
    granted = 0
    for step in range(1, 60_001):  # one attempt per virtual millisecond for 60 s
        t = step / 1000
        granted += bucket.take(1, t) == 0.0
    assert granted == pytest.approx(1000, rel=0.02)


def test_bucket_allows_a_burst_of_its_capacity() -> None:
    bucket = TokenBucket(1.0, 5, now=0.0)
    assert [bucket.take(1, 0.0) == 0.0 for _ in range(6)] == [True] * 5 + [False]


def test_refused_take_reports_the_wait() -> None:
    bucket = TokenBucket(2.0, 1, now=0.0)
    bucket.take(1, 0.0)
    assert bucket.take(1, 0.1) == pytest.approx(0.4)


def test_clock_stepping_back_does_not_refill() -> None:
    bucket = TokenBucket(10.0, 1, now=5.0)
    bucket.take(1, 5.0)
    assert bucket.take(1, 4.0) > 0


def test_oversized_token_charge_passes_from_a_full_bucket_and_leaves_debt() -> None:
    bucket = TokenBucket(100.0, 1000, now=0.0)
    assert bucket.take(5000, 0.0) == 0.0
    assert bucket.tokens(0.0) == -4000
    assert bucket.take(1, 1.0) > 0


def test_settling_gives_back_the_unused_charge_or_takes_the_excess() -> None:
    bucket = TokenBucket(10.0, 1000, now=0.0)
    bucket.take(600, 0.0)
    bucket.settle(600, 50, 0.0)  # reserved 600, used 50
    assert bucket.tokens(0.0) == 950
    bucket.take(900, 0.0)
    bucket.settle(900, 0, 100.0)  # given back at most to the full bucket, refilled meanwhile
    assert bucket.tokens(100.0) == 1000
    bucket.take(100, 100.0)
    bucket.settle(100, 2100, 130.0)  # a request without max_tokens generated 2000 more: refilled first
    assert bucket.tokens(130.0) == -1000  # full again at 110 s, then 2000 taken: debt


def test_line_refuses_over_its_token_budget_with_a_reason() -> None:
    limiter = LineLimiter("batch", GateLineConfig(tokens_per_min=600, burst_ratio=1), now=0.0)
    assert limiter.admit(600, 0.0).granted
    verdict = limiter.admit(60, 0.0)
    assert not verdict.granted and verdict.retry_after_s == pytest.approx(6.0)
    assert "token rate" in verdict.reason


def test_refund_returns_the_request_token() -> None:
    limiter = LineLimiter("a", GateLineConfig(requests_per_min=60, burst_ratio=1), now=0.0)
    for _ in range(60):
        limiter.admit(0, 0.0)
    limiter.refund(0)
    assert limiter.admit(0, 0.0).granted


def _resolver() -> LineResolver:
    cfg = GateConfig(lines={"chat": GateLineConfig(), "batch": GateLineConfig()}, api_keys={"sk-1": "batch"})
    return LineResolver(cfg)


def test_api_key_map_wins_over_the_header() -> None:
    headers = {"Authorization": "Bearer sk-1", "x-servepilot-line": "chat"}
    assert _resolver().resolve(headers) == "batch"


def test_header_names_a_known_line() -> None:
    assert _resolver().resolve({"x-servepilot-line": "chat"}) == "chat"


def test_unknown_line_falls_back_to_the_default() -> None:
    assert _resolver().resolve({"x-servepilot-line": "nope", "Authorization": "Bearer sk-2"}) == "default"


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert [retry_after_header(s) for s in (0.0, 0.2, 1.0, 1.01)] == ["1", "1", "1", "2"]


def _spent(limits: LineLimits, line: str, now: float) -> int:
    """Take requests from ``line`` at ``now`` until refused; how many were granted."""
    granted = 0
    while limits.get(line, now).admit(0, now).granted:
        granted += 1
    return granted


def test_a_reload_keeps_each_lines_bucket_level_and_applies_the_new_rate() -> None:
    old = GateConfig(lines={"batch": GateLineConfig(requests_per_min=600, burst_ratio=1)})
    limits = LineLimits(old, now=0.0)
    assert _spent(limits, "batch", 0.0) == 600  # the burst is used up
    assert _spent(limits, "chat", 0.0) == 2000  # an unlisted line, at the default rate
    new = GateConfig(
        lines={"batch": GateLineConfig(requests_per_min=1200, burst_ratio=1, tokens_per_min=60_000)},
        default_requests_per_min=3000,
    )
    limits = limits.reconfigured(new, now=0.0)
    # no fresh burst: both lines are still empty right after the reload
    assert _spent(limits, "batch", 0.0) == 0 and _spent(limits, "chat", 0.0) == 0
    # one second later each has refilled at its new rate: 1200/min = 20, 3000/min = 50
    assert _spent(limits, "batch", 1.0) == 20 and _spent(limits, "chat", 1.0) == 50
    # a token budget new to the line starts full
    budget = limits.get("batch", 1.0).tokens
    assert budget is not None and budget.tokens(1.0) == 60_000


def test_a_reload_that_lowers_a_burst_caps_what_the_line_holds() -> None:
    limits = LineLimits(GateConfig(lines={"a": GateLineConfig(requests_per_min=600)}), now=0.0)
    limits = limits.reconfigured(GateConfig(lines={"a": GateLineConfig(requests_per_min=60)}), now=0.0)
    assert _spent(limits, "a", 0.0) == 120  # the new capacity (2 x 60), not the 1200 it held


def test_rate_limit_headers_say_the_lines_bucket_as_openai_writes_them() -> None:
    """A line of 60 requests a minute with a burst of 2 (a bucket of 120) and 6,000 tokens a minute: after
    one request of 500 tokens, 119 requests and 11,500 tokens are left, full again in 1 s and 5 s."""
    line = GateLineConfig(requests_per_min=60, burst_ratio=2.0, tokens_per_min=6000)
    limiter = LineLimiter("search", line, now=0.0)
    assert limiter.admit(500, now=0.0).granted
    assert dict(limiter.headers(0.0)) == {
        "x-ratelimit-limit-requests": "120",
        "x-ratelimit-remaining-requests": "119",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "12000",
        "x-ratelimit-remaining-tokens": "11500",
        "x-ratelimit-reset-tokens": "5s",
    }
    plain = LineLimiter("default", GateLineConfig(requests_per_min=1000), now=0.0)
    assert [name for name, _ in plain.headers(0.0)] == [
        "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
    ]  # fmt: skip
    assert [duration(s) for s in (0.0, 0.0204, 1.5, 59.99, 360.0, 3725.2)] == [
        "0ms", "21ms", "1.5s", "60s", "6m0s", "62m6s",
    ]  # fmt: skip


def test_a_request_gets_the_class_it_asks_for_up_to_its_lines_cap() -> None:
    tenant = LineLimiter("tenant", GateLineConfig(priority="low", max_priority="normal"), now=0.0)
    assert [tenant.class_of(asked) for asked in (None, "bogus", "low", "normal", "HIGH")] == [
        Priority.LOW,
        Priority.LOW,
        Priority.LOW,
        Priority.NORMAL,
        Priority.NORMAL,
    ]
    assert LineLimiter("open", GateLineConfig(), now=0.0).class_of("high") is Priority.HIGH
