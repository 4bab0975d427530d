"""How a request's tokens reach its client: the core emits them into a queue per sequence
(:meth:`simulator.server.SimServer._dispatch`), and these turn each queue into an API's events, or into
the whole text. The API modules (:mod:`simulator.openai_api`, :mod:`simulator.messages_api`,
:mod:`simulator.responses_api`) say what the events look like; these say when they are written.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from simulator import messages_api, openai_api, responses_api

T = TypeVar("T")
TokenQueue = asyncio.Queue[tuple[str, Any]]
"""What the core sends a sequence: ``("tokens", count)`` per step, then ``("finish", reason)``."""
Write = Callable[[bytes], Awaitable[None]]
"""Writes one event to the client's stream."""


async def relay_tokens(
    queue: TokenQueue,
    piece: Callable[[str], Awaitable[None]],
    last: Callable[[str, str], Awaitable[None]] | None = None,
) -> tuple[str, int, bool]:
    """Call ``piece(text)`` once per engine step with the text of the tokens the core emitted into
    ``queue`` in it, until it ends the request; return the finish reason, the number of tokens, and
    whether ``last`` was called. A step brings one token, or under speculative decoding 1 + the
    accepted drafts, which vLLM streams as one event (its ``inter_token_latency`` observes the step once
    too). Every streamed API writes its events through it.

    With ``last``, the step that ends the request goes to ``last(text, reason)`` instead: vLLM's OpenAI
    streams carry the finish reason on the last token's event, not on an event of its own (the core
    queues a step's tokens and the end of the request it finished together, so the end is already there
    when its tokens are read)."""
    emitted = 0
    pending: tuple[str, Any] | None = None
    while True:
        what, value = pending if pending is not None else await queue.get()
        pending = None
        if what != "tokens":
            return value, emitted, False
        text = "".join(openai_api.token_text(emitted + i) for i in range(value))
        emitted += value
        if last is not None and not queue.empty():
            pending = queue.get_nowait()
            if pending[0] != "tokens":
                await last(text, pending[1])
                return pending[1], emitted, True
        await piece(text)


async def gather_tokens(queue: TokenQueue) -> tuple[list[str], str]:
    """A sequence's whole text as the core emits it into ``queue``, and why it ended."""
    pieces: list[str] = []
    while True:
        what, value = await queue.get()
        if what != "tokens":
            return pieces, value
        pieces.extend(openai_api.token_text(len(pieces) + i) for i in range(value))


async def side_by_side(sequences: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run one coroutine per sequence of a request (``n`` > 1) at once; their results in order. When one
    fails (the client went away) the others are cancelled, rather than left waiting for tokens that the
    aborted requests will never get. A single sequence, the common case, runs in the caller's task."""
    if len(sequences) == 1:
        return [await sequences[0]]
    tasks = [asyncio.ensure_future(sequence) for sequence in sequences]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def message_events(
    write: Write,
    parsed: openai_api.ParsedRequest,
    rid: str,
    model: str,
    queue: TokenQueue,
) -> None:
    """An Anthropic Messages stream (simulator/messages_api.py): one text block, a delta per token."""
    await write(messages_api.message_start(rid, model, parsed.prompt_tokens))
    await write(messages_api.block_start())

    async def token(text: str) -> None:
        await write(messages_api.block_delta(text))

    finish_reason, emitted, _ = await relay_tokens(queue, token)
    await write(messages_api.block_stop())
    await write(messages_api.message_delta(finish_reason, parsed.prompt_tokens, emitted))
    await write(messages_api.message_stop())


async def response_events(
    write: Write,
    parsed: openai_api.ParsedRequest,
    rid: str,
    model: str,
    queue: TokenQueue,
) -> None:
    """A Responses API stream (simulator/responses_api.py): one message item, a delta per token."""
    api, sequence = responses_api, iter(range(1 << 62))
    item_id, created = f"msg_{uuid.uuid4().hex[:16]}", int(time.time())

    def whole(finish_reason: str | None = None, text: str | None = None, emitted: int = 0) -> dict[str, Any]:
        output = None if text is None else [api.item(item_id, text)]
        tokens = None if finish_reason is None else (parsed.prompt_tokens, emitted)
        return api.response(
            rid, model, created, parsed.max_tokens, instructions=parsed.instructions,
            output=output, finish_reason=finish_reason, tokens=tokens,
        )  # fmt: skip

    where = {"output_index": 0, "item_id": item_id, "content_index": 0}
    for kind in ("response.created", "response.in_progress"):
        await write(api.event(kind, next(sequence), {"response": whole()}))
    await write(
        api.event(
            "response.output_item.added",
            next(sequence),
            {"item": api.item(item_id, None), "output_index": 0},
        )
    )
    added = {**where, "part": api.part("", done=False)}
    await write(api.event("response.content_part.added", next(sequence), added))
    pieces: list[str] = []

    async def token(text: str) -> None:
        pieces.append(text)
        delta = {**where, "delta": pieces[-1], "logprobs": []}
        await write(api.event("response.output_text.delta", next(sequence), delta))

    finish_reason, emitted, _ = await relay_tokens(queue, token)
    text = "".join(pieces)
    done = {**where, "logprobs": [], "text": text}
    await write(api.event("response.output_text.done", next(sequence), done))
    await write(
        api.event("response.content_part.done", next(sequence), {**where, "part": api.part(text, done=True)})
    )
    finished = {"item": api.item(item_id, text), "output_index": 0}
    await write(api.event("response.output_item.done", next(sequence), finished))
    await write(
        api.event("response.completed", next(sequence), {"response": whole(finish_reason, text, emitted)})
    )
