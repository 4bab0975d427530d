"""What the gate adds to its answers.

One id per request across the client, the gate and the engine (``gate.request_ids``): the client's
``X-Request-Id``, or one the gate gives it, is sent to the engine (vLLM names its request by it, in its
log and its abort messages), returned to the client, refusals included, and written in the access log.
And the business line's rate-limit headers in OpenAI's shape (``gate.rate_limit_headers``)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

from agent.config import GateLineConfig
from tests.agent.gate.parked import ParkedEngine, serving
from tests.engines.client import gate_for

TIMEOUT = 5.0


class Echo(ParkedEngine):
    """``/v1/completions`` answered at once; keeps the ``X-Request-Id`` each request came with."""

    path = "/v1/completions"

    def __init__(self) -> None:
        super().__init__()
        self.go.set()
        self.ids: list[str | None] = []
        self.forwarded_for: list[str | None] = []

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        self.ids.append(request.headers.get("X-Request-Id"))
        self.forwarded_for.append(request.headers.get("X-Forwarded-For"))
        usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
        if body.get("stream"):  # its headers leave with its first byte, before the gate's handler ends
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Server": "uvicorn"})
            await stream.prepare(request)
            await stream.write(b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n')
            await stream.write_eof()
            return stream
        return web.json_response({"choices": [{"text": "a"}], "usage": usage}, headers={"Server": "uvicorn"})


@pytest.fixture
async def engine() -> AsyncIterator[Echo]:
    async for served in serving(Echo()):
        yield served


async def test_a_request_without_an_id_gets_one_the_engine_the_client_and_the_log_share(
    engine: Echo, tmp_path: Path
) -> None:
    log = tmp_path / "access.jsonl"
    lines = {"batch": GateLineConfig(requests_per_min=1, burst_ratio=1.0)}
    body = {"prompt": "hi", "max_tokens": 1}
    async with (
        gate_for(engine.url, access_log=str(log), lines=lines) as (_, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        async with client.post(f"{base}/v1/completions", json=body) as r:
            given = r.headers["X-Request-Id"]
        async with client.post(f"{base}/v1/completions", json=body, headers={"X-Request-Id": "mine-1"}) as r:
            assert r.headers["X-Request-Id"] == "mine-1"
        async with client.post(f"{base}/v1/completions", json={**body, "stream": True}) as r:
            streamed = r.headers["X-Request-Id"]
            assert (await r.read()).endswith(b"[DONE]\n\n")
        refused = []
        for _ in range(2):  # the line's one request a minute: the second is refused, its id said
            async with client.post(
                f"{base}/v1/completions", json=body, headers={"x-servepilot-line": "batch"}
            ) as r:
                refused.append((r.status, r.headers.get("X-Request-Id")))
    assert len(given) == 32 and engine.ids[:3] == [given, "mine-1", streamed]
    assert refused[1][0] == 429 and refused[1][1] and refused[1][1] != refused[0][1]
    logged = [json.loads(line)["request_id"] for line in log.read_text().splitlines()]
    assert logged == [given, "mine-1", streamed, refused[0][1], refused[1][1]]
    # and on the latency histograms, as exemplars (OpenMetrics): from a slow bucket to its access line
    exposed = openmetrics(registry).decode()
    e2e = [line for line in exposed.splitlines() if line.startswith("servepilot_gate_e2e_seconds_bucket")]
    carried = set(re.findall(r'# \{request_id="([^"]+)"\}', "\n".join(e2e)))  # a bucket keeps its latest
    assert carried and carried <= {given, "mine-1", streamed, refused[0][1]}, (
        e2e
    )  # the answered, not the refused


async def test_the_engine_is_told_the_client_behind_the_gate(engine: Echo) -> None:
    """``X-Forwarded-For`` gets the client's address appended, as proxies do (uvicorn, which vLLM and
    SGLang serve on, trusts it from loopback by default, so their logs name the client, not the gate)."""
    body = {"prompt": "hi", "max_tokens": 1}
    async with (
        gate_for(engine.url) as (_, base, _registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        async with client.post(f"{base}/v1/completions", json=body):
            pass
        async with client.post(f"{base}/v1/completions", json=body, headers={"X-Forwarded-For": "10.1.2.3"}):
            pass
    assert engine.forwarded_for == ["127.0.0.1", "10.1.2.3, 127.0.0.1"]


async def test_request_ids_off_adds_none(engine: Echo) -> None:
    async with (
        gate_for(engine.url, request_ids=False) as (_, base, _registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        client.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 1}) as r,
    ):
        assert "X-Request-Id" not in r.headers
    assert engine.ids == [None]


async def test_answers_and_refusals_carry_the_lines_rate_limit_headers(engine: Echo) -> None:
    """OpenAI's ``x-ratelimit-*`` headers (``gate.rate_limit_headers``): the line's bucket after the
    request was admitted, or at its refusal, where nothing is left and ``Retry-After`` says the wait.
    And no answer names the gate's Python or aiohttp version in ``Server`` (aiohttp's default): the
    gate's own say ``servepilot``, a relayed one keeps the engine's."""
    lines = {"batch": GateLineConfig(requests_per_min=2, burst_ratio=1.0)}
    body = {"prompt": "hi", "max_tokens": 1}
    seen = []
    async with (
        gate_for(engine.url, lines=lines) as (_, base, _registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        for stream in (False, True, False):  # a JSON answer, a stream, a refusal
            async with client.post(
                f"{base}/v1/completions",
                json={**body, "stream": stream},
                headers={"x-servepilot-line": "batch"},
            ) as r:
                limits = {k: v for k, v in r.headers.items() if k.startswith("x-ratelimit-")}
                seen.append((r.status, limits, r.headers.get("Server")))
    assert [(status, server) for status, _, server in seen] == [
        (200, "uvicorn"),
        (200, "uvicorn"),
        (429, "servepilot"),
    ]
    assert [h["x-ratelimit-remaining-requests"] for _, h, _ in seen] == ["1", "0", "0"]
    assert {h["x-ratelimit-limit-requests"] for _, h, _ in seen} == {"2"}
    assert seen[2][1]["x-ratelimit-reset-requests"].endswith("s")  # about a minute until it is full
    async with (
        gate_for(engine.url, rate_limit_headers=False) as (_, base, _registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        client.post(f"{base}/v1/completions", json=body) as r,
    ):
        assert not any(k.startswith("x-ratelimit-") for k in r.headers)


class Held(Echo):
    """Answers once ``go`` is set: the first request holds the gate's only slot meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.go.clear()

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await self.go.wait()
        return await super().answer(request, body)


async def test_a_request_refused_after_its_charge_says_the_refunded_level() -> None:
    """The line's bucket is charged as a request is admitted to the queue; one the full queue turns away
    is given its charge back, and its 429 says the level after the refund (2 of 3), not before it (1)."""
    lines = {"batch": GateLineConfig(requests_per_min=3, burst_ratio=1.0)}
    body = {"prompt": "hi", "max_tokens": 1}
    headers = {"x-servepilot-line": "batch"}
    async for held in serving(Held()):
        async with (
            gate_for(held.url, lines=lines, max_in_flight=1, queue_size=0, high_reserved_ratio=0.0) as (
                gate,
                base,
                _registry,
            ),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        ):
            first = asyncio.ensure_future(client.post(f"{base}/v1/completions", json=body, headers=headers))
            async with asyncio.timeout(TIMEOUT):
                while gate.admission.in_flight < 1:
                    await asyncio.sleep(0.01)
            async with client.post(f"{base}/v1/completions", json=body, headers=headers) as r:
                refused = (r.status, r.headers["x-ratelimit-remaining-requests"])
            held.go.set()
            async with await first as r:
                answered = (r.status, r.headers["x-ratelimit-remaining-requests"])
    assert answered == (200, "2") and refused == (429, "2")
