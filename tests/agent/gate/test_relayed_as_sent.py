"""What the gate relays as the upstream sent it: compressed bodies, and redirects.

``Content-Encoding`` is end to end (RFC 9110): the gate relays an answer's bytes as they came, so it
keeps the header with them; until 2026-12-06 it dropped it, and a compressed answer (an upstream behind
a gzip-ing ingress, or a pass-through path) reached its client as bytes it could not read. Where the
gate reads the answer (its usage, its token events) it asks the upstream for it uncompressed. A request
body it must read and cannot (compressed) is refused with a clear 415.

Cookies are the client's: an upstream's ``Set-Cookie`` goes to the client that got the answer, and
the gate sends only what each client sends. Until 2026-12-06 its upstream session kept a cookie jar,
and one client's cookie went with every later client's requests.

A redirect is the client's to follow: until 2026-12-06 the gate followed it itself (aiohttp's default),
turning a POST into a GET elsewhere and answering with another page as this one."""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.engines.client import gate_for, gate_tokens

TIMEOUT = 5.0
ANSWER = {
    "choices": [{"text": "hi"}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
}
MODELS = {"object": "list", "data": [{"id": "m", "object": "model"}]}


class Gzipping:
    """``POST /v1/completions`` and ``GET /v1/models`` (passed through by the gate): compressed when the
    request accepts gzip, as behind a gzip-ing ingress, or always when ``stubborn``. Keeps the
    ``Accept-Encoding`` each request came with."""

    def __init__(self) -> None:
        self.stubborn = False
        self.redirect = False
        self.cookies: list[str | None] = []
        self.expects: list[str | None] = []
        self.accepted: list[str | None] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    def _answer(self, request: web.Request, doc: dict[str, Any]) -> web.Response:
        self.accepted.append(request.headers.get("Accept-Encoding"))
        body = json.dumps(doc).encode()
        headers = {"Content-Type": "application/json", "Set-Cookie": f"sticky=s{len(self.accepted)}; Path=/"}
        if self.stubborn or "gzip" in request.headers.get("Accept-Encoding", ""):
            headers["Content-Encoding"] = "gzip"
            body = gzip.compress(body)
        return web.Response(body=body, headers=headers)

    async def completions(self, request: web.Request) -> web.Response:
        self.cookies.append(request.headers.get("Cookie"))
        self.expects.append(request.headers.get("Expect"))
        if self.redirect:
            raise web.HTTPTemporaryRedirect("/v1/models")
        return self._answer(request, ANSWER)

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({})

    async def models(self, request: web.Request) -> web.Response:
        return self._answer(request, MODELS)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"


@pytest.fixture
async def engine() -> AsyncIterator[Gzipping]:
    served = Gzipping()
    await served.start()
    yield served
    assert served.runner is not None
    await served.runner.cleanup()


async def _post(base: str, headers: dict[str, str] | None = None, **kw: Any) -> tuple[int, str | None, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        client.post(
            f"{base}/v1/completions", headers={"Accept-Encoding": "gzip", **(headers or {})}, **kw
        ) as resp,
    ):
        return resp.status, resp.headers.get("Content-Encoding"), await resp.json()


async def test_an_answer_the_gate_reads_is_asked_for_uncompressed_and_counted(engine: Gzipping) -> None:
    async with gate_for(engine.url) as (_, base, registry):
        status, encoding, answer = await _post(base, json={"prompt": "x", "max_tokens": 3})
    assert (status, encoding, answer) == (200, None, ANSWER)
    assert engine.accepted == ["identity"]
    assert gate_tokens(registry) == {"prompt": 7.0, "output": 3.0}


async def test_a_compressed_answer_keeps_its_encoding(engine: Gzipping) -> None:
    """An upstream that compresses whatever it is asked: its client can still read it (the gate cannot:
    the counts fall back to the estimate)."""
    engine.stubborn = True
    async with gate_for(engine.url) as (_, base, _registry):
        status, encoding, answer = await _post(base, json={"prompt": "x", "max_tokens": 3})
    assert (status, encoding, answer) == (200, "gzip", ANSWER)


async def test_a_passed_through_answer_is_compressed_as_its_client_asked(engine: Gzipping) -> None:
    async with (
        gate_for(engine.url) as (_, base, _registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        client.get(f"{base}/v1/models", headers={"Accept-Encoding": "gzip"}) as resp,
    ):
        assert resp.headers.get("Content-Encoding") == "gzip"
        assert await resp.json() == MODELS
    assert engine.accepted == ["gzip"]


async def test_a_compressed_request_body_is_refused_clearly(engine: Gzipping) -> None:
    body = gzip.compress(json.dumps({"prompt": "x", "max_tokens": 3}).encode())
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with gate_for(engine.url) as (_, base, _registry):
        status, _, answer = await _post(base, data=body, headers=headers)
    assert status == 415 and answer["error"]["code"] == "unsupported_content_encoding"
    assert "gzip" in answer["error"]["message"] and engine.accepted == []


async def test_a_redirect_is_relayed_for_the_client_to_follow(engine: Gzipping) -> None:
    engine.redirect = True
    async with (
        gate_for(engine.url) as (_, base, _registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        client.post(f"{base}/v1/completions", json={"prompt": "x"}, allow_redirects=False) as resp,
    ):
        assert (resp.status, resp.headers["Location"]) == (307, "/v1/models")
    assert engine.accepted == []  # the gate did not go there itself


async def test_an_upstreams_cookie_is_its_clients_alone(engine: Gzipping) -> None:
    named = engine.url.replace("127.0.0.1", "localhost")  # aiohttp's jar takes no cookie from an IP address
    async with gate_for(named) as (_, base, _registry):
        for _ in range(2):  # two clients, each with a session of its own (its own cookie jar)
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
                client.post(f"{base}/v1/completions", json={"prompt": "x"}) as resp,
            ):
                assert resp.cookies["sticky"].value == f"s{len(engine.accepted)}"
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
            client.post(f"{base}/v1/completions", json={"prompt": "x"}, headers={"Cookie": "mine=1"}),
        ):
            pass
    assert engine.cookies == [None, None, "mine=1"]


async def test_a_clients_expect_100_continue_is_answered_by_the_gate_not_passed_on(engine: Gzipping) -> None:
    """The gate holds the whole body by the time it sends the request: passed on, the header made it wait
    for the upstream's 100 first."""
    async with (
        gate_for(engine.url) as (_, base, _registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
        client.post(f"{base}/v1/completions", json={"prompt": "x" * 2000}, expect100=True) as resp,
    ):
        assert resp.status == 200
    assert engine.expects == [None]
