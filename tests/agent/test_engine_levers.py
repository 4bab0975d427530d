"""The policies that join once the engine's control API is known (agent/engine_levers.py), each alone.

The sidecar's own tests run them against the simulator's control API (tests/agent/test_sidecar.py); here
the knobs are stand-ins, so each case of "the engine lacks the lever" is seen to leave it out, with a
log line, rather than fail.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from agent import config, engine_levers
from agent.control.base import Capabilities, KnobSpec
from policies.energy import Energy
from policies.sleep import SLEEPING, SleepWake


def _knobs(bound: tuple[str, ...] = (), caps: Capabilities | None = None, **extra: Any) -> Any:
    control = None if caps is None else SimpleNamespace(capabilities=caps)
    fields = {"gpu": None, "gate": None, "control": control, **extra}
    return SimpleNamespace(actuation=SimpleNamespace(knobs=dict.fromkeys(bound)), **fields)


SLEEPY = {"policies": {"sleep": True}, "forecast": {"enabled": True}, "control": {"enabled": True}}


def test_sleep_wake_waits_for_the_engine_to_offer_sleep(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config.build(SLEEPY)
    with caplog.at_level(logging.WARNING, logger="agent.engine_levers"):
        assert engine_levers.sleep_wake(cfg, _knobs()) is None
    assert "offers no sleep" in caplog.text
    policy = engine_levers.sleep_wake(cfg, _knobs((SLEEPING,)))
    assert isinstance(policy, SleepWake)
    assert policy.forecast_signal == "forecast.requests_per_second.h30m.q0.9"  # selection horizon, top q
    assert engine_levers.sleep_wake(config.build({}), _knobs((SLEEPING,))) is None  # not asked for


def test_energy_on_the_engine_clock_needs_the_knob_and_its_top(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config.build({"policies": {"energy": True}, "control": {"enabled": True}})
    without = Capabilities("generic", {}, leases=True)
    with caplog.at_level(logging.WARNING, logger="agent.engine_levers"):
        assert engine_levers.engine_energy(cfg, _knobs(caps=without)) is None
    assert "offers no sm_clock_mhz" in caplog.text
    clock = Capabilities(
        "generic", {"sm_clock_mhz": KnobSpec("sm_clock_mhz", minimum=210, maximum=1410)}, True
    )
    policy = engine_levers.engine_energy(cfg, _knobs(caps=clock))
    assert isinstance(policy, Energy)
    assert policy.levels_mhz[0] == 1410 and policy.levels_mhz[-1] == pytest.approx(0.45 * 1410, abs=1)
    assert engine_levers.engine_energy(cfg, _knobs(caps=clock, gpu=object())) is None  # the GPU's own knob


async def test_the_token_budget_is_left_out_unless_auto_and_bound() -> None:
    cfg = config.build({"policies": {"set": "seed"}})
    assert await engine_levers.token_budget(cfg, _knobs(("engine.max_num_batched_tokens",)), []) is None
    assert await engine_levers.token_budget(config.build({}), _knobs(), []) is None
