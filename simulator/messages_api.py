"""Anthropic Messages API request parsing and response shapes (``POST /v1/messages``), as vLLM serves it.

vLLM (0.32 and later) answers Anthropic's Messages API beside OpenAI's, so clients built on Anthropic's
SDK can use it; the gate admits and meters it (agent/gate/openai.py). The shapes here follow vLLM's real
answers, recorded in tests/fixtures/gate/vllm-0.32.0-cpu-messages{.json,-stream.sse}: ids start with
``chatcmpl-``, a stream is ``message_start``, one text block (``content_block_start``, one
``content_block_delta`` per token, ``content_block_stop``), ``message_delta`` with the stop reason and the
usage, then ``message_stop``. Each event is an SSE ``event:`` line and a ``data:`` line.

Pure functions, like :mod:`simulator.openai_api`: the server does the I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from simulator.openai_api import (
    ApiError,
    ParsedRequest,
    chat_tokens,
    estimate_tokens,
    stream_flag,
    token_limit,
)

#: OpenAI's finish reasons as Anthropic's stop reasons
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "abort": "end_turn"}


def _system_tokens(system: Any) -> int:
    """``system`` is a string or a list of text blocks; absent or empty counts nothing."""
    if system is None or system == "":
        return 0
    if isinstance(system, list):
        system = "".join(b.get("text", "") for b in system if isinstance(b, Mapping))
    if not isinstance(system, str):
        raise ApiError(400, "system must be a string or a list of text blocks")
    return estimate_tokens(system) if system else 0


def parse(body: Any, served_model: str) -> ParsedRequest:
    """Validate a Messages request; 400 on anything malformed (``max_tokens`` is required, as in
    Anthropic's API), 404 on another model."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model", served_model)
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    prompt_tokens = chat_tokens(body.get("messages")) + _system_tokens(body.get("system"))
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise ApiError(400, "max_tokens is required")
    return ParsedRequest(
        "messages",
        str(model),
        prompt_tokens,
        token_limit("max_tokens", max_tokens),
        stream_flag(body),
        include_usage=False,
    )


def event(kind: str, payload: Mapping[str, Any]) -> bytes:
    """One SSE event: its type on the ``event:`` line, the JSON on the ``data:`` line."""
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def message_start(request_id: str, model: str, input_tokens: int) -> bytes:
    message: dict[str, Any] = {
        "id": request_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }
    return event("message_start", {"type": "message_start", "message": message})


def block_start() -> bytes:
    block = {"type": "text", "text": ""}
    return event("content_block_start", {"type": "content_block_start", "content_block": block, "index": 0})


def block_delta(text: str) -> bytes:
    delta = {"type": "text_delta", "text": text}
    return event("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": 0})


def block_stop() -> bytes:
    return event("content_block_stop", {"type": "content_block_stop", "index": 0})


def message_delta(finish_reason: str, input_tokens: int, output_tokens: int) -> bytes:
    payload = {
        "type": "message_delta",
        "delta": {"stop_reason": STOP_REASONS.get(finish_reason, finish_reason), "stop_sequence": None},
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }
    return event("message_delta", payload)


def message_stop() -> bytes:
    return event("message_stop", {"type": "message_stop"})


def full_message(
    request_id: str, model: str, text: str, finish_reason: str, input_tokens: int, output_tokens: int
) -> dict[str, Any]:
    """The non-streaming answer."""
    return {
        "id": request_id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": STOP_REASONS.get(finish_reason, finish_reason),
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }
