"""Each sequence's own inter-token gaps in a multi-sequence stream (``n`` > 1, a list of prompts).

The streams are real: vLLM 0.32 CPU's completions and chat with ``n`` = 2, and llama.cpp's native
``/completion`` with two prompts (tests/fixtures/gate/SOURCES.md). Their events interleave the two
sequences in the order the engine sent them; the tests time each event and check that the gaps are taken
between events of the same sequence, however the bytes are cut into network chunks.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.gate.sequences import MAX_EVENT_BYTES, SequenceGaps
from tests.agent.gate.parked import Stepped, serving
from tests.engines.client import gate_for, gate_tokens

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gate"
TIMEOUT = 5.0


def _events(name: str) -> list[bytes]:
    body = (FIXTURES / name).read_bytes()
    return [event + b"\n\n" for event in body.split(b"\n\n") if event.strip()]


def _index(event: bytes) -> int | None:
    """The sequence a recorded event is for, read the plain way (the expectation, not the code under test)."""
    data = event.removeprefix(b"data: ").strip()
    if data in (b"[DONE]", b"null"):
        return None
    doc = json.loads(data)
    choices = doc.get("choices")
    if choices is not None:
        if not choices or choices[0].get("delta") == {"role": "assistant", "content": ""}:
            return None  # the usage, or a chat sequence's opening role: no token
        return choices[0]["index"]
    return int(doc["index"])


def _expected(events: list[bytes], times: list[float]) -> list[float]:
    last: dict[int, float] = {}
    gaps = []
    for event, t in zip(events, times, strict=True):
        index = _index(event)
        if index is None:
            continue
        if index in last:
            gaps.append(t - last[index])
        last[index] = t
    return gaps


@pytest.mark.parametrize(
    ("name", "sequences", "gaps"),
    [
        ("vllm-0.32.0-cpu-completions-n2-stream.sse", 2, 6),  # 4 tokens each: 3 gaps each
        ("vllm-0.32.0-cpu-chat-n2-stream.sse", 2, 6),  # the role event (no token), then 4 tokens
        ("llamacpp-prompts2-stream.sse", 2, 8),  # top-level index; a leading "data: null"
    ],
)
def test_gaps_are_taken_between_events_of_the_same_sequence(name: str, sequences: int, gaps: int) -> None:
    events = _events(name)
    times = [0.01 * 2**i for i in range(len(events))]  # every gap distinct, so a wrong pairing shows
    seen: list[float] = []
    clock = SequenceGaps(seen)
    for event, t in zip(events, times, strict=True):
        clock.feed(event, t)
    assert clock.sequences == sequences
    assert seen == pytest.approx(_expected(events, times))
    assert len(seen) == gaps


@pytest.mark.parametrize("size", [1, 7, 64, 333])
def test_events_cut_across_chunks_are_put_back_together(size: int) -> None:
    """An event split over network chunks counts once, when its end arrives (with CRLF lines too)."""
    events = _events("vllm-0.32.0-cpu-completions-n2-stream.sse")
    body = b"".join(events).replace(b"\n", b"\r\n")
    seen: list[float] = []
    clock = SequenceGaps(seen)
    for start in range(0, len(body), size):
        clock.feed(body[start : start + size], float(start))  # a piece's time: where it starts
    ends, at = [], 0  # each event counts when the piece with its last byte comes
    for event in events:
        at += len(event.replace(b"\n", b"\r\n"))
        ends.append(float((at - 1) // size * size))
    assert seen == pytest.approx(_expected(events, ends))


def test_events_naming_no_sequence_are_nobodys_tokens() -> None:
    seen: list[float] = []
    clock = SequenceGaps(seen)
    noise = (
        b"data: not json\n\n"
        b'data: ["a", "list"]\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 8}}\n\n'
        b'data: {"choices": [{"index": true}]}\n\n'
        b'data: {"index": -1}\n\n'
        b": a comment\n\n"
        b"data: [DONE]\n\n"
    )
    clock.feed(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n', 1.0)
    clock.feed(noise, 2.0)
    clock.feed(b'data: {"choices": [{"index": 0, "text": "b"}]}\n\n', 3.0)
    assert seen == [2.0] and clock.sequences == 1


def test_an_event_that_never_ends_is_dropped_not_kept_growing() -> None:
    seen: list[float] = []
    clock = SequenceGaps(seen)
    clock.feed(b'data: {"choices": [{"index": 0, "text": "', 1.0)
    clock.feed(b"x" * MAX_EVENT_BYTES, 2.0)  # past the bound: what was kept goes
    clock.feed(b'"}]}\n\ndata: {"choices": [{"index": 0}]}\n\n', 3.0)
    clock.feed(b'data: {"choices": [{"index": 0}]}\n\n', 4.0)
    assert seen == [1.0] and clock.sequences == 1


class SteppedUpstream(Stepped):
    """``/v1/completions`` with ``n`` = 2: the recorded vLLM stream regrouped as an engine sends it, both
    sequences' tokens of a decode step in one write, a step every ``STEP_S`` of the gate's (virtual)
    clock. The next step waits until the gate has read the last one (its clock was read)."""

    path = "/v1/completions"

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        events = _events("vllm-0.32.0-cpu-completions-n2-stream.sse")
        by_sequence: dict[int, list[bytes]] = {0: [], 1: []}
        for event in events[:-1]:
            index = _index(event)
            assert index is not None
            by_sequence[index].append(event)
        steps = [a + b for a, b in zip(by_sequence[0], by_sequence[1], strict=True)] + [events[-1]]
        return await self.send(request, steps)


@pytest.fixture
async def stepped() -> AsyncIterator[SteppedUpstream]:
    async for engine in serving(SteppedUpstream([100.0])):
        yield engine


async def test_the_gate_records_each_sequences_own_token_gaps(stepped: SteppedUpstream) -> None:
    """Two sequences decoding a token each per 50 ms step: the gate's ITL is 50 ms, 3 gaps each (before
    2026-12-04 it recorded none for such a stream; the gaps between events would have said 0 and 50 ms)."""
    body = {"model": "m", "prompt": "Say hello", "max_tokens": 4, "n": 2, "stream": True}
    async with (
        gate_for(stepped.url) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        gate.clock = stepped.clock
        async with client.post(f"{base}/v1/completions", json=body) as resp:
            relayed = await resp.read()
        values = gate.stats.values(stepped.now[0])
    recorded = _events("vllm-0.32.0-cpu-completions-n2-stream.sse")
    assert sorted(relayed.split(b"\n\n")) == sorted(b"".join(recorded).split(b"\n\n"))  # every event
    bucket = {"bucket": "le256"}
    assert registry.get_sample_value("servepilot_gate_itl_seconds_count", bucket) == 6
    assert registry.get_sample_value("servepilot_gate_itl_seconds_sum", bucket) == pytest.approx(0.3)
    assert values["gate.le256.itl_seconds.p99"] == pytest.approx(SteppedUpstream.STEP_S)
    assert registry.get_sample_value("servepilot_gate_ttft_seconds_sum", bucket) == pytest.approx(0.05)


async def _through_a_gate_to_the_simulator(path: str, body: dict[str, Any]) -> tuple[bytes, Any]:
    """``body`` sent to ``path`` through a gate in front of the simulator: the answer, and the gate's
    registry."""
    from simulator.engine import make_core
    from simulator.server import SimServer

    sim = SimServer(make_core("h100-sxm", "llama-3-8b", "fp16", 64), speed=10.0)
    runner = web.AppRunner(sim.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with (
            gate_for(f"http://127.0.0.1:{runner.addresses[0][1]}") as (_, base, registry),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
            client.post(f"{base}{path}", json=body) as resp,
        ):
            assert resp.status == 200
            return await resp.read(), registry
    finally:
        await runner.cleanup()


async def test_the_simulators_n_2_stream_is_timed_per_sequence_through_the_gate() -> None:
    """The simulator serves ``n`` as vLLM does (tests/simulator/test_n_sequences.py): through the gate,
    each of the two sequences (4 tokens, the last with the finish reason) gives 3 gaps, as vLLM's recorded
    stream does, and the tokens of both count."""
    body = {
        "prompt": "x" * 40,
        "max_tokens": 4,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, registry = await _through_a_gate_to_the_simulator("/v1/completions", body)
    bucket = {"bucket": "le256"}
    assert registry.get_sample_value("servepilot_gate_itl_seconds_count", bucket) == 6
    output = registry.get_sample_value("servepilot_gate_tokens_total", {"line": "default", "kind": "output"})
    assert output == 8.0  # from the usage: both sequences' tokens


@pytest.mark.parametrize("n", [1, 2])
async def test_a_chat_streams_opening_role_is_neither_a_token_nor_a_gap(n: int) -> None:
    """A chat stream opens each sequence with its role and no content (vLLM's recorded stream does too):
    without usage, the gate counts the tokens themselves, 5 a sequence, and times 4 gaps of each, where
    the role event made it 6 and 5 (one token too many per answer, and a gap of about 0)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": n, "stream": True}
    answer, registry = await _through_a_gate_to_the_simulator("/v1/chat/completions", body)
    assert answer.count(b'"role":"assistant","content":""') == n
    assert registry.get_sample_value("servepilot_gate_itl_seconds_count", {"bucket": "le256"}) == 4 * n
    output = registry.get_sample_value("servepilot_gate_tokens_total", {"line": "default", "kind": "output"})
    assert output == 5.0 * n


class ReplayedChat(Stepped):
    """``/v1/chat/completions``: llama.cpp's recorded chat stream (its role event, 6 tokens, a closing
    event with an empty delta and its ``timings``, ``[DONE]``), an event every ``STEP_S`` of the gate's
    virtual clock; without ``timings`` when ``strip`` (an engine that reports no counts)."""

    path = "/v1/chat/completions"

    def __init__(self, now: list[float], strip: bool) -> None:
        super().__init__(now)
        self.strip = strip

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        events = _events("llamacpp-chat-stream.sse")
        if self.strip:
            events = [re.sub(rb',"timings":\{[^}]*\}', b"", event) for event in events]
        return await self.send(request, events)


@pytest.mark.parametrize("strip", [False, True], ids=["timings", "no counts"])
async def test_llamacpps_chat_stream_is_counted_by_its_tokens_alone(strip: bool) -> None:
    """Its opening role event and its closing empty delta carry no token: neither is counted or timed.
    The closing event's ``timings`` give the exact counts (57 prompt tokens computed, 6 generated);
    without them the 6 token events are counted. The first token came 100 ms after the request (the role
    50 ms before it), then one every 50 ms: 5 gaps."""
    now = [100.0]
    async for engine in serving(ReplayedChat(now, strip)):
        body = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 6, "stream": True}
        async with (
            gate_for(engine.url) as (gate, base, registry),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        ):
            gate.clock = engine.clock
            async with client.post(f"{base}/v1/chat/completions", json=body) as resp:
                await resp.read()
    bucket = {"bucket": "le256"}
    assert registry.get_sample_value("servepilot_gate_itl_seconds_count", bucket) == 5
    assert registry.get_sample_value("servepilot_gate_itl_seconds_sum", bucket) == pytest.approx(0.25)
    assert registry.get_sample_value("servepilot_gate_ttft_seconds_sum", bucket) == pytest.approx(0.1)
    tokens = gate_tokens(registry)
    assert tokens["output"] == 6.0
    assert (tokens["prompt"] == 57.0) is not strip  # the estimate from the message, without timings
