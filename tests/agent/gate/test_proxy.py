"""The gate as an HTTP proxy on loopback, in front of a small aiohttp upstream written here.

Nothing sleeps: the upstream parks on events the test sets, and waits are bounded by ``wait_for``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from agent.config import GateConfig, GateLineConfig
from agent.engines.launcher import free_port
from agent.gate.collector import GateCollector
from agent.gate.proxy import Gate
from policies import knobs

TIMEOUT = 5.0
PRIORITY = "x-servepilot-priority"


class Upstream:
    """An OpenAI-ish upstream whose requests park until ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.release.set()
        self.next_chunk = asyncio.Semaphore(0)
        self.keep_alive = asyncio.Semaphore(0)  # chunked: each release writes an SSE comment meanwhile
        self.chunked = False
        self.headers_early = False  # streams: the headers before the wait for ``release`` (as vLLM does)
        self.health_block_s = 0.0  # the next health check blocks the event loop this long
        self.fail_status = 0  # answer every request with this error status at once (0: answer normally)
        self.running = 0
        self.peak = 0
        self.seen = 0
        self.bodies: list[dict[str, Any]] = []  # as received, in order
        self.vias: list[str] = []  # the Via header of each, in order
        self.aborted: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen += 1
        self.bodies.append(body)
        self.vias.append(request.headers.get("Via", ""))
        if self.fail_status:
            error = {"message": "engine unavailable", "type": "InternalServerError", "code": self.fail_status}
            return web.json_response({"error": error}, status=self.fail_status)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            if self.headers_early and body.get("stream"):
                await resp.prepare(request)
            await self.release.wait()
            if not body.get("stream"):
                usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
                return web.json_response({"choices": [{"text": "abc"}], "usage": usage})
            if not resp.prepared:
                await resp.prepare(request)
            for i in range(3):
                await resp.write(f'data: {{"choices":[{{"text":"t{i}"}}]}}\n\n'.encode())
                if self.chunked:
                    await self._next_chunk(resp)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError) as error:
            if not self.aborted.done():
                self.aborted.set_result(type(error).__name__)
            raise
        finally:
            self.running -= 1

    async def _next_chunk(self, resp: web.StreamResponse) -> None:
        """Wait for ``next_chunk``, writing a keep-alive comment for each ``keep_alive`` meanwhile (as
        axum's SSE keep-alive does while a hung engine sends nothing)."""
        while self.next_chunk.locked():
            if not self.keep_alive.locked():
                await self.keep_alive.acquire()
                await resp.write(b": keep-alive\n\n")
            await asyncio.sleep(0.001)
        await self.next_chunk.acquire()

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def health(self, request: web.Request) -> web.Response:
        if self.health_block_s:
            time.sleep(self.health_block_s)  # the whole process stops, the gate with it
            self.health_block_s = 0.0
        return await self.models(request)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self.url


async def _running_upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    await up.start()
    yield up
    up.release.set()  # a failed test must not leave handlers parked through cleanup
    assert up.runner is not None
    await up.runner.cleanup()


upstream = pytest.fixture(_running_upstream)
spare = pytest.fixture(_running_upstream)
"""A second upstream, for failover."""


def _totals(counter: Any, label: str) -> dict[str, float]:
    """A labelled counter's ``_total`` samples summed by the value of ``label``."""
    totals: dict[str, float] = {}
    for m in counter.collect():
        for s in m.samples:
            if s.name.endswith("_total"):
                totals[s.labels[label]] = totals.get(s.labels[label], 0.0) + s.value
    return totals


async def _gate(upstreams: dict[str, str], **overrides: Any) -> Gate:
    split = overrides.pop("split", {next(iter(upstreams)): 1.0})
    overrides.setdefault("health_interval_s", 600)
    cfg = GateConfig(enabled=True, upstreams=upstreams, split=split, **overrides)
    gate = Gate(cfg, CollectorRegistry())
    await gate.start("127.0.0.1", 0)
    return gate


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
        yield session


def _body(stream: bool = False, prompt: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": 3, "stream": stream, **extra}


async def _post(client: aiohttp.ClientSession, gate: Gate, body: Any, **kw: Any) -> aiohttp.ClientResponse:
    return await client.post(f"http://127.0.0.1:{gate.port}/v1/completions", json=body, **kw)


async def test_sse_is_relayed_chunk_by_chunk(upstream: Upstream, client: aiohttp.ClientSession) -> None:
    upstream.chunked = True
    gate = await _gate({"primary": upstream.url})
    try:
        resp = await _post(client, gate, _body(stream=True))
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT)
        assert b"t0" in first  # arrived while the upstream still holds t1 back
        for _ in range(3):
            upstream.next_chunk.release()
        rest = await asyncio.wait_for(resp.read(), TIMEOUT)
        assert rest.count(b"data:") == 3 and rest.endswith(b"data: [DONE]\n\n")
        values = gate.snapshot_values()
        assert "gate.le256.ttft_seconds.p50" in values and "gate.le256.itl_seconds.p99" in values
        assert values["gate.in_flight"] == 0
        # the batch policy needs the reserve to tell when normal traffic has filled what it may use
        assert (
            values["gate.limit"] == gate.admission.limit
            and values["gate.reserved"] == gate.admission.reserved
        )
        assert 0 < values["gate.reserved"] < values["gate.limit"]
    finally:
        await gate.stop()


async def test_client_disconnect_aborts_the_upstream_request(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """And its record counts the tokens relayed until then (one event), which its line's token budget
    is settled by (charged its prompt's estimate, 1.25, and ``max_tokens`` 3)."""
    upstream.chunked = True
    lines = {"default": GateLineConfig(tokens_per_min=60, burst_ratio=10)}  # 600, refilled 1 a second
    gate = await _gate({"primary": upstream.url}, lines=lines)
    try:
        resp = await _post(client, gate, _body(stream=True))
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT)
        resp.close()  # the client goes away mid-stream
        assert await asyncio.wait_for(upstream.aborted, TIMEOUT) in ("CancelledError", "ConnectionResetError")
        await asyncio.wait_for(_until(lambda: gate.admission.in_flight == 0), TIMEOUT)
        assert _totals(gate.stats.tokens, "kind")["output"] == 1
        assert 600 - 1.25 - 1 <= _token_level(gate) < 599  # charged 4.25 without
    finally:
        await gate.stop()


def _token_level(gate: Gate, line: str = "default") -> float:
    """What ``line``'s token budget holds now."""
    now = gate.clock()
    bucket = gate.lines.get(line, now).tokens
    assert bucket is not None
    return bucket.tokens(now)


async def _until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0)  # yield to the loop; bounded by the caller's wait_for


async def test_oversized_body_gets_413_json(upstream: Upstream, client: aiohttp.ClientSession) -> None:
    gate = await _gate({"primary": upstream.url}, max_body_bytes=1024)
    try:
        resp = await _post(client, gate, _body(prompt="x" * 5000))
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large" and upstream.seen == 0
    finally:
        await gate.stop()


