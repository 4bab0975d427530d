"""WebSocket sessions through the gate: the engine's realtime APIs (vLLM's ``/v1/realtime`` transcription).

A WebSocket starts as a GET with ``Upgrade: websocket``. Relayed as plain HTTP, its ``Upgrade`` and
``Connection`` headers are hop-by-hop and dropped, so the engine saw a GET without a handshake and the
client never got its session: every realtime client failed behind the gate. Here the gate completes the
client's handshake only once an upstream has accepted its own, then relays each message both ways as it
came (text, binary, close with its code), until either side closes. The upstreams are tried in the
split's order: one that serves no such socket (404: the breaker's small model) or is failing (502-504)
sends the session to the next; a refusal that is the client's own (401, 403, 400) reaches it with its
status, as does the split's pick's when no upstream took it.

A session is one request of its business line: it takes one from the line's request bucket before the
handshake (429 with ``Retry-After`` when the line is over its rate). It holds no in-flight slot: it is
open for minutes while the engine works on its audio only now and then. The tokens of each utterance,
as vLLM's ``transcription.done`` event says them, count toward the line's ``servepilot_gate_tokens_total``
and are taken from its token budget. ``servepilot_gate_websockets``
counts the sessions open now, ``servepilot_gate_websocket_sessions_total{upstream}`` those relayed. At
the gate's stop, sessions still open near the end of its drain are ended with 1001 (going away) on both
sides (:meth:`WebSocketRelay.going_away`), so their clients reconnect to another pod.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import WSMsgType, web

from agent.gate.metrics import GateMetrics
from agent.gate.openai import usage_from_json
from agent.gate.relay import json_error, upstream_headers
from agent.gate.upstreams import UpstreamPool

log = logging.getLogger(__name__)

#: Handshake refusals that send the session to the next upstream: one that serves no such socket (the
#: breaker's small model, another engine), or one failing; any other (401, 403, 400) is the client's.
ASK_NEXT = frozenset({404, 405, 501, 502, 503, 504})
#: How long the second side of a session may take to close once the first did.
CLOSE_TIMEOUT_S = 5.0
#: What marks the engine's message with an utterance's usage (vLLM's realtime ``transcription.done``;
#: pydantic writes it without spaces).
USAGE_DONE = '"type":"transcription.done"'
#: A ping to each side this often; one not answered within half of it ends the session. A client gone
#: without closing (a phone off the network, a NAT that forgot the connection) would otherwise hold its
#: session, and the engine's, for as long as the gate runs.
HEARTBEAT_S = 30.0

#: The handshake's own headers: aiohttp writes the upstream handshake's afresh.
HANDSHAKE = frozenset(
    {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions", "sec-websocket-protocol"}
)


def is_websocket(request: web.Request) -> bool:
    """Whether ``request`` asks to become a WebSocket (RFC 6455: a GET with ``Upgrade: websocket``)."""
    return request.method == "GET" and request.headers.get("Upgrade", "").strip().lower() == "websocket"


class WebSocketRelay:
    """Relays WebSocket sessions to the first upstream of the split that takes the handshake.

    ``http`` gives the gate's upstream session (opened at the gate's start); ``auth`` the engine's
    key headers (``gate.upstream_api_key_file``); ``pick`` a number in [0, 1) for the split."""

    def __init__(
        self,
        pool: UpstreamPool,
        metrics: GateMetrics,
        http: Callable[[], aiohttp.ClientSession | None],
        auth: dict[str, str],
        via: str,
        pick: Callable[[], float],
        max_msg_bytes: int,
        counted: Callable[[str, tuple[float, float]], None] | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self._http = http
        self.auth = auth
        self.via = via  # the gate's Via entry, as its HTTP requests carry (agent/gate/forward.py)
        self._pick = pick
        self.max_msg_bytes = max_msg_bytes
        #: called with a session's line and each utterance's (prompt, output) tokens
        self.counted = counted
        #: the sessions open now
        self.sessions: set[Session] = set()

    async def __call__(self, request: web.Request, line: str) -> web.StreamResponse:
        """Relay ``request``'s session; ``line``: its business line, whose tokens it counts."""
        http = self._http()
        assert http is not None, "Gate.start() was not called"
        headers = upstream_headers(request, self.auth, self.via)
        for name in list(headers):
            if name.lower() in HANDSHAKE:
                del headers[name]
        asked = request.headers.get("Sec-WebSocket-Protocol", "")
        protocols = tuple(p.strip() for p in asked.split(",") if p.strip())
        errors: list[str] = []
        refusals: list[tuple[str, int]] = []
        for upstream in self.pool.candidates(self._pick()):
            url = upstream.url + request.rel_url.path_qs
            try:
                up = await http.ws_connect(
                    url,
                    headers=headers,
                    protocols=protocols,
                    max_msg_size=self.max_msg_bytes,
                    autoping=True,
                    heartbeat=HEARTBEAT_S,
                )
            except aiohttp.WSServerHandshakeError as refused:  # it answered, and not with a session
                refusals.append((upstream.name, refused.status))
                if (
                    refused.status in ASK_NEXT
                ):  # it serves no such socket (a breaker's small model), or is down
                    continue
                break
            except (aiohttp.ClientConnectionError, TimeoutError, OSError) as error:
                errors.append(f"{upstream.name}: {type(error).__name__}")
                continue
            try:
                return await self._relay(request, up, upstream.name, line)
            finally:
                await up.close()
        if refusals:  # the split's pick's answer, naming every upstream's
            status = refusals[0][1] if refusals[0][1] >= 400 else 502  # a 200 that was no handshake
            said = ", ".join(f"{name} {code}" for name, code in refusals)
            message = f"the upstreams refused the WebSocket ({said})"
            return json_error(status, message, "invalid_request_error", "websocket_refused")
        message = "no upstream reachable (" + "; ".join(errors) + ")" if errors else "no upstream configured"
        return json_error(502, message, "upstream_error", "bad_gateway")

    async def _relay(
        self, request: web.Request, up: aiohttp.ClientWebSocketResponse, upstream: str, line: str
    ) -> web.WebSocketResponse:
        client = web.WebSocketResponse(
            protocols=(up.protocol,) if up.protocol else (),
            max_msg_size=self.max_msg_bytes,
            autoping=True,
            heartbeat=HEARTBEAT_S,
        )
        await client.prepare(request)
        self.metrics.websocket_sessions.labels(upstream).inc()
        self.metrics.websockets_open.inc()
        session = Session(client, up)
        self.sessions.add(session)
        pumps = (
            asyncio.create_task(_pump(client, up, session)),
            asyncio.create_task(_pump(up, client, session, self._usage_of(line))),
        )
        # neither side gave a code: the gate itself ends the session (its drain at a stop cancels this)
        unsaid = aiohttp.WSCloseCode.OK
        try:
            # one side closed: its pump closes the other side, which ends the other pump in turn (cut
            # short, a close under way never sent its code)
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait(pumps, timeout=CLOSE_TIMEOUT_S)
        except asyncio.CancelledError:
            unsaid = aiohttp.WSCloseCode.GOING_AWAY  # so clients reconnect, to another pod
            raise
        finally:
            for pump in pumps:
                pump.cancel()  # nothing to a finished one
            for pump in pumps:
                try:
                    await pump
                except asyncio.CancelledError:
                    pass
                except (aiohttp.ClientError, ConnectionError, RuntimeError) as error:  # a side that broke
                    log.info("websocket relay to %s ended: %s", upstream, error)
            self.metrics.websockets_open.dec()
            self.sessions.discard(session)
            # the close each side sent goes on to the other, also when the handler is cancelled as the
            # client's connection closes (aiohttp's handler cancellation) before its pump passed it on
            if not up.closed:
                await up.close(code=sendable(client.close_code, unsaid))
            if not client.closed:
                await client.close(code=sendable(up.close_code, unsaid))
        return client

    def _usage_of(self, line: str) -> Callable[[str], None] | None:
        """What reads the engine's text messages for ``line``'s tokens: vLLM's realtime API says an
        utterance's usage in its ``transcription.done`` event."""
        counted = self.counted
        if counted is None:
            return None

        def read(text: str) -> None:
            if USAGE_DONE in text:
                usage = usage_from_json(text.encode())
                if usage is not None:
                    counted(line, usage)

        return read

    async def going_away(self) -> None:
        """End every open session with 1001 (going away) on both sides, the gate stopping: a realtime
        client reconnects, to another pod, and the engine ends its side."""
        sessions = list(self.sessions)
        if not sessions:
            return
        log.info("gate stopping: ending %d WebSocket session(s)", len(sessions))
        away = aiohttp.WSCloseCode.GOING_AWAY
        for session in sessions:
            session.ending = away  # the pumps pass on this code, not what either side answers it with
        sides = [side for session in sessions for side in (session.client, session.up)]
        await asyncio.gather(
            *(side.close(code=away, message=b"the gate is stopping") for side in sides),
            return_exceptions=True,
        )


