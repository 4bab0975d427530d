from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from agent.loadgen import LoadGenerator


def _sse_app(
    seen: list[dict[str, Any]], status: int = 200, headers: dict[str, str] | None = None
) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if status != 200:
            return web.json_response({"error": "down"}, status=status, headers=headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": f"t{i}"}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def _run_until(gen: LoadGenerator, done: Any) -> None:
    stop = asyncio.Event()

    async def watch() -> None:
        while not done():
            await asyncio.sleep(0)
        stop.set()

    await asyncio.wait_for(asyncio.gather(gen.run(stop), watch()), timeout=10)


async def test_replays_token_lengths_and_counts_streamed_tokens(aiohttp_server: Any) -> None:
    seen: list[dict[str, Any]] = []
    server = await aiohttp_server(_sse_app(seen))
    trace = np.array([[0.0, 5, 3], [0.0, 7, 2], [0.0, 2, 4]])
    gen = LoadGenerator(str(server.make_url("")), trace, speed=1000.0)
    await _run_until(gen, lambda: gen.stats.ok >= 3)
    assert sorted(len(b["prompt"]) for b in seen[:3]) == [2, 5, 7]
    assert sorted(b["max_tokens"] for b in seen[:3]) == [2, 3, 4]
    assert all(b["stream"] for b in seen)
    assert gen.stats.tokens >= 9
    assert len(gen.stats.ttft_s) >= 3


async def test_caps_output_and_prompt_lengths(aiohttp_server: Any) -> None:
    seen: list[dict[str, Any]] = []
    server = await aiohttp_server(_sse_app(seen))
    trace = np.array([[0.0, 50_000, 5_000]])
    gen = LoadGenerator(
        str(server.make_url("")), trace, speed=1000.0, max_output_tokens=4, max_prompt_tokens=16
    )
    await _run_until(gen, lambda: gen.stats.ok >= 1)
    assert (len(seen[0]["prompt"]), seen[0]["max_tokens"]) == (16, 4)


async def test_http_errors_are_counted_not_raised(aiohttp_server: Any) -> None:
    server = await aiohttp_server(_sse_app([], status=503))
    gen = LoadGenerator(str(server.make_url("")), np.array([[0.0, 1, 1]]), speed=1000.0)
    await _run_until(gen, lambda: gen.stats.failed >= 1)
    assert gen.stats.last_error == "HTTP 503"
    assert gen.stats.shed == 0  # no Retry-After: an engine that is down, not one shedding load


@pytest.mark.parametrize("status", [429, 503])
async def test_a_refusal_with_retry_after_counts_as_shed_not_failed(aiohttp_server: Any, status: int) -> None:
    server = await aiohttp_server(_sse_app([], status=status, headers={"Retry-After": "1"}))
    gen = LoadGenerator(str(server.make_url("")), np.array([[0.0, 1, 1]]), speed=1000.0)
    await _run_until(gen, lambda: gen.stats.shed >= 1)
    assert (gen.stats.failed, gen.stats.last_error) == (0, "")


def test_rejects_an_empty_trace() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        LoadGenerator("http://127.0.0.1:1", np.zeros((0, 3)))
