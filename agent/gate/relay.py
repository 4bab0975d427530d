"""One upstream answer relayed to the client, and what the request's record learns from it.

A JSON answer is read whole and sent on. An SSE stream is written chunk by chunk as it comes, and its
response headers go with the first byte: until then the client has had nothing, so a hang can still be
taken back (:class:`Unanswered`) and the request sent to another upstream. The record gets the TTFT, the
gaps between chunks (its ITL; per sequence when it has several, :mod:`agent.gate.sequences`), the usage
the answer reports (else one token per event; a usage event the gate asked for is not the client's and
is taken out, :mod:`agent.gate.stream_usage`), the status and the outcome, and ``finish`` counts it. A
client that leaves closes the upstream connection, so the engine aborts the request instead of
generating for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from agent.gate.access_log import FORWARDED_FOR
from agent.gate.cache import Fill
from agent.gate.ejection import UpstreamStalled
from agent.gate.openai import (
    EVENT_ENDS,
    NO_TOKEN,
    REQUEST_ID,
    anthropic_error,
    error_body,
    stream_error,
    stream_error_event,
    stream_finished,
    usage_from_json,
    usage_from_sse_tail,
)
from agent.gate.ratelimit import retry_after_header
from agent.gate.records import RequestRecord
from agent.gate.sequences import SequenceGaps
from agent.gate.stream_usage import UsageEventFilter

log = logging.getLogger(__name__)

_Answer = TypeVar("_Answer", bound=web.StreamResponse)

#: The proxies a request went through (RFC 9110): the gate adds itself, as proxies do.
VIA = "Via"

#: RFC 9110 hop-by-hop headers, plus those aiohttp recomputes for the new connection. Not
#: ``Content-Encoding``: it is end to end, and the bytes are relayed as they came (dropped, a compressed
#: answer reached its client as garbage). The gate asks for answers it reads uncompressed
#: (:mod:`agent.gate.forward`). ``Expect: 100-continue`` was answered to the client already, and the gate
#: holds the whole body: passed on, it made the gate wait for the upstream's 100 before sending it.
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "Expect",
    )
)  # fmt: skip

Filled = Callable[[Fill, aiohttp.ClientResponse, bool, "RequestRecord | None"], None]
"""Called with a complete 200 answer's fill, its response, whether it streamed, and its record."""


def forward_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """``headers`` without the hop-by-hop ones: what goes on to the other side."""
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP)


def closing(response: _Answer) -> _Answer:
    """``response`` closing its connection after it is sent (``Connection: close``, so the client knows
    to open a new one for its next request, which a Service may send to another pod)."""
    response.force_close()
    response.headers[aiohttp.hdrs.CONNECTION] = "close"
    return response


def upstream_headers(request: web.Request, auth: Mapping[str, str], via: str) -> CIMultiDict[str]:
    """What ``request`` goes upstream with, as a proxy sends it: its end-to-end headers, the engine's
    key in place of the client's (``auth``: the client's key is the gate's), the client's address added
    to ``X-Forwarded-For`` (the engine's log, uvicorn trusting loopback, names the client) and the
    gate's own entry ``via`` to ``Via`` (RFC 9110 section 7.6.3), by which a request that comes back to
    the gate is known. A WebSocket's handshake carries the same: a loop through the realtime route is
    caught as one through any other."""
    headers = forward_headers(request.headers)
    headers.update(auth)
    if request.remote:
        prior = headers.get(FORWARDED_FOR)
        headers[FORWARDED_FOR] = f"{prior}, {request.remote}" if prior else request.remote
    prior = headers.get(VIA)
    headers[VIA] = f"{prior}, {via}" if prior else via
    return headers


def answer_headers(up: aiohttp.ClientResponse, record: RequestRecord | None) -> CIMultiDict[str]:
    """The upstream's answer headers for the client, with what the gate adds (:func:`add_gate_headers`):
    for a stream, whose headers leave with its first byte, before the gate's handler sees the response."""
    headers = forward_headers(up.headers)
    if record is not None:
        add_gate_headers(headers, record)
    return headers


