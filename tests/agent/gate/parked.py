"""A fake engine on loopback for the gate's API tests: one generation route whose answers wait for ``go``.

Subclasses write the answer in their engine's shape (:meth:`ParkedEngine.answer`); the base counts the
requests at the engine (``running``, ``peak``), so a test sees whether the gate held them to its limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from aiohttp import web


class ParkedEngine:
    """Serves ``path`` and ``more_paths`` (POST) and ``/health``; answers through :meth:`answer`, which
    awaits ``go``. A body that is not JSON reaches :meth:`answer` as ``{"raw": bytes}``."""

    path = ""
    more_paths: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.running = 0
        self.peak = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        raise NotImplementedError

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = (
            await request.json()
            if request.content_type == "application/json"
            else {"raw": await request.read()}
        )
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            return await self.answer(request, body)
        finally:
            self.running -= 1

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({})

    async def start(self) -> None:
        app = web.Application()
        for path in (self.path, *self.more_paths):
            app.router.add_post(path, self._generate)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"


class Stepped(ParkedEngine):
    """Writes a stream's steps one per ``STEP_S`` of the gate's (virtual) clock, :meth:`clock`; the next
    step waits until the gate has read the last one (its clock was read)."""

    STEP_S = 0.05

    def __init__(self, now: list[float]) -> None:
        super().__init__()
        self.now = now
        self.reads = 0

    def clock(self) -> float:
        self.reads += 1
        return self.now[0]

    async def send(self, request: web.Request, steps: list[bytes]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for step in steps:
            self.now[0] += self.STEP_S
            reads = self.reads
            await resp.write(step)
            while self.reads == reads:  # the gate reads its clock for each chunk it relays
                await asyncio.sleep(0.001)
        await resp.write_eof()
        return resp


class ParkedCompletions(ParkedEngine):
    """``/v1/completions`` answered with a one-word JSON completion once ``go`` is set."""

    path = "/v1/completions"

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await self.go.wait()
        return web.json_response({"choices": [{"text": "ok"}]})


E = TypeVar("E", bound=ParkedEngine)


async def serving(engine: E) -> AsyncIterator[E]:
    """Start ``engine``, yield it, and stop it (answering whatever still waits)."""
    await engine.start()
    yield engine
    engine.go.set()
    assert engine.runner is not None
    await engine.runner.cleanup()


async def settled(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``check`` every 10 ms until it holds or ``timeout_s`` passes. Wait for the whole state the test
    then asserts: a request the gate has admitted is still on its way to the engine for a moment, so a wait
    on the gate's side alone races the engine's count. The caller asserts, so a timeout fails with values."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check() and loop.time() < deadline:
        await asyncio.sleep(0.01)
