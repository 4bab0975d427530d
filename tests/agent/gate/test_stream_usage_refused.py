"""An upstream that refuses the ``stream_options`` the gate puts in (``gate.stream_usage``) gets the
request again without it, and goes unasked for :data:`~agent.gate.stream_usage.REASK_AFTER_S`.

The refusals are the answers public issue reports quote from vLLM 0.4, Fireworks and TGI
(tests/fixtures/gate/stream-options-refusals.json, SOURCES.md)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.gate.stream_usage import (
    REASK_AFTER_S,
    UsageRefusals,
    ask_stream_usage,
    refuses_stream_usage,
    unask_stream_usage,
)
from tests.engines.client import gate_for, gate_tokens
from tests.loopback import serve

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gate"
REFUSALS = json.loads((FIXTURES / "stream-options-refusals.json").read_text())
CHAT = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4, "stream": True}
TIMEOUT = 5.0


def _recorded_stream() -> bytes:
    """vLLM 0.32's recorded chat stream (a role event, 4 tokens) less its usage event: what vLLM sends a
    request that did not ask for the usage."""
    events = (FIXTURES / "vllm-0.32.0-cpu-chat-usage-stream.sse").read_bytes().split(b"\n\n")
    kept = [e for e in events if b'"choices":[]' not in e]
    return b"\n\n".join(kept)


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r["engine"].split()[0])
def test_each_recorded_refusal_is_told_as_one(refusal: dict[str, Any]) -> None:
    assert refuses_stream_usage(refusal["status"], refusal["body"].encode())


@pytest.mark.parametrize(
    ("status", "payload"),
    [
        (400, b'{"object":"error","message":"This model\'s maximum context length is 2048 tokens."}'),
        (500, b'{"error":"stream_options handling crashed"}'),  # a failure, not a refusal of the field
        (200, b'{"stream_options":"x"}'),
    ],
)
def test_other_answers_are_not_refusals(status: int, payload: bytes) -> None:
    assert not refuses_stream_usage(status, payload)


def test_unasking_gives_back_the_clients_body() -> None:
    body = b'  {"prompt": "hi", "stream": true}'
    asked = ask_stream_usage("/v1/completions", body)
    assert asked is not None
    assert unask_stream_usage(asked) == body.lstrip()


def test_a_refusal_is_remembered_per_upstream_for_a_while() -> None:
    refusals = UsageRefusals()
    refusals.note("primary", 100.0)
    assert refusals.refused("primary", 100.0 + REASK_AFTER_S - 1)
    assert not refusals.refused("primary", 100.0 + REASK_AFTER_S)
    assert not refusals.refused("fp8", 100.0)


class Refusing:
    """A chat upstream that answers ``refusal`` to a body holding ``stream_options``, as an engine that
    forbids the field does, and vLLM's recorded stream otherwise; keeps the bodies it got."""

    def __init__(self, refusal: dict[str, Any]) -> None:
        self.refusal = refusal
        self.bodies: list[dict[str, Any]] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if "stream_options" in body:
            return web.Response(
                status=self.refusal["status"],
                body=self.refusal["body"].encode(),
                headers={"Content-Type": self.refusal["content_type"]},
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_recorded_stream())
        await resp.write_eof()
        return resp


@contextlib.asynccontextmanager
async def serving(refusal: dict[str, Any]) -> AsyncIterator[tuple[Refusing, str]]:
    """A :class:`Refusing` upstream on loopback and its URL."""
    upstream = Refusing(refusal)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", upstream.chat)
    async with serve(app) as url:
        yield upstream, url


@pytest.fixture(params=REFUSALS, ids=lambda r: r["engine"].split()[0])
async def refusing(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Refusing, str]]:
    async with serving(request.param) as served:
        yield served


async def _chat(client: aiohttp.ClientSession, base: str) -> bytes:
    async with client.post(f"{base}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.read()


def _refused(registry: Any) -> float | None:
    return registry.get_sample_value("servepilot_gate_stream_usage_refused_total", {"upstream": "primary"})


async def test_a_refused_stream_is_sent_again_without_the_field_and_the_upstream_goes_unasked(
    refusing: tuple[Refusing, str],
) -> None:
    upstream, url = refusing
    now = [1000.0]
    async with (
        gate_for(url) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        gate.clock = lambda: now[0]
        first = await _chat(client, base)
        assert [("stream_options" in b) for b in upstream.bodies] == [True, False]
        assert upstream.bodies[1] == CHAT  # the client's request, as it sent it
        assert first == _recorded_stream()  # the client never saw the refusal
        assert _refused(registry) == 1

        now[0] += REASK_AFTER_S - 1
        await _chat(client, base)  # not asked: one request, without the field
        assert [("stream_options" in b) for b in upstream.bodies[2:]] == [False]

        now[0] += 1
        await _chat(client, base)  # asked again (an upgrade would be found), refused again
        assert [("stream_options" in b) for b in upstream.bodies[3:]] == [True, False]
        assert _refused(registry) == 2
    # counted per token event, as before the gate asked: 4 tokens a stream
    assert gate_tokens(registry)["output"] == 3 * 4


async def test_an_error_that_is_not_about_the_field_reaches_the_client_as_it_came() -> None:
    message = {
        "object": "error",
        "message": "This model's maximum context length is 2048 tokens.",
        "code": 400,
    }
    refusal = {"status": 400, "content_type": "application/json", "body": json.dumps(message)}
    async with (
        serving(refusal) as (upstream, url),
        gate_for(url) as (_, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        client.post(f"{base}/v1/chat/completions", json=CHAT) as resp,
    ):
        assert resp.status == 400
        assert await resp.read() == refusal["body"].encode()
    assert len(upstream.bodies) == 1
    assert _refused(registry) == 0
