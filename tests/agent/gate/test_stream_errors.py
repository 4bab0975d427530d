"""A failure after a stream's 200 went can only be said in the stream: vLLM 0.32 ends it with an error
event (``{"error": {"message", "type", "param", "code"}}``, then ``[DONE]``). Until 2026-12-06 the gate
counted such an answer ``ok``, its error event a token: the breaker's error rate and the SLO-bad share
never saw an engine failing mid-generation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from agent.gate.openai import stream_error, stream_finished
from agent.gate.proxy import Gate
from tests.agent.gate.parked import ParkedEngine, Stepped, serving
from tests.engines.client import gate_for, gate_tokens

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gate"
TIMEOUT = 5.0


def _recorded(name: str) -> list[bytes]:
    """The events of a recorded stream in tests/fixtures/gate, each with its blank line."""
    return [event + b"\n\n" for event in (FIXTURES / name).read_bytes().split(b"\n\n")[:-1]]


async def _streamed(
    engine: ParkedEngine, path: str = "/v1/completions", clock: Callable[[], float] | None = None
) -> tuple[bytes, Gate, CollectorRegistry]:
    """What a client read of a stream of ``path`` from ``engine`` through a gate (answered 200), the gate
    (stopped) and its registry; ``clock``: the gate's, an engine's virtual one."""
    async with (
        gate_for(engine.url, stream_usage=False) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        if clock is not None:
            gate.clock = clock
        body = {"model": "m", "prompt": "Say hello", "max_tokens": 4, "stream": True}
        body |= {"messages": [{"role": "user", "content": "Say hello"}]} if path == "/v1/messages" else {}
        async with client.post(f"{base}{path}", json=body) as resp:
            assert resp.status == 200  # as the engine sent it: the client reads an error event itself
            relayed = await resp.read()
    return relayed, gate, registry


def _vllm_error(code: int) -> bytes:
    """vLLM 0.32's streamed error, written as its create_streaming_error_response writes it."""
    error = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": code}
    return f"data: {json.dumps({'error': error})}\n\n".encode()


class FailingMidStream(Stepped):
    """vLLM's recorded completion stream cut after its first three tokens by an error event (``code``)."""

    path = "/v1/completions"

    def __init__(self) -> None:
        super().__init__([100.0])
        self.go.set()
        self.code = 500

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        tokens = _recorded("vllm-0.32.0-cpu-completions-usage-stream.sse")[:3]
        return await self.send(request, [*tokens, _vllm_error(self.code), b"data: [DONE]\n\n"])


@pytest.fixture
async def engine() -> AsyncIterator[FailingMidStream]:
    async for served in serving(FailingMidStream()):
        yield served


@pytest.mark.parametrize(("code", "outcome"), [(500, "upstream_error"), (400, "client_error")])
async def test_an_answer_that_failed_mid_stream_is_a_failed_answer(
    engine: FailingMidStream, code: int, outcome: str
) -> None:
    engine.code = code
    relayed, gate, registry = await _streamed(engine, clock=engine.clock)
    errors = gate.stats.errors
    assert _vllm_error(code) in relayed and relayed.endswith(b"data: [DONE]\n\n")
    labels = {"line": "default", "priority": "normal", "outcome": outcome}
    assert registry.get_sample_value("servepilot_gate_requests_total", labels) == 1
    assert errors == (code >= 500)  # the breaker's and the canary's 5xx count
    assert gate_tokens(registry)["output"] == 3.0  # its three tokens; the error event is none


class KilledMidStream(FailingMidStream):
    """The engine's process dies after ``keep`` events of ``recorded`` (all of them: after its end) and,
    with ``fragment``, part of the next: its connection drops without the stream's end, as a kill -9 of
    llama.cpp mid-generation showed."""

    more_paths = ("/v1/messages",)
    recorded = "vllm-0.32.0-cpu-completions-usage-stream.sse"
    keep: int | None = 3
    fragment = b""

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        events = _recorded(self.recorded)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"".join(events[: self.keep]) + self.fragment)
        await asyncio.sleep(0.05)  # on the wire before the drop (an abort discards what is buffered)
        assert request.transport is not None
        request.transport.abort()
        return resp


async def _relayed_from_killed(engine: KilledMidStream, path: str) -> tuple[bytes, dict[str, float]]:
    """What the client read of a stream from ``engine`` through a gate, and the gate's requests by
    outcome."""
    relayed, _, registry = await _streamed(engine, path)
    line = {"line": "default", "priority": "normal"}
    outcomes = {
        outcome: registry.get_sample_value("servepilot_gate_requests_total", line | {"outcome": outcome})
        or 0.0
        for outcome in ("ok", "upstream_error")
    }
    return relayed, outcomes


