"""A reference receiver for the generic webhook: verify, drop duplicates, keep the payloads.

Small enough to copy into another service; also what the tests and the end-to-end test run. It shows
the two checks a receiver owes the sender: :func:`~agent.webhooks.signing.verify` (authenticity and the
replay window), then an idempotency check on ``webhook-id`` (a retry after a lost response repeats the
id), answering 2xx to duplicates so the sender stops retrying.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from agent.server_name import without_versions
from agent.webhooks.signing import DEFAULT_TOLERANCE_S, SignatureError, verify


@dataclass
class ReceivedLog:
    """What a receiver accepted (``messages``, in arrival order) and rejected (``rejected`` reasons)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    duplicates: int = 0
    rejected: list[str] = field(default_factory=list)


def build_receiver_app(
    secret: bytes | Sequence[bytes],
    *,
    path: str = "/hook",
    clock: Callable[[], float] = time.time,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> tuple[web.Application, ReceivedLog]:
    """An aiohttp app that accepts signed servepilot messages at ``path``; returns it and its log.
    ``secret``: the key, or several (old and new while a rotation is in progress)."""
    log = ReceivedLog()

    async def hook(request: web.Request) -> web.Response:
        body = await request.read()
        try:
            msg_id = verify(secret, request.headers, body, now=clock(), tolerance_s=tolerance_s)
        except SignatureError as error:
            log.rejected.append(str(error))
            return web.json_response({"error": str(error)}, status=401)
        if msg_id in log.ids:
            log.duplicates += 1
            return web.json_response({"duplicate": msg_id})
        try:
            payload = json.loads(body)
        except ValueError:
            log.rejected.append("body is not JSON")
            return web.json_response({"error": "body is not JSON"}, status=400)
        log.ids.add(msg_id)
        log.messages.append(payload)
        return web.json_response({"accepted": msg_id})

    app = without_versions(web.Application())
    app.router.add_post(path, hook)
    return app, log
