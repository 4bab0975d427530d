"""The least an aiohttp reverse proxy does: bench/gate.py's floor for a proxy written on aiohttp.

Reads the request, sends it upstream through one pooled ``aiohttp.ClientSession`` and relays the answer
chunk by chunk, on uvloop, with the start-up heap frozen as the gate freezes its own. No admission, no
records, no metrics, no failover: what separates the gate's figures from this one's is the gate's own
work; what separates this one's from nginx's is Python and aiohttp. Not part of servepilot::

    python bench/aiohttp_floor.py UPSTREAM_URL PORT
"""

from __future__ import annotations

import asyncio
import gc
import signal
import sys

import aiohttp
import uvloop
from aiohttp import web

from agent.gate.relay import forward_headers


async def serve(upstream: str, port: int) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        url = upstream + request.rel_url.path_qs
        headers = forward_headers(request.headers)
        async with session.request(request.method, url, data=body or None, headers=headers) as up:
            resp = web.StreamResponse(status=up.status, headers=forward_headers(up.headers))
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", relay)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runner.cleanup()
    await session.close()


if __name__ == "__main__":
    uvloop.run(serve(sys.argv[1], int(sys.argv[2])))
