"""OpenAI-compatible request parsing and response shapes (completions and chat completions).

Pure functions: the server does the I/O. Prompt length is estimated the way clients budget it, about four
characters per token (a list of token ids counts exactly); chat messages add four tokens each for the chat
template's role markers. Output text is filler: the simulated model is about timing, not words, and it
never stops early (``finish_reason`` is always ``length``) unless the request is cut short.

Completions also honour ``echo`` and ``logprobs`` (non-streaming), the way vLLM answers a perplexity
probe: the prompt is split into the same four-character tokens its length was estimated from, and each
token's log-probability is a pure function of its text, its position and the precision
(:func:`token_logprob`), so a validation set has one stable perplexity per precision. fp8 raises every
token's surprisal by ``log(1 + fp8_ppl_delta)``, which raises the perplexity by exactly that share.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}
WORDS = (
    " the",
    " engine",
    " is",
    " a",
    " calibrated",
    " model",
    " of",
    " tokens",
    " per",
    " second",
    ",",
    " and",
    " it",
    " streams",
    " them",
    " back",
    ".",
)


class ApiError(Exception):
    """A bad request: HTTP ``status`` and a one-line message, returned in OpenAI's error shape."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": None, "code": self.status}}


@dataclass(frozen=True)
class ParsedRequest:
    """What the engine needs from a request."""

    kind: str  # "completion" | "chat" | "messages" (Anthropic's) | "responses" (OpenAI's Responses API)
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None
    prompt_pieces: tuple[str, ...] = ()
    instructions: str | None = None
    """A Responses request's ``instructions``, which its response object repeats."""
    n: int = 1
    """Sequences to generate for each prompt (completions and chat ``n``): each is a request of its own
    in the engine, as vLLM fans them out, and their events interleave in one stream."""
    batch: tuple[int, ...] = ()
    """A completions ``prompt`` that is a list of prompts: each one's tokens (``prompt_tokens`` is their
    sum, as the usage counts it); empty for one prompt."""

    @property
    def prompt_lengths(self) -> tuple[int, ...]:
        """Each prompt's tokens, in order."""
        return self.batch or (self.prompt_tokens,)


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def prompt_pieces(prompt: Any) -> tuple[str, ...]:
    """The prompt as the simulator's tokens: four-character pieces of a string, or the ids as text."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        pieces = [prompt[i : i + CHARS_PER_TOKEN] for i in range(0, len(prompt), CHARS_PER_TOKEN)]
        return tuple(pieces) or ("",)
    return tuple(str(t) for t in prompt)


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return estimate_tokens(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return len(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return _prompt_tokens(prompt[0])
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those")


def _batch(prompt: Any) -> tuple[int, ...]:
    """Each prompt's tokens when ``prompt`` is a list of several prompts (strings or token-id lists), as
    vLLM takes them; empty for one prompt."""
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        return tuple(_prompt_tokens(p) for p in prompt)
    return ()


def chat_tokens(messages: Any) -> int:
    """Prompt tokens of a chat ``messages`` list (Anthropic's Messages API counts the same way); an
    :class:`ApiError` (400) when it is not a non-empty list of messages with a string role."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    chars = 0
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message must be an object with a string 'role'")
        content = message.get("content", "")
        if isinstance(content, list):  # content parts: count the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        if not isinstance(content, str):
            raise ApiError(400, "message content must be a string or a list of content parts")
        chars += len(content)
    return max(1, math.ceil(chars / CHARS_PER_TOKEN)) + CHAT_TOKENS_PER_MESSAGE * len(messages)


def token_limit(field: str, value: Any) -> int:
    """A request's output-token limit ``field``: an integer >= 1 (a bool is not one), else a 400."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"{field} must be an integer >= 1, got {value!r}")
    return value


def stream_flag(body: Mapping[str, Any]) -> bool:
    """The body's ``stream`` (default false): a boolean, else a 400."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean")
    return stream


def priority_of(body: Mapping[str, Any]) -> int:
    """The body's ``priority`` (vLLM's extra field, lower first; 0 when absent). It orders the request
    only when the engine runs the priority scheduling policy, and is ignored otherwise, as vLLM does."""
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ApiError(400, f"priority must be an integer, got {priority!r}")
    return priority


def parse(kind: str, body: Any, served_model: str) -> ParsedRequest:
    """Validate a request body; raises ApiError(400) on anything malformed, 404 on a wrong model."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model", served_model)
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    if kind == "chat":
        prompt_tokens = chat_tokens(body.get("messages"))
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required")
        batch = _batch(body["prompt"])
        prompt_tokens = sum(batch) if batch else _prompt_tokens(body["prompt"])
    raw_max = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = DEFAULT_MAX_TOKENS[kind] if raw_max is None else token_limit("max_tokens", raw_max)
    stream = stream_flag(body)
    options = body.get("stream_options") or {}
    include_usage = bool(isinstance(options, Mapping) and options.get("include_usage"))
    n = sequences(body.get("n", 1))
    if kind == "chat":  # chat logprobs are not simulated: the fields are ignored as before
        return ParsedRequest(kind, str(model), prompt_tokens, max_tokens, stream, include_usage, n=n)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise ApiError(400, "echo must be a boolean")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise ApiError(400, f"logprobs must be an integer >= 0 or null, got {logprobs!r}")
    if batch and (echo or logprobs is not None):
        raise ApiError(400, "echo and logprobs take one prompt, not a list of them")
    pieces = prompt_pieces(body["prompt"]) if echo or logprobs is not None else ()
    return ParsedRequest(
        kind, str(model), prompt_tokens, max_tokens, stream, include_usage, echo, logprobs, pieces, n=n,
        batch=batch,
    )  # fmt: skip


MAX_N = 128
"""The most sequences one request may ask for: each holds a sequence slot and its KV cache, so a client
asking thousands would crowd every other request out (vLLM leaves that to ``max_num_seqs``)."""


def sequences(value: Any) -> int:
    """A request's ``n``: an integer in [1, :data:`MAX_N`] (null means 1), else a 400."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_N:
        raise ApiError(400, f"n must be an integer in [1, {MAX_N}], got {value!r}")
    return value


def token_text(index: int) -> str:
    return WORDS[index % len(WORDS)]


def token_logprob(text: str, position: int, precision: str = "fp16", fp8_ppl_delta: float = 0.0) -> float:
    """The simulated model's log-probability of token ``text`` at ``position``: a hash of both mapped
    to ``-(0.5 + 4.5 u)`` with ``u`` in [0, 1) (a perplexity near e^2.75 ~ 16), minus
    ``log(1 + fp8_ppl_delta)`` in fp8. fp16 and bf16 score alike."""
    digest = hashlib.blake2b(f"{position}\x00{text}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2.0**64
    logprob = -(0.5 + 4.5 * u)
    if precision == "fp8":
        logprob -= math.log1p(fp8_ppl_delta)
    return logprob


def logprobs_block(
    prompt: Sequence[str], generated: Sequence[str], echo: bool, precision: str, fp8_ppl_delta: float
) -> dict[str, Any]:
    """The completions ``logprobs`` object (vLLM's shape): with ``echo`` the prompt tokens come first and
    the first of them has no log-probability (nothing precedes it); generated tokens follow."""
    tokens: list[str] = []
    values: list[float | None] = []
    offset = 0
    offsets: list[int] = []
    if echo:
        for position, piece in enumerate(prompt):
            tokens.append(piece)
            values.append(None if position == 0 else token_logprob(piece, position, precision, fp8_ppl_delta))
            offsets.append(offset)
            offset += len(piece)
    else:
        offset = sum(len(piece) for piece in prompt)
    for i, piece in enumerate(generated):
        tokens.append(piece)
        values.append(token_logprob(piece, len(prompt) + i, precision, fp8_ppl_delta))
        offsets.append(offset)
        offset += len(piece)
    top = [None if v is None else {t: v} for t, v in zip(tokens, values, strict=True)]
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}


def chunk(
    kind: str,
    request_id: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    role: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    """One SSE chunk in OpenAI's (and vLLM's) shape, for sequence ``index`` of the request."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class Answer:
    """One sequence of a non-streaming answer: its text, why it ended, its logprobs block if asked."""

    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None


def full_response(
    kind: str,
    request_id: str,
    model: str,
    created: int,
    answers: Sequence[Answer],
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """The non-streaming answer: one choice per sequence (``n``), the prompt counted once in the usage
    and the tokens of every sequence."""
    choices: list[dict[str, Any]] = []
    for index, answer in enumerate(answers):
        if kind == "chat":
            choices.append(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": answer.text},
                    "logprobs": None,
                    "finish_reason": answer.finish_reason,
                }
            )
        else:
            choices.append(
                {
                    "index": index,
                    "text": answer.text,
                    "logprobs": answer.logprobs,
                    "finish_reason": answer.finish_reason,
                }
            )
    return {
        "id": request_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }
