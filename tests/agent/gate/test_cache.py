"""The response cache: what may be cached, admission, consistency, tiers. Time is injected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.config import GateConfig
from agent.gate.cache import Entry, Fill, ResponseCache, cache_key, response_identity

PATH = "/v1/completions"
ID_A = response_identity(b'{"model": "m", "system_fingerprint": "fp-a"}', False)
ID_B = response_identity(b'{"model": "m", "system_fingerprint": "fp-b"}', False)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _key(line: str = "default", headers: dict[str, str] | None = None, **body: Any) -> str | None:
    doc = {"model": "m", "prompt": "p", "temperature": 0, **body}
    return cache_key(PATH, json.dumps(doc).encode(), line, headers or {}, ())


def _cache(clock: Clock | None = None, **cfg: Any) -> ResponseCache:
    return ResponseCache(
        GateConfig(cache_enabled=True, **cfg), CollectorRegistry(), wall_clock=clock or Clock()
    )


def test_temperature_zero_is_cacheable() -> None:
    assert _key() is not None


def test_sampled_request_is_never_cacheable() -> None:
    assert _key(temperature=0.7) is None
    assert cache_key(PATH, b'{"model": "m", "prompt": "p"}', "default", {}, ()) is None  # default is 1


def test_fixed_seed_makes_a_sampled_request_cacheable() -> None:
    assert _key(temperature=0.9, seed=7) is not None and _key(temperature=0.9, seed=True) is None


def test_tools_are_never_cacheable() -> None:
    assert _key(tools=[{"type": "function", "function": {"name": "pay"}}]) is None


def test_no_store_header_bypasses() -> None:
    assert _key(headers={"Cache-Control": "no-store"}) is None


def test_line_not_allowed_bypasses() -> None:
    body = json.dumps({"prompt": "p", "temperature": 0}).encode()
    assert cache_key(PATH, body, "batch", {}, ("chat",)) is None
    assert cache_key(PATH, body, "chat", {}, ("chat",)) is not None


def test_key_ignores_json_key_order_but_not_content() -> None:
    a = cache_key(PATH, b'{"prompt": "p", "temperature": 0}', "x", {}, ())
    b = cache_key(PATH, b'{"temperature": 0, "prompt": "p"}', "x", {}, ())
    assert a == b and a != _key(prompt="q")


def test_entry_is_admitted_on_second_sighting_only() -> None:
    cache = _cache()
    assert cache.admit("k") is False and cache.admit("k") is True


def test_hit_counts_saved_gpu_time() -> None:
    cache = _cache()
    cache.put("k", b"{}", "application/json", False, 1.5, ID_A)
    assert cache.get("k") is not None and cache.saved_gpu._value.get() == 1.5
    assert cache.values()["gate.cache.hit_ratio"] == 1.0


def test_entry_expires_after_ttl() -> None:
    clock = Clock()
    cache = _cache(clock, cache_ttl_s=10)
    cache.put("k", b"{}", "application/json", False, 0.1, ID_A)
    clock.now += 10
    assert cache.get("k") is None and cache.values()["gate.cache.entries"] == 0


def test_model_change_invalidates() -> None:
    cache = _cache()
    cache.put("k", b"{}", "application/json", False, 0.1, ID_A)
    cache.observe_identity(ID_B)  # a fresh response from a new model version
    assert cache.get("k") is None


def test_declared_model_version_change_invalidates() -> None:
    cache = _cache()
    cache.put("k", b"{}", "application/json", False, 0.1, ID_A)
    cache.set_model_version("fp8")
    assert cache.get("k") is None


def test_memory_tier_evicts_least_recently_used_within_its_bound() -> None:
    cache = _cache(cache_max_bytes=2048, cache_max_entry_bytes=1024)
    for key in "abc":
        cache.put(key, b"x" * 1000, "application/json", False, 0.1, ID_A)
    assert cache.get("a") is None and cache.get("c") is not None and cache.memory_bytes == 2000


def test_oversized_response_is_not_kept() -> None:
    cache = _cache(cache_max_entry_bytes=64)
    assert cache.put("k", b"x" * 65, "application/json", False, 0.1, ID_A) is False


def test_disk_tier_survives_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    first = _cache(clock, cache_dir=str(tmp_path))
    first.put("k", b'{"ok": 1}', "application/json", False, 0.3, ID_A)
    first.close()
    second = _cache(clock, cache_dir=str(tmp_path))
    second.observe_identity(ID_A)
    entry = second.get("k")
    assert entry is not None and entry.body == b'{"ok": 1}' and second.values()["gate.cache.entries"] == 1
    second.close()


def test_stream_entry_replays_its_events() -> None:
    entry = Entry(b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n", "text/event-stream", True, 0.0, "", 0.0)
    assert entry.events() == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]


def test_stream_identity_comes_from_the_first_event() -> None:
    payload = b'data: {"model": "m", "system_fingerprint": "x"}\n\ndata: [DONE]\n\n'
    assert response_identity(payload, True) == "m|x" and response_identity(b"garbage", False) == ""


def test_fill_over_its_limit_stores_nothing() -> None:
    fill = Fill("k", True, 4)
    fill.feed(b"abc")
    fill.feed(b"de")
    assert fill.body == b"" and fill.head == b"abcde"


def test_hot_keys_rank_by_hits() -> None:
    cache = _cache()
    for key in ("a" * 64, "b" * 64):
        cache.put(key, b"{}", "application/json", False, 0.0, ID_A)
    for _ in range(3):
        cache.get("b" * 64)
    cache.get("a" * 64)
    assert cache.hot_keys(1) == [("b" * 16, 3)]


@pytest.mark.parametrize("ttl", [0.0, -1.0])
def test_config_refuses_a_non_positive_ttl(ttl: float) -> None:
    with pytest.raises(ValueError, match="cache_ttl_s"):
        GateConfig(cache_ttl_s=ttl)
