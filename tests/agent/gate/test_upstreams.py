"""Traffic split and failover order (pure)."""

from __future__ import annotations

import pytest

from agent.gate.upstreams import UpstreamPool

URLS = {"primary": "http://127.0.0.1:1", "fp8": "http://127.0.0.1:2", "small": "http://127.0.0.1:3"}


def test_split_sends_traffic_in_proportion() -> None:
    pool = UpstreamPool(URLS, {"primary": 0.9, "fp8": 0.1})
    firsts = [pool.candidates(i / 1000)[0].name for i in range(1000)]
    assert firsts.count("fp8") == 100 and firsts.count("small") == 0


def test_unhealthy_upstream_is_skipped_and_others_follow_as_failover() -> None:
    pool = UpstreamPool(URLS, {"primary": 1.0})
    pool.mark("primary", False, 1.0, "refused")
    assert [up.name for up in pool.candidates(0.0)] in (["fp8", "small"], ["small", "fp8"])


def test_when_nothing_is_healthy_every_upstream_is_still_tried() -> None:
    pool = UpstreamPool(URLS, {"fp8": 1.0})
    for name in URLS:
        pool.mark(name, False, 1.0)
    assert pool.candidates(0.5)[0].name == "fp8" and len(pool.candidates(0.5)) == 3


@pytest.mark.parametrize(
    ("split", "message"),
    [({"nope": 1.0}, "unknown upstream"), ({"primary": -1.0}, ">= 0"), ({"primary": 0.0}, "all be zero")],
)
def test_bad_split_is_refused_and_the_old_one_kept(split: dict[str, float], message: str) -> None:
    pool = UpstreamPool(URLS, {"primary": 1.0})
    with pytest.raises(ValueError, match=message):
        pool.set_split(split)
    assert pool.weights["primary"] == 1.0


def test_an_upstream_going_down_is_a_warning_and_coming_back_is_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A vLLM killed and restarted logged "upstream primary is up" as a warning: a recovery raised
    whatever alerts on the sidecar's warnings."""
    pool = UpstreamPool({"primary": "http://a", "fp8": "http://b"}, {"primary": 1.0})
    with caplog.at_level("INFO", logger="agent.gate.upstreams"):
        assert pool.mark("primary", False, 1.0, "ClientConnectorError: refused")
        assert not pool.mark("primary", False, 2.0, "ClientConnectorError: refused")  # no change: no line
        assert pool.mark("primary", True, 3.0)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "upstream primary is down: ClientConnectorError: refused"),
        ("INFO", "upstream primary is up"),
    ]
