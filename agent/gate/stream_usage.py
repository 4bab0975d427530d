"""Asking the upstream for a stream's usage when the client did not, and taking it out of the answer.

A stream counts its tokens exactly only where its last event says them: OpenAI's usage event, which
vLLM, SGLang and llama.cpp send when the request says ``stream_options: {"include_usage": true}``.
Most clients do not ask, and without it the gate counts one token per event, or the engine's mean
tokens per step under speculative decoding (agent/gate/relay.py): an estimate that feeds the line's
``tokens_per_min`` bucket, ``servepilot_gate_tokens_total`` and the answer's SLO verdict.

So the gate asks for it (``gate.stream_usage``) on completion and chat streams whose client set no
``stream_options`` of its own, and takes the usage event out of what the client gets: a client that
never asked for it may index ``choices[0]`` of every event, and that event has none. The event is
told by ``"choices":[]`` (vLLM and llama.cpp write it so, both recorded in tests/fixtures/gate;
generated text cannot forge it: inside a JSON string its quotes are escaped). llama.cpp's completions
put the usage in their last token event instead; that event is the client's and stays.

A request body is changed by bytes, not parsed again: the field goes in after the object's opening
brace (the body was parsed once already, and a prompt may be long).

An upstream that refuses the field gets the request again without it, and is not asked for a while
(:class:`UsageRefusals`): vLLM before 0.5 forbade unknown fields (400, ``extra_forbidden``), TGI
answers 422 to a ``stream_options`` it cannot read, and hosted OpenAI-like APIs have done the same
(tests/fixtures/gate/SOURCES.md). Without that, every stream to such an upstream failed while
``gate.stream_usage`` was on.
"""

from __future__ import annotations

from agent.gate.openai import CHAT_PATHS, EVENT_ENDS, USAGE_EVENT
from agent.gate.sequences import EVENT_END, MAX_EVENT_BYTES

#: The streams that take ``stream_options``: OpenAI's completions and chat.
USAGE_PATHS = frozenset({"/v1/completions", *CHAT_PATHS})
_ASK = b'{"stream_options":{"include_usage":true},'

#: What an upstream refusing a request's fields answers: FastAPI/pydantic servers 400 (vLLM) or 422,
#: axum/serde ones (TGI) 422.
REFUSAL_STATUSES = frozenset({400, 422})
#: The largest refusal read to find out whether it names the field: validation errors are short.
MAX_REFUSAL_BYTES = 64 * 1024
#: How long an upstream that refused the field goes unasked: an upgraded engine is asked again after it.
REASK_AFTER_S = 600.0


def ask_stream_usage(path: str, body: bytes) -> bytes | None:
    """``body`` asking for the stream's usage event, or None where the gate should not ask: another
    path, or a client that set ``stream_options`` itself (the choice is its own), or a body that is not
    a JSON object with a field (the gate parsed it already: the engine judges anything else)."""
    if path not in USAGE_PATHS or b'"stream_options"' in body:
        return None
    body = body.lstrip()
    if not body.startswith(b"{") or body[1:].lstrip().startswith(b"}"):
        return None
    return _ASK + body[1:]


def unask_stream_usage(asked: bytes) -> bytes:
    """The body :func:`ask_stream_usage` made ``asked`` from, as the client sent it (less its leading
    blanks)."""
    assert asked.startswith(_ASK)
    return b"{" + asked[len(_ASK) :]


def refuses_stream_usage(status: int, payload: bytes) -> bool:
    """Whether an answer to a request the gate asked the usage for refused the field: a 400 or 422
    naming it. The client set no ``stream_options`` (the gate would not have asked), so the field an
    error names is the gate's."""
    return status in REFUSAL_STATUSES and b"stream_options" in payload


class UsageRefusals:
    """The upstreams that refused ``stream_options``, each until :data:`REASK_AFTER_S` after its last
    refusal: their requests go without the field, their streams counted per event as before."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def refused(self, upstream: str, now: float) -> bool:
        """Whether ``upstream`` is not to be asked now."""
        return self._until.get(upstream, 0.0) > now

    def note(self, upstream: str, now: float) -> None:
        self._until[upstream] = now + REASK_AFTER_S


class UsageEventFilter:
    """Feed it a stream's chunks; it returns what the client gets: the same bytes less the usage event.

    A chunk that ends between events and holds no usage event passes as it is. Otherwise its complete
    events pass, but the usage event, and an unfinished event at its end waits for the rest (an SSE
    client cannot read an event before its blank line anyway), up to :data:`MAX_EVENT_BYTES`: a stream
    that never ends an event is passed on as it comes. :meth:`rest` gives what waits at the end."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._held + chunk if self._held else chunk
        self._held = b""
        if data.endswith(EVENT_ENDS) and USAGE_EVENT not in data:
            return data
        kept, start = [], 0
        for end in EVENT_END.finditer(data):
            event = data[start : end.end()]
            if USAGE_EVENT not in event:
                kept.append(event)
            start = end.end()
        unfinished = data[start:]
        if len(unfinished) <= MAX_EVENT_BYTES:
            self._held = unfinished
        else:
            kept.append(unfinished)
        return b"".join(kept)

    def rest(self) -> bytes:
        """The unfinished event the stream ended with, if any (an SSE client drops it; it is passed on)."""
        held, self._held = self._held, b""
        return held
