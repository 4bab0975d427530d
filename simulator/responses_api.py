"""OpenAI Responses API request parsing and response shapes (``POST /v1/responses``), as vLLM serves it.

vLLM serves OpenAI's Responses API beside chat completions (agents and the OpenAI Agents SDK use it);
the gate admits and meters it (agent/gate/openai.py). The shapes here follow vLLM 0.32's real answers,
recorded in tests/fixtures/gate/vllm-0.32.0-cpu-responses{.json,-stream.sse}: a response object with
vLLM's fields (ids ``resp_...``, one ``message`` item ``msg_...`` holding one ``output_text`` part), and
a stream of ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per token, then the ``.done`` events
for the text, the part and the item, and ``response.completed`` with the whole response and its usage.
Every event carries a ``sequence_number`` from 0. A response cut by ``max_output_tokens`` is status
``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens``, still in ``response.completed``.

Pure functions, like :mod:`simulator.openai_api`: the server does the I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from simulator.openai_api import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    ParsedRequest,
    chat_tokens,
    stream_flag,
    token_limit,
)


def _messages(value: Any, instructions: Any) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of items) and ``instructions`` as chat messages to count: a string
    is one user message; a message item keeps its role and content (a string or content parts); another
    item (a tool call's output) counts its ``output``."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "input must be a string or a non-empty list of input items")
    for item in value:
        if not isinstance(item, Mapping):
            raise ApiError(400, "each input item must be an object")
        if "role" in item:
            messages.append({"role": item["role"], "content": item.get("content", "")})
        else:
            output = item.get("output", "")
            messages.append(
                {"role": "tool", "content": output if isinstance(output, str) else json.dumps(output)}
            )
    return messages


def parse(body: Any, served_model: str) -> ParsedRequest:
    """Validate a Responses request; 400 on anything malformed (``input`` is required), 404 on another
    model. Without ``max_output_tokens`` the answer may run as long as a chat answer may."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model", served_model)
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    if "input" not in body:
        raise ApiError(400, "input is required")
    prompt_tokens = chat_tokens(_messages(body["input"], body.get("instructions")))
    raw_max = body.get("max_output_tokens")
    max_tokens = DEFAULT_MAX_TOKENS["chat"] if raw_max is None else token_limit("max_output_tokens", raw_max)
    stream = stream_flag(body)
    instructions = body.get("instructions")
    return ParsedRequest(
        "responses",
        str(model),
        prompt_tokens,
        max_tokens,
        stream,
        include_usage=False,
        instructions=instructions,
    )


def event(kind: str, sequence: int, payload: Mapping[str, Any]) -> bytes:
    """One SSE event: its type on the ``event:`` line; the JSON, with its sequence number and type, on the
    ``data:`` line."""
    data = {**payload, "sequence_number": sequence, "type": kind}
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": input_tokens + output_tokens,
    }


def part(text: str, *, done: bool) -> dict[str, Any]:
    """The ``output_text`` content part (vLLM's ``logprobs`` is [] while it streams, null when done)."""
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None if done else []}


def item(item_id: str, text: str | None) -> dict[str, Any]:
    """The assistant ``message`` output item: empty and in progress (``text`` None), or completed."""
    content = [] if text is None else [part(text, done=True)]
    status = "in_progress" if text is None else "completed"
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def response(
    request_id: str,
    model: str,
    created_at: int,
    max_output_tokens: int,
    *,
    instructions: str | None = None,
    output: list[dict[str, Any]] | None = None,
    finish_reason: str | None = None,
    tokens: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The response object, with vLLM's fields in vLLM's order: in progress (no ``finish_reason``), or
    finished with its output and ``tokens`` (input, output) as usage."""
    if finish_reason is None:
        status, incomplete = "in_progress", None
    elif finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    else:
        status, incomplete = "completed", None
    return {
        "id": request_id,
        "created_at": created_at,
        "incomplete_details": incomplete,
        "instructions": instructions,
        "metadata": None,
        "model": model,
        "object": "response",
        "output": output or [],
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "tool_choice": "none",
        "tools": [],
        "top_p": 1.0,
        "background": False,
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": None,
        "previous_response_id": None,
        "prompt": None,
        "reasoning": None,
        "service_tier": "auto",
        "status": status,
        "text": None,
        "top_logprobs": None,
        "truncation": "disabled",
        "usage": None if tokens is None else usage(*tokens),
        "user": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }
