"""WebSocket sessions through the gate (agent/gate/websockets.py): the engines' realtime APIs, such as
vLLM's ``/v1/realtime``. Until 2026-12-06 the gate dropped the handshake's hop-by-hop headers and every
realtime client failed behind it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from agent.config import GateConfig, GateLineConfig
from agent.engines.launcher import free_port
from agent.gate import websockets
from agent.gate.proxy import Gate
from agent.gate.websockets import sendable
from tests.engines.client import gate_for
from tests.loopback import serve

TIMEOUT = 5.0
#: vLLM 0.32's realtime ``transcription.done``, as its pydantic model writes it (protocol.py, installed here)
DONE = (
    '{"type":"transcription.done","text":"hello there","usage":{"prompt_tokens":120,"total_tokens":125,'
    '"completion_tokens":5,"prompt_tokens_details":null}}'
)


class Realtime:
    """An upstream serving ``/v1/realtime`` as a WebSocket that echoes each message, with the
    ``realtime`` subprotocol; a text ``"close 4001"`` makes it close with that code. Keeps the headers
    of each handshake and the close code each session ended with."""

    def __init__(self) -> None:
        self.handshakes: list[dict[str, str]] = []
        self.closed_with: list[int | None] = []
        self.ended = asyncio.Event()

    async def realtime(self, request: web.Request) -> web.WebSocketResponse:
        self.handshakes.append(dict(request.headers))
        ws = web.WebSocketResponse(protocols=("realtime",))
        await ws.prepare(request)
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.TEXT and msg.data.startswith("close "):
                await ws.close(code=int(msg.data.split()[1]))
            elif msg.type is aiohttp.WSMsgType.TEXT and msg.data == "commit":
                await ws.send_str(DONE)
            elif msg.type is aiohttp.WSMsgType.TEXT:
                await ws.send_str(msg.data)
            elif msg.type is aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
        self.closed_with.append(ws.close_code)
        self.ended.set()
        return ws


@contextlib.asynccontextmanager
async def realtime_served() -> AsyncIterator[tuple[Realtime, str]]:
    served = Realtime()
    app = web.Application()
    app.router.add_get("/v1/realtime", served.realtime)
    async with serve(app) as url:
        yield served, url


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Realtime, str]]:
    async with realtime_served() as served:
        yield served


def _open(registry: Any) -> float | None:
    return registry.get_sample_value("servepilot_gate_websockets")


async def _none_open(registry: Any) -> None:
    """Wait (1 s at most) for the gate to count no session open: it counts one down as its handler ends."""
    for _ in range(100):
        if _open(registry) == 0:
            break
        await asyncio.sleep(0.01)
    assert _open(registry) == 0


async def test_a_session_is_relayed_both_ways_as_it_came(upstream: tuple[Realtime, str]) -> None:
    served, url = upstream
    async with (
        gate_for(url) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        async with client.ws_connect(f"{base}/v1/realtime?model=m", protocols=("realtime",)) as ws:
            assert ws.protocol == "realtime"  # the upstream's choice, passed on
            assert _open(registry) == 1
            await ws.send_str('{"type":"session.update"}')
            assert await ws.receive_str(timeout=TIMEOUT) == '{"type":"session.update"}'
            audio = bytes(range(256)) * 64
            await ws.send_bytes(audio)
            assert await ws.receive_bytes(timeout=TIMEOUT) == audio
            await ws.close(code=4000)  # the client's code reaches the engine
        await asyncio.wait_for(served.ended.wait(), TIMEOUT)
        await _none_open(registry)
    assert served.closed_with == [4000]
    handshake = served.handshakes[0]
    assert handshake["X-Forwarded-For"] == "127.0.0.1"
    assert handshake["Via"] == gate.forwarder.via  # as the gate's HTTP requests carry it
    assert registry.get_sample_value("servepilot_gate_websocket_sessions_total", {"upstream": "primary"}) == 1


async def test_a_session_whose_upstream_leads_back_to_the_gate_is_refused_508_at_its_handshake() -> None:
    """Its handshake carries the gate's ``Via`` entry: at its first return the gate knows it, as it knows
    a looping HTTP request (without it, the handshake went round until its headers outgrew 8 kB)."""
    port = free_port()
    loop = Gate(
        GateConfig(enabled=True, upstreams={"primary": f"http://127.0.0.1:{port}"}), CollectorRegistry()
    )
    await loop.start("127.0.0.1", port)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await client.ws_connect(f"http://127.0.0.1:{port}/v1/realtime")
        assert refused.value.status == 508
        assert not loop.websockets.sessions and loop.in_progress == 0
    finally:
        await loop.stop()


async def test_the_engines_close_code_reaches_the_client(upstream: tuple[Realtime, str]) -> None:
    _, url = upstream
    async with (
        gate_for(url) as (_, base, _registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        client.ws_connect(f"{base}/v1/realtime") as ws,
    ):
        await ws.send_str("close 4001")
        msg = await ws.receive(timeout=TIMEOUT)
        assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 4001


async def test_a_refused_handshake_reaches_the_client_with_its_status(upstream: tuple[Realtime, str]) -> None:
    _, url = upstream
    async with (
        gate_for(url) as (_, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(f"{base}/v1/no-such-socket")
        assert refused.value.status == 404
        assert _open(registry) == 0


async def test_a_session_is_a_request_of_its_line() -> None:
    """A line of one request a minute: its second session in a row is refused 429 before the handshake,
    with the time to wait."""
    lines = {"voice": GateLineConfig(requests_per_min=1, burst_ratio=1.0)}
    headers = {"x-servepilot-line": "voice"}
    async with (
        realtime_served() as (served, url),
        gate_for(url, lines=lines) as (_, base, _registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        async with client.ws_connect(f"{base}/v1/realtime", headers=headers) as ws:
            await ws.send_str("hi")
            assert await ws.receive_str(timeout=TIMEOUT) == "hi"
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(f"{base}/v1/realtime", headers=headers)
        assert refused.value.status == 429 and int(refused.value.headers["Retry-After"]) >= 1
    assert len(served.handshakes) == 1


async def test_without_a_key_a_session_is_refused_where_keys_are_required(
    upstream: tuple[Realtime, str],
) -> None:
    served, url = upstream
    async with (
        gate_for(url, api_keys={"sk-voice": "voice"}, require_api_key=True) as (_, base, _registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(f"{base}/v1/realtime")
        assert refused.value.status == 401
        async with client.ws_connect(
            f"{base}/v1/realtime", headers={"Authorization": "Bearer sk-voice"}
        ) as ws:
            await ws.send_str("hi")
            assert await ws.receive_str(timeout=TIMEOUT) == "hi"
    assert len(served.handshakes) == 1


async def test_no_upstream_reachable_is_a_502() -> None:
    async with (
        gate_for("http://127.0.0.1:9") as (_, base, _registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(f"{base}/v1/realtime")
        assert refused.value.status == 502


@pytest.mark.parametrize(
    ("code", "sent"), [(None, 1000), (1000, 1000), (4001, 4001), (1006, 1001), (1005, 1001)]
)
def test_close_codes_that_cannot_be_sent_become_going_away(code: int | None, sent: int) -> None:
    assert sendable(code) == sent


async def test_an_upstream_without_the_socket_sends_the_session_to_the_next(
    upstream: tuple[Realtime, str],
) -> None:
    """The split's pick (``small``, a breaker level's model without a realtime API) answers 404: the session
    goes to ``primary``. A refusal that is the client's own (403) is not asked of another upstream."""
    served, url = upstream
    forbidden = web.Application()

    async def refuse(_: web.Request) -> web.Response:
        return web.Response(status=403, text="forbidden")

    forbidden.router.add_get("/v1/realtime", refuse)
    async with (
        serve(web.Application()) as small,
        serve(forbidden) as strict,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        async with _gate({"small": small, "primary": url}) as (base, registry):
            async with client.ws_connect(f"{base}/v1/realtime") as ws:
                await ws.send_str("hi")
                assert await ws.receive_str(timeout=TIMEOUT) == "hi"
            sessions = registry.get_sample_value(
                "servepilot_gate_websocket_sessions_total", {"upstream": "primary"}
            )
        assert sessions == 1 and len(served.handshakes) == 1
        async with _gate({"strict": strict, "primary": url}) as (base, _registry):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await client.ws_connect(f"{base}/v1/realtime")
        assert refused.value.status == 403 and len(served.handshakes) == 1


@contextlib.asynccontextmanager
async def _gate(upstreams: dict[str, str]) -> AsyncIterator[tuple[str, CollectorRegistry]]:
    """A gate whose split sends everything to the first of ``upstreams``, the others its fallbacks."""
    first = next(iter(upstreams))
    split = {name: 1.0 if name == first else 0.0 for name in upstreams}
    registry = CollectorRegistry()
    gate = Gate(GateConfig(enabled=True, upstreams=upstreams, split=split, health_interval_s=600), registry)
    port = await gate.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", registry
    finally:
        await gate.stop()


async def test_a_stop_ends_open_sessions_as_going_away(upstream: tuple[Realtime, str]) -> None:
    """At a stop the gate drains for ``drain_s``; a session still open then is ended with 1001 (going away)
    on both sides, so a realtime client reconnects, to another pod, rather than take it as done."""
    served, url = upstream
    async with (
        gate_for(url, drain_s=0.2) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        client.ws_connect(f"{base}/v1/realtime") as ws,
    ):
        await ws.send_str("hi")
        assert await ws.receive_str(timeout=TIMEOUT) == "hi"
        draining = asyncio.create_task(gate.drain())
        msg = await ws.receive(timeout=TIMEOUT)
        assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1001
        await asyncio.wait_for(draining, TIMEOUT)
        await asyncio.wait_for(served.ended.wait(), TIMEOUT)
        assert _open(registry) == 0
    assert served.closed_with == [1001]


async def test_a_client_gone_silent_is_ended_by_the_heartbeat(
    upstream: tuple[Realtime, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that stops answering pings (gone without a close: off the network) is ended after the
    heartbeat, and the engine's side with it, rather than held open for as long as the gate runs."""
    monkeypatch.setattr(websockets, "HEARTBEAT_S", 0.1)
    served, url = upstream
    async with (
        gate_for(url) as (_, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        client.ws_connect(f"{base}/v1/realtime", autoping=False) as ws,  # reads nothing, answers no ping
    ):
        await asyncio.wait_for(served.ended.wait(), TIMEOUT)
        await _none_open(registry)
        del ws
    assert served.closed_with == [1001]  # going away: the gate ended it, the client said nothing


async def test_an_utterances_tokens_count_for_its_line_and_come_out_of_its_budget(
    upstream: tuple[Realtime, str],
) -> None:
    """The engine's ``transcription.done`` says an utterance's usage: it reaches the client as it came,
    its tokens count for the session's line, and they are taken from the line's token budget (100 a
    minute here): the line's next request finds it in debt and is refused for its token rate."""
    _, url = upstream
    lines = {"voice": GateLineConfig(requests_per_min=60, burst_ratio=1.0, tokens_per_min=100)}
    headers = {"x-servepilot-line": "voice"}
    async with (
        gate_for(url, lines=lines) as (_, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        async with client.ws_connect(f"{base}/v1/realtime", headers=headers) as ws:
            await ws.send_str("commit")
            assert await ws.receive_str(timeout=TIMEOUT) == DONE
        body = {"model": "m", "prompt": "hi", "max_tokens": 1}
        async with client.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 429
        tokens = {
            kind: registry.get_sample_value("servepilot_gate_tokens_total", {"line": "voice", "kind": kind})
            for kind in ("prompt", "output")
        }
        refused = registry.get_sample_value(
            "servepilot_gate_refused_total", {"line": "voice", "reason": "token_rate"}
        )
    assert tokens == {"prompt": 120, "output": 5} and refused == 1