def add_gate_headers(headers: MutableMapping[str, str], record: RequestRecord) -> None:
    """The request's ``X-Request-Id`` where the upstream did not echo it, and its line's rate-limit
    headers."""
    if record.request_id and REQUEST_ID not in headers:
        headers[REQUEST_ID] = record.request_id
    for name, value in record.rate_limit:
        headers[name] = value


#: The key a gate's own JSON error carries its message under (aiohttp responses are mappings), so that
#: :func:`for_messages_clients` can reshape it on its way out
GATE_ERROR: web.ResponseKey[str] = web.ResponseKey("servepilot_gate_error", str)


def json_error(
    status: int, message: str, kind: str, code: str, retry_after_s: float | None = None
) -> web.Response:
    """An OpenAI-shaped JSON error, with ``Retry-After`` where waiting helps."""
    headers = {"Retry-After": retry_after_header(retry_after_s)} if retry_after_s is not None else None
    response = web.json_response(error_body(message, kind, code), status=status, headers=headers)
    response[GATE_ERROR] = message
    return response


def for_messages_clients(response: web.StreamResponse) -> None:
    """Reshape a gate's own JSON error (:func:`json_error`) as Anthropic's Messages API writes errors,
    ``{"type": "error", "error": {"type", "message"}}``, as vLLM's ``/v1/messages`` answers its own: a
    client of Anthropic's SDK reading ``error.type`` got OpenAI's names from the gate (a 429 read
    ``rate_limit_exceeded``, not ``rate_limit_error``). Answers relayed from the engine are left as sent."""
    message = response.get(GATE_ERROR)
    if message is None or not isinstance(response, web.Response) or response.prepared:
        return
    response.text = json.dumps(anthropic_error(response.status, message))


async def _end_with_error(
    resp: web.StreamResponse, path: str, cut: bool, message: str, code: str, status: int
) -> None:
    """End a started stream with an error event, as vLLM and SGLang end theirs on a failure, in the
    shape the client's SDK raises on (:func:`~agent.gate.openai.stream_error_event`), so the client
    learns its answer failed rather than reading a short one as whole. ``cut``: the client's bytes stop
    inside an event; a blank line first closes that fragment (an SSE client drops it or fails on it), so
    the error event arrives whole."""
    event = stream_error_event(path, message, code, status)
    with contextlib.suppress(ConnectionResetError):
        await resp.write((b"\n\n" if cut else b"") + event)
        await resp.write_eof()


#: How an upstream's answer breaks on the way: its connection lost, a malformed body, a read timeout
_BROKEN = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError)


class Unanswered(Exception):
    """A hung upstream's answer was taken back before any of it reached the client (the gate sends the
    request to the next upstream)."""


def _outcome(status: int) -> str:
    return "ok" if status < 400 else "client_error" if status < 500 else "upstream_error"


