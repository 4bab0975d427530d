"""Helpers shared by the fault-injection tests: loopback servers on free ports, nothing sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from tests.loopback import serve

__all__ = ["app_with", "closed_port_url", "held_stream_upstream", "serve"]


def app_with(path: str, handler: Callable[[web.Request], object], method: str = "GET") -> web.Application:
    app = web.Application()
    app.router.add_route(method, path, handler)  # type: ignore[arg-type]
    return app


def closed_port_url() -> str:
    """A loopback URL nothing listens on: bind a port, then release it."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def held_stream_upstream(release: asyncio.Event) -> web.Application:
    """An OpenAI-ish upstream: ``/v1/models``, ``/health``, plain completions answered at once, and streamed
    ones that send ``data: one`` and then the rest only when ``release`` is set (a stream in flight, on
    demand)."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):
            return web.json_response({"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        await release.wait()
        await response.write(b"data: two\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", models)  # what the gate's health check asks, as of a real engine
    app.router.add_post("/v1/completions", completions)
    return app
