"""The gate asks for a stream's usage where its client did not (``gate.stream_usage``), counts the
stream's tokens from it exactly, and takes the event out of what the client gets.

The streams are real: vLLM 0.32 CPU's chat and completions and llama.cpp's chat, each asked for its
usage (tests/fixtures/gate/SOURCES.md)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.gate.sequences import MAX_EVENT_BYTES
from agent.gate.stream_usage import UsageEventFilter, ask_stream_usage
from tests.agent.gate.parked import Stepped, serving
from tests.engines.client import gate_for, gate_tokens

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gate"
TIMEOUT = 5.0
RECORDED = [
    "vllm-0.32.0-cpu-chat-usage-stream.sse",
    "vllm-0.32.0-cpu-completions-usage-stream.sse",
    "llamacpp-chat-usage-stream.sse",
]


def _without_usage(stream: bytes) -> bytes:
    """``stream`` less its usage event, found the plain way (each event decoded): the expectation."""
    kept = []
    for event in stream.split(b"\n\n"):
        data = event.removeprefix(b"data: ")
        if event and data != b"[DONE]" and json.loads(data).get("choices") == []:
            continue
        kept.append(event)
    return b"\n\n".join(kept)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'),
        ("/v1/completions", b'\n  {"prompt": "hi", "stream": true, "max_tokens": 3}'),
        ("/chat/completions", b'{"stream":true,"messages":[]}'),  # llama.cpp's alias
        # the field named in a string is not the field: inside a string its quotes are escaped
        ("/v1/completions", b'{"prompt": "about \\"stream_options\\"", "stream": true}'),
    ],
)
def test_the_request_asks_for_the_usage_and_is_otherwise_the_clients(path: str, body: bytes) -> None:
    asked = ask_stream_usage(path, body)
    assert asked is not None
    doc = json.loads(asked)
    assert doc.pop("stream_options") == {"include_usage": True}
    assert doc == json.loads(body)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"prompt": "hi", "stream": true, "stream_options": {"include_usage": false}}'),
        ("/v1/responses", b'{"input": "hi", "stream": true}'),  # its last event has the usage anyway
        ("/v1/messages", b'{"messages": [], "stream": true}'),  # so has Anthropic's
        ("/generate", b'{"text": "hi", "stream": true}'),  # SGLang's meta_info counts
        ("/v1/completions", b'["not", "an", "object"]'),
        ("/v1/completions", b"  { }"),
    ],
)
def test_the_gate_leaves_alone_what_it_should_not_ask_for(path: str, body: bytes) -> None:
    assert ask_stream_usage(path, body) is None


@pytest.mark.parametrize("name", RECORDED)
@pytest.mark.parametrize("size", [1, 7, 64, 200, 10_000])
def test_the_usage_event_is_taken_out_however_the_stream_is_cut(name: str, size: int) -> None:
    """Cut into chunks of ``size`` bytes (1: the marker itself split), the client gets every byte of the
    recorded stream but the usage event's, in order."""
    stream = (FIXTURES / name).read_bytes()
    assert stream.count(b'"choices":[]') == 1
    events = UsageEventFilter()
    out = b"".join(events.feed(stream[i : i + size]) for i in range(0, len(stream), size)) + events.rest()
    assert out == _without_usage(stream)
    assert b'"usage"' not in out and out.endswith(b"data: [DONE]\n\n")


def test_events_may_end_in_crlf_too() -> None:
    stream = (FIXTURES / RECORDED[0]).read_bytes().replace(b"\n\n", b"\r\n\r\n")
    events = UsageEventFilter()
    chunks = stream.split(b"\r\n\r\n")[:-1]
    out = [events.feed(chunk + b"\r\n\r\n") for chunk in chunks]
    assert [len(o) for o in out].count(0) == 1  # the usage event's chunk, alone
    assert b"".join(out) == _without_usage(stream.replace(b"\r\n\r\n", b"\n\n")).replace(b"\n\n", b"\r\n\r\n")


def test_a_stream_that_never_ends_an_event_is_passed_on_not_kept() -> None:
    events = UsageEventFilter()
    assert events.feed(b"data: {}\n\n") == b"data: {}\n\n"
    assert events.feed(b"x" * 1000) == b""  # an event's start: waits for its end
    assert events.feed(b"x" * MAX_EVENT_BYTES) == b"x" * (MAX_EVENT_BYTES + 1000)
    assert events.rest() == b""


