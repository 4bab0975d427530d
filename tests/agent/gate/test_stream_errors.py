"""A failure after a stream's 200 went can only be said in the stream: vLLM 0.32 ends it with an error
event (``{"error": {"message", "type", "param", "code"}}``, then ``[DONE]``). Until 2026-12-06 the gate
counted such an answer ``ok``, its error event a token: the breaker's error rate and the SLO-bad share
never saw an engine failing mid-generation."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.gate.openai import stream_error
from tests.agent.gate.parked import Stepped, serving
from tests.engines.client import gate_for, gate_tokens

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gate"
TIMEOUT = 5.0


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
        recorded = (FIXTURES / "vllm-0.32.0-cpu-completions-usage-stream.sse").read_bytes()
        tokens = [event + b"\n\n" for event in recorded.split(b"\n\n")[:3]]
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
    async with (
        gate_for(engine.url, stream_usage=False) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        gate.clock = engine.clock
        body = {"prompt": "Say hello", "max_tokens": 4, "stream": True}
        async with client.post(f"{base}/v1/completions", json=body) as resp:
            assert resp.status == 200  # as the engine sent it: the client reads the error event itself
            relayed = await resp.read()
        errors = gate.stats.errors
    assert _vllm_error(code) in relayed and relayed.endswith(b"data: [DONE]\n\n")
    labels = {"line": "default", "priority": "normal", "outcome": outcome}
    assert registry.get_sample_value("servepilot_gate_requests_total", labels) == 1
    assert errors == (code >= 500)  # the breaker's and the canary's 5xx count
    assert gate_tokens(registry)["output"] == 3.0  # its three tokens; the error event is none


@pytest.mark.parametrize(
    ("tail", "status"),
    [
        (_vllm_error(500) + b"data: [DONE]\n\n", 500),
        (_vllm_error(503), 503),
        # SGLang's (serving_base.create_streaming_error_response: json.dumps of {"error": ErrorResponse}),
        # as vLLM before 0.10 wrote it too: spaced, with the ErrorResponse's "object" inside
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
    ],
)
def test_the_error_events_status(tail: bytes, status: int | None) -> None:
    assert stream_error(tail) == status
