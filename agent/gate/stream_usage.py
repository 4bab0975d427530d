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
"""

from __future__ import annotations

from agent.gate.openai import CHAT_PATHS, USAGE_EVENT
from agent.gate.sequences import EVENT_END, MAX_EVENT_BYTES

#: The streams that take ``stream_options``: OpenAI's completions and chat.
USAGE_PATHS = frozenset({"/v1/completions", *CHAT_PATHS})
_ASK = b'{"stream_options":{"include_usage":true},'
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")


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
        if data.endswith(_EVENT_ENDS) and USAGE_EVENT not in data:
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