@dataclass(frozen=True)
class Relay:
    """Relays answers: ``clock`` times them, ``finish`` counts each record once its outcome is known,
    ``filled`` gets each complete 200 answer's cache fill."""

    clock: Callable[[], float]
    finish: Callable[[RequestRecord], None]
    filled: Filled | None = None
    #: upstream -> the decode tokens each of its events brings (the engine's steps under speculative
    #: decoding, ``engine.decode_tokens_per_step``); an upstream not here brings one
    tokens_per_event: dict[str, float] = field(default_factory=dict)

    async def __call__(
        self,
        request: web.Request,
        up: aiohttp.ClientResponse,
        record: RequestRecord | None,
        fill: Fill | None = None,
        token_event: bytes = b"",
    ) -> web.StreamResponse:
        """Relay ``up`` to ``request``'s client; ``record`` is None for pass-through paths;
        ``token_event``: what marks a stream's events that carry tokens (empty: every event does; see
        :attr:`~agent.gate.openai.RequestInfo.token_event`). Raises :class:`Unanswered` when a hang was
        taken back before the client had anything."""
        if up.headers.get("Content-Type", "").startswith("text/event-stream"):
            return await self._stream(request, up, record, fill, token_event)
        return await self._json(up, record, fill)

    async def _json(
        self, up: aiohttp.ClientResponse, record: RequestRecord | None, fill: Fill | None
    ) -> web.Response:
        try:
            payload = await up.read()
        except UpstreamStalled:  # nothing of it reached the client: another upstream may answer
            up.close()
            raise Unanswered from None
        if record is not None:
            now = record.heard_at = self.clock()
            record.status, record.e2e_s, record.whole = up.status, now - record.arrived, True
            usage = usage_from_json(payload) if up.status < 300 else None
            if usage is not None:
                record.prompt_tokens, record.output_tokens = usage
                record.counted = True
            if record.output_tokens <= 1:  # a pooling answer or a single token: its first is its whole
                record.ttft_s = record.e2e_s
            record.outcome = _outcome(up.status)
            self.finish(record)
        if fill is not None and self.filled is not None and up.status == 200:
            fill.feed(payload)
            fill.head = payload  # the whole JSON: its model fields name the model
            self.filled(fill, up, False, record)
        # not sent yet: the gate adds its own headers on the way out (Gate._handle), as to its refusals
        return web.Response(status=up.status, body=payload, headers=forward_headers(up.headers))

    async def _stream(
        self,
        request: web.Request,
        up: aiohttp.ClientResponse,
        record: RequestRecord | None,
        fill: Fill | None,
        token_event: bytes,
    ) -> web.StreamResponse:
        clock = self.clock  # read per chunk
        # counted per chunk: unrolled, a third cheaper than a generator
        done, role_empty, role_null, closing, usage_event, error_event = NO_TOKEN
        # the usage event the gate asked for on the client's behalf is taken out (agent/gate/stream_usage.py)
        unasked = UsageEventFilter() if record is not None and record.usage_asked else None
        resp = web.StreamResponse(status=up.status, headers=answer_headers(up, record))
        last: float | None = None  # the last chunk that carried tokens
        events = 0  # SSE events (every one carries tokens), or token events (with token_event)
        tail = b""
        itl = record.itl_s if record is not None else []
        # several sequences' events interleave: each one's gaps are taken from its own events instead
        per_sequence = SequenceGaps(itl) if record is not None and record.choices > 1 else None

        def ended(outcome: str, status: int) -> None:
            """The stream ended before its end: its record counts the tokens relayed until then."""
            if record is not None:
                record.outcome, record.status = outcome, status
                record.e2e_s = self.clock() - record.arrived
                record.output_tokens = self._counted(float(max(0, events)), record)
                record.counted = True
                self.finish(record)

        try:
            async for chunk in up.content.iter_any():
                now = clock()
                if not resp.prepared:
                    # the headers go with the first byte: until then, a hang can still be taken back
                    await resp.prepare(request)  # the client may have gone while the upstream was busy
                # an SSE comment at an event's start is a keep-alive: no token, and no sign of progress (the
                # HTTP server of a hung engine may go on writing them), so it counts for neither
                keepalive = (
                    chunk.startswith(b":")
                    and (not tail or tail.endswith(EVENT_ENDS))
                    and b"data:" not in chunk
                )
                if record is not None and not keepalive:
                    record.heard_at = now
                if token_event:
                    carried = chunk.count(token_event)
                    arrived = carried > 0
                else:  # every event carries tokens but "[DONE]" and a chat stream's opening and closing ones
                    empty = (
                        chunk.count(done)
                        + chunk.count(role_empty)
                        + chunk.count(role_null)
                        + chunk.count(closing)
                        + chunk.count(usage_event)
                        + chunk.count(error_event)
                    )
                    carried = chunk.count(b"data:") - empty
                    # a chunk with no whole event is a token's rest
                    arrived = carried > 0 or not (empty or keepalive)
                events += carried
                if arrived:
                    if last is None:
                        if record is not None:
                            record.ttft_s = now - record.arrived
                    elif per_sequence is None:
                        itl.append(now - last)
                    last = now
                if per_sequence is not None:
                    per_sequence.feed(chunk, now)
                tail = chunk if len(chunk) > 256 else (tail + chunk)[-4096:]
                if unasked is not None:
                    chunk = unasked.feed(chunk)
                if fill is not None:
                    fill.feed(chunk)
                if chunk:
                    await resp.write(chunk)
            if not resp.prepared:  # an empty stream
                await resp.prepare(request)
            await self._close_whole(resp, unasked, fill)
        except (ConnectionResetError, asyncio.CancelledError) as error:
            up.close()  # the client is gone: drop the upstream connection so the engine aborts
            ended("disconnected", 499)
            if isinstance(error, asyncio.CancelledError):
                raise
            return resp  # nobody to answer: not a server error worth a traceback in the log
        except (UpstreamStalled, *_BROKEN) as error:
            up.close()
            stalled = isinstance(error, UpstreamStalled)  # its upstream hung mid-stream, rather than broke
            if stalled and not resp.prepared:  # the client has had nothing: another upstream may answer
                raise Unanswered from None
            if resp.prepared and stream_finished(tail):
                # it hung or broke after the stream's end event: the client has its whole answer
                log.debug("the stream from upstream %s failed after its end: %s", up.url, error)
                with contextlib.suppress(ConnectionResetError):
                    await self._close_whole(resp, unasked, fill)
            else:
                name, how = record.upstream if record else up.url, "hung" if stalled else "broke"
                log.warning("the stream from upstream %s %s: %s", name, how, error)
                ended("upstream_error", 504 if stalled else up.status if resp.prepared else 502)
                if not resp.prepared:  # nothing sent yet: a clear error rather than an empty 200
                    message = f"the upstream's stream broke before its first byte: {error}"
                    return json_error(502, message, "upstream_error", "bad_gateway")
                # an engine killed mid-stream: until 2026-12-06 the client's stream just ended, as a whole
                # answer's would (without [DONE]), and the OpenAI SDK returned the truncated text as whole
                cut = unasked is None and not tail.endswith(EVENT_ENDS)
                message, code, status = (
                    (f"upstream {error}", "upstream_stalled", 504)
                    if stalled
                    else (f"the upstream's stream broke: {error}", "bad_gateway", 502)
                )
                await _end_with_error(resp, request.path, cut, message, code, status)
                return resp
        # a failure after the 200 went is an event in the stream: the answer failed all the same
        failed = stream_error(tail) if record is not None and up.status < 300 else None
        if record is not None:
            record.status, record.e2e_s = failed or up.status, self.clock() - record.arrived
            usage = usage_from_sse_tail(tail)
            if usage is not None:
                record.prompt_tokens, record.output_tokens = usage
            # one token per token event is the norm without usage; and a usage of none generated beside
            # token events is a start's, not the end's: a Messages stream cut short (its message_start)
            if usage is None or (usage[1] == 0 and events > 0):
                record.output_tokens = self._counted(float(max(0, events)), record)
            record.counted = True
            record.outcome = _outcome(record.status)
            self.finish(record)
        if fill is not None and self.filled is not None and up.status == 200 and not failed:
            self.filled(fill, up, True, record)
        return resp

    @staticmethod
    async def _close_whole(
        resp: web.StreamResponse, unasked: UsageEventFilter | None, fill: Fill | None
    ) -> None:
        """End a whole stream: what the usage filter still holds, then the end of the body."""
        if unasked is not None and (rest := unasked.rest()):
            if fill is not None:
                fill.feed(rest)
            await resp.write(rest)
        await resp.write_eof()

    def _counted(self, events: float, record: RequestRecord) -> float:
        """The output tokens of a stream without usage, from its token events: one each, or, from an
        upstream whose steps bring several (:attr:`tokens_per_event`), that many after each sequence's
        first (its prefill brings one). An estimate: the engine's window mean, not this answer's own."""
        per_event = self.tokens_per_event.get(record.upstream, 1.0)
        first = min(events, float(max(1, record.choices)))
        return first + (events - first) * per_event
