"""Sleep mode: the pure model (wake delay, no sleep in flight) and the simulator's /sleep, /wake_up."""

from __future__ import annotations

from typing import Any

import pytest

from simulator.sleep import SleepModel, SleepRefused
from tests.simulator.conftest import FakeClock


def test_sleep_is_refused_while_requests_are_in_flight() -> None:
    model = SleepModel()
    with pytest.raises(SleepRefused, match="2 request"):
        model.sleep(2, 0.0)
    assert not model.asleep


def test_wake_up_takes_the_modelled_delay() -> None:
    model = SleepModel(wake_delay_s=30.0)
    model.sleep(0, 0.0)
    assert model.wake_up(100.0) == 130.0
    assert model.is_sleeping(129.9) and not model.is_sleeping(130.0)


def test_wake_up_when_awake_changes_nothing() -> None:
    model = SleepModel(wake_delay_s=30.0)
    assert model.wake_up(100.0) == 0.0 and not model.is_sleeping(100.0)


async def test_sleeping_engine_answers_503_until_reloaded(sim: Any, clock: FakeClock) -> None:
    sim.sim_server.sleep_mode.wake_delay_s = 20.0
    assert (await sim.post("/sleep")).status == 200
    assert (await (await sim.get("/is_sleeping")).json()) == {"is_sleeping": True}
    body = {"prompt": "hi", "max_tokens": 2}
    assert (await sim.post("/v1/completions", json=body)).status == 503
    await sim.post("/wake_up")
    clock.advance(19.0)
    assert (await sim.post("/v1/completions", json=body)).status == 503
    clock.advance(1.0)
    assert (await sim.post("/v1/completions", json=body)).status == 200


async def test_sleep_with_a_request_in_flight_is_a_409(sim: Any) -> None:
    sim.sim_server.core.submit("busy", 100, 1000, sim.sim_server.sim_now())
    resp = await sim.post("/sleep")
    assert resp.status == 409 and "in flight" in (await resp.json())["error"]["message"]
