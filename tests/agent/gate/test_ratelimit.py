"""Token buckets and business-line resolution, in virtual time."""

from __future__ import annotations

import pytest

from agent.config import GateConfig, GateLineConfig
from agent.gate.ratelimit import LineLimiter, LineResolver, TokenBucket, retry_after_header


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