async def test_requests_the_gate_cannot_read_are_counted_by_line_and_why(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """A client sending malformed requests shows in servepilot_gate_refused_total (before 2026-12-06 it
    showed in no metric: no engine answered them, so no request was recorded)."""
    lines = {"batch": GateLineConfig()}
    gate = await _gate({"primary": upstream.url}, max_body_bytes=1024, lines=lines)
    url = f"http://127.0.0.1:{gate.port}/v1/completions"
    batch = {"x-servepilot-line": "batch"}
    try:
        assert (await _post(client, gate, _body(prompt="x" * 5000), headers=batch)).status == 413
        assert (await client.post(url, data=b"{not json", headers=batch)).status == 400
        gzipped = {**batch, "Content-Encoding": "gzip"}
        assert (await client.post(url, data=b"\x1f\x8b", headers=gzipped)).status == 415
        bad_wait = {gate.cfg.max_wait_header: "soon"}  # no line header: the default line
        assert (await _post(client, gate, _body(), headers=bad_wait)).status == 400
        assert upstream.seen == 0
        refused = {
            (s.labels["line"], s.labels["reason"]): s.value
            for m in gate.metrics.refused.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }
        assert refused == {
            ("batch", "request_too_large"): 1,
            ("batch", "bad_request"): 1,
            ("batch", "unsupported_content_encoding"): 1,
            ("default", "bad_request"): 1,
        }
    finally:
        await gate.stop()


async def test_line_over_its_rate_gets_429_with_retry_after(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    lines = {"default": GateLineConfig(requests_per_min=1, burst_ratio=1)}
    gate = await _gate({"primary": upstream.url}, lines=lines)
    try:
        assert (await _post(client, gate, _body())).status == 200
        resp = await _post(client, gate, _body())
        assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 59
        error = (await resp.json())["error"]
        assert error["code"] == "rate_limit_exceeded" and "default" in error["message"]
    finally:
        await gate.stop()


async def test_a_lines_token_rate_is_charged_max_tokens_for_each_sequence(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """A 300-token bucket: ``max_tokens`` 100 with ``n`` = 4 may generate 400 tokens, more than it holds:
    served from the full bucket, it leaves the line in debt while it runs, and the next request waits
    (until 2026-12-03 it was charged 100 whatever ``n``, and the line still held 199)."""
    lines = {"default": GateLineConfig(tokens_per_min=300, burst_ratio=1)}
    gate = await _gate({"primary": upstream.url}, lines=lines)
    upstream.release.clear()
    try:
        first = asyncio.create_task(_post(client, gate, _body(max_tokens=100, n=4)))
        await asyncio.wait_for(_until(lambda: upstream.running == 1), TIMEOUT)
        resp = await _post(client, gate, _body(max_tokens=1))
        assert resp.status == 429 and "token rate" in (await resp.json())["error"]["message"]
        upstream.release.set()
        assert (await first).status == 200
    finally:
        await gate.stop()


async def test_a_lines_token_budget_is_settled_by_what_its_answers_used(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """Charged its estimate at admission (prompt + ``max_tokens``), a request pays, once answered, what
    its answer used: the upstream's usage (7 prompt + 3 output tokens), or a stream's token events (3)
    beside the prompt's estimate. Ten requests of ``max_tokens`` 100 each through a 300-token budget:
    before 2026-12-06 the third was refused, a line held to a tenth of its budget. A request the engine
    refused (4xx) pays nothing; one that failed (5xx) keeps its charge, what it used being unknown."""
    lines = {"default": GateLineConfig(tokens_per_min=30, burst_ratio=10)}  # 300, refilled 0.5 a second
    gate = await _gate({"primary": upstream.url}, lines=lines)

    try:
        statuses = [(await _post(client, gate, _body(max_tokens=100))).status for _ in range(10)]
        assert statuses == [200] * 10
        before = _token_level(gate)
        assert (await _post(client, gate, _body(max_tokens=100))).status == 200
        assert _token_level(gate) == pytest.approx(before - 10, abs=2)  # (refilled meanwhile)
        before = _token_level(gate)
        resp = await _post(client, gate, _body(stream=True, prompt="x" * 40, max_tokens=100))
        await resp.read()
        assert _token_level(gate) == pytest.approx(before - (10 + 3), abs=2)  # prompt estimate, 3 events
        upstream.fail_status = 400
        before = _token_level(gate)
        assert (await _post(client, gate, _body(max_tokens=100))).status == 400
        assert _token_level(gate) == pytest.approx(before, abs=2)
        upstream.fail_status = 500
        before = _token_level(gate)
        assert (await _post(client, gate, _body(max_tokens=100))).status == 500
        assert _token_level(gate) == pytest.approx(before - (1.25 + 100), abs=2)
    finally:
        await gate.stop()


async def test_a_client_that_leaves_before_its_answer_is_counted_and_pays_only_once_admitted(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """Until 2026-12-06 a client that left while queued, or while the engine worked on its answer in
    one piece, was in no count. Now both are ``disconnected``; the one that left the queue gets its line's
    token charge back (the engine never saw it), the other keeps it (the engine worked on it), and its
    upstream connection is closed, so the engine aborts it."""
    upstream.release.clear()
    lines = {"default": GateLineConfig(tokens_per_min=60, burst_ratio=10)}  # 600, refilled 1 a second
    gate = await _gate({"primary": upstream.url}, lines=lines, max_in_flight=1, high_reserved_ratio=0.0)

    def disconnected() -> float:
        return _totals(gate.stats.requests, "outcome").get("disconnected", 0.0)

    try:
        held, queued = await _one_held_one_queued(upstream, client, gate)
        charged = 600 - _token_level(gate)
        assert charged == pytest.approx(2 * (1.25 + 3), abs=0.5)  # each: its prompt's estimate, max_tokens
        queued.cancel()
        await asyncio.wait_for(_until(lambda: disconnected() == 1), TIMEOUT)
        assert 600 - _token_level(gate) <= charged / 2  # given back (and refilled meanwhile)
        before = _token_level(gate)
        held.cancel()
        await asyncio.wait_for(_until(lambda: disconnected() == 2), TIMEOUT)
        assert _token_level(gate) - before < 2  # not the 4.25 back: refilled a little at most
        assert await asyncio.wait_for(upstream.aborted, TIMEOUT) == "CancelledError"  # the engine stops
        assert gate.admission.in_flight == 0 and _totals(gate.stats.requests, "outcome") == {
            "disconnected": 2
        }
    finally:
        upstream.release.set()
        await gate.stop()


async def _one_held(
    upstream: Upstream, client: aiohttp.ClientSession, gate: Gate
) -> asyncio.Task[aiohttp.ClientResponse]:
    """With a limit of 1 and the upstream parked: one request in flight (the task answers once released)."""
    held = asyncio.create_task(_post(client, gate, _body()))
    await asyncio.wait_for(_until(lambda: upstream.running == 1), TIMEOUT)
    return held


async def _one_held_one_queued(
    upstream: Upstream, client: aiohttp.ClientSession, gate: Gate
) -> tuple[asyncio.Task[aiohttp.ClientResponse], asyncio.Task[aiohttp.ClientResponse]]:
    """With a limit of 1 and the upstream parked: one request in flight, the next one waiting."""
    held = await _one_held(upstream, client, gate)
    queued = asyncio.create_task(_post(client, gate, _body()))
    await asyncio.wait_for(_until(lambda: gate.admission.queue_depth == 1), TIMEOUT)
    return held, queued


async def test_full_queue_gets_429_and_a_long_wait_503(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    upstream.release.clear()
    gate = await _gate({"primary": upstream.url}, max_in_flight=1, queue_size=1, max_queue_wait_s=0.02)
    try:
        held, queued = await _one_held_one_queued(upstream, client, gate)
        full = await _post(client, gate, _body())
        assert full.status == 429 and (await full.json())["error"]["code"] == "queue_full"
        timed_out = await queued
        assert timed_out.status == 503 and "Retry-After" in timed_out.headers
        assert (await timed_out.json())["error"]["code"] == "queue_timeout"
        upstream.release.set()
        assert (await held).status == 200
    finally:
        await gate.stop()


async def test_a_client_s_own_shorter_deadline_answers_503_before_the_gate_s(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    upstream.release.clear()
    gate = await _gate({"primary": upstream.url}, max_in_flight=1, queue_size=4, max_queue_wait_s=60.0)
    try:
        held = await _one_held(upstream, client, gate)
        own = await asyncio.wait_for(
            _post(client, gate, _body(), headers={"x-servepilot-max-wait-ms": "20"}), TIMEOUT
        )  # well before the gate's 60 s
        assert own.status == 503 and (await own.json())["error"]["code"] == "queue_timeout"
        assert "within 0.02 s" in (await own.json())["error"]["message"]
        never = await asyncio.wait_for(
            _post(client, gate, _body(), headers={"x-servepilot-max-wait-ms": "0"}), TIMEOUT
        )
        assert never.status == 503  # 0: rather a 503 than any wait
        assert gate.admission.queue_depth == 0
        upstream.release.set()
        assert (await held).status == 200
        free = await _post(client, gate, _body(), headers={"x-servepilot-max-wait-ms": "0"})
        assert free.status == 200  # no wait needed: the deadline never applies
    finally:
        await gate.stop()


async def test_the_gate_s_deadline_still_applies_to_a_longer_client_deadline(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    upstream.release.clear()
    gate = await _gate({"primary": upstream.url}, max_in_flight=1, queue_size=4, max_queue_wait_s=0.02)
    try:
        held = await _one_held(upstream, client, gate)
        patient = await asyncio.wait_for(
            _post(client, gate, _body(), headers={"x-servepilot-max-wait-ms": "600000"}), TIMEOUT
        )
        assert patient.status == 503 and "within 0.02 s" in (await patient.json())["error"]["message"]
        upstream.release.set()
        assert (await held).status == 200
    finally:
        await gate.stop()


@pytest.mark.parametrize("value", ["soon", "-5", "nan", "inf", ""])
async def test_a_bad_client_deadline_is_a_400_naming_the_header(
    upstream: Upstream, client: aiohttp.ClientSession, value: str
) -> None:
    gate = await _gate({"primary": upstream.url})
    try:
        resp = await _post(client, gate, _body(), headers={"x-servepilot-max-wait-ms": value})
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["code"] == "bad_request"
        assert error["message"].startswith("x-servepilot-max-wait-ms: must be a number of milliseconds")
        assert upstream.seen == 0
    finally:
        await gate.stop()


async def test_lowering_the_queue_deadline_expires_who_waited_past_it(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    upstream.release.clear()
    gate = await _gate({"primary": upstream.url}, max_in_flight=1, queue_size=4, max_queue_wait_s=60.0)
    try:
        held, queued = await _one_held_one_queued(upstream, client, gate)
        clock = gate.clock
        gate.clock = lambda: clock() + 30.0  # 30 s later: it has waited longer than the deadline set next
        gate.set_max_queue_wait(10.0)
        timed_out = await asyncio.wait_for(queued, TIMEOUT)  # at once, not after the 60 s it started with
        assert timed_out.status == 503 and (await timed_out.json())["error"]["code"] == "queue_timeout"
        assert gate.snapshot_values()["gate.max_queue_wait_s"] == 10.0
        with pytest.raises(ValueError, match="max_queue_wait_s"):
            gate.set_max_queue_wait(0.0)
        upstream.release.set()
        assert (await held).status == 200
    finally:
        await gate.stop()


async def test_dead_upstream_gets_502_json(client: aiohttp.ClientSession) -> None:
    gate = await _gate({"primary": "http://127.0.0.1:9"})  # discard port: nothing listens
    try:
        resp = await _post(client, gate, _body())
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "bad_gateway"
        assert not gate.pool.upstreams["primary"].healthy
        # the client's retry comes on a new connection, which a Service may send to another replica
        assert resp.headers["Connection"] == "close"
        # every upstream down: wait for a health check (600 s here), but no longer than 30 s
        assert resp.headers["Retry-After"] == "30"
    finally:
        await gate.stop()
    gate = await _gate({"primary": "http://127.0.0.1:9"}, health_interval_s=3)
    try:
        resp = await _post(client, gate, _body(stream=True))
        assert resp.status == 502 and resp.headers["Retry-After"] == "3"
    finally:
        await gate.stop()


async def test_a_request_that_comes_back_to_the_gate_is_a_508_at_once(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """An upstream leading back to the gate (its own port, the engine's mixed up with it) looped each
    request through the gate some 740 times, every hop admitted and holding a slot, until
    X-Forwarded-For outgrew 8 kB. The gate's own ``Via`` entry stops it at its first return; a request
    that went through another gate first is served."""
    port = free_port()
    loop = Gate(
        GateConfig(enabled=True, upstreams={"primary": f"http://127.0.0.1:{port}"}), CollectorRegistry()
    )
    await loop.start("127.0.0.1", port)
    behind = await _gate({"primary": upstream.url})
    front = await _gate({"primary": f"http://127.0.0.1:{behind.port}"})  # a chain of two gates: no loop
    try:
        resp = await _post(client, loop, _body())
        assert resp.status == 508 and (await resp.json())["error"]["code"] == "loop_detected"
        assert loop.admission.in_flight == 0 and loop.in_progress == 0
        chained = await _post(client, front, _body())
        assert chained.status == 200, await chained.text()
        assert upstream.vias[-1] == f"{front.forwarder.via}, {behind.forwarder.via}"
    finally:
        for gate in (loop, front, behind):
            await gate.stop()


async def test_connection_failure_fails_over_to_the_next_upstream(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    gate = await _gate({"primary": "http://127.0.0.1:9", "fp8": upstream.url}, split={"primary": 1.0})
    try:
        resp = await _post(client, gate, _body())
        assert resp.status == 200 and upstream.seen == 1
    finally:
        await gate.stop()


async def test_in_flight_never_exceeds_the_limit_at_the_proxy(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    upstream.release.clear()
    gate = await _gate({"primary": upstream.url}, max_in_flight=2, high_reserved_ratio=0.0)
    try:
        tasks = [asyncio.create_task(_post(client, gate, _body())) for _ in range(6)]
        await asyncio.wait_for(
            _until(lambda: gate.admission.queue_depth == 4 and upstream.running == 2), TIMEOUT
        )
        gate.set_limit(3)
        await asyncio.wait_for(_until(lambda: upstream.running == 3), TIMEOUT)
        upstream.release.set()
        assert [r.status for r in await asyncio.gather(*tasks)] == [200] * 6
        assert upstream.peak == 3
    finally:
        await gate.stop()


async def test_a_request_for_several_sequences_takes_as_many_of_the_limit(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """``n`` = 3 is three sequences in the engine's batch: with a limit of 4, a request for 2 more waits
    while it runs (counted as one request, the two put 5 sequences into a batch of 4), and so does a
    single one behind it, first come first served. Until 2026-12-04 the limit counted requests."""
    upstream.release.clear()
    gate = await _gate({"primary": upstream.url}, max_in_flight=4, high_reserved_ratio=0.0)
    try:
        first = asyncio.create_task(_post(client, gate, _body(n=3)))
        await asyncio.wait_for(_until(lambda: upstream.running == 1), TIMEOUT)
        assert gate.snapshot_values()["gate.in_flight"] == 3
        later = [asyncio.create_task(_post(client, gate, _body(**extra))) for extra in ({"n": 2}, {})]
        await asyncio.wait_for(_until(lambda: gate.admission.queue_depth == 2), TIMEOUT)
        assert upstream.running == 1
        upstream.release.set()
        assert [r.status for r in await asyncio.gather(first, *later)] == [200] * 3
        assert gate.admission.in_flight == 0
    finally:
        await gate.stop()


async def test_requests_no_upstream_answered_give_their_lines_tokens_back(
    client: aiohttp.ClientSession,
) -> None:
    """An engine down: clients retry, the gate answers 502. Until 2026-12-06 each 502 kept its charge
    (prompt + max_tokens): four of them drained a 1,000-token budget, and the line met 429 token_rate
    when the engine came back, for answers nobody gave."""
    lines = {"default": GateLineConfig(tokens_per_min=1000, burst_ratio=1)}
    gate = await _gate({"primary": "http://127.0.0.1:9"}, lines=lines)  # discard port: nothing listens
    try:
        for _ in range(4):
            resp = await _post(client, gate, _body(max_tokens=240))
            assert resp.status == 502
        bucket = gate.lines.get("default", gate.clock()).tokens
        assert bucket is not None and bucket.tokens(gate.clock()) == pytest.approx(1000, abs=5)
        assert not _totals(gate.stats.tokens, "kind")  # no token counted either
        outcomes = _totals(gate.stats.requests, "outcome")
        assert outcomes == {"upstream_error": 4.0}
    finally:
        await gate.stop()


async def test_a_prompt_the_engine_refused_adds_no_tokens(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """A 400 (a prompt past the context: real vLLM answers so before any work) processed no token.
    Until 2026-12-06 the counter took the gate's estimate of its prompt: 20 such prompts of 5,000 words
    sent to vLLM counted 50,000 prompt tokens for their line, while its token budget charged none."""
    registry = CollectorRegistry()
    cfg = GateConfig(enabled=True, upstreams={"primary": upstream.url}, health_interval_s=600)
    gate = Gate(cfg, registry)
    await gate.start("127.0.0.1", 0)
    try:
        upstream.fail_status = 400
        resp = await _post(client, gate, {**_body(), "prompt": "word " * 5000})
        assert resp.status == 400
        outcome = {"line": "default", "priority": "normal", "outcome": "client_error"}
        assert registry.get_sample_value("servepilot_gate_requests_total", outcome) == 1
        prompt = {"line": "default", "kind": "prompt"}
        assert not registry.get_sample_value("servepilot_gate_tokens_total", prompt)
        upstream.fail_status = 0
        await (await _post(client, gate, _body())).read()
        assert registry.get_sample_value("servepilot_gate_tokens_total", prompt) == 7  # its usage's
    finally:
        await gate.stop()


async def test_usage_of_a_plain_response_lands_in_the_token_counter(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    registry = CollectorRegistry()
    cfg = GateConfig(enabled=True, upstreams={"primary": upstream.url}, health_interval_s=600)
    gate = Gate(cfg, registry)
    await gate.start("127.0.0.1", 0)
    try:
        await (await _post(client, gate, _body())).read()
        labels = {"line": "default", "kind": "output"}
        assert registry.get_sample_value("servepilot_gate_tokens_total", labels) == 3
    finally:
        await gate.stop()


async def test_other_paths_pass_through_without_admission(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    gate = await _gate({"primary": upstream.url}, max_in_flight=1)
    try:
        resp = await client.get(f"http://127.0.0.1:{gate.port}/v1/models")
        assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "m"
    finally:
        await gate.stop()


async def test_invalid_json_gets_400_without_reaching_the_upstream(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    gate = await _gate({"primary": upstream.url})
    try:
        resp = await client.post(f"http://127.0.0.1:{gate.port}/v1/completions", data=b"{nope")
        assert resp.status == 400 and "JSON" in json.loads(await resp.read())["error"]["message"]
        assert upstream.seen == 0
    finally:
        await gate.stop()


@pytest.mark.parametrize(
    "stale",
    [aiohttp.ClientOSError(32, "Can not write request body"), aiohttp.ServerDisconnectedError()],
    ids=["write-failed", "disconnected"],
)
async def test_a_stale_keepalive_write_is_retried_once_not_marked_down(
    upstream: Upstream, client: aiohttp.ClientSession, stale: Exception
) -> None:
    """llama.cpp closes a kept-alive connection after 100 requests; the gate's next write on it fails
    ("Can not write request body"). That request never reached the upstream: retry, no 502, still healthy."""
    gate = await _gate({"primary": upstream.url})
    assert gate.forwarder.session is not None
    real = gate.forwarder.session.request
    failures = 0

    async def stale_once(*args: Any, **kwargs: Any) -> aiohttp.ClientResponse:
        nonlocal failures
        if failures == 0 and args[0] == "POST":
            failures += 1
            raise stale
        return await real(*args, **kwargs)

    gate.forwarder.session.request = stale_once  # type: ignore[method-assign]
    try:
        resp = await _post(client, gate, _body())
        assert resp.status == 200 and failures == 1 and upstream.seen == 1
        assert gate.snapshot_values()["gate.upstreams_healthy"] == 1
    finally:
        await gate.stop()


async def test_the_retry_takes_a_new_connection_when_every_pooled_one_went_stale(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """An upstream that closes idle connections closes them all at once: a retry through the same pool
    would pick another dead socket. The retry must open a new connection."""
    gate = await _gate({"primary": upstream.url})
    assert gate.forwarder.session is not None
    pooled = 0

    async def every_pooled_socket_is_dead(*args: Any, **kwargs: Any) -> aiohttp.ClientResponse:
        nonlocal pooled
        pooled += 1
        raise aiohttp.ClientOSError(32, "Can not write request body")

    gate.forwarder.session.request = every_pooled_socket_is_dead  # type: ignore[method-assign]
    try:
        statuses = [(await _post(client, gate, _body())).status for _ in range(3)]
        assert statuses == [200, 200, 200] and pooled == 3 and upstream.seen == 3
        assert gate.snapshot_values()["gate.upstreams_healthy"] == 1
    finally:
        await gate.stop()


async def test_a_refused_connection_is_not_retried_on_the_same_upstream(
    client: aiohttp.ClientSession,
) -> None:
    gate = await _gate({"primary": "http://127.0.0.1:1"})
    try:
        resp = await _post(client, gate, _body())
        assert resp.status == 502
        assert gate.snapshot_values()["gate.upstreams_healthy"] == 0
    finally:
        await gate.stop()


async def test_an_upstream_serving_another_model_gets_its_own_model_name(
    client: aiohttp.ClientSession,
) -> None:
    """The breaker's L3 sends traffic to a smaller model. Clients keep naming the primary's model, which
    the small engine does not serve (404); ``gate.upstream_models`` names what to send it instead."""
    from simulator.engine import make_core
    from simulator.server import SimServer

    primary = SimServer(make_core("h100-sxm", "llama-3-8b", "fp16", 64), speed=10.0)
    small = SimServer(make_core("h100-sxm", "llama-2-7b", "fp16", 64), speed=10.0)
    runners = []
    urls = {}
    for name, server in (("primary", primary), ("small", small)):
        runner = web.AppRunner(server.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        urls[name] = f"http://127.0.0.1:{runner.addresses[0][1]}"
    asked, small_model = primary.core.model.served_name, small.core.model.served_name
    assert asked != small_model
    body = {"model": asked, "prompt": "hello", "max_tokens": 2}
    plain = await _gate(urls, split={"small": 1.0})
    mapped = await _gate(urls, split={"small": 1.0}, upstream_models={"small": small_model})
    try:
        resp = await _post(client, plain, body)
        assert resp.status == 404  # what L3 answered before the mapping
        resp = await _post(client, mapped, body)
        assert resp.status == 200 and (await resp.json())["model"] == small_model  # says who answered
        mapped.set_split({"primary": 1.0})  # the breaker back at L0: the primary gets the name as sent
        resp = await _post(client, mapped, {**body, "stream": True})
        assert resp.status == 200 and f'"model":"{asked}"' in await resp.text()
    finally:
        await plain.stop()
        await mapped.stop()
        for runner in runners:
            await runner.cleanup()


async def test_an_engine_with_priority_scheduling_is_told_each_requests_own_class(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """``gate.engine_priority``: the body's ``priority`` carries the class a request arrived in, in the
    engine's order (vLLM: lower first), in place of the client's own; a request promoted while it waited
    is sent as its own class still: ranked as the class above in the engine, promoted normal traffic put
    fresh high requests behind it in the engine's queue and first among its preemption victims."""
    gate = await _gate(
        {"primary": upstream.url},
        engine_priority={"primary": "vllm"},
        max_in_flight=1,
        high_reserved_ratio=0.0,
        aging_s=0.05,
    )
    try:
        for cls in ("high", "normal", "low"):
            resp = await _post(client, gate, _body(prompt=cls, priority=-99), headers={PRIORITY: cls})
            assert resp.status == 200
        assert [(b["prompt"], b["priority"]) for b in upstream.bodies] == [
            ("high", -1),
            ("normal", 0),
            ("low", 1),
        ]
        upstream.release.clear()  # the one slot held, so a low request waits past aging_s
        first = asyncio.create_task(_post(client, gate, _body(prompt="holder")))
        await asyncio.wait_for(_until(lambda: upstream.running == 1), TIMEOUT)
        waiter = asyncio.create_task(_post(client, gate, _body(prompt="aged"), headers={PRIORITY: "low"}))
        await asyncio.wait_for(_until(lambda: gate.admission.queue_depth == 1), TIMEOUT)
        await asyncio.sleep(0.1)
        upstream.release.set()
        assert (await first).status == 200 and (await waiter).status == 200
        assert upstream.bodies[-1]["prompt"] == "aged" and upstream.bodies[-1]["priority"] == 1
        assert gate.admission.promotions == 1
    finally:
        await gate.stop()


async def test_without_engine_priority_the_body_goes_as_the_client_sent_it(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """An engine not running priority scheduling may refuse a ``priority`` (vLLM before V1 did): the gate
    adds none unless configured, and passes a client's own untouched."""
    gate = await _gate({"primary": upstream.url, "spare": upstream.url}, engine_priority={"spare": "sglang"})
    try:
        for extra in ({}, {"priority": 7}):
            resp = await _post(client, gate, _body(**extra), headers={PRIORITY: "high"})
            assert resp.status == 200
        assert [b.get("priority") for b in upstream.bodies] == [None, 7]
        gate.set_split({"spare": 1.0})  # the upstream configured with SGLang's order: higher first
        resp = await _post(client, gate, _body(), headers={PRIORITY: "high"})
        assert resp.status == 200 and upstream.bodies[-1]["priority"] == 1
    finally:
        await gate.stop()


async def test_an_anthropic_messages_stream_from_the_simulator_is_metered_like_vllms(
    client: aiohttp.ClientSession,
) -> None:
    """``/v1/messages`` through the gate to the simulator (which answers it in vLLM's shapes): the client
    gets every event, and the gate counts the tokens the stream's last ``message_delta`` reports."""
    from simulator.engine import make_core
    from simulator.server import SimServer

    sim = SimServer(make_core("h100-sxm", "llama-3-8b", "fp16", 64), speed=10.0)
    runner = web.AppRunner(sim.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    gate = await _gate({"primary": f"http://127.0.0.1:{runner.addresses[0][1]}"})
    body = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 6, "stream": True}
    try:
        url = f"http://127.0.0.1:{gate.port}/v1/messages"
        resp = await client.post(url, json=body)
        text = await resp.text()
        assert resp.status == 200 and text.count("event: content_block_delta") == 6
        assert text.rstrip().endswith('data: {"type":"message_stop"}')
        assert _totals(gate.stats.tokens, "kind") == {"prompt": 14.0, "output": 6.0}
    finally:
        await gate.stop()
        await runner.cleanup()


async def test_a_responses_stream_from_the_simulator_is_metered_like_vllms(
    client: aiohttp.ClientSession,
) -> None:
    """``/v1/responses`` through the gate to the simulator (vLLM's shapes): the client gets every event,
    the first token is timed at the first ``response.output_text.delta`` (not at ``response.created``,
    sent at once) and the tokens are the usage in ``response.completed``."""
    from simulator.engine import make_core
    from simulator.server import SimServer

    sim = SimServer(make_core("h100-sxm", "llama-3-8b", "fp16", 64), speed=10.0)
    runner = web.AppRunner(sim.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    gate = await _gate({"primary": f"http://127.0.0.1:{runner.addresses[0][1]}"})
    body = {"input": "x" * 40, "max_output_tokens": 6, "stream": True}
    try:
        resp = await client.post(f"http://127.0.0.1:{gate.port}/v1/responses", json=body)
        text = await resp.text()
        assert resp.status == 200 and text.count("event: response.output_text.delta") == 6
        assert text.rstrip().endswith('"type":"response.completed"}')
        assert _totals(gate.stats.tokens, "kind") == {"prompt": 14.0, "output": 6.0}
        itl = gate.stats.itl.labels("le256").collect()[0].samples
        assert next(s.value for s in itl if s.name.endswith("_count")) == 5  # gaps between 6 deltas
    finally:
        await gate.stop()
        await runner.cleanup()


async def test_a_request_held_past_the_ttft_slo_without_a_token_is_late_at_its_upstream(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """What the canary judges a candidate by before its answers come back (policies/canary.py): an
    upstream too slow to answer within a rollout step is seen while it holds the requests."""
    now = [100.0]
    gate = await _gate({"primary": upstream.url, "fp8": "http://127.0.0.1:9"})
    gate.clock = lambda: now[0]
    gate.stats.slo = (2.0, 0.1)
    collector = GateCollector(gate)
    try:
        upstream.release.clear()
        upstream.chunked = True
        held = asyncio.create_task(_post(client, gate, _body(stream=True)))
        await asyncio.wait_for(_until(lambda: upstream.running == 1), TIMEOUT)
        assert gate.late_at_upstreams() == {}  # 0 s of a 2 s TTFT SLO
        now[0] = 102.5
        assert gate.late_at_upstreams() == {"primary": 1}
        values = (await collector.collect(1.0)).values
        assert (values["gate.upstream.primary.late"], values["gate.upstream.fp8.late"]) == (1, 0)
        assert values[knobs.GATE_LATE] == 1
        exported = {s.labels["upstream"]: s.value for m in gate.metrics.late.collect() for s in m.samples}
        assert exported == {"primary": 1.0, "fp8": 0.0}  # servepilot_gate_late_requests{upstream}
        upstream.release.set()  # the first token comes (late): the request is answered, no longer pending
        resp = await asyncio.wait_for(held, TIMEOUT)
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT)
        assert gate.late_at_upstreams() == {}
        for _ in range(3):
            upstream.next_chunk.release()
        await asyncio.wait_for(resp.read(), TIMEOUT)
    finally:
        await gate.stop()
    # a request no upstream took (502) leaves nothing behind to count as late later
    dead = await _gate({"primary": "http://127.0.0.1:9"})
    dead.clock = lambda: now[0]
    dead.stats.slo = (2.0, 0.1)
    try:
        assert (await _post(client, dead, _body(stream=True))).status == 502
        now[0] = 200.0
        assert dead.late_at_upstreams() == {} and len(dead.held) == 0
    finally:
        await dead.stop()


async def test_a_non_streamed_answer_has_the_time_its_tokens_allow_and_no_ttft_of_its_own(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """With a 2 s TTFT and a 100 ms ITL SLO, 3 tokens in one piece may take 2 + 2 x 0.1 = 2.2 s: at 2.1 s
    the held request is not late, and answered then it is no SLO miss. Judged by the TTFT SLO alone (as
    until 2026-12-03), it was both, and non-streaming clients burnt the error budget of a healthy engine."""
    now = [100.0]
    registry = CollectorRegistry()
    cfg = GateConfig(enabled=True, upstreams={"primary": upstream.url}, health_interval_s=600)
    gate = Gate(cfg, registry)
    await gate.start("127.0.0.1", 0)
    gate.clock = lambda: now[0]
    gate.stats.slo = (2.0, 0.1)
    collector = GateCollector(gate)
    try:
        await collector.collect(1.0)
        upstream.release.clear()
        held = asyncio.create_task(_post(client, gate, _body()))  # max_tokens 3, not streamed
        await asyncio.wait_for(_until(lambda: upstream.running == 1), TIMEOUT)
        now[0] = 102.1
        assert gate.late_at_upstreams() == {}
        now[0] = 102.3
        assert gate.late_at_upstreams() == {"primary": 1}  # past any 3-token answer's budget
        now[0] = 102.1
        upstream.release.set()
        resp = await asyncio.wait_for(held, TIMEOUT)
        assert (await resp.json())["usage"]["completion_tokens"] == 3
        values = (await collector.collect(2.0)).values
        assert (values[knobs.GATE_REQUESTS], values[knobs.GATE_SLO_BAD]) == (1, 0)
        bucket = {"bucket": "le256"}
        assert registry.get_sample_value("servepilot_gate_ttft_seconds_count", bucket) is None  # none seen
        assert registry.get_sample_value("servepilot_gate_e2e_seconds_sum", bucket) == pytest.approx(2.1)
        upstream.release.clear()
        late = asyncio.create_task(_post(client, gate, _body()))
        await asyncio.wait_for(_until(lambda: upstream.running == 1), TIMEOUT)
        now[0] = 104.4  # 2.3 s after it came
        upstream.release.set()
        await (await asyncio.wait_for(late, TIMEOUT)).read()
        assert (await collector.collect(3.0)).values[knobs.GATE_SLO_BAD] == 1
        exported = [
            registry.get_sample_value(f"servepilot_gate_{n}_total", {"priority": "normal"})
            for n in ("answered", "slo_bad")
        ]
        assert exported == [2, 1]  # the same verdict, for Prometheus
    finally:
        await gate.stop()


async def test_a_class_with_its_own_slo_is_judged_by_it(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """``policies.slo_by_priority``: low (batch) traffic allowed a 30 s TTFT. A low and a normal request,
    3 tokens in one piece, held 5 s: only the normal one is late while held and an SLO miss once answered
    (its budget is 2 + 2 x 0.1 = 2.2 s; the low one's 30.2 s), so the breaker and the canary, which read
    these verdicts, do not count batch traffic's slowness against the engine."""
    now = [100.0]
    registry = CollectorRegistry()
    gate = Gate(
        GateConfig(enabled=True, upstreams={"primary": upstream.url}, health_interval_s=600), registry
    )
    await gate.start("127.0.0.1", 0)
    gate.clock = lambda: now[0]
    gate.set_slo(2.0, 0.1, {"low": (30.0, 0.1)})
    collector = GateCollector(gate)
    try:
        await collector.collect(1.0)
        upstream.release.clear()
        cls = ("low", "normal")
        held = [asyncio.create_task(_post(client, gate, _body(), headers={PRIORITY: c})) for c in cls]
        await asyncio.wait_for(_until(lambda: upstream.running == 2), TIMEOUT)
        now[0] = 105.0
        assert gate.late_at_upstreams() == {"primary": 1}
        upstream.release.set()
        for task in held:
            assert (await asyncio.wait_for(task, TIMEOUT)).status == 200
        values = (await collector.collect(2.0)).values
        assert (values[knobs.GATE_REQUESTS], values[knobs.GATE_SLO_BAD]) == (2, 1)
        bad = {c: registry.get_sample_value("servepilot_gate_slo_bad_total", {"priority": c}) for c in cls}
        assert bad == {"low": 0.0, "normal": 1.0}  # per class, for an SLO attainment of each in Prometheus
        gate.set_slo(2.0, 0.1)  # a reload that drops it: the low class is judged by the SLO again
        upstream.release.clear()
        late = asyncio.create_task(_post(client, gate, _body(), headers={PRIORITY: "low"}))
        await asyncio.wait_for(_until(lambda: upstream.running == 1), TIMEOUT)
        now[0] = 110.0
        upstream.release.set()
        await (await asyncio.wait_for(late, TIMEOUT)).read()
        assert (await collector.collect(3.0)).values[knobs.GATE_SLO_BAD] == 1  # this tick's one miss
    finally:
        await gate.stop()


async def test_a_class_with_a_looser_ttft_target_waits_longer_for_admission(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """Batch traffic allowed 60 s against a 2 s SLO waits 30x the gate's deadline (0.05 s -> 1.5 s): the
    normal request behind the busy slot is answered 503 while the low one waits, and is served. A reload
    that drops the class's target answers a low request that has waited past the deadline at once."""
    upstream.release.clear()
    gate = await _gate({"primary": upstream.url}, max_in_flight=1, queue_size=4, max_queue_wait_s=0.05)
    gate.set_slo(2.0, 0.1, {"low": (60.0, 0.1)})
    try:
        held = await _one_held(upstream, client, gate)
        normal = asyncio.create_task(_post(client, gate, _body(), headers={PRIORITY: "normal"}))
        low = asyncio.create_task(_post(client, gate, _body(), headers={PRIORITY: "low"}))
        refused = await asyncio.wait_for(normal, TIMEOUT)
        assert refused.status == 503 and "within 0.05 s" in (await refused.json())["error"]["message"]
        assert gate.admission.queue_depth == 1 and not low.done()  # the low one still waits
        upstream.release.set()
        assert (await held).status == 200
        assert (await asyncio.wait_for(low, TIMEOUT)).status == 200
        upstream.release.clear()
        held = await _one_held(upstream, client, gate)
        low = asyncio.create_task(_post(client, gate, _body(), headers={PRIORITY: "low"}))
        await asyncio.wait_for(_until(lambda: gate.admission.queue_depth == 1), TIMEOUT)
        await asyncio.sleep(0.1)  # past the global deadline, well within the class's 1.5 s
        assert not low.done()
        gate.set_slo(2.0, 0.1)  # the reload: low is back to the global 0.05 s, which it has waited past
        dropped = await asyncio.wait_for(low, 1.0)  # at once, not after its 1.5 s
        assert dropped.status == 503 and (await dropped.json())["error"]["code"] == "queue_timeout"
        assert dropped.headers["Retry-After"] == "1"  # the class's deadline now, rounded up to a second
        upstream.release.set()
        assert (await held).status == 200
    finally:
        await gate.stop()


async def test_each_class_s_queue_deadline_is_exported_and_follows_the_gate_s() -> None:
    """``servepilot_gate_queue_deadline_seconds{priority}``: the deadline scaled by each class's TTFT
    target, read at scrape, so it follows the queue-deadline policy's moves and a reload's targets."""
    registry = CollectorRegistry()
    cfg = GateConfig(enabled=True, upstreams={"primary": "http://127.0.0.1:9"}, max_queue_wait_s=2.0)
    gate = Gate(cfg, registry)

    def deadlines() -> tuple[float | None, ...]:
        name = "servepilot_gate_queue_deadline_seconds"
        return tuple(registry.get_sample_value(name, {"priority": c}) for c in ("high", "normal", "low"))

    assert deadlines() == (2.0, 2.0, 2.0)
    gate.set_slo(2.0, 0.1, {"low": (30.0, 0.1), "high": (0.5, 0.1)})
    assert deadlines() == (0.5, 2.0, 30.0)
    gate.set_max_queue_wait(1.0)  # the queue-deadline policy's knob
    assert deadlines() == (0.25, 1.0, 15.0)


async def test_a_hung_upstream_is_ejected_from_the_split_and_returns_when_it_sends_again(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """A hung engine keeps answering its health check (seen on vLLM with its engine core stopped), so
    health alone kept it in the split and each request sent there waited for ``read_timeout_s``. The gate
    now takes out an upstream whose streams got no byte for ``eject_stalled_s``, keeps it out while the
    health check still passes, and sends new requests to the others (here the weight-0 fallback)."""
    fallback = Upstream()
    await fallback.start()
    now = [100.0]
    gate = await _gate(
        {"primary": upstream.url, "small": fallback.url},
        split={"primary": 1.0},
        health_interval_s=0.1,
        cut_stalled_streams=False,  # the held stream stays, to show the upstream's return at its next byte
    )
    gate.clock = lambda: now[0]
    try:
        upstream.chunked = True  # the first token comes, then the engine hangs mid-stream
        resp = await _post(client, gate, _body(stream=True))
        assert b"t0" in await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT)
        now[0] = 159.0
        assert gate.stalled_upstreams() == {}  # 59 s of silence: not yet
        now[0] = 160.0
        stalled = gate.stalled_upstreams()
        assert stalled == {"primary": "stalled: 1 streaming request(s) held, no byte from it for 60 s"}
        await asyncio.wait_for(_until(lambda: not gate.pool.upstreams["primary"].healthy), TIMEOUT)
        assert gate.pool.upstreams["primary"].last_error == stalled["primary"]
        await asyncio.sleep(0.3)  # health rounds pass: its /health answers 200, yet it stays out
        assert not gate.pool.upstreams["primary"].healthy
        ejected = gate.metrics.ejected.collect()
        ejections = {
            s.labels["upstream"]: s.value for m in ejected for s in m.samples if s.name.endswith("_total")
        }
        assert ejections["primary"] == 1 and ejections["small"] == 0  # counted once, not per round
        assert gate.snapshot_values()["gate.upstreams_healthy"] == 1
        other = await _post(client, gate, _body())
        assert other.status == 200 and fallback.seen == 1 and upstream.seen == 1
        now[0] = 161.0
        upstream.next_chunk.release()  # the engine moves again: a byte arrives
        assert b"t1" in await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT)
        assert gate.stalled_upstreams() == {}
        await asyncio.wait_for(_until(lambda: gate.pool.upstreams["primary"].healthy), TIMEOUT)
        for _ in range(2):
            upstream.next_chunk.release()
        await asyncio.wait_for(resp.read(), TIMEOUT)
    finally:
        await gate.stop()
        assert fallback.runner is not None
        await fallback.runner.cleanup()


async def test_keep_alive_comments_from_a_hung_upstream_are_no_sign_of_life(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """An HTTP server may write SSE keep-alive comments while its engine sends nothing (axum's keep-alive,
    as TGI has it; some gateways too). Until 2026-12-06 each one counted as a byte from the upstream, and
    an engine hung behind such a server was never found silent."""
    now = [100.0]
    gate = await _gate({"primary": upstream.url}, cut_stalled_streams=False)  # the verdict alone
    gate.clock = lambda: now[0]
    try:
        upstream.chunked = True  # the first token comes, then only keep-alives
        resp = await _post(client, gate, _body(stream=True))
        assert b"t0" in await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT)
        now[0] = 160.0
        upstream.keep_alive.release()
        kept = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT)
        assert kept == b": keep-alive\n\n"  # relayed as sent
        assert gate.stalled_upstreams() == {
            "primary": "stalled: 1 streaming request(s) held, no byte from it for 60 s"
        }
        now[0] = 161.0
        upstream.next_chunk.release()  # a token: it is back
        assert b"t1" in await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT)
        assert gate.stalled_upstreams() == {}
        for _ in range(2):
            upstream.next_chunk.release()
        await asyncio.wait_for(resp.read(), TIMEOUT)
    finally:
        await gate.stop()


async def test_stall_ejection_needs_silence_on_a_stream_and_from_the_whole_upstream(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """A long non-streamed answer is silent until done, and an engine with a long queue leaves some
    streams silent while it runs others: neither is a hang."""
    now = [100.0]
    gate = await _gate({"primary": upstream.url}, cut_stalled_streams=False)  # the verdict alone
    gate.clock = lambda: now[0]
    try:
        upstream.release.clear()  # nothing is answered yet: both requests wait for their first byte
        plain = asyncio.create_task(_post(client, gate, _body()))
        await asyncio.wait_for(_until(lambda: upstream.running == 1), TIMEOUT)
        now[0] = 1000.0
        assert gate.stalled_upstreams() == {}  # 900 s without a byte, but it does not stream
        upstream.chunked = True
        queued = asyncio.create_task(_post(client, gate, _body(stream=True)))  # sent at 1000
        await asyncio.wait_for(_until(lambda: upstream.running == 2), TIMEOUT)
        now[0] = 1059.0
        assert gate.stalled_upstreams() == {}
        now[0] = 1060.0
        assert set(gate.stalled_upstreams()) == {"primary"}
        upstream.release.set()  # both answer: the stream's first chunk, the plain answer whole
        assert (await asyncio.wait_for(plain, TIMEOUT)).status == 200
        resp = await asyncio.wait_for(queued, TIMEOUT)
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT)
        upstream.release.clear()
        late = asyncio.create_task(_post(client, gate, _body(stream=True)))  # waits, sent at 1060
        await asyncio.wait_for(_until(lambda: upstream.running == 2), TIMEOUT)
        now[0] = 1125.0  # the new stream has waited 65 s; the first one sent its last byte 65 s ago
        assert set(gate.stalled_upstreams()) == {"primary"}
        upstream.next_chunk.release()  # the running stream moves on
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT)
        now[0] = 1150.0  # the waiting stream is 90 s old, but the upstream sent a byte 25 s ago
        assert gate.stalled_upstreams() == {}
        gate.ejector.after_s = 0.0
        now[0] = 5000.0
        assert gate.stalled_upstreams() == {}  # 0: off
        upstream.release.set()
        for _ in range(5):  # three chunks each, one of them sent already
            upstream.next_chunk.release()
        await asyncio.wait_for(resp.read(), TIMEOUT)
        await asyncio.wait_for((await asyncio.wait_for(late, TIMEOUT)).read(), TIMEOUT)
    finally:
        await gate.stop()


async def test_the_silence_of_a_hung_upstream_outlasts_clients_that_give_up_and_send_again(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """Seen live: clients with a 30 s timeout replaced their requests to a hung simulator before any was
    60 s old, and a silence judged per request never came. It is the upstream's: it goes on across
    requests while the upstream holds streams. Once out, the upstream holds none (no new request reaches
    it) and nothing can show it is back: it stays out a while, then is tried again, on probation."""
    now = [100.0]
    gate = await _gate({"primary": upstream.url})
    gate.clock = lambda: now[0]

    async def send() -> asyncio.Task[aiohttp.ClientResponse]:
        task = asyncio.create_task(_post(client, gate, _body(stream=True)))
        await asyncio.wait_for(_until(lambda: upstream.running == 1), TIMEOUT)
        return task

    async def give_up(task: asyncio.Task[aiohttp.ClientResponse]) -> None:
        task.cancel()  # the client's timeout: the gate drops the upstream request
        await asyncio.wait_for(_until(lambda: upstream.running == 0 and not gate.held), TIMEOUT)

    try:
        upstream.release.clear()  # hung: nothing comes back
        first = await send()
        now[0] = 110.0
        assert gate.stalled_upstreams() == {}  # a health round while it holds the first request
        await give_up(first)
        now[0] = 131.0
        second = await send()
        now[0] = 159.0
        assert gate.stalled_upstreams() == {}
        now[0] = 160.0  # the second request is 29 s old; the upstream has been silent for 60 s
        assert gate.stalled_upstreams() == {
            "primary": "stalled: 1 streaming request(s) held, no byte from it for 60 s"
        }
        await give_up(second)
        now[0] = 170.0  # it holds nothing now, and gets no new request while out: out 60 s more
        assert gate.stalled_upstreams() == {
            "primary": "stalled (no byte since it was judged hung 10 s ago): out for 60 s more, "
            "ejection 1 in a row"
        }
        now[0] = 171.0
        third = await send()  # the only upstream: tried anyway, and the silence goes on across the pause
        now[0] = 172.0
        assert gate.stalled_upstreams() == {
            "primary": "stalled: 1 streaming request(s) held, no byte from it for 72 s"
        }
        await give_up(third)
        ejected = gate.metrics.ejected.collect()  # one hang, one ejection (probation: test_ejection.py)
        assert [s.value for m in ejected for s in m.samples if s.name.endswith("_total")] == [1.0]
    finally:
        upstream.release.set()
        await gate.stop()


async def test_silence_across_the_gates_own_blind_spot_is_not_a_hang(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """When the gate is not scheduled (its event loop blocked here; on a stalled node the engine stops
    too), the engine's bytes wait unread and its silence is the gate's: seen on a 2-core VM under vLLM's
    CPU backend, stalls of up to 5.9 s made a 3 s ``eject_stalled_s`` cut healthy streams. The silence
    restarts when the gate wakes; a real hang is still found ``eject_stalled_s`` later."""
    from agent.gate.ejection import BLIND_AFTER_S

    now = [100.0]
    gate = await _gate({"primary": upstream.url})
    gate.clock = lambda: now[0]
    try:
        upstream.chunked = True  # the first token comes, then nothing
        resp = await _post(client, gate, _body(stream=True))
        assert b"t0" in await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT)
        now[0] = 159.0
        assert gate.stalled_upstreams() == {}
        time.sleep(BLIND_AFTER_S + 0.2)  # the event loop blocked: the gate hears nothing
        now[0] = 160.0  # 60 s since the last byte, the last second of it unheard
        assert gate.stalled_upstreams() == {}
        assert gate.metrics.blind._value.get() >= BLIND_AFTER_S  # servepilot_gate_blind_seconds_total
        now[0] = 219.0
        assert gate.stalled_upstreams() == {}
        now[0] = 220.0  # 60 s heard since the gate woke
        assert gate.stalled_upstreams() == {
            "primary": "stalled: 1 streaming request(s) held, no byte from it for 60 s"
        }
        tail = await asyncio.wait_for(resp.read(), TIMEOUT)
        assert b"upstream primary stalled: no byte for 120 s" in tail  # cut once 60 s were heard
    finally:
        upstream.next_chunk.release()
        await gate.stop()


async def test_a_health_check_that_timed_out_across_the_gates_blind_spot_marks_nothing(
    upstream: Upstream,
) -> None:
    """A probe's 2 s timeout that runs out while the gate is not scheduled says nothing of the upstream:
    its answer may be waiting unread. Before, it marked the upstream down until the next round, and its
    traffic went to the others."""
    gate = await _gate({"primary": upstream.url}, health_interval_s=0.1)
    marks: list[tuple[str, bool]] = []
    mark = gate.pool.mark

    def recorded(name: str, healthy: bool, now: float, error: str = "") -> bool:
        marks.append((name, healthy))
        return mark(name, healthy, now, error)

    gate.pool.mark = recorded  # type: ignore[method-assign]
    try:
        await asyncio.wait_for(_until(lambda: len(marks) >= 2), TIMEOUT)
        upstream.health_block_s = 2.5  # past the probe's 2 s timeout
        await asyncio.wait_for(_until(lambda: upstream.health_block_s == 0.0), TIMEOUT)
        seen = len(marks)
        await asyncio.wait_for(_until(lambda: len(marks) >= seen + 2), TIMEOUT)  # rounds after it
        assert all(healthy for _, healthy in marks), marks
        assert gate.metrics.blind._value.get() >= 2.0
    finally:
        await gate.stop()


async def test_a_stream_decoding_too_slowly_for_the_itl_slo_is_late_before_it_ends(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """A candidate with a fast first token and slow decoding: its answers finish after the canary's step
    ends. Once a stream has run so long since its first token that its mean ITL would exceed the SLO even
    if every token its ``max_tokens`` still allows came at once, it will be SLO-bad: late. With ``n`` = 2
    the two sequences decode side by side, each to ``max_tokens``: the same budget (until 2026-12-03 it
    was ``max_tokens`` x ``n``, as if they took turns, which let a sequence decode at half the SLO's
    rate unjudged)."""
    now = [100.0]
    gate = await _gate({"primary": upstream.url})
    gate.clock = lambda: now[0]
    gate.stats.slo = (2.0, 0.1)
    upstream.chunked = True
    try:
        responses = []
        # 3 tokens; 3 in each of 2 sequences; as many as the engine allows
        for extra in ({}, {"n": 2}, {"max_tokens": None}):
            resp = await _post(client, gate, _body(stream=True, **extra))
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), TIMEOUT)  # its first token, at 100
            responses.append(resp)
        assert gate.late_at_upstreams() == {}
        now[0] = 100.19  # under 0.1 s x (3 - 1) tokens: still possible
        assert gate.late_at_upstreams() == {}
        now[0] = 100.21
        assert gate.late_at_upstreams() == {"primary": 2}
        now[0] = 1000.0  # no max_tokens: never certain
        assert gate.late_at_upstreams() == {"primary": 2}
        for _ in range(9):  # three chunks each
            upstream.next_chunk.release()
        for resp in responses:
            await asyncio.wait_for(resp.read(), TIMEOUT)
        assert gate.late_at_upstreams() == {}
    finally:
        await gate.stop()


async def test_a_started_stream_of_a_hung_upstream_ends_with_an_error_event_and_a_waiting_one_is_retried(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """Without this, a client whose stream froze mid-answer waited ``read_timeout_s`` (300 s) for
    nothing. The frozen stream proves the hang, so a request that had no byte yet is taken back too:
    with no other upstream to ask, it gets a 504 at once instead of waiting 300 s."""
    now = [100.0]
    gate = await _gate({"primary": upstream.url})
    gate.clock = lambda: now[0]
    try:
        upstream.chunked = True
        started = await _post(client, gate, _body(stream=True))
        assert b"t0" in await asyncio.wait_for(started.content.readuntil(b"\n\n"), TIMEOUT)  # at 100
        upstream.release.clear()
        waiting = asyncio.create_task(_post(client, gate, _body(stream=True)))  # no byte yet
        await asyncio.wait_for(_until(lambda: upstream.running == 2), TIMEOUT)
        now[0] = 159.0
        assert gate.stalled_upstreams() == {}
        now[0] = 160.0
        assert set(gate.stalled_upstreams()) == {"primary"}
        rest = await asyncio.wait_for(started.read(), TIMEOUT)  # ended now, not at read_timeout_s
        event = json.loads(rest.decode().removeprefix("data: ").strip())
        assert event == {
            "error": {
                "message": "upstream primary stalled: no byte for 60 s",
                "type": "upstream_error",
                "code": "upstream_stalled",
            }
        }
        resp = await asyncio.wait_for(waiting, TIMEOUT)
        assert resp.status == 504 and resp.headers["Connection"] == "close"
        assert await resp.json() == {
            "error": {
                "message": "upstream primary stalled: no byte for 60 s",
                "type": "upstream_error",
                "code": "upstream_stalled",
            }
        }
        await asyncio.wait_for(_until(lambda: upstream.running == 0), TIMEOUT)  # both dropped upstream
        outcomes = _totals(gate.stats.requests, "outcome")
        assert outcomes == {"upstream_error": 2.0}
        assert _totals(gate.metrics.resent, "upstream") == {"primary": 1.0}
    finally:
        await gate.stop()


@pytest.mark.parametrize("stream, headers_early", [(True, True), (True, False), (False, False)])
async def test_requests_a_hung_upstream_never_answered_go_to_the_next_one_unnoticed(
    upstream: Upstream, spare: Upstream, client: aiohttp.ClientSession, stream: bool, headers_early: bool
) -> None:
    """Requests sent to an engine in the minute before it was found hung waited ``read_timeout_s``
    (seen in CI: 300 s) while the streams it had started were ended at once. Once a started stream proves
    the hang, each request it has not answered at all goes to the next upstream; its client has had
    nothing (the gate sends the response headers with the first byte, not when vLLM sends them), so it
    just gets its answer. Whatever the engine was doing: its headers sent or not, a stream or not."""
    now = [100.0]
    gate = await _gate({"primary": upstream.url, "small": spare.url}, split={"primary": 1.0})
    gate.clock = lambda: now[0]
    try:
        upstream.chunked = True
        started = await _post(client, gate, _body(stream=True))
        assert b"t0" in await asyncio.wait_for(started.content.readuntil(b"\n\n"), TIMEOUT)
        upstream.release.clear()
        upstream.headers_early = headers_early
        waiting = asyncio.create_task(_post(client, gate, _body(stream=stream)))
        await asyncio.wait_for(_until(lambda: upstream.running == 2), TIMEOUT)
        now[0] = 160.0
        assert set(gate.stalled_upstreams()) == {"primary"}  # a health round
        resp = await asyncio.wait_for(waiting, TIMEOUT)
        assert resp.status == 200
        answer = await asyncio.wait_for(resp.read(), TIMEOUT)
        assert answer.endswith(b"data: [DONE]\n\n") if stream else b'"abc"' in answer
        assert spare.seen == 1 and upstream.seen == 2
        assert b"upstream_stalled" in await asyncio.wait_for(started.read(), TIMEOUT)
        await asyncio.wait_for(_until(lambda: upstream.running == 0), TIMEOUT)  # the engine's copy dropped
        assert _totals(gate.metrics.resent, "upstream") == {"primary": 1.0, "small": 0.0}
        outcomes = _totals(gate.stats.requests, "outcome")
        assert outcomes == {"upstream_error": 1.0, "ok": 1.0}  # the frozen stream; the one resent
    finally:
        upstream.release.set()
        await gate.stop()


async def _holding(
    upstream: Upstream, spare: Upstream, client: aiohttp.ClientSession, streams: tuple[bool, ...]
) -> tuple[Gate, list[float], list[asyncio.Task[aiohttp.ClientResponse]]]:
    """A gate over ``primary`` (all the split) and ``small`` on a virtual clock (``now[0]``, at 100 s), with
    ``primary`` holding one request per entry of ``streams`` (streamed or not), its headers sent and no
    byte of an answer yet."""
    now = [100.0]
    gate = await _gate({"primary": upstream.url, "small": spare.url}, split={"primary": 1.0})
    gate.clock = lambda: now[0]
    upstream.release.clear()
    upstream.headers_early = True
    waiting = [asyncio.create_task(_post(client, gate, _body(stream=stream))) for stream in streams]
    try:
        await asyncio.wait_for(_until(lambda: upstream.running == len(streams)), TIMEOUT)
    except BaseException:
        await gate.stop()
        raise
    return gate, now, waiting


async def test_without_a_frozen_stream_a_silent_upstream_keeps_the_requests_it_holds(
    upstream: Upstream, spare: Upstream, client: aiohttp.ClientSession
) -> None:
    """An upstream holding only requests with no byte yet may be busy with a very long prompt: it leaves
    the split (new requests go elsewhere), but what it holds is not taken back; it answers them."""
    gate, now, waiting = await _holding(upstream, spare, client, streams=(True, False))
    try:
        now[0] = 1000.0
        assert set(gate.stalled_upstreams()) == {"primary"}
        assert set(gate.stalled_upstreams()) == {"primary"}
        await asyncio.sleep(0.1)
        assert not any(task.done() for task in waiting) and spare.seen == 0
        upstream.release.set()
        for task in waiting:
            resp = await asyncio.wait_for(task, TIMEOUT)
            assert resp.status == 200
            await asyncio.wait_for(resp.read(), TIMEOUT)
        assert spare.seen == 0
    finally:
        await gate.stop()


async def test_the_sidecars_stall_finding_proves_a_hang_that_holds_no_stream(
    upstream: Upstream, spare: Upstream, client: aiohttp.ClientSession
) -> None:
    """An engine hung while it holds only non-streamed requests gives the gate no frozen stream to prove
    it (the test above), so they waited ``read_timeout_s``. The sidecar's ``engine_stall`` detector reads
    the engine's own counters, not streams: while its finding stands, the upstream is out and what it
    never answered goes to the next one; once it clears, the upstream is judged by its streams again."""
    gate, now, waiting = await _holding(upstream, spare, client, streams=(False, False))
    try:
        now[0] = 1000.0
        assert gate.stalled_upstreams() == {}  # nothing streams: the gate alone sees no hang
        why = "engine stalled: 2 request(s) held, no progress for 61s"
        gate.set_engine_stalled("primary", why)
        assert gate.stalled_upstreams() == {"primary": f"{why} (the sidecar's engine_stall detector)"}
        for task in waiting:
            resp = await asyncio.wait_for(task, TIMEOUT)
            assert resp.status == 200 and b'"abc"' in await asyncio.wait_for(resp.read(), TIMEOUT)
        assert spare.seen == 2 and upstream.seen == 2
        await asyncio.wait_for(_until(lambda: upstream.running == 0), TIMEOUT)  # the engine's copies dropped
        assert _totals(gate.metrics.resent, "upstream") == {"primary": 2.0, "small": 0.0}
        gate.set_engine_stalled("primary", None)  # it moves again
        assert gate.stalled_upstreams() == {}
        with pytest.raises(ValueError, match="unknown upstream 'fp8'; known: primary, small"):
            gate.set_engine_stalled("fp8", why)
    finally:
        upstream.release.set()
        await gate.stop()


async def test_a_stream_that_breaks_before_its_first_byte_is_a_502_not_an_empty_200(
    client: aiohttp.ClientSession,
) -> None:
    """An engine that sends the stream's headers and dies before any event (a crash in its first step)
    used to leave the client with a 200 and an empty body, which OpenAI clients take as an empty answer.
    The gate holds the headers until the first byte, so it can still say what happened."""

    async def dies(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        assert request.transport is not None
        request.transport.close()  # gone before the first event
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", dies)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    gate = await _gate({"primary": f"http://127.0.0.1:{runner.addresses[0][1]}"})
    try:
        resp = await _post(client, gate, _body(stream=True))
        assert resp.status == 502
        error = (await resp.json())["error"]
        assert error["code"] == "bad_gateway" and "before its first byte" in error["message"], error
        outcomes = _totals(gate.stats.requests, "outcome")
        assert outcomes == {"upstream_error": 1.0}
    finally:
        await gate.stop()
        await runner.cleanup()


async def test_a_request_sent_to_a_proven_hung_only_upstream_gets_the_time_the_upstream_got(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """With one upstream, an ejected one is still tried. A request sent there after the proof is not taken
    back at the next round: the engine may have recovered and this may be a long prompt. It gets
    ``eject_stalled_s`` without a byte, as the upstream did, before a 504."""
    now = [100.0]
    gate = await _gate({"primary": upstream.url})
    gate.clock = lambda: now[0]
    try:
        upstream.chunked = True
        started = await _post(client, gate, _body(stream=True))
        await asyncio.wait_for(started.content.readuntil(b"\n\n"), TIMEOUT)
        upstream.release.clear()
        now[0] = 160.0
        assert set(gate.stalled_upstreams()) == {"primary"}  # the frozen stream proves the hang
        assert b"upstream_stalled" in await asyncio.wait_for(started.read(), TIMEOUT)
        now[0] = 161.0
        late = [asyncio.create_task(_post(client, gate, _body())) for _ in range(2)]
        await asyncio.wait_for(_until(lambda: upstream.running == 2), TIMEOUT)
        now[0] = 165.0
        assert set(gate.stalled_upstreams()) == {"primary"}
        await asyncio.sleep(0.1)
        assert not any(task.done() for task in late)  # 4 s without a byte: not yet
        now[0] = 221.0
        assert set(gate.stalled_upstreams()) == {"primary"}  # still out (until 225)
        for task in late:
            resp = await asyncio.wait_for(task, TIMEOUT)
            assert resp.status == 504 and (await resp.json())["error"]["code"] == "upstream_stalled"
        now[0] = 222.0
        recovered = asyncio.create_task(_post(client, gate, _body()))
        await asyncio.wait_for(_until(lambda: upstream.running == 1), TIMEOUT)
        now[0] = 224.0
        assert set(gate.stalled_upstreams()) == {"primary"}
        await asyncio.sleep(0.1)
        assert not recovered.done()
        upstream.release.set()  # it answers after all
        assert (await asyncio.wait_for(recovered, TIMEOUT)).status == 200
    finally:
        upstream.release.set()
        await gate.stop()


async def test_marking_the_engine_upstream_moves_its_role_and_leaves_one_series_each(
    upstream: Upstream,
) -> None:
    gate = await _gate({"primary": upstream.url, "small": upstream.url})
    try:

        def roles() -> set[tuple[str, str]]:
            return {
                (s.labels["upstream"], s.labels["role"])
                for m in gate.metrics.role.collect()
                for s in m.samples
            }

        assert roles() == {("primary", "other"), ("small", "other")}
        gate.mark_engine("small")
        assert roles() == {("primary", "other"), ("small", "engine")}
        gate.mark_engine(None)
        assert roles() == {("primary", "other"), ("small", "other")}
        with pytest.raises(ValueError, match="unknown upstream 'nope'"):
            gate.mark_engine("nope")
    finally:
        await gate.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstream_answering_503_is_retried_on_the_next_and_still_counted_as_its_5xx(
    upstream: Upstream, spare: Upstream, client: aiohttp.ClientSession, stream: bool
) -> None:
    upstream.fail_status = 503
    gate = await _gate({"primary": upstream.url, "fp8": spare.url}, split={"primary": 1.0})
    try:
        resp = await _post(client, gate, _body(stream=stream))
        assert resp.status == 200, await resp.text()
        text = await resp.text()
        assert ("t2" in text) if stream else ("abc" in text)
        assert (upstream.seen, spare.seen) == (1, 1)
        assert _totals(gate.metrics.retried, "upstream") == {"primary": 1.0, "fp8": 0.0}
        assert _totals(gate.metrics.retried, "status") == {"502": 0.0, "503": 1.0, "504": 0.0}
        # the breaker's and the canary's error shares still see primary's 5xx, not the client's 200
        assert (gate.stats.answered, gate.stats.errors) == (2, 1)
        assert gate.stats.by_upstream["primary"] == (1, 1, 0)
        assert gate.stats.by_upstream["fp8"][:2] == (1, 0)
        assert gate.pool.upstreams["primary"].healthy  # an error answer is no health verdict
    finally:
        await gate.stop()


@pytest.mark.parametrize(("status", "statuses"), [(500, (502, 503, 504)), (503, ())])
async def test_a_status_outside_retry_statuses_is_passed_on(
    upstream: Upstream,
    spare: Upstream,
    client: aiohttp.ClientSession,
    status: int,
    statuses: tuple[int, ...],
) -> None:
    """A 500 may be this request's own doing (it would fail again elsewhere); with no statuses, none."""
    upstream.fail_status = status
    gate = await _gate(
        {"primary": upstream.url, "fp8": spare.url}, split={"primary": 1.0}, retry_statuses=statuses
    )
    try:
        resp = await _post(client, gate, _body())
        assert resp.status == status and spare.seen == 0
        assert (await resp.json())["error"]["message"] == "engine unavailable"
    finally:
        await gate.stop()


async def test_when_every_upstream_answers_503_the_last_answer_is_passed_on(
    upstream: Upstream, spare: Upstream, client: aiohttp.ClientSession
) -> None:
    upstream.fail_status = spare.fail_status = 503
    gate = await _gate({"primary": upstream.url, "fp8": spare.url}, split={"primary": 1.0})
    try:
        resp = await _post(client, gate, _body())
        assert resp.status == 503 and (upstream.seen, spare.seen) == (1, 1)
        assert gate.stats.errors == 2
    finally:
        await gate.stop()


async def test_the_retry_budget_passes_errors_on_rather_than_doubling_the_load(
    upstream: Upstream, spare: Upstream, client: aiohttp.ClientSession
) -> None:
    """Budget 0% of the requests at upstreams: the floor of 3 retries at a time. Five requests meet a
    failing primary while the spare holds the retried ones: three are retried, two get the 503."""
    upstream.fail_status = 503
    spare.release.clear()
    gate = await _gate(
        {"primary": upstream.url, "fp8": spare.url}, split={"primary": 1.0}, retry_budget_ratio=0.0
    )
    try:
        sent = [asyncio.ensure_future(_post(client, gate, _body())) for _ in range(5)]
        await _until(lambda: upstream.seen == 5 and spare.seen == 3)
        [denied] = [
            s.value
            for m in gate.metrics.retry_denied.collect()
            for s in m.samples
            if s.name.endswith("_total")
        ]
        assert denied == 2
        spare.release.set()
        statuses = sorted([(await resp).status for resp in sent])
        assert statuses == [200, 200, 200, 503, 503]
        assert gate.forwarder.retrying == 0  # every place in the budget was given back
    finally:
        await gate.stop()


async def test_a_drafting_engine_s_streams_without_usage_are_counted_by_its_tokens_per_step(
    client: aiohttp.ClientSession,
) -> None:
    """The simulator drafting 3 tokens (each accepted with p 0.8) streams a step's tokens as one event,
    as vLLM does: 96-token answers come in about 33 events. Counted one token per event, the gate saw a
    third of them; told the engine's decode tokens per step (the sidecar passes
    ``engine.decode_tokens_per_step``), it counts them within a few percent. Usage, when asked for, wins.
    (The gate asks for it itself unless ``gate.stream_usage`` is off, as here: tests/agent/gate/
    test_stream_usage.py.)"""
    from simulator.engine import make_core
    from simulator.server import SimServer
    from simulator.specdec import SpecDecodeConfig

    sim = SimServer(
        make_core("h100-sxm", "llama-3-8b", "fp16", 64, spec=SpecDecodeConfig(3, 0.8)), speed=20.0
    )
    runner = web.AppRunner(sim.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    gate = await _gate({"primary": f"http://127.0.0.1:{runner.addresses[0][1]}"}, stream_usage=False)

    async def output_tokens(**extra: Any) -> float:
        before = _totals(gate.stats.tokens, "kind").get("output", 0.0)
        for i in range(8):
            body = _body(stream=True, prompt=f"p{i}", max_tokens=96, model=sim.model_name, **extra)
            resp = await _post(client, gate, body)
            assert resp.status == 200
            await resp.read()
        return _totals(gate.stats.tokens, "kind")["output"] - before

    try:
        assert 8 * 96 / 4 < await output_tokens() < 8 * 96 / 2  # one per event: a step's worth lost
        gate.set_tokens_per_event("primary", (1 - 0.8**4) / (1 - 0.8))  # E[1 + accepted] = 2.95
        assert await output_tokens() == pytest.approx(8 * 96, rel=0.1)
        assert await output_tokens(stream_options={"include_usage": True}) == 8 * 96
        gate.set_tokens_per_event("primary", None)
        assert gate.tokens_per_event == {}
        with pytest.raises(ValueError, match="unknown upstream 'nope'"):
            gate.set_tokens_per_event("nope", 2.0)
    finally:
        await gate.stop()
        await runner.cleanup()


async def _first_answer(port: int, declared: int) -> bytes:
    """The status line a client sending ``Expect: 100-continue`` gets before it sends its body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: gate\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {declared}\r\n".encode()
            + b"Expect: 100-continue\r\n\r\n"
        )
        await writer.drain()
        return (await asyncio.wait_for(reader.readline(), 5.0)).strip()
    finally:
        writer.close()


async def test_a_body_declared_over_the_limit_gets_413_before_it_is_sent(
    upstream: Upstream, client: aiohttp.ClientSession
) -> None:
    """curl asks with ``Expect: 100-continue`` for bodies over 1 MiB: the gate's first answer is the 413,
    not the 100 that asks for an upload it would refuse unread."""
    gate = await _gate({"primary": upstream.url}, max_body_bytes=1024)
    try:
        assert await _first_answer(gate.port, 5000) == b"HTTP/1.1 413 Request Entity Too Large"
        assert await _first_answer(gate.port, 500) == b"HTTP/1.1 100 Continue"  # within the limit: send it
        assert upstream.seen == 0
        # a client that waits for the 100 gets it, sends, and is answered
        url = f"http://127.0.0.1:{gate.port}/v1/completions"
        resp = await client.post(url, data=json.dumps(_body()).encode(), expect100=True)
        assert resp.status == 200 and upstream.seen == 1
    finally:
        await gate.stop()
