"""vLLM's runtime control endpoints as a small aiohttp app, for adapter and sidecar tests.

Serves ``/openapi.json`` listing the paths of the chosen knobs (see :data:`agent.control.vllm.ENDPOINTS`)
and the endpoints themselves: a POST to the "on" or "off" path sets the knob and is recorded by its path
name (``"sleep"``, ``"wake_up"``, ...), the read-back path answers ``{key: value}``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

from agent.control.vllm import ENDPOINTS

Handler = Callable[[web.Request], Awaitable[web.Response]]


def vllm_control_app(knobs: Iterable[str], calls: list[str]) -> web.Application:
    """An app serving ``knobs`` (all false at first); each POST's path name is appended to ``calls``."""
    state: dict[str, bool] = {}
    paths: dict[str, dict[str, object]] = {}
    app = web.Application()

    def setter(knob: str, value: bool, path: str) -> Handler:
        async def handler(_: web.Request) -> web.Response:
            calls.append(path.lstrip("/"))
            state[knob] = value
            return web.json_response({})

        return handler

    def reader(knob: str, key: str) -> Handler:
        async def handler(_: web.Request) -> web.Response:
            return web.json_response({key: state[knob]})

        return handler

    for knob in knobs:
        on, off, read, key = ENDPOINTS[knob]
        state[knob] = False
        paths.update({on: {}, off: {}, read: {}})
        app.router.add_post(on, setter(knob, True, on))
        app.router.add_post(off, setter(knob, False, off))
        app.router.add_get(read, reader(knob, key))

    async def openapi(_: web.Request) -> web.Response:
        return web.json_response({"paths": paths})

    app.router.add_get("/openapi.json", openapi)
    return app
