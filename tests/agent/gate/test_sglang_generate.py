"""SGLang's native ``POST /generate`` through the gate.

SGLang's own clients, its router and the RL frameworks built on it send ``/generate``, not OpenAI's
paths; passed straight through, they got past the in-flight limit, the line buckets and the priorities.
The upstream here answers in the shape SGLang documents (docs.sglang.io, "SGLang Native APIs" and
"Sampling Parameters"): ``text`` is the answer so far, ``meta_info`` counts ``prompt_tokens`` and
``completion_tokens``, a stream ends with ``data: [DONE]``, and a batch is answered with a list. No SGLang
runs here (it needs a GPU), so this shape is what the gate is checked against.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.gate.openai import BadRequest, RequestInfo, parse_request, usage_from_json, usage_from_sse_tail
from tests.agent.gate.parked import ParkedEngine, serving, settled
from tests.engines.client import ONE_AT_A_TIME, gate_for

TIMEOUT = 5.0


def _meta(prompt: int, completion: int) -> dict[str, Any]:
    finish = {"type": "length", "length": completion}
    return {"id": "r1", "finish_reason": finish, "prompt_tokens": prompt, "completion_tokens": completion}


class SglangUpstream(ParkedEngine):
    """``/generate``, answering 4 prompt tokens and 3 generated ones per prompt once ``go`` is set."""

    path = "/generate"

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await self.go.wait()
        if isinstance(body.get("text"), list):
            return web.json_response([{"text": "abc", "meta_info": _meta(4, 3)} for _ in body["text"]])
        if not body.get("stream"):
            return web.json_response({"text": "abc", "meta_info": _meta(4, 3)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(1, 4):
            event = {"text": "abc"[:i], "meta_info": {**_meta(4, i), "finish_reason": None}}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
async def upstream() -> AsyncIterator[SglangUpstream]:
    async for engine in serving(SglangUpstream()):
        yield engine


def _info(doc: object) -> RequestInfo:
    return parse_request("/generate", json.dumps(doc).encode())


def test_a_generate_body_is_read_for_its_prompts_batch_and_max_new_tokens() -> None:
    body = {"text": "x" * 40, "sampling_params": {"max_new_tokens": 64}, "stream": True}
    assert _info(body) == RequestInfo(True, 10.0, 64.0, "", 1)
    # a batch of two prompts, each sampled 3 times: six answers, each up to max_new_tokens
    batch = _info({"text": ["x" * 8, "y" * 4], "sampling_params": {"max_new_tokens": 5, "n": 3}})
    assert (batch.prompt_tokens, batch.choices) == (3.0, 6)
    assert _info({"input_ids": [1, 2, 3, 4, 5]}).prompt_tokens == 5.0  # token ids counted exactly
    ids = _info({"input_ids": [[1, 2], [3, 4, 5]]})
    assert (ids.prompt_tokens, ids.choices, ids.max_tokens) == (5.0, 2, 0.0)
    with pytest.raises(BadRequest, match="'sampling_params' must be an object"):
        _info({"text": "x", "sampling_params": [1]})
    with pytest.raises(BadRequest, match=r"'sampling_params\.max_new_tokens' must be a number"):
        _info({"text": "x", "sampling_params": {"max_new_tokens": -1}})


def test_a_batch_may_carry_sampling_params_per_prompt_as_sglang_takes_them() -> None:
    """SGLang's ``sampling_params`` is an object or a list of them, one per prompt; the gate answered
    the list with a 400 until 2026-12-04, so such a client could not pass it at all."""
    params = [{"max_new_tokens": 8, "n": 2}, {"max_new_tokens": 32}]
    info = _info({"text": ["x" * 8, "y" * 4], "sampling_params": params})
    assert (info.prompts, info.choices, info.max_tokens) == (2, 3, 32.0)  # bounded by the largest
    single = _info({"text": ["x", "y", "z"], "sampling_params": [{"max_new_tokens": 4}]})
    assert (single.choices, single.max_tokens) == (3, 4.0)  # one object in a list: for every prompt
    with pytest.raises(BadRequest, match=r"one per prompt \(2\)"):
        _info({"text": ["x", "y"], "sampling_params": [{}, {}, {}]})
    with pytest.raises(BadRequest, match=r"'sampling_params\.max_new_tokens' must be a number"):
        _info({"text": ["x", "y"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": "a"}]})
    with pytest.raises(BadRequest, match="'sampling_params' must be an object"):
        _info({"text": "x", "sampling_params": "greedy"})


def test_meta_info_counts_a_plain_answer_a_batch_and_the_last_event_of_a_stream() -> None:
    assert usage_from_json(json.dumps({"text": "abc", "meta_info": _meta(4, 3)}).encode()) == (4.0, 3.0)
    batch = [{"text": "a", "meta_info": _meta(4, 3)}, {"text": "b", "meta_info": _meta(6, 2)}]
    assert usage_from_json(json.dumps(batch).encode()) == (10.0, 5.0)
    assert usage_from_json(b'[{"text": "a"}]') is None  # one answer uncounted: the events count instead
    events = b"".join(
        f"data: {json.dumps({'text': 'abc'[:i], 'meta_info': _meta(4, i)})}\n\n".encode() for i in (1, 2, 3)
    )
    assert usage_from_sse_tail(events + b"data: [DONE]\n\n") == (4.0, 3.0)  # cumulative: the last one


async def test_generate_is_admitted_under_the_limit_and_counted_from_meta_info(
    upstream: SglangUpstream,
) -> None:
    bodies = [
        {"text": "hello", "sampling_params": {"max_new_tokens": 3}, "stream": True},
        {"text": "hello", "sampling_params": {"max_new_tokens": 3}},
        {"text": ["hello", "there"], "sampling_params": {"max_new_tokens": 3}},
    ]
    async with (
        gate_for(upstream.url, **ONE_AT_A_TIME) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        tasks = [asyncio.create_task(client.post(f"{base}/generate", json=body)) for body in bodies]
        # one at the engine, two waiting: the limit holds on this path
        await settled(lambda: gate.admission.queue_depth == 2 and upstream.running == 1)
        assert gate.admission.queue_depth == 2 and upstream.running == 1
        upstream.go.set()
        answers = [await task for task in tasks]
        texts = [await resp.text() for resp in answers]
    assert [resp.status for resp in answers] == [200, 200, 200], texts
    assert texts[0].endswith("data: [DONE]\n\n") and texts[0].count("data:") == 4
    assert upstream.peak == 1
    output = {"line": "default", "kind": "output"}
    assert registry.get_sample_value("servepilot_gate_tokens_total", output) == 3 + 3 + 2 * 3
    prompt = {"line": "default", "kind": "prompt"}
    assert registry.get_sample_value("servepilot_gate_tokens_total", prompt) == 4 + 4 + 2 * 4
