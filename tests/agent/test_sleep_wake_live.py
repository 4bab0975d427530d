"""policies.sleep live: the sidecar puts a (fake) vLLM to sleep through its dev-mode endpoints when idle
and the forecast is low, and wakes it when the forecast rises or a request waits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from agent import config
from agent.engines.launcher import free_port
from agent.sidecar import Sidecar
from detectors.snapshot import Reading, SourceStatus
from tests.agent.control.fake_vllm import vllm_control_app

FORECAST = "forecast.requests_per_second.h30m.q0.9"  # the selection horizon, the top quantile


class Traffic:
    """The forecast and the in-flight signals, as the test sets them."""

    name = "traffic"

    def __init__(self) -> None:
        self.values = {FORECAST: 0.01, "engine.requests_running": 0.0, "engine.requests_waiting": 0.0}

    async def collect(self, now: float) -> Reading:
        return Reading("traffic", now, SourceStatus.OK, dict(self.values))

    async def close(self) -> None:
        pass


@pytest.fixture
async def vllm() -> AsyncIterator[tuple[str, list[str]]]:
    """vLLM's dev-mode sleep endpoints and its OpenAPI document, recording each call."""
    calls: list[str] = []
    runner = web.AppRunner(vllm_control_app(["sleeping"], calls))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", calls
    await runner.cleanup()


def _cfg(url: str, tmp_path: Path, mode: str = "act") -> config.Config:
    return config.build(
        {
            "agent": {"listen_port": free_port(), "admin_listen_port": None, "interval_s": 0.05},
            "control": {"enabled": True, "url": url, "adapter": "vllm"},
            "forecast": {"enabled": True, "state_path": None},
            "policies": {"sleep": True, "sleep_min_idle_s": 0.5},
            "actuators": {"mode": mode},
            "audit": {"path": None},
            "probe": {"enabled": False},
        }
    )


async def _until(calls: list[str], wanted: list[str], timeout_s: float = 10.0) -> None:
    """Wait for the running sidecar (20 ticks a second) to have made exactly ``wanted`` calls."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while calls != wanted and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)  # a live loop on real sockets: wait for its ticks
    assert calls == wanted


async def test_sleeps_when_idle_and_the_forecast_is_low_then_wakes_ahead_of_the_rise(
    vllm: tuple[str, list[str]], tmp_path: Path
) -> None:
    url, calls = vllm
    traffic = Traffic()
    sidecar = Sidecar(_cfg(url, tmp_path), collectors=[traffic])
    await sidecar.start()
    try:
        assert "sleep_wake" in [p.name for p in sidecar.loop.policies]
        started = asyncio.get_running_loop().time()
        await _until(calls, ["sleep"])
        assert asyncio.get_running_loop().time() - started >= 0.5  # not before sleep_min_idle_s of idleness
        await asyncio.sleep(0.3)  # asleep and still quiet: nothing more is sent
        assert calls == ["sleep"]
        traffic.values[FORECAST] = 0.5  # the forecast rises past wake_above_rps (0.2)
        await _until(calls, ["sleep", "wake_up"])
        # the engine has the call; the action is audited once its read-back returns, a moment later
        deadline = asyncio.get_running_loop().time() + 10.0
        while asyncio.get_running_loop().time() < deadline:
            reasons = [a["reason"] for a in sidecar.knobs.audit.recent(50) if a["knob"] == "engine.sleeping"]
            if any("wake: forecast 0.5 req/s" in r for r in reasons):
                break
            await asyncio.sleep(0.02)
        assert any("wake: forecast 0.5 req/s" in r for r in reasons), reasons
        assert all(a["result"] == "ok" for a in sidecar.knobs.audit.recent(50)), sidecar.knobs.audit.recent(
            50
        )
    finally:
        await sidecar.stop()


async def test_a_waiting_request_wakes_it_at_once(vllm: tuple[str, list[str]], tmp_path: Path) -> None:
    url, calls = vllm
    traffic = Traffic()
    sidecar = Sidecar(_cfg(url, tmp_path), collectors=[traffic])
    await sidecar.start()
    try:
        await _until(calls, ["sleep"])
        traffic.values["engine.requests_waiting"] = 1.0  # the forecast was wrong: someone is here
        await _until(calls, ["sleep", "wake_up"])
    finally:
        await sidecar.stop()


async def test_advise_mode_records_the_decision_and_sends_nothing(
    vllm: tuple[str, list[str]], tmp_path: Path
) -> None:
    url, calls = vllm
    sidecar = Sidecar(_cfg(url, tmp_path, mode="advise"), collectors=[Traffic()])
    await sidecar.start()
    try:
        deadline = asyncio.get_running_loop().time() + 10.0
        while asyncio.get_running_loop().time() < deadline and not sidecar.knobs.audit.recent(1):
            await asyncio.sleep(0.02)
        [advice, *_] = sidecar.knobs.audit.recent(10)
        assert (advice["knob"], advice["result"]) == ("engine.sleeping", "advised")
        assert calls == []
    finally:
        await sidecar.stop()


async def test_without_sleep_endpoints_the_policy_stays_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = web.AppRunner(vllm_control_app(["paused"], []))  # a vLLM that serves pause, not sleep
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    sidecar = Sidecar(_cfg(f"http://127.0.0.1:{runner.addresses[0][1]}", tmp_path), collectors=[Traffic()])
    try:
        await sidecar.start()
        assert "sleep_wake" not in [p.name for p in sidecar.loop.policies]
        assert "sleep/wake off: the engine's control API offers no sleep" in caplog.text
    finally:
        await sidecar.stop()
        await runner.cleanup()


@pytest.mark.parametrize(
    ("policies", "extra", "says"),
    [
        ({"sleep": True}, {"control": {"enabled": True}}, "policies.sleep needs forecast.enabled"),
        ({"sleep": True}, {"forecast": {"enabled": True}}, "policies.sleep needs control.enabled"),
        ({"sleep_below_rps": 0.5, "wake_above_rps": 0.2}, {}, "policies.sleep_below_rps must be below"),
    ],
)
def test_sleep_settings_are_checked(policies: dict[str, object], extra: dict[str, object], says: str) -> None:
    with pytest.raises(config.ConfigError) as info:
        config.build({"policies": policies, **extra})
    assert str(info.value).startswith(says)
