"""SGLang and vLLM adapters against small loopback servers that mimic those engines' endpoints."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.control.base import ControlError
from agent.control.sglang import ALLOWED, SglangAdapter
from agent.control.vllm import VllmAdapter, knobs_from_openapi
from tests.agent.control.fake_vllm import vllm_control_app


class FakeSglang:
    """``/get_server_info`` and ``/set_internal_state`` with SGLang's allowlist behaviour."""

    def __init__(self) -> None:
        self.args: dict[str, Any] = {"max_micro_batch_size": 8, "speculative_accept_threshold_single": 1.0}
        self.posts: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        async def info(_: web.Request) -> web.Response:
            return web.json_response({**self.args, "version": "0.4.9"})

        async def set_state(request: web.Request) -> web.Response:
            body = await request.json()
            self.posts.append(body)
            if set(body["server_args"]) - set(ALLOWED):
                return web.json_response({"updated": False, "server_args": self.args})
            self.args.update(body["server_args"])
            return web.json_response({"updated": True, "server_args": self.args})

        app = web.Application()
        app.router.add_get("/get_server_info", info)
        app.router.add_post("/set_internal_state", set_state)
        return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_sglang_offers_only_allowlisted_keys_it_serves(session: aiohttp.ClientSession) -> None:
    fake = FakeSglang()
    runner, url = await _serve(fake.app())
    try:
        caps = await SglangAdapter(session, url).discover()
        assert set(caps.knobs) == {"max_micro_batch_size", "speculative_accept_threshold_single"}
        assert not caps.leases
    finally:
        await runner.cleanup()


async def test_sglang_apply_posts_server_args_and_reads_back(session: aiohttp.ClientSession) -> None:
    fake = FakeSglang()
    runner, url = await _serve(fake.app())
    try:
        read_back = await SglangAdapter(session, url).apply({"max_micro_batch_size": 4}, "k", 30)
        assert fake.posts == [{"server_args": {"max_micro_batch_size": 4}}]
        assert read_back["max_micro_batch_size"] == 4
    finally:
        await runner.cleanup()


async def test_sglang_refuses_a_key_outside_the_allowlist_before_sending(
    session: aiohttp.ClientSession,
) -> None:
    fake = FakeSglang()
    runner, url = await _serve(fake.app())
    try:
        with pytest.raises(ControlError, match="does not allow setting max_running_requests"):
            await SglangAdapter(session, url).apply({"max_running_requests": 4}, "k", 30)
        assert fake.posts == []
    finally:
        await runner.cleanup()


def test_vllm_knobs_come_only_from_complete_endpoint_sets() -> None:
    doc = {"paths": {"/pause": {}, "/resume": {}, "/is_paused": {}, "/sleep": {}, "/wake_up": {}}}
    assert list(knobs_from_openapi(doc)) == ["paused"]


async def test_vllm_without_runtime_endpoints_is_not_controllable(session: aiohttp.ClientSession) -> None:
    async def openapi(_: web.Request) -> web.Response:
        return web.json_response({"paths": {"/v1/completions": {}, "/metrics": {}}})

    app = web.Application()
    app.router.add_get("/openapi.json", openapi)
    runner, url = await _serve(app)
    try:
        with pytest.raises(ControlError, match="no runtime control endpoint"):
            await VllmAdapter(session, url).discover()
    finally:
        await runner.cleanup()


async def test_vllm_pause_is_applied_and_read_back(session: aiohttp.ClientSession) -> None:
    calls: list[str] = []
    runner, url = await _serve(vllm_control_app(["paused"], calls))
    try:
        adapter = VllmAdapter(session, url)
        await adapter.discover()
        assert await adapter.apply({"paused": True}, "k", 30) == {"paused": True}
        assert calls == ["pause"]
    finally:
        await runner.cleanup()