@dataclass(eq=False)
class Session:
    """One relayed session: its two sides, and the code the gate ends it with itself (at its stop)."""

    client: web.WebSocketResponse
    up: aiohttp.ClientWebSocketResponse
    ending: int | None = None


Socket = web.WebSocketResponse | aiohttp.ClientWebSocketResponse


async def _pump(
    source: Socket, sink: Socket, session: Session, read: Callable[[str], None] | None = None
) -> None:
    """Every message of ``source`` to ``sink`` as it came, until ``source`` closes; then close ``sink``
    with ``source``'s code (a normal close when it gave none), or the gate's own where it ends the
    session. ``read`` sees each text message once it is passed on."""
    async for msg in source:
        if msg.type is WSMsgType.TEXT:
            await sink.send_str(msg.data)
            if read is not None:
                read(msg.data)
        elif msg.type is WSMsgType.BINARY:
            await sink.send_bytes(msg.data)
        elif msg.type is WSMsgType.ERROR:
            log.info("websocket relay: %s", source.exception())
            break
    if not sink.closed:
        await sink.close(code=session.ending or sendable(source.close_code))


#: Close codes that say how a connection ended and may not be sent in a close frame (RFC 6455 7.4.1).
UNSENDABLE = frozenset({1005, 1006, 1015})


def sendable(code: int | None, unsaid: int = aiohttp.WSCloseCode.OK) -> int:
    """The code to close the other side with: ``code``, ``unsaid`` where there was none (a normal close,
    or going away when the gate itself ends the session), and going away for one that may not be sent
    (the connection broke, or closed without a code)."""
    if code is None:
        return int(unsaid)
    return int(aiohttp.WSCloseCode.GOING_AWAY) if code in UNSENDABLE else code
