"""Shared fixtures: a fake clock whose sleep advances it (tests never really sleep) and a served simulator."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from simulator.engine import EngineCore, make_core
from simulator.server import SimServer


class FakeClock:
    """Wall clock for the server: ``sleep`` moves it forward instead of waiting."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    async def sleep(self, seconds: float) -> None:
        self.t += seconds
        await asyncio.sleep(0)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def small_core() -> EngineCore:
    """A 7B model on an A100, the calibration reference."""
    return make_core("a100-80g", "llama-2-7b", "fp16", 64)


ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
async def sim(aiohttp_client: ClientFactory, clock: FakeClock, small_core: EngineCore):  # type: ignore[no-untyped-def]
    server = SimServer(small_core, speed=1.0, clock=clock, sleep=clock.sleep, seed=1, pid=4242)
    client = await aiohttp_client(server.app())
    client.sim_server = server  # type: ignore[attr-defined]
    return client
