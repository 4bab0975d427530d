"""What servepilot's HTTP listeners say in ``Server``: ``servepilot``, with no version.

aiohttp writes its own and Python's version into ``Server`` on every answer it makes
(``Python/3.11 aiohttp/3.14.5``): what a scanner matches against advisories, and what security reviews
ask a listener to drop (nginx's ``server_tokens off``). Every aiohttp application servepilot serves (the
gate, the agent API, the admin listener, the webhook receiver) goes through :func:`without_versions`.
An answer the gate relays keeps the ``Server`` its engine sent (``uvicorn`` for vLLM and SGLang).
"""

from __future__ import annotations

from aiohttp import hdrs, web
from aiohttp.http import SERVER_SOFTWARE

#: What servepilot's own answers say in ``Server``
SERVER_NAME = "servepilot"


async def _name_without_versions(_: web.Request, response: web.StreamResponse) -> None:
    if response.headers.get(hdrs.SERVER) == SERVER_SOFTWARE:  # aiohttp's default, not a relayed one
        response.headers[hdrs.SERVER] = SERVER_NAME


def without_versions(app: web.Application) -> web.Application:
    """``app``, whose answers say ``Server: servepilot`` where aiohttp would name its version."""
    app.on_response_prepare.append(_name_without_versions)
    return app
