"""Helpers shared by the fault-injection tests: loopback servers on free ports, nothing sleeps."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from aiohttp import web


@asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    """Run ``app`` on 127.0.0.1 (free port) for the block; yields its base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


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
