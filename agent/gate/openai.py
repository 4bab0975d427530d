"""What the gate needs to know about an OpenAI-style request body, and its JSON error bodies. Pure.

The gate does not tokenize (that would cost more than the proxying itself): prompt length is estimated
at 4 characters per token, OpenAI's rule of thumb for English, or counted exactly when the prompt is
already token ids. The estimate only picks a length bucket and charges a token budget; the usage the
engine reports, when it reports one, replaces it in the request's record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeGuard

CHARS_PER_TOKEN = 4.0
#: Paths whose requests are admitted through the queue; anything else is passed straight through.
ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})


@dataclass(frozen=True, slots=True)
class RequestInfo:
    stream: bool = False
    prompt_tokens: float = 0.0
    max_tokens: float = 0.0
    model: str = ""
    choices: int = 1
    """Answers generated per request (``n``, or ``best_of`` when larger): each may run to ``max_tokens``."""


class BadRequest(ValueError):
    """The body is not what the path needs; the gate answers 400 without bothering the engine."""


def _text_tokens(value: Any) -> float:
    if isinstance(value, str):
        return len(value) / CHARS_PER_TOKEN
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return float(len(value))  # already token ids
        return sum(_text_tokens(v) for v in value)
    if isinstance(value, dict):  # chat content part {"type": "text", "text": ...}
        return _text_tokens(value.get("text", ""))
    return 0.0


MAX_TOKENS_LIMIT = 2**31 - 1


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_request(path: str, body: bytes) -> RequestInfo:
    """Stream flag, estimated prompt tokens and ``max_tokens`` of a completion/chat/embedding body.

    Hostile bodies get a :class:`BadRequest` (400), never an unexpected exception: NaN/Infinity literals
    are refused (they would poison a token bucket), and so is nesting deep enough to hit the recursion
    limit while parsing or counting tokens.
    """
    if path not in ADMITTED_PATHS or not body:
        return RequestInfo()
    try:
        return _parse(path, body)
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None


def _parse(path: str, body: bytes) -> RequestInfo:
    try:
        doc = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"request body is not valid JSON: {error}") from None
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    if path == "/v1/chat/completions":
        messages = doc.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("'messages' must be a list")
        prompt = sum(_text_tokens(m.get("content", "")) for m in messages if isinstance(m, dict))
    elif path == "/v1/completions":
        prompt = _text_tokens(doc.get("prompt", ""))
    else:
        prompt = _text_tokens(doc.get("input", ""))
    max_tokens = doc.get("max_completion_tokens", doc.get("max_tokens")) or 0
    if (
        not isinstance(max_tokens, int | float)
        or isinstance(max_tokens, bool)
        or not 0 <= max_tokens <= MAX_TOKENS_LIMIT
    ):
        raise BadRequest(f"'max_tokens' must be a number in [0, {MAX_TOKENS_LIMIT}]")
    model = doc.get("model")
    choices = max((v for v in (doc.get("n"), doc.get("best_of")) if _count(v)), default=1)
    return RequestInfo(
        bool(doc.get("stream", False)),
        prompt,
        float(max_tokens),
        model if isinstance(model, str) else "",
        choices,
    )


def _count(value: Any) -> TypeGuard[int]:
    """A plain positive integer (what ``n``/``best_of`` must be; anything else is the engine's to refuse)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def error_body(message: str, kind: str, code: str) -> dict[str, Any]:
    """OpenAI's error shape, so clients that already handle OpenAI errors handle the gate's."""
    return {"error": {"message": message, "type": kind, "code": code}}


def usage_from_json(body: bytes) -> tuple[float, float] | None:
    """``(prompt_tokens, completion_tokens)`` from a non-streamed response's ``usage``, if any."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
    if not isinstance(prompt, int | float) or not isinstance(completion, int | float):
        return None
    return float(prompt), float(completion)


def usage_from_sse_tail(tail: bytes) -> tuple[float, float] | None:
    """The ``usage`` of the last SSE event that has one (``stream_options.include_usage``), if any."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    start = tail.rfind(b"data:", 0, at)
    end = tail.find(b"\n", at)
    if start < 0:
        return None
    return usage_from_json(tail[start + 5 : end if end >= 0 else len(tail)])
