"""The least any Python proxy on uvloop does: a TCP byte pipe, bench/gate.py's ``--pipe`` route.

Each client connection gets its own upstream connection, and bytes go across in the transports'
``data_received`` callbacks: no HTTP parsing, no task per request or per chunk, no headers rewritten,
chunked framing passed through as it came. No proxy that admits, records or fails over can do less, so
its row is the floor under any gate written in Python on this event loop; what separates it from the
aiohttp floor (bench/aiohttp_floor.py) is aiohttp's server, client and their tasks. Not part of
servepilot::

    python bench/pipe_floor.py UPSTREAM_URL PORT
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import cast
from urllib.parse import urlsplit

import uvloop


class _Upstream(asyncio.Protocol):
    """The upstream side of one pipe: what it sends goes to the client's transport."""

    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class _Client(asyncio.Protocol):
    """The client side of one pipe: opens its upstream connection, holding what arrives until then."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.transport: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.early: list[bytes] = []
        self.connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass, the same methods
        self.connecting = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        try:
            client = self.transport
            upstream, _ = await loop.create_connection(lambda: _Upstream(client), self.host, self.port)
        except OSError:
            self.transport.close()
            return
        if self.transport.is_closing():  # the client left while the upstream connection opened
            upstream.close()
            return
        self.upstream = upstream
        for data in self.early:
            upstream.write(data)
        self.early.clear()

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.early.append(data)
        else:
            self.upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


async def serve(upstream: str, port: int) -> None:
    url = urlsplit(upstream)
    if url.hostname is None or url.port is None:
        raise SystemExit(f"pipe_floor: UPSTREAM_URL needs a host and a port, got {upstream!r}")
    host, upstream_port = url.hostname, url.port
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(host, upstream_port), "127.0.0.1", port, backlog=4096)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    server.close()


if __name__ == "__main__":
    uvloop.run(serve(sys.argv[1], int(sys.argv[2])))