class RecordedVllmChat(Stepped):
    """``/v1/chat/completions`` answered with vLLM's recorded chat stream (a role event, 4 tokens), with
    its usage event (22 prompt tokens, 4 generated) only when the request asks for it, as vLLM does; an
    event every ``STEP_S`` of the gate's virtual clock. Keeps the bodies it got."""

    path = "/v1/chat/completions"

    def __init__(self) -> None:
        super().__init__([100.0])
        self.go.set()
        self.bodies: list[dict[str, Any]] = []

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        self.bodies.append(body)
        stream = (FIXTURES / RECORDED[0]).read_bytes()
        if not body.get("stream_options", {}).get("include_usage"):
            stream = _without_usage(stream)
        return await self.send(request, [event + b"\n\n" for event in stream.split(b"\n\n")[:-1]])


@pytest.fixture
async def vllm_chat() -> AsyncIterator[RecordedVllmChat]:
    async for served in serving(RecordedVllmChat()):
        yield served


async def _chat(base: str, **extra: Any) -> bytes:
    body = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4, "stream": True, **extra}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        client.post(f"{base}/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
        return await resp.read()


async def test_the_gate_counts_from_the_usage_it_asked_for_and_the_client_never_sees_it(
    vllm_chat: RecordedVllmChat,
) -> None:
    recorded = (FIXTURES / RECORDED[0]).read_bytes()
    async with gate_for(vllm_chat.url) as (gate, base, registry):
        gate.clock = vllm_chat.clock
        answer = await _chat(base)
    assert vllm_chat.bodies[0]["stream_options"] == {"include_usage": True}
    assert answer == _without_usage(recorded)  # byte for byte what the client would get from vLLM
    # the engine's count of the prompt (its chat template's tokens), not the estimate from "Say hello"
    assert gate_tokens(registry) == {"prompt": 22.0, "output": 4.0}
    # the usage event is not a token's arrival: 4 tokens, 3 gaps
    assert registry.get_sample_value("servepilot_gate_itl_seconds_count", {"bucket": "le256"}) == 3


async def test_a_client_that_asks_gets_the_usage_and_one_that_set_options_keeps_them(
    vllm_chat: RecordedVllmChat,
) -> None:
    recorded = (FIXTURES / RECORDED[0]).read_bytes()
    async with gate_for(vllm_chat.url) as (gate, base, registry):
        gate.clock = vllm_chat.clock
        asked = await _chat(base, stream_options={"include_usage": True})
        declined = await _chat(base, stream_options={"include_usage": False})
    assert asked == recorded
    assert vllm_chat.bodies[1]["stream_options"] == {"include_usage": False}
    assert declined == _without_usage(recorded)
    assert gate_tokens(registry)["output"] == 8.0  # 4 from the usage, 4 counted one per token event
    assert registry.get_sample_value("servepilot_gate_itl_seconds_count", {"bucket": "le256"}) == 6


async def test_stream_usage_off_sends_the_clients_body_as_it_came(vllm_chat: RecordedVllmChat) -> None:
    async with gate_for(vllm_chat.url, stream_usage=False) as (gate, base, registry):
        gate.clock = vllm_chat.clock
        await _chat(base)
    assert "stream_options" not in vllm_chat.bodies[0]
    tokens = gate_tokens(registry)
    assert tokens["output"] == 4.0 and tokens["prompt"] != 22.0  # counted per event; the prompt estimated


async def test_a_drafting_engines_streams_are_counted_exactly() -> None:
    """The simulator drafting 3 tokens (each accepted with p 0.8) streams a step's tokens as one event:
    96-token answers in about 33 events. Without usage the gate counted a third of them, or the engine's
    mean tokens per step when told it (tests/agent/gate/test_proxy.py); asking for the usage, it counts
    every token, and the client gets no event it did not ask for."""
    from simulator.engine import make_core
    from simulator.server import SimServer
    from simulator.specdec import SpecDecodeConfig

    sim = SimServer(
        make_core("h100-sxm", "llama-3-8b", "fp16", 64, spec=SpecDecodeConfig(3, 0.8)), speed=20.0
    )
    runner = web.AppRunner(sim.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    answers = []
    try:
        async with (
            gate_for(f"http://127.0.0.1:{runner.addresses[0][1]}") as (_, base, registry),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        ):
            for i in range(8):
                body = {"prompt": f"p{i}", "max_tokens": 96, "stream": True, "model": sim.model_name}
                async with client.post(f"{base}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    answers.append(await resp.read())
    finally:
        await runner.cleanup()
    assert gate_tokens(registry)["output"] == 8 * 96
    assert all(b'"usage"' not in a and a.endswith(b"data: [DONE]\n\n") for a in answers)
    assert sum(a.count(b"data: {") for a in answers) < 8 * 96 / 2  # steps, not tokens
