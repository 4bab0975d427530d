from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from agent.loadgen import PRIORITY_HEADER, LoadGenerator


def _sse_app(
    seen: list[dict[str, Any]], status: int = 200, headers: dict[str, str] | None = None
) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({**body, "class": request.headers.get(PRIORITY_HEADER)})
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


async def test_a_priority_mix_names_each_requests_class_and_counts_each_apart(aiohttp_server: Any) -> None:
    seen: list[dict[str, Any]] = []
    server = await aiohttp_server(_sse_app(seen))
    trace = np.array([[0.0, 1, 1]] * 400)
    mix = {"high": 1.0, "normal": 0.0, "low": 3.0}
    gen = LoadGenerator(str(server.make_url("")), trace, speed=1000.0, priority_mix=mix, seed=3)
    await _run_until(gen, lambda: gen.stats.ok >= 400)
    sent = [b["class"] for b in seen[:400]]
    assert 0.2 < sent.count("high") / 400 < 0.3 and sent.count("normal") == 0  # shares, not weights
    by_class = gen.stats.classes
    assert set(by_class) == {"high", "normal", "low"}
    assert sum(c.ok for c in by_class.values()) == gen.stats.ok
    assert by_class["normal"].sent == 0 and by_class["high"].ok > 0
    assert len(by_class["high"].ttft_s) == min(512, by_class["high"].ok)  # each class timed apart


def test_a_priority_mix_without_a_positive_share_is_refused() -> None:
    with pytest.raises(ValueError, match="priority_mix must give shares >= 0 with a total above 0"):
        LoadGenerator("http://127.0.0.1:1", np.zeros((1, 3)), priority_mix={"high": 0.0, "low": -1.0})


async def test_a_burst_larger_than_the_cap_is_dropped_beyond_it(aiohttp_server: Any) -> None:
    """The cap counts requests from the moment they are scheduled: of 300 arriving at the same instant,
    a cap of 50 sends 50 and drops 250. (Counted when each task started, none had started when the next
    was checked: all 300 were sent, to wait in the connection pool, and a trace replayed at 1000x grew
    them without bound, 24 GB in minutes.)"""
    arrived = 0
    hold = asyncio.Event()

    async def completions(request: web.Request) -> web.Response:
        nonlocal arrived
        arrived += 1
        await hold.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    server = await aiohttp_server(app)
    trace = np.array([[0.0, 1, 1]] * 300)
    gen = LoadGenerator(str(server.make_url("")), trace, speed=1.0, max_in_flight=50)
    stop = asyncio.Event()
    run = asyncio.create_task(gen.run(stop))
    await asyncio.wait_for(_until_settled(lambda: arrived), timeout=10)
    stop.set()
    hold.set()
    await asyncio.wait_for(run, timeout=10)
    assert arrived == 50 and (gen.stats.sent, gen.stats.dropped) == (50, 250)


async def _until_settled(count: Any) -> None:
    """Until ``count()`` is positive and has not changed over 0.2 s."""
    last = -1
    while count() == 0 or count() != last:
        last = count()
        await asyncio.sleep(0.2)
