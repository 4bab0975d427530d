"""Anthropic's Messages API (``POST /v1/messages``), vLLM's batch chat and SageMaker's ``/invocations``
through the gate, and which of an engine's routes the gate admits (``servepilot check``).

vLLM 0.32 serves all three; none was admitted until 2026-12-02, so a client written against Anthropic's
SDK got past the in-flight limit, the buckets and the priorities. The streams and answers replayed here
are a real vLLM 0.32 CPU server's (tests/fixtures/gate/SOURCES.md): a Messages stream opens with
``message_start`` and ``content_block_start``, which carry no token, and its last ``message_delta``
carries the usage.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.gate.openai import (
    MESSAGES_TOKEN_EVENT,
    RequestInfo,
    parse_request,
    usage_from_json,
    usage_from_sse_tail,
)
from agent.gate.routes import classify
from tests.agent.gate.parked import ParkedEngine, serving, settled
from tests.engines.client import ONE_AT_A_TIME, gate_for

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gate"
STREAM = (FIXTURES / "vllm-0.32.0-cpu-messages-stream.sse").read_bytes()
ANSWER = (FIXTURES / "vllm-0.32.0-cpu-messages.json").read_bytes()
BATCH_ANSWER = (FIXTURES / "vllm-0.32.0-cpu-chat-batch.json").read_bytes()
OPENAPI = json.loads((FIXTURES / "vllm-0.32.0-cpu-openapi-paths.json").read_text())
TIMEOUT = 5.0


def _info(path: str, doc: object) -> RequestInfo:
    return parse_request(path, json.dumps(doc).encode())


def test_a_messages_body_counts_its_messages_and_system_and_is_bounded_by_max_tokens() -> None:
    body = {
        "model": "m",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "s" * 40}],
        "messages": [
            {"role": "user", "content": "u" * 40},
            {"role": "assistant", "content": [{"type": "text", "text": "a" * 8}]},
        ],
        "stream": True,
    }
    assert _info("/v1/messages", body) == RequestInfo(
        True, 10.0 + 10.0 + 2.0, 64.0, "m", 1, MESSAGES_TOKEN_EVENT
    )


def test_a_real_messages_stream_has_one_marker_per_token_and_its_usage_at_the_end() -> None:
    assert STREAM.count(MESSAGES_TOKEN_EVENT) == 5  # the five generated tokens (max_tokens 5)
    assert STREAM.count(b"data:") == 10  # where counting events would have said 9 tokens
    assert usage_from_sse_tail(STREAM[-1024:]) == (38.0, 5.0)  # the last message_delta's usage
    assert usage_from_json(ANSWER) == (38.0, 5.0)


def test_a_batch_chat_is_as_many_answers_as_conversations() -> None:
    body = {
        "max_tokens": 4,
        "n": 2,
        "messages": [[{"role": "user", "content": "a" * 8}], [{"role": "user", "content": "b" * 4}]],
    }
    info = _info("/v1/chat/completions/batch", body)
    assert (info.prompt_tokens, info.max_tokens, info.choices) == (3.0, 4.0, 4)
    assert usage_from_json(BATCH_ANSWER) == (32.0, 8.0)


def test_invocations_are_read_by_field_whatever_api_the_body_is_for() -> None:
    assert _info("/invocations", {"prompt": "x" * 8, "max_tokens": 3}) == RequestInfo(False, 2.0, 3.0, "", 1)
    chat = {"messages": [{"role": "user", "content": "x" * 8}], "max_completion_tokens": 5, "stream": True}
    assert _info("/invocations", chat) == RequestInfo(True, 2.0, 5.0, "", 1)
    assert _info("/generative_scoring", {"query": "q" * 4, "items": ["a" * 4, "b" * 4]}).prompt_tokens == 3.0


def test_every_post_route_of_vllm_0_32_is_admitted_or_known_harmless() -> None:
    routes = classify(OPENAPI)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses",
                 "/v1/messages", "/invocations", "/generative_scoring", "/v1/systemone"):  # fmt: skip
        assert path in routes.admitted
    assert "/tokenize" in routes.passed and "/v1/responses/{response_id}/cancel" in routes.passed
    assert routes.unjudged == ()
    # a route a later release adds is named for the operator, until admit_paths (or the gate) knows it
    later = {**OPENAPI, "paths": {**OPENAPI["paths"], "/v1/newer": {"post": {"summary": "Newer"}}}}
    assert classify(later).unjudged == ("/v1/newer",)
    assert "not known to the gate: /v1/newer" in classify(later).summary()
    assert classify(later, admit_paths=("/v1/newer",)).unjudged == ()
    with pytest.raises(ValueError, match="no 'paths'"):
        classify({"openapi": "3.1.0"})


class MessagesUpstream(ParkedEngine):
    """``/v1/messages``: the real stream's events, ``message_start`` at once and the rest once ``go``."""

    path = "/v1/messages"

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if not body.get("stream"):
            await self.go.wait()
            return web.Response(body=ANSWER, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        events = [event + b"\n\n" for event in STREAM.split(b"\n\n") if event.strip()]
        await resp.write(events[0] + events[1])  # message_start, content_block_start: no token yet
        self.started.set()
        await self.go.wait()
        for event in events[2:]:
            await resp.write(event)
            await asyncio.sleep(0.005)
        await resp.write_eof()
        return resp


@pytest.fixture
async def upstream() -> AsyncIterator[MessagesUpstream]:
    async for engine in serving(MessagesUpstream()):
        yield engine


async def test_messages_are_held_to_the_limit_timed_from_their_first_token_and_counted_from_usage(
    upstream: MessagesUpstream,
) -> None:
    now = [100.0]
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Say hello"}]}
    async with (
        gate_for(upstream.url, **ONE_AT_A_TIME) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        gate.clock = lambda: now[0]
        url = f"{base}/v1/messages"
        first = asyncio.create_task(client.post(url, json={**body, "stream": True}))
        await asyncio.wait_for(upstream.started.wait(), TIMEOUT)
        second = asyncio.create_task(client.post(url, json=body))
        # the second waits for the first's slot
        await settled(lambda: gate.admission.queue_depth == 1 and upstream.running == 1)
        assert gate.admission.queue_depth == 1 and upstream.running == 1
        await asyncio.sleep(0.05)
        now[0] = 101.5  # the first token comes 1.5 s after the request; message_start came at once
        upstream.go.set()
        texts = [await (await task).text() for task in (first, second)]
    assert texts[0].encode() == STREAM and texts[1].encode() == ANSWER  # relayed byte for byte
    assert upstream.peak == 1
    ttft = {"bucket": "le256"}
    # the stream's first token; the answer in one piece (5 tokens) has no TTFT of its own, only its e2e
    assert registry.get_sample_value("servepilot_gate_ttft_seconds_count", ttft) == 1
    assert registry.get_sample_value("servepilot_gate_ttft_seconds_sum", ttft) == pytest.approx(1.5)
    assert registry.get_sample_value("servepilot_gate_e2e_seconds_count", ttft) == 2
    tokens = {
        k: registry.get_sample_value("servepilot_gate_tokens_total", {"line": "default", "kind": k})
        for k in ("prompt", "output")
    }
    assert tokens == {"prompt": 2 * 38.0, "output": 2 * 5.0}


def test_anthropic_usage_adds_the_cached_prompt_back_and_chat_without_v1_is_chat() -> None:
    # llama.cpp's /v1/messages answer to a one-word prompt (2026-12-02, tests/e2e/test_llamacpp.py)
    llamacpp = b'{"usage": {"cache_read_input_tokens": 50, "input_tokens": 1, "output_tokens": 3}}'
    assert usage_from_json(llamacpp) == (51.0, 3.0)
    created = b'{"usage": {"input_tokens": 4, "cache_creation_input_tokens": 6, "output_tokens": 1}}'
    assert usage_from_json(created) == (10.0, 1.0)
    openai_shape = b'{"usage": {"prompt_tokens": 9, "completion_tokens": 2, "cache_read_input_tokens": 5}}'
    assert usage_from_json(openai_shape) == (9.0, 2.0)  # prompt_tokens already counts what was cached
    chat = {"messages": [{"role": "user", "content": "x" * 8}], "max_tokens": 3}
    assert (
        _info("/chat/completions", chat)
        == _info("/v1/chat/completions", chat)
        == RequestInfo(False, 2.0, 3.0)
    )


ENGINE_REFUSAL = {"type": "error", "error": {"type": "BadRequestError", "message": "max_tokens too large"}}


class RefusingMessages(ParkedEngine):
    """An engine that answers every Messages request with its own 400, in vLLM 0.32's shape there
    (vllm/entrypoints/anthropic/api_router.py: ``translate_error_response``)."""

    path = "/v1/messages"
    more_paths = ("/v1/chat/completions",)

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response(ENGINE_REFUSAL, status=400)


async def test_the_gates_own_refusals_on_messages_are_in_anthropics_shape() -> None:
    """vLLM answers its own errors on /v1/messages in Anthropic's shape; the gate's refusals there were
    OpenAI's until 2026-12-06 (a client reading ``error.type`` got ``rate_limit_exceeded``). An answer
    the engine sent is relayed as it came, and the other APIs keep OpenAI's shape."""
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Say hello"}]}
    async for engine in serving(RefusingMessages()):
        async with (
            gate_for(engine.url, default_requests_per_min=1.0) as (_, base, _registry),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        ):
            answers = []
            for path, sent in [
                ("/v1/messages", b"{not json"),  # the gate's 400
                ("/v1/chat/completions", b"{not json"),  # the gate's 400, OpenAI's shape
                *[("/v1/messages", json.dumps(body).encode())] * 3,  # the engine's 400 twice, then a 429
            ]:
                headers = {"Content-Type": "application/json"}
                async with client.post(base + path, data=sent, headers=headers) as resp:
                    answers.append((resp.status, await resp.json(), resp.headers.get("Retry-After")))
    (bad, _, _), (openai_bad, openai_doc, _) = answers[0], answers[1]
    assert bad == 400 and answers[0][1]["type"] == "error"
    assert answers[0][1]["error"]["type"] == "invalid_request_error"
    assert answers[0][1]["error"]["message"].startswith("request body is not valid JSON")
    assert openai_bad == 400 and openai_doc["error"]["code"] == "bad_request"  # OpenAI's, as before
    assert [status for status, _, _ in answers[2:]] == [400, 400, 429]
    assert answers[2][1] == answers[3][1] == ENGINE_REFUSAL  # the engine's, as it came
    limited, retry = answers[4][1], answers[4][2]
    assert set(limited) == {"type", "error"} and limited["error"]["type"] == "rate_limit_error"
    assert retry is not None and float(retry) > 0
