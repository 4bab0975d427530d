"""Each sequence's own inter-token gaps in a stream that carries several (``n`` > 1, a list of prompts).

The sequences decode side by side and the engine sends their events interleaved, so the gap between
two consecutive events of such a stream is about 1/n of either sequence's own: counted as ITL, it made
the engine look n times faster than its clients saw it. Every event names its sequence, so the gaps
can be taken per sequence instead: OpenAI's completions and chat in ``choices[].index`` (vLLM, SGLang
and llama.cpp alike), llama.cpp's native ``/completion`` and SGLang's native ``/generate`` at the top
level (``index``). An event that names none (the last one with the usage, ``[DONE]``, llama.cpp's
``data: null``) is nobody's token, nor is a chat sequence's opening event (its role, no content) or an
empty closing one.

Only multi-sequence streams pay for this: each event is parsed as JSON, where the single-sequence path
only counts ``data:`` markers. Events split across network chunks are put back together first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

#: Between SSE events: a blank line (``\n\n``; ``\r\n\r\n`` from some servers).
EVENT_END = re.compile(rb"\r?\n\r?\n")
#: An unfinished event longer than this is dropped rather than kept growing (a stream that never sends
#: a blank line is not SSE the gate can time; its client still gets every byte).
MAX_EVENT_BYTES = 1 << 20


class SequenceGaps:
    """Feed it a stream's chunks as they come; it appends to ``gaps`` each event's distance from the
    previous event of the same sequence. A sequence's first event adds no gap (it is that sequence's
    first token, which the stream's TTFT or the sequence's own prefill covers)."""

    __slots__ = ("_last", "_partial", "gaps")

    def __init__(self, gaps: list[float]) -> None:
        self.gaps = gaps
        self._last: dict[int, float] = {}
        self._partial = b""

    def feed(self, chunk: bytes, now: float) -> None:
        """Account the complete events in ``chunk`` (with what was left of the last chunk) at ``now``."""
        *events, rest = EVENT_END.split(self._partial + chunk)
        self._partial = rest if len(rest) <= MAX_EVENT_BYTES else b""
        last = self._last
        for event in events:
            for index in _sequences(event):
                before = last.get(index)
                if before is not None:
                    self.gaps.append(now - before)
                last[index] = now

    @property
    def sequences(self) -> int:
        """Sequences seen so far."""
        return len(self._last)


def _sequences(event: bytes) -> Iterator[int]:
    """The sequence indices an SSE event carries tokens for; none when it is not a JSON object that
    names one."""
    data = b"\n".join(line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:"))
    if not data or data == b"[DONE]":
        return
    try:
        doc: Any = json.loads(data)
    except (ValueError, UnicodeDecodeError):  # not JSON: the client still gets it, nobody's token
        return
    if not isinstance(doc, dict):
        return
    choices = doc.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and _is_index(choice.get("index")) and not _no_token(choice):
                yield choice["index"]
    elif _is_index(doc.get("index")):
        yield doc["index"]


def _no_token(choice: dict[str, Any]) -> bool:
    """A chat sequence's event with no token (:data:`agent.gate.openai.NO_TOKEN`): its opening role
    alone, or an empty closing delta."""
    delta = choice.get("delta")
    return isinstance(delta, dict) and set(delta) <= {"role", "content"} and not delta.get("content")


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
