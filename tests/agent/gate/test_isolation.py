"""Long-request isolation: the lane's rule, its config check, and the gate routing through it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from agent.config import GateConfig
from agent.gate.isolation import IsolationLane
from agent.gate.proxy import Gate
from tests.agent.gate.test_proxy import TIMEOUT, Upstream, _body, _post, _until

UPSTREAMS = {"primary": "http://127.0.0.1:1", "long": "http://127.0.0.1:2"}


def _cfg(**overrides: object) -> GateConfig:
    return GateConfig(upstreams=UPSTREAMS, isolation_threshold_tokens=1000, **overrides)  # type: ignore[arg-type]


def test_prompt_at_threshold_is_long() -> None:
    lane = IsolationLane(_cfg(), CollectorRegistry())
    assert lane.is_long(1000) and not lane.is_long(999.75)


def test_lane_has_its_own_limit() -> None:
    lane = IsolationLane(_cfg(isolation_max_in_flight=3, max_in_flight=50), CollectorRegistry())
    assert lane.admission.limit == 3 and lane.values()["gate.isolation.limit"] == 3.0


def test_threshold_zero_means_off() -> None:
    with pytest.raises(ValueError, match="off"):
        IsolationLane(GateConfig(upstreams=UPSTREAMS), CollectorRegistry())


def test_config_rejects_an_unknown_long_upstream() -> None:
    with pytest.raises(ValueError, match="isolation_upstream 'big' is not one of the upstreams"):
        GateConfig(upstreams=UPSTREAMS, isolation_threshold_tokens=10, isolation_upstream="big")


def test_isolation_metrics_go_to_the_given_registry() -> None:
    registry = CollectorRegistry()
    IsolationLane(_cfg(), registry)
    assert registry.get_sample_value("servepilot_gate_isolation_threshold_tokens") == 1000.0
    assert registry.get_sample_value("servepilot_gate_isolation_requests_total") == 0.0


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Upstream, Upstream]]:
    short, long = Upstream(), Upstream()
    await short.start()
    await long.start()
    yield short, long
    for up in (short, long):
        up.release.set()
        assert up.runner is not None
        await up.runner.cleanup()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
        yield session


async def _isolating_gate(short: Upstream, long: Upstream) -> Gate:
    cfg = GateConfig(
        enabled=True,
        upstreams={"primary": short.url, "long": long.url},
        split={"primary": 1.0},
        health_interval_s=600,
        max_in_flight=4,
        isolation_threshold_tokens=100,  # 400 characters
        isolation_max_in_flight=1,
    )
    gate = Gate(cfg, CollectorRegistry())
    await gate.start("127.0.0.1", 0)
    return gate


async def test_long_prompt_goes_to_the_long_pool(
    pair: tuple[Upstream, Upstream], client: aiohttp.ClientSession
) -> None:
    short, long = pair
    gate = await _isolating_gate(short, long)
    try:
        assert (await _post(client, gate, _body(prompt="x" * 400))).status == 200
        assert (await _post(client, gate, _body(prompt="x" * 40))).status == 200
        assert (long.seen, short.seen) == (1, 1)
        # 140 Chinese characters, 105 tokens by their bytes (about 100-140 by a tokenizer): long; counted
        # 4 characters a token, as until 2026-12-06, they were 35 and went to the short pool
        assert (await _post(client, gate, _body(prompt="长上下文" * 35))).status == 200
        assert (long.seen, short.seen) == (2, 1)
    finally:
        await gate.stop()


async def test_a_batch_of_short_prompts_is_judged_by_one_prompt_not_their_sum(
    pair: tuple[Upstream, Upstream], client: aiohttp.ClientSession
) -> None:
    """Four 40-token prompts in one completions request (160 tokens in all, over the 100-token threshold)
    are four short prompts: they stay in the short pool; a batch with a long prompt's share goes long."""
    short, long = pair
    gate = await _isolating_gate(short, long)
    try:
        assert (await _post(client, gate, _body(prompt=["x" * 160] * 4))).status == 200
        assert (long.seen, short.seen) == (0, 1)
        assert (await _post(client, gate, _body(prompt=["x" * 400] * 2))).status == 200
        assert (long.seen, short.seen) == (1, 1)
    finally:
        await gate.stop()


async def test_parked_long_requests_do_not_hold_short_ones(
    pair: tuple[Upstream, Upstream], client: aiohttp.ClientSession
) -> None:
    short, long = pair
    long.release.clear()
    gate = await _isolating_gate(short, long)
    try:
        held = [asyncio.create_task(_post(client, gate, _body(prompt="y" * 800))) for _ in range(2)]
        await asyncio.wait_for(
            _until(lambda: gate.snapshot_values()["gate.isolation.queue_depth"] == 1), TIMEOUT
        )
        resp = await _post(client, gate, _body(prompt="short"))
        assert resp.status == 200 and long.running == 1 and gate.admission.in_flight == 0
        long.release.set()
        assert [(await t).status for t in held] == [200, 200]
    finally:
        await gate.stop()
