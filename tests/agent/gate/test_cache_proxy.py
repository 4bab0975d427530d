"""The response cache inside the gate, on loopback, in front of an upstream that names its model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from agent.config import GateConfig
from agent.gate.proxy import Gate

TIMEOUT = 5.0


class ModelUpstream:
    """Answers with a counter in the text, so a cached answer is distinguishable from a fresh one."""

    def __init__(self) -> None:
        self.seen = 0
        self.fingerprint = "fp-a"
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen += 1
        head = {"model": "m", "system_fingerprint": self.fingerprint}
        if not body.get("stream"):
            return web.json_response({**head, "choices": [{"text": f"answer {self.seen}"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            chunk = {**head, "choices": [{"text": f"{self.seen}.{i}"}]}
            await resp.write(f"data: {web.json_response(chunk).text}\n\n".encode())
        if body.get("stream_options", {}).get("include_usage"):  # as vLLM writes it
            usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
            await resp.write(f'data: {{"choices":[],"usage":{web.json_response(usage).text}}}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"


@pytest.fixture
async def upstream() -> AsyncIterator[ModelUpstream]:
    up = ModelUpstream()
    await up.start()
    yield up
    assert up.runner is not None
    await up.runner.cleanup()


@pytest.fixture
async def gate(upstream: ModelUpstream) -> AsyncIterator[Gate]:
    cfg = GateConfig(
        enabled=True, upstreams={"primary": upstream.url}, health_interval_s=600, cache_enabled=True
    )
    g = Gate(cfg, CollectorRegistry())
    await g.start("127.0.0.1", 0)
    yield g
    await g.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
        yield session


async def _ask(client: aiohttp.ClientSession, gate: Gate, **body: Any) -> tuple[bytes, bool]:
    doc = {"model": "m", "prompt": "same", "max_tokens": 3, "temperature": 0, **body}
    async with client.post(f"http://127.0.0.1:{gate.port}/v1/completions", json=doc) as resp:
        assert resp.status == 200
        assert len(resp.headers["X-Request-Id"]) == 32  # a cached answer is a request of its own too
        return await resp.read(), resp.headers.get("X-Servepilot-Cache") == "hit"


async def test_third_identical_request_is_served_from_cache(
    gate: Gate, upstream: ModelUpstream, client: aiohttp.ClientSession
) -> None:
    first, _ = await _ask(client, gate)
    second, _ = await _ask(client, gate)  # second sighting: admitted and stored
    third, hit = await _ask(client, gate)
    assert hit and third == second != first and upstream.seen == 2


async def test_sampled_request_is_never_served_from_cache(
    gate: Gate, upstream: ModelUpstream, client: aiohttp.ClientSession
) -> None:
    hits = [(await _ask(client, gate, temperature=0.8))[1] for _ in range(4)]
    assert hits == [False] * 4 and upstream.seen == 4


async def test_model_change_invalidates_entries(
    gate: Gate, upstream: ModelUpstream, client: aiohttp.ClientSession
) -> None:
    await _ask(client, gate)
    await _ask(client, gate)
    upstream.fingerprint = "fp-b"  # the engine behind the gate was redeployed
    await _ask(client, gate, prompt="another")  # a miss shows the new identity
    body, hit = await _ask(client, gate)
    assert not hit and b"fp-b" in body and upstream.seen == 4


async def test_stream_is_replayed_as_a_stream(
    gate: Gate, upstream: ModelUpstream, client: aiohttp.ClientSession
) -> None:
    await _ask(client, gate, stream=True)
    stored, _ = await _ask(client, gate, stream=True)
    replayed, hit = await _ask(client, gate, stream=True)
    assert hit and replayed == stored and replayed.count(b"data:") == 4 and upstream.seen == 2
    assert (
        b"usage" not in stored
    )  # the usage event the gate asked for (gate.stream_usage) was not its client's
    await _ask(client, gate, stream=True, stream_options={"include_usage": True})
    asked, _ = await _ask(client, gate, stream=True, stream_options={"include_usage": True})
    replayed, hit = await _ask(client, gate, stream=True, stream_options={"include_usage": True})
    assert hit and replayed == asked and replayed.count(b'"usage"') == 1  # a client that asked gets it


async def test_cache_signals_and_metrics(
    gate: Gate, upstream: ModelUpstream, client: aiohttp.ClientSession
) -> None:
    for _ in range(4):
        await _ask(client, gate)
    values = gate.snapshot_values()
    assert values["gate.cache.hit_ratio"] == pytest.approx(0.5) and values["gate.cache.entries"] == 1


async def test_routing_everything_to_another_upstream_stops_serving_the_others_entries(
    upstream: ModelUpstream, client: aiohttp.ClientSession
) -> None:
    """The breaker sends all traffic to fp8: primary's cached answers are not fp8's; back on primary,
    they are served again. A canary's 5% share changes nothing."""
    fp8 = ModelUpstream()
    await fp8.start()
    cfg = GateConfig(
        enabled=True,
        upstreams={"primary": upstream.url, "fp8": fp8.url},
        split={"primary": 1.0},
        health_interval_s=600,
        cache_enabled=True,
    )
    g = Gate(cfg, CollectorRegistry())
    await g.start("127.0.0.1", 0)
    try:
        await _ask(client, g)
        stored, _ = await _ask(client, g)
        g.set_split({"primary": 0.95, "fp8": 0.05})
        assert (await _ask(client, g))[1]  # canary share: still primary's cache
        g.set_split({"fp8": 1.0})
        _, hit_on_fp8 = await _ask(client, g)
        g.set_split({"primary": 1.0})
        again, hit_back = await _ask(client, g)
        assert not hit_on_fp8 and fp8.seen == 1
        assert hit_back and again == stored and upstream.seen == 2
    finally:
        await g.stop()
        assert fp8.runner is not None
        await fp8.runner.cleanup()
