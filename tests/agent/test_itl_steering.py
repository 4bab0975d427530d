"""``policies.itl_steering``: the ITL target the engine-wide policies steer to (agent/itl_steering.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent import config
from agent.config import PolicyConfig
from agent.engines.launcher import free_port
from agent.itl_steering import AUDIT_KNOB, steered_itl, steering_warnings
from agent.sidecar import Sidecar
from tests.agent.test_sidecar import OneValue


def _policies(**overrides: Any) -> PolicyConfig:
    fields: dict[str, Any] = {
        "itl_slo_s": 0.1,
        "itl_steering": "served_classes",
        "served_window_s": 60.0,
        "slo_by_priority": {"high": {"itl_s": 0.05}, "low": {"ttft_s": 30.0, "itl_s": 0.2}},
    }
    return PolicyConfig.model_validate({**fields, **overrides})


async def _sidecar(tmp_path: Path, mode: str, policies: dict[str, Any]) -> tuple[Sidecar, dict[str, Any]]:
    """A sidecar from a config file (so it reloads) with a gate whose upstream is down, the auto policy
    set at an ITL SLO of 0.1 s plus ``policies``, started; and the config as written."""
    import yaml

    raw: dict[str, Any] = {
        "agent": {"listen_port": free_port(), "admin_listen_port": None},
        "gate": {"enabled": True, "listen_port": free_port(), "upstreams": {"primary": "http://127.0.0.1:9"}},
        "actuators": {"mode": mode},
        "audit": {"path": None},
        "probe": {"enabled": False},
        "forecast": {"enabled": False},
        "policies": {"set": "auto", "itl_slo_s": 0.1, **policies},
    }
    path = tmp_path / "servepilot.yaml"
    path.write_text(yaml.safe_dump(raw))
    sidecar = Sidecar(config.load(path, {}), collectors=[OneValue()], config_path=str(path))
    await sidecar.knobs.start()
    return sidecar, raw


def test_the_tightest_target_of_the_classes_served_within_the_window() -> None:
    p = _policies()
    assert steered_itl(p, {"low": 100.0}, 130.0).itl_s == 0.2  # batch traffic alone: its looser target
    both = steered_itl(p, {"low": 100.0, "high": 120.0}, 130.0)
    assert both.itl_s == 0.05 and both.served == (("high", 0.05), ("low", 0.2))
    assert "served in the last 60 s (high 0.05 s, low 0.2 s)" in both.reason
    later = steered_itl(p, {"low": 100.0, "high": 120.0}, 170.0)  # low last sent 70 s ago, high 50 s
    assert later.itl_s == 0.05 and later.served == (("high", 0.05),)
    assert steered_itl(p, {"low": 100.0, "high": 120.0}, 181.0).itl_s == 0.1  # both past 60 s: the SLO
    assert steered_itl(p, {"normal": 100.0, "low": 100.0}, 130.0).itl_s == 0.1  # normal has no own: 0.1
    assert steered_itl(p, {}, 130.0).reason.startswith("no class sent requests in the last 60 s")


def test_global_steering_keeps_the_slo_whatever_is_served() -> None:
    p = _policies(itl_steering="global")
    assert steered_itl(p, {"high": 100.0}, 100.0).itl_s == 0.1


def test_start_warns_of_a_tighter_class_target_steered_globally_and_of_steering_without_a_gate() -> None:
    [tighter] = steering_warnings(_policies(itl_steering="global"), gate_enabled=True)  # low's 0.2: looser
    assert tighter.startswith("policies.slo_by_priority.high.itl_s 0.05 s is tighter than policies.itl_slo_s")
    assert steering_warnings(_policies(), gate_enabled=True) == []
    [blind] = steering_warnings(_policies(), gate_enabled=False)
    assert blind.startswith("policies.itl_steering served_classes needs the gate (gate.enabled)")
    # the default steers to the served classes; without a class ITL target of its own there is nothing
    # to steer to, and a sidecar without the gate hears nothing of it
    assert PolicyConfig().itl_steering == "served_classes"
    assert steering_warnings(PolicyConfig(), gate_enabled=False) == []
    only_ttft = PolicyConfig.model_validate({"slo_by_priority": {"low": {"ttft_s": 60.0, "itl_s": 0.1}}})
    assert steering_warnings(only_ttft, gate_enabled=False) == []


def test_a_bad_steering_mode_names_the_field() -> None:
    with pytest.raises(ValueError, match="itl_steering"):
        _policies(itl_steering="tightest")


async def test_the_sidecar_retunes_the_policies_to_the_classes_its_gate_serves(tmp_path: Path) -> None:
    """Requests through the gate (its upstream is down: the class was still sent) move the target the
    batch controller and the breaker steer to, from the next tick, each move audited and exported; when
    the classes stop sending, the target returns to policies.itl_slo_s."""
    policies = {
        "itl_steering": "served_classes",
        "served_window_s": 60.0,
        "slo_by_priority": {"high": {"itl_s": 0.05}, "low": {"itl_s": 0.2}},
    }
    sidecar, _ = await _sidecar(tmp_path, "act", policies)
    gate = sidecar.knobs.gate
    assert gate is not None
    now = [1000.0]
    gate.clock = lambda: now[0]
    registry = sidecar.exporter.registry

    def targets() -> dict[str, float]:
        aims = {p.name: getattr(p, "itl_slo_s", None) for p in sidecar.loop.policies}
        return {name: itl for name, itl in aims.items() if itl is not None}

    async def send(priority: str) -> None:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{gate.port}/v1/completions"
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            async with session.post(url, json=body, headers={"x-servepilot-priority": priority}) as resp:
                assert resp.status == 502

    try:
        await sidecar.loop.tick(1.0)
        assert set(targets()) >= {"batch_auto", "breaker"} and set(targets().values()) == {0.1}
        await send("low")
        await sidecar.loop.tick(2.0)
        assert set(targets().values()) == {0.2}  # batch traffic alone: the larger batch its target allows
        now[0] = 1030.0
        await send("high")
        await sidecar.loop.tick(3.0)
        assert set(targets().values()) == {0.05}
        assert registry.get_sample_value("servepilot_policy_itl_target_seconds") == 0.05
        now[0] = 1065.0  # low last sent 65 s ago, high 35 s ago
        await sidecar.loop.tick(4.0)
        assert set(targets().values()) == {0.05}
        now[0] = 1095.0
        await sidecar.loop.tick(5.0)
        assert set(targets().values()) == {0.1}
        assert registry.get_sample_value("servepilot_policy_itl_target_seconds") == 0.1
        assert registry.get_sample_value("servepilot_slo_itl_seconds") == 0.1  # the SLO itself stays
        moves = [a for a in sidecar.knobs.audit.recent(20) if a["knob"] == AUDIT_KNOB][::-1]
        assert [(a["from"], a["to"]) for a in moves] == [(0.1, 0.2), (0.2, 0.05), (0.05, 0.1)]
        assert "(high 0.05 s, low 0.2 s)" in moves[1]["reason"] and moves[1]["policy"] == "itl_steering"
    finally:
        await sidecar.stop()


async def test_a_reload_that_turns_steering_on_retunes_at_once_and_audits_it(tmp_path: Path) -> None:
    """The policies steer to the SLO while steering is global, whatever is served; the reload that turns
    it on moves them to the served class's target in the same step, audited; turning it off moves them
    back, audited with the reason that says so."""
    import yaml

    policies = {"itl_steering": "global", "slo_by_priority": {"high": {"itl_s": 0.05}}}
    sidecar, raw = await _sidecar(tmp_path, "advise", policies)
    path = tmp_path / "servepilot.yaml"
    gate = sidecar.knobs.gate
    assert gate is not None

    def aim() -> float:
        auto = next(p for p in sidecar.loop.policies if p.name == "batch_auto")
        return float(getattr(auto, "itl_slo_s"))  # noqa: B009 (the Policy protocol has no targets)

    try:
        gate.stats.last_seen["high"] = gate.clock()  # what a request through the gate records
        await sidecar.loop.tick(1.0)
        assert aim() == 0.1
        for steering, expected in (("served_classes", 0.05), ("global", 0.1)):
            raw["policies"]["itl_steering"] = steering
            path.write_text(yaml.safe_dump(raw))
            assert sidecar.reload("SIGHUP").result == "applied"
            assert aim() == expected
            await sidecar.loop.tick(2.0)
            assert aim() == expected  # the tick after agrees: no second move
        moves = [a for a in sidecar.knobs.audit.recent(20) if a["knob"] == AUDIT_KNOB][::-1]
        assert [(a["from"], a["to"]) for a in moves] == [(0.1, 0.05), (0.05, 0.1)]
        assert moves[0]["reason"].endswith("(high 0.05 s)") and moves[0]["mode"] == "advise"
        assert moves[1]["reason"] == "policies.itl_slo_s (itl_steering: global)"
    finally:
        await sidecar.stop()