@pytest.mark.parametrize("fragment", [b"", b'data: {"id":"cmpl-1","choices":[{"te'])
async def test_a_stream_whose_engine_died_ends_with_an_error_event(fragment: bytes) -> None:
    """Until 2026-12-06 the client's stream just ended, as a whole answer's does, and the OpenAI SDK
    returned the three tokens as the answer. Now an error event says it failed; a fragment of an event
    is closed by a blank line first, so the error event parses."""
    async for engine in serving(KilledMidStream()):
        engine.fragment = fragment
        relayed, outcomes = await _relayed_from_killed(engine, "/v1/completions")
        events = relayed.split(b"\n\n")
        assert events[-1] == b"" and events[2].startswith(b"data: ")  # three whole token events
        assert events[3:-2] == ([fragment] if fragment else [])
        error = json.loads(events[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == "bad_gateway" and error["message"].startswith("the upstream's stream broke")
        assert outcomes == {"ok": 0.0, "upstream_error": 1.0}


async def test_a_messages_stream_whose_engine_died_ends_with_anthropics_error_event() -> None:
    """Anthropic's SDK raises on an event named ``error`` and passes over unnamed ones: until 2026-12-07
    the gate's OpenAI-shaped error event let it read a cut Messages answer as whole."""
    async for engine in serving(KilledMidStream()):
        engine.recorded, engine.keep = "vllm-0.32.0-cpu-messages-stream.sse", 4
        relayed, outcomes = await _relayed_from_killed(engine, "/v1/messages")
        name, data = relayed.split(b"\n\n")[-2].split(b"\n")
        assert name == b"event: error"
        doc = json.loads(data.removeprefix(b"data: "))
        assert doc["type"] == "error" and doc["error"]["type"] == "api_error", doc
        assert doc["error"]["message"].startswith("the upstream's stream broke")
        assert stream_error(relayed) == 500  # the gate reads its own event as the engines' are read
        assert outcomes == {"ok": 0.0, "upstream_error": 1.0}


@pytest.mark.parametrize(
    ("recorded", "path"),
    [
        ("vllm-0.32.0-cpu-completions-usage-stream.sse", "/v1/completions"),  # ends with [DONE]
        ("vllm-0.32.0-cpu-messages-stream.sse", "/v1/messages"),  # ends with message_stop
    ],
)
async def test_a_stream_that_broke_after_its_end_is_a_whole_answer(recorded: str, path: str) -> None:
    """Until 2026-12-07 a connection lost after ``[DONE]`` counted the answer an upstream error and
    added an error event after the end, which no client reads."""
    async for engine in serving(KilledMidStream()):
        engine.recorded, engine.keep = recorded, None
        relayed, outcomes = await _relayed_from_killed(engine, path)
        assert relayed == (FIXTURES / recorded).read_bytes()
        assert outcomes == {"ok": 1.0, "upstream_error": 0.0}


class KeptAlive(Stepped):
    """An upstream that writes SSE comments while it prefills (axum's keep-alive, as TGI sends it; some
    gateways do the same), then vLLM's recorded completion stream, one event per step."""

    path = "/v1/completions"

    def __init__(self) -> None:
        super().__init__([100.0])
        self.go.set()

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        events = _recorded("vllm-0.32.0-cpu-completions-usage-stream.sse")
        return await self.send(request, [b":\n\n", b": keep-alive\n\n", *events])


async def test_keep_alive_comments_are_neither_a_first_token_nor_a_gap() -> None:
    """Until 2026-12-06 a comment-only chunk counted as a token's arrival: a 15-s prefill behind
    keep-alives read as a TTFT of one keep-alive interval."""
    async for engine in serving(KeptAlive()):
        relayed, _, registry = await _streamed(engine, clock=engine.clock)
        assert relayed.startswith(b":\n\n: keep-alive\n\n")  # relayed as sent
        bucket = {"bucket": "le256"}
        # the gate reads its clock at arrival, then once per chunk: the first token is the third chunk
        ttft = registry.get_sample_value("servepilot_gate_ttft_seconds_sum", bucket)
        assert ttft == pytest.approx(3 * Stepped.STEP_S)
        assert gate_tokens(registry)["output"] == 4.0


@pytest.mark.parametrize(
    ("tail", "status"),
    [
        (_vllm_error(500) + b"data: [DONE]\n\n", 500),
        (_vllm_error(503), 503),
        # SGLang's (serving_base.create_streaming_error_response: json.dumps of {"error": ErrorResponse}),
        # as older vLLM releases wrote it too: spaced, with the ErrorResponse's "object" inside
        (
            b'data: {"error": {"object": "error", "message": "Invalid request", "type": "BadRequestError", '
            b'"param": null, "code": 400}}\n\ndata: [DONE]\n\n',
            400,
        ),
        (b'data: {"error": {"message": "no code"}}\n\n', 500),
        (b'data: {"error": {"message": "odd", "code": 200}}\n\n', 500),
        (b'data: {"error": "cut sh', 500),  # cut by the tail's start or end: an error all the same
        (b'data: {"choices":[{"text":"data: {\\"error\\": 1}"}]}\n\n', None),  # text cannot forge it
        (b"data: [DONE]\n\n", None),
        # llama.cpp's (server-context.cpp: format_oai_sse of {"error": its error JSON}; no [DONE] after)
        (b'data: {"error":{"code":400,"message":"context full","type":"invalid_request_error"}}\n\n', 400),
    ],
)
def test_the_error_events_status(tail: bytes, status: int | None) -> None:
    assert stream_error(tail) == status


@pytest.mark.parametrize(
    ("tail", "status"),
    [
        # vLLM's Messages stream (anthropic serving: an AnthropicStreamEvent of type error, then [DONE])
        (
            b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":"Invalid data '
            b'format received"}}\n\ndata: [DONE]\n\n',
            500,
        ),
        # SGLang's (orjson of its stream event: the fields it leaves None come too)
        (
            b'event: error\ndata: {"type":"error","error":{"type":"internal_server_error","message":"boom"},'
            b'"index":null}\n\n',
            500,
        ),
        # Anthropic's own overloaded error: 529, its status for it
        (
            b'event: error\ndata: {"type":"error", "error": {"type": "overloaded_error", "message": ""}}\n\n',
            529,
        ),
        (
            b'event: error\ndata: {"type":"error","error":{"type":"invalid_request_error","message":""}}\n\n',
            400,
        ),
        # llama.cpp's Messages stream: its error JSON under the name, with its code
        (b'event: error\ndata: {"code":503,"message":"Loading model","type":"unavailable_error"}\n\n', 503),
        # OpenAI's Responses stream: a failed response, and an error event with a code that is no status
        (
            b'event: response.failed\ndata: {"type":"response.failed","response":{"status":"failed",'
            b'"error":{"code":"server_error","message":"x"}}}\n\n',
            500,
        ),
        (b'event: error\ndata: {"type":"error","code":"ERR_SOMETHING","message":"x","param":null}\n\n', 500),
        (b"event: error\n", 500),  # its data cut off by the tail's end
        # the name in generated text is no event: a JSON string holds no raw newline
        (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":'
            b'"text_delta","text":"event: error\\n"}}\n\n',
            None,
        ),
        (b'data: {"type":"response.output_text.delta","delta":"xevent: error\\n"}\n\n', None),
    ],
)
def test_named_error_events_are_failed_answers(tail: bytes, status: int | None) -> None:
    assert stream_error(tail) == status


@pytest.mark.parametrize(
    "name", ["vllm-0.32.0-cpu-messages-stream.sse", "vllm-0.32.0-cpu-responses-stream.sse"]
)
def test_the_recorded_messages_and_responses_streams_hold_no_error(name: str) -> None:
    stream = (FIXTURES / name).read_bytes()
    assert stream_error(stream) is None
    assert stream_error(stream[-4096:]) is None


class FailingMessages(Stepped):
    """vLLM's recorded Messages stream cut after its first token by its error event, as vLLM ends it."""

    path = "/v1/messages"

    def __init__(self) -> None:
        super().__init__([100.0])
        self.go.set()

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        events = _recorded("vllm-0.32.0-cpu-messages-stream.sse")[:3]  # start, block start, a token
        error = b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":"x"}}\n\n'
        return await self.send(request, [*events, error, b"data: [DONE]\n\n"])


async def test_a_messages_stream_that_failed_is_a_failed_answer() -> None:
    async for engine in serving(FailingMessages()):
        async with (
            gate_for(engine.url) as (gate, base, registry),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        ):
            gate.clock = engine.clock
            body = {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
            }
            async with client.post(f"{base}/v1/messages", json=body) as resp:
                assert resp.status == 200
                assert (await resp.read()).count(b"event: error\n") == 1  # relayed as it came
            errors = gate.stats.errors
    labels = {"line": "default", "priority": "normal", "outcome": "upstream_error"}
    assert registry.get_sample_value("servepilot_gate_requests_total", labels) == 1
    assert errors == 1
    # its one token event; its prompt as message_start counted it (the stream's only usage, and 0
    # generated: a start's, not the end's)
    assert gate_tokens(registry) == {"prompt": 38.0, "output": 1.0}


@pytest.mark.parametrize(
    "recorded",
    [
        "vllm-0.32.0-cpu-completions-usage-stream.sse",
        "vllm-0.32.0-cpu-chat-usage-stream.sse",
        "vllm-0.32.0-cpu-messages-stream.sse",
        "vllm-0.32.0-cpu-responses-stream.sse",
        "llamacpp-chat-usage-stream.sse",
    ],
)
def test_a_recorded_stream_is_finished_at_its_end_and_not_before(recorded: str) -> None:
    whole = (FIXTURES / recorded).read_bytes()
    assert stream_finished(whole)
    assert stream_finished(whole.replace(b"\n", b"\r\n"))  # an engine that ends its lines so
    events = whole.split(b"\n\n")
    assert not stream_finished(b"\n\n".join(events[:-2]) + b"\n\n")  # its last event missing
    assert not stream_finished(whole[:-20])  # cut inside it


def test_text_that_reads_like_an_end_does_not_finish_a_stream() -> None:
    assert not stream_finished(b'data: {"choices":[{"text":"data: [DONE]"}]}\n\n')
    assert not stream_finished(b"")
