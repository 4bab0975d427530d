"""Fuzz the admission gate's request handling over real HTTP on loopback: bodies, headers and sizes.

The gate and a small OpenAI-ish upstream run on one event loop in a background thread for the whole
module (starting a server per example would dominate the run); each hypothesis example is one raw HTTP
request sent with the standard library's client, which lets headers and bodies be anything the wire
allows. Properties: the answer is a deliberate status (never a 500 or a dropped connection), refusals are
OpenAI-shaped JSON with a one-line message, the gate keeps serving afterwards, and an oversized body is
refused without being buffered.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from agent.config import GateConfig, GateLineConfig
from agent.gate.proxy import Gate
from tests.fuzz.strategies import FUZZ

API_KEY = "sk-fuzz-0123456789abcdef"
MAX_BODY = 1 << 18
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health", "/x"]
ALLOWED = {200, 400, 404, 405, 413, 429, 503}


class _Servers:
    """Upstream + gate on a private event loop in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self._call(self._start())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def _start(self) -> int:
        async def answer(request: web.Request) -> web.Response:
            await request.read()
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            return web.json_response({"choices": [{"text": "ok"}], "usage": usage})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        self.upstream = web.AppRunner(app, access_log=None)
        await self.upstream.setup()
        site = web.TCPSite(self.upstream, "127.0.0.1", 0)
        await site.start()
        upstream_port = self.upstream.addresses[0][1]
        cfg = GateConfig(
            upstreams={"primary": f"http://127.0.0.1:{upstream_port}"},
            max_body_bytes=MAX_BODY,
            api_keys={API_KEY: "team"},
            default_requests_per_min=1e7,
            # a token budget on the default line, so a NaN or huge token estimate would poison its bucket
            lines={"default": GateLineConfig(requests_per_min=1e7, tokens_per_min=1e12)},
            health_interval_s=600,
        )
        self.gate = Gate(cfg, CollectorRegistry())
        return await self.gate.start("127.0.0.1", 0)

    def close(self) -> None:
        async def stop() -> None:
            await self.gate.stop()
            await self.upstream.cleanup()

        self._call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[_Servers]:
    running = _Servers()
    yield running
    running.close()


def _send(port: int, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _assert_deliberate(status: int, payload: bytes) -> None:
    assert status in ALLOWED, (status, payload[:300])
    if status in (400, 413, 429, 503):
        error = json.loads(payload)["error"]
        assert error["message"] and "\n" not in error["message"]


_HEADER_VALUE = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=60
)
_JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
)
_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=20,
)
_TOKENS = st.one_of(st.sampled_from([float("nan"), float("inf"), 1e300, -1, 2**64, 16]), _JSON)
_DOC = st.fixed_dictionaries(
    {},
    optional={
        "model": _JSON,
        "prompt": _JSON,
        "messages": _JSON,
        "input": _JSON,
        "max_tokens": _TOKENS,
        "max_completion_tokens": _TOKENS,
        "stream": _JSON,
    },
)
_BODY = st.one_of(
    _DOC.map(lambda d: json.dumps(d).encode()),  # json.dumps writes NaN/Infinity, which Python reads back
    st.binary(max_size=200),
    # deeper than any recursion limit (hypothesis raises the interpreter's while it runs), under MAX_BODY
    st.just(b"[" * 50_000 + b"]" * 50_000),
    st.integers(MAX_BODY - 2, MAX_BODY + 2).map(lambda n: b'{"prompt": "' + b"a" * n + b'"}'),
)
_HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "Authorization": st.one_of(_HEADER_VALUE, st.just(f"Bearer {API_KEY}"), st.just("Bearer ")),
        "x-servepilot-line": _HEADER_VALUE,
        "x-servepilot-priority": st.one_of(_HEADER_VALUE, st.sampled_from(["high", "low", "HIGH", ""])),
        "Content-Type": _HEADER_VALUE,
    },
)


@FUZZ
@given(
    method=st.sampled_from(["POST", "GET", "PUT"]), path=st.sampled_from(PATHS), body=_BODY, headers=_HEADERS
)
def test_any_request_gets_a_deliberate_answer(
    servers: _Servers, method: str, path: str, body: bytes, headers: dict[str, str]
) -> None:
    status, payload = _send(servers.port, method, path, body, headers)
    _assert_deliberate(status, payload)
    # and the gate still serves an ordinary request afterwards
    ok, _ = _send(servers.port, "POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}', {})
    assert ok == 200


def test_an_oversized_streamed_body_is_refused_without_buffering_it(servers: _Servers) -> None:
    """8 MiB sent chunked (no Content-Length to refuse on) against a 4 KiB limit: 413, memory flat."""
    chunk = b"x" * 65536

    def chunks() -> Iterator[bytes]:
        for _ in range(128):
            yield chunk

    tracemalloc.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", servers.port, timeout=10)
        try:
            conn.request("POST", "/v1/completions", body=chunks(), encode_chunked=True)
            status = conn.getresponse().status
        except (BrokenPipeError, ConnectionResetError):
            status = 413  # the gate answered and closed while the client was still writing
        finally:
            conn.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 413
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB while refusing an 8 MiB body"


# Regressions the fuzzer found (each failed before the fix it names in docs/security.md).
def test_json_nested_past_the_recursion_limit_is_a_400(servers: _Servers) -> None:
    status, payload = _send(servers.port, "POST", "/v1/completions", b"[" * 50_000 + b"]" * 50_000, {})
    assert status == 400, payload[:200]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "1e300"])
def test_a_non_finite_or_absurd_max_tokens_is_a_400_and_poisons_nothing(
    servers: _Servers, value: str
) -> None:
    body = b'{"prompt": "x", "max_tokens": ' + value.encode() + b"}"
    status, _ = _send(servers.port, "POST", "/v1/completions", body, {})
    ok, payload = _send(servers.port, "POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}', {})
    assert (status, ok) == (400, 200), payload[:200]
