"""Control API faults: 5xx and timeouts. A fault-injecting front sits between the client and the
simulator's real control API, so a lost answer still reaches the engine: the retry carries the same
idempotency key and the engine applies the change once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from agent.config import ControlConfig
from agent.control.base import ControlError
from agent.control.client import ControlClient
from simulator.engine import make_core
from simulator.server import SimServer
from tests.faults.conftest import serve


class Front:
    """Forwards to the simulator; the first ``fail`` applies are answered 503 or never (``hang``),
    *after* the engine has applied them (a lost response, the hard case)."""

    def __init__(self, target: str, fail: int, hang: bool = False) -> None:
        self.target, self.fail, self.hang = target, fail, hang
        self.keys: list[str] = []
        self.never = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with (
            aiohttp.ClientSession() as session,
            session.request(request.method, self.target + request.rel_url.path_qs, data=body,
                            headers={"Content-Type": "application/json"}) as resp,
        ):  # fmt: skip
            payload, status = await resp.read(), resp.status
        if request.path.endswith("/apply") and request.method == "POST":
            self.keys.append(str((await request.json()).get("idempotency_key")))
            if self.fail > 0:
                self.fail -= 1
                if self.hang:
                    await self.never.wait()
                return web.json_response({"error": "injected"}, status=503)
        return web.Response(body=payload, status=status, content_type="application/json")


@pytest.fixture
async def sim() -> AsyncIterator[tuple[SimServer, str]]:
    server = SimServer(make_core("a100-80g", "llama-2-7b", "fp16", 256), speed=10.0)
    async with serve(server.app()) as url:
        yield server, url


async def _apply_through(front: Front, value: int, timeout_s: float = 2.0) -> tuple[ControlClient, object]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", front.handle)
    async with serve(app) as url:
        client = ControlClient(
            # the tests read the engine after the client closed: keep the lease rather than end it
            ControlConfig(
                enabled=True, url=url, adapter="generic", timeout_s=timeout_s, release_on_stop=False
            ),
            sleep=lambda _s: asyncio.sleep(0),  # backoff without waiting
        )
        try:
            await client.start()
            try:
                return client, await client.apply({"max_num_seqs": value})
            except ControlError as error:
                return client, error
        finally:
            front.never.set()
            await client.close()


async def test_5xx_is_retried_under_the_same_key_and_applied_once(sim: tuple[SimServer, str]) -> None:
    server, url = sim
    front = Front(url, fail=2)
    _, result = await _apply_through(front, 48)
    assert getattr(result, "ok", False), result
    assert len(front.keys) == 3 and len(set(front.keys)) == 1
    assert server.core.settings.max_num_seqs == 48 and server.control.generation == 1


async def test_a_timeout_is_retried_and_the_change_is_not_applied_twice(sim: tuple[SimServer, str]) -> None:
    server, url = sim
    front = Front(url, fail=1, hang=True)
    _, result = await _apply_through(front, 40, timeout_s=0.2)
    assert getattr(result, "ok", False), result
    assert len(set(front.keys)) == 1 and server.control.generation == 1


async def test_an_engine_that_keeps_failing_gives_one_temporary_error(sim: tuple[SimServer, str]) -> None:
    _, url = sim
    _, result = await _apply_through(Front(url, fail=100), 32)
    assert isinstance(result, ControlError) and result.temporary and "\n" not in str(result)


async def test_the_sidecar_runs_the_token_budget_controller_where_the_engine_offers_the_knob(
    sim: tuple[SimServer, str],
) -> None:
    """Discovery decides: the simulator's control API offers max_num_batched_tokens, so the auto set gains
    the controller, bounded around the value the engine runs with; without control there is none."""
    from agent import config
    from agent.engines.launcher import free_port
    from agent.sidecar import Sidecar
    from policies.token_budget import TokenBudget

    server, url = sim
    base = {
        "agent": {"listen_port": free_port(), "admin_listen_port": free_port()},
        "audit": {"path": None},
        "forecast": {"enabled": False},
        "engine": {"url": url, "kind": "vllm"},
    }
    with_control = config.build({**base, "control": {"enabled": True, "url": url, "adapter": "generic"}})
    for cfg, wanted in ((with_control, True), (config.build(base), False)):
        sidecar = Sidecar(cfg)
        await sidecar.start()
        try:
            budgets = [p for p in sidecar.loop.policies if isinstance(p, TokenBudget)]
        finally:
            await sidecar.stop()
        assert bool(budgets) is wanted
        if budgets:
            start = server.core.max_num_batched_tokens
            assert budgets[0].lower <= start <= budgets[0].upper
