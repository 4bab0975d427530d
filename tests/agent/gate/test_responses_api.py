"""OpenAI's Responses API (``POST /v1/responses``, served by vLLM and SGLang) through the gate.

It is generation like chat, so it is admitted like chat: before, it was passed straight through, and a
client on it got past the in-flight limit, the line buckets and the priorities, and was never measured.
Its stream differs: ``response.created`` and the other lifecycle events come before any token, and its
``response.completed`` event repeats the whole answer before the ``usage``. The upstream here speaks
that shape (the events' fields as vLLM 0.32 sends them); tests/e2e/test_vllm_cpu.py sends the same
requests to a real vLLM.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.gate.openai import RequestInfo, parse_request, usage_from_json, usage_from_sse_tail
from tests.agent.gate.parked import ParkedEngine, serving, settled
from tests.engines.client import ONE_AT_A_TIME, gate_for

TIMEOUT = 5.0
ANSWER = "x" * 6000  # the completed event repeats it: longer than the tail of a stream the gate keeps


def _event(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def _response(status: str, usage: dict[str, int] | None) -> dict[str, Any]:
    text = ANSWER if status == "completed" else ""
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]
    return {
        "id": "resp_1",
        "object": "response",
        "model": "m",
        "status": status,
        "output": output,
        "usage": usage,
    }


USAGE = {"input_tokens": 9, "output_tokens": 3, "total_tokens": 12}


class ResponsesUpstream(ParkedEngine):
    """``/v1/responses``: ``response.created`` at once, then the tokens once ``go`` is set."""

    path = "/v1/responses"

    def __init__(self) -> None:
        super().__init__()
        self.created_sent = asyncio.Event()

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if not body.get("stream"):
            await self.go.wait()
            return web.json_response(_response("completed", USAGE))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_event("response.created", response=_response("in_progress", None)))
        await resp.write(_event("response.in_progress", response=_response("in_progress", None)))
        self.created_sent.set()
        await self.go.wait()
        for i in range(3):
            await resp.write(_event("response.output_text.delta", item_id="m1", delta=f"t{i}"))
            await asyncio.sleep(0.01)
        await resp.write(_event("response.output_text.done", item_id="m1", text=ANSWER))
        await resp.write(_event("response.completed", response=_response("completed", USAGE)))
        await resp.write_eof()
        return resp


@pytest.fixture
async def upstream() -> AsyncIterator[ResponsesUpstream]:
    async for engine in serving(ResponsesUpstream()):
        yield engine


def test_a_responses_body_is_read_for_its_input_instructions_and_max_output_tokens() -> None:
    doc = {
        "model": "m",
        "instructions": "i" * 8,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "u" * 20}]},
            {"type": "message", "role": "assistant", "content": "a" * 12},
            {"type": "function_call_output", "call_id": "c1", "output": "o" * 4},
        ],
        "max_output_tokens": 64,
        "max_tokens": 9999,  # not a Responses field: ignored
        "stream": True,
    }
    info = parse_request("/v1/responses", json.dumps(doc).encode())
    assert info == RequestInfo(True, 11.0, 64.0, "m", 1, b'.delta"')  # (8 + 20 + 12 + 4) / 4
    assert parse_request("/v1/responses", b'{"input": "abcd"}').prompt_tokens == 1.0
    # a chat stream's every event carries tokens: no marker
    assert parse_request("/v1/chat/completions", b'{"messages": []}').token_event == b""


def test_usage_is_read_in_either_naming_and_from_a_completed_event_longer_than_the_tail() -> None:
    assert usage_from_json(json.dumps(_response("completed", USAGE)).encode()) == (9.0, 3.0)
    chat = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    assert usage_from_sse_tail(chat) == (5.0, 2.0)
    completed = _event("response.completed", response=_response("completed", USAGE))
    assert len(completed) > 4096
    assert usage_from_sse_tail(completed[-4096:]) == (9.0, 3.0)  # its "data:" is cut off: found anyway
    assert usage_from_sse_tail(b'data: {"usage": null}\n\n') is None
    assert usage_from_sse_tail(b'data: {"usage": {"input_tokens": 9, "outp') is None  # cut short
    assert usage_from_json(b'{"usage": {"prompt_tokens": true, "completion_tokens": 1}}') is None


async def test_a_responses_stream_is_admitted_and_its_ttft_is_its_first_token_not_response_created(
    upstream: ResponsesUpstream,
) -> None:
    now = [100.0]
    body = {"model": "m", "input": "hello", "max_output_tokens": 3, "stream": True}
    async with gate_for(upstream.url, **ONE_AT_A_TIME) as (gate, base, registry):
        gate.clock = lambda: now[0]
        url = f"{base}/v1/responses"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client:
            first = asyncio.create_task(client.post(url, json=body))
            await asyncio.wait_for(upstream.created_sent.wait(), TIMEOUT)
            second = asyncio.create_task(client.post(url, json=body))
            # the second waits for the first's slot: the limit holds on this path
            await settled(lambda: gate.admission.queue_depth == 1 and upstream.running == 1)
            assert gate.admission.queue_depth == 1 and upstream.running == 1
            await asyncio.sleep(0.1)  # response.created has reached the gate: no token yet
            assert gate.late_at_upstreams() == {}  # no SLO set: nothing is judged late
            now[0] = 102.5  # the first token comes 2.5 s after the request
            upstream.go.set()
            for task in (first, second):
                resp = await task
                text = await resp.text()
                assert resp.status == 200 and text.count("event: response.output_text.delta\n") == 3
                assert '"status": "completed"' in text
    assert upstream.peak == 1
    labels = {"bucket": "le256"}
    assert registry.get_sample_value("servepilot_gate_ttft_seconds_count", labels) == 2
    # each TTFT is the 2.5 s from its arrival to its first delta (queue included). Timed at the first
    # byte instead, the first request's would be 0 s: its response.created came at once
    assert registry.get_sample_value("servepilot_gate_ttft_seconds_sum", labels) == pytest.approx(5.0)
    output = {"line": "default", "kind": "output"}
    assert registry.get_sample_value("servepilot_gate_tokens_total", output) == 6  # usage: 3 each
    prompt = {"line": "default", "kind": "prompt"}
    assert registry.get_sample_value("servepilot_gate_tokens_total", prompt) == 18  # usage: 9 each
    requests = {"line": "default", "priority": "normal", "outcome": "ok"}
    assert registry.get_sample_value("servepilot_gate_requests_total", requests) == 2


async def test_a_plain_responses_answer_is_admitted_and_counted_from_its_usage(
    upstream: ResponsesUpstream,
) -> None:
    upstream.go.set()
    async with (
        gate_for(upstream.url, health_interval_s=600) as (_, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        body = {"model": "m", "input": "hello", "max_output_tokens": 3}
        async with client.post(f"{base}/v1/responses", json=body) as resp:
            assert resp.status == 200 and (await resp.json())["usage"] == USAGE
    output = {"line": "default", "kind": "output"}
    assert registry.get_sample_value("servepilot_gate_tokens_total", output) == 3
