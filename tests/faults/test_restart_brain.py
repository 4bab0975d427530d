"""Restart with persisted brain state: the breaker level and the detector baselines resume.

The breaker is escalated through its own API (a 5xx storm fed to ``Breaker.decide``), the sidecar is
stopped (which saves ``agent.state_path``) and a new Sidecar starts from the same file. Detector baselines
are checked on two Loops directly (a Sidecar adds nothing there). Time is passed in by hand.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest

from agent import config, persist
from agent.assembly import build_detectors
from agent.engines.launcher import free_port as _free_port
from agent.loop import Loop
from agent.sidecar import Sidecar
from agent.store import Store
from detectors.snapshot import Reading, Snapshot, SourceStatus
from policies.breaker import Breaker, BreakerState
from policies.canary import Canary, CanaryState
from tests.agent.test_sidecar import OneValue


def _cfg(tmp_path: Path, state_path: str | None = None) -> config.Config:
    return config.build(
        {
            "agent": {
                "listen_port": _free_port(),
                "admin_listen_port": _free_port(),
                "state_path": state_path or str(tmp_path / "brain.state"),
            },
            "audit": {"path": None},
            "forecast": {"enabled": False},
        }
    )


def _storm(now: float) -> Snapshot:
    """A 5xx storm as the gate reports it: 50 % of 100 answers failed."""
    values = {"gate.requests": 100.0, "gate.errors": 50.0, "gate.slo_bad": 0.0}
    return Snapshot.from_readings(now, {"gate": Reading("gate", now, SourceStatus.OK, values)})


def _breaker(sidecar: Sidecar) -> BreakerState:
    state = sidecar.loop.policy_state("breaker")
    assert isinstance(state, BreakerState)
    return state


async def test_the_breaker_level_survives_a_restart(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    now = time.time()
    first = Sidecar(cfg, collectors=[OneValue()])
    await first.start()
    try:
        escalated, _ = Breaker().decide(_storm(now), [], None, now)
        assert escalated.level == 1
        first.loop.set_policy_state("breaker", escalated)
    finally:
        await first.stop()  # saves the state file

    second = Sidecar(cfg, collectors=[OneValue()])
    await second.start()
    try:
        restored = _breaker(second)
        assert (restored.level, restored.generation, restored.reason) == (1, 1, escalated.reason)
        assert restored.buckets == escalated.buckets
        await second.loop.tick(now + 1.0)  # healthy now, but within the dwell: the level holds
        assert _breaker(second).level == 1
    finally:
        await second.stop()


def _with_gate(cfg: config.Config, *upstreams: str) -> config.Config:
    data = cfg.model_dump()
    data["gate"] = {
        "enabled": True,
        "listen_port": _free_port(),
        "upstreams": {name: "http://127.0.0.1:9" for name in upstreams},
    }
    return config.build(data)


async def test_a_forced_breaker_level_stays_forced_after_a_restart(tmp_path: Path) -> None:
    cfg = _with_gate(_cfg(tmp_path), "primary", "fp8", "small")  # L3 routes to small: the gate has one
    first = Sidecar(cfg, collectors=[OneValue()])
    await first.start()
    try:  # as the admin API forces it (a tick while the gate drains on stop must not release it)
        first.knobs.actuation.forced["breaker.level"] = 3
        first.loop.set_policy_state("breaker", Breaker().force(None, 3, time.time()))
    finally:
        await first.stop()
    second = Sidecar(cfg, collectors=[OneValue()])
    await second.start()
    try:
        await second.loop.tick(time.time())
        assert (_breaker(second).level, _breaker(second).forced) == (3, 3)
    finally:
        await second.stop()
    # restarted with a config whose gate lost its small upstream: L3 means nothing there, so it steps down
    third = Sidecar(_with_gate(cfg, "primary"), collectors=[OneValue()])
    await third.start()
    try:
        await third.loop.tick(time.time())
        assert (_breaker(third).level, _breaker(third).forced) == (1, None)
        assert "breaker.level" not in third.knobs.actuation.forced
    finally:
        await third.stop()


def _loop() -> Loop:
    return Loop([], Store(100, 64), interval_s=1.0, source_timeout_s=0.5, detectors=build_detectors())


def _feed(loop: Loop, start: int, count: int) -> None:
    for i in range(start, start + count):
        values = {"engine.gpu_cache_usage_perc": 0.5 + 0.01 * (i % 7)}
        reading = Reading("engine", float(i), SourceStatus.OK, values)
        loop.think(Snapshot.from_readings(float(i), {"engine": reading}))


def _general(loop: Loop) -> object:
    return next(d for d in loop.detectors if d.name == "general")


def test_detector_baselines_survive_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "brain.state")
    before = _loop()
    _feed(before, 0, 200)
    persist.write_atomically(path, persist.capture(before, 200.0))
    after = _loop()
    assert persist.load_into(path, after) == ["1 detector baseline(s)"]
    scorer = _general(after).scorers_["engine.gpu_cache_usage_perc"]  # type: ignore[attr-defined]
    assert scorer.learned_ == 200  # past the 150-point warm-up: scores at once, no re-learning
    original = _general(before).scorers_["engine.gpu_cache_usage_perc"]  # type: ignore[attr-defined]
    assert scorer.score_one(201.0, 5.0) == original.score_one(201.0, 5.0) > 0.0


def _tick(loop: Loop, now: float, model: str) -> None:
    values = {"engine.gpu_cache_usage_perc": 0.5}
    reading = Reading("engine", now, SourceStatus.OK, values, info={"engine": "vllm", "model": model})
    loop.think(Snapshot.from_readings(now, {"engine": reading}))


def test_restored_baselines_are_kept_beside_the_same_model_and_learned_again_beside_another(
    tmp_path: Path,
) -> None:
    """A state file on a volume outlives a model upgrade: the old model's baselines would judge the new
    one's levels, every signal warning for an hour. The setup they were learned beside is saved with
    them; the first tick of another drops them."""
    path = str(tmp_path / "brain.state")
    before = _loop()
    for i in range(200):
        _tick(before, float(i), "qwen3-4b")
    persist.write_atomically(path, persist.capture(before, 200.0))
    for model, kept in (("qwen3-4b", True), ("qwen3-32b", False)):
        after = _loop()
        assert persist.load_into(path, after) == ["1 detector baseline(s)"]
        general = _general(after)
        assert general.setup_.seen == {"engine": "vllm", "model": "qwen3-4b"}  # type: ignore[attr-defined]
        _tick(after, 201.0, model)
        seen = general.scorers_["engine.gpu_cache_usage_perc"].learned_  # type: ignore[attr-defined]
        assert seen == (201 if kept else 1), model


def test_baselines_of_another_version_are_dropped_but_the_breaker_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "brain.state")
    before = _loop()
    before.policies = [Breaker()]
    _feed(before, 0, 10)
    before.set_policy_state("breaker", Breaker().force(None, 2, 10.0))
    persist.write_atomically(path, persist.capture(before, 10.0))
    monkeypatch.setattr(persist, "_servepilot_version", lambda: "9.9.9")
    after = _loop()
    after.policies = [Breaker()]
    assert persist.load_into(path, after) == ["breaker L2 (gen 1)"]
    assert _general(after).scorers_ == {}  # type: ignore[attr-defined]


def test_a_canary_rollout_resumes_at_its_step_after_a_restart(tmp_path: Path) -> None:
    """A restart in the middle of a rollout keeps fp8 at the step's share, with the step's counts, where a
    fresh canary would have sent every request back to the primary and waited for an operator's start.
    A deployment that disabled the canary since restores nothing of it."""
    path = str(tmp_path / "brain.state")
    rollout = CanaryState(
        phase="rolling",
        step=2,
        entered_at=100.0,
        failures=1,
        reason="step 2 (50%)",
        answered=40.0,
        served=20.0,
        recent=((119.0, 4.0, 0.0, 0.0),),
    )
    before = _loop()
    before.policies = [Breaker(), Canary()]
    before.set_policy_state("canary", rollout)
    persist.write_atomically(path, persist.capture(before, 120.0))

    after = _loop()
    after.policies = [Breaker(), Canary()]
    assert persist.load_into(path, after) == ["canary rolling (step 2)"]
    assert after.policy_state("canary") == rollout
    assert Canary().share(after.policy_state("canary")) == 0.5

    disabled = _loop()
    disabled.policies = [Breaker()]
    assert persist.load_into(path, disabled) == []
    assert disabled.policy_state("canary") is None


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch pwned",))


def test_a_state_file_naming_other_callables_is_refused_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "brain.state"
    path.write_bytes(pickle.dumps({"version": 1, "policies": {}, "x": _Exploit()}))
    monkeypatch.chdir(tmp_path)
    assert persist.read(str(path), _loop()) is None
    assert not (tmp_path / "pwned").exists()


def test_a_truncated_state_file_means_a_fresh_start(tmp_path: Path) -> None:
    path = str(tmp_path / "brain.state")
    loop = _loop()
    _feed(loop, 0, 10)
    data = persist.capture(loop, 10.0)
    Path(path).write_bytes(data[: len(data) // 2])
    assert persist.load_into(path, _loop()) == []


def test_a_failed_save_leaves_the_previous_state_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "brain.state")
    persist.write_atomically(path, b"previous")

    def full_disk(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        persist.write_atomically(path, b"new")
    assert Path(path).read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["brain.state"]


async def test_a_periodic_save_alone_restores_the_level_after_a_kill(tmp_path: Path) -> None:
    """SIGKILL leaves no save on stop: the last periodic save (``save_state``) must be enough."""
    cfg = _cfg(tmp_path)
    running = Sidecar(cfg, collectors=[OneValue()])
    await running.start()
    try:
        running.loop.set_policy_state("breaker", Breaker().force(None, 2, time.time()))
        await running.save_state()  # what the periodic task does every agent.state_save_interval_s
        fresh = _loop()
        fresh.policies = [Breaker()]
        assert persist.load_into(str(cfg.agent.state_path), fresh)[0] == "breaker L2 (gen 1)"
    finally:
        await running.stop()


async def test_an_unwritable_state_path_costs_the_save_not_the_agent(tmp_path: Path) -> None:
    sidecar = Sidecar(_cfg(tmp_path, state_path="/"), collectors=[OneValue()])
    await sidecar.start()
    try:
        await sidecar.save_state()  # a directory, not a file: os.replace fails, the agent goes on
        assert (await sidecar.loop.tick(time.time())).stats.ticks >= 1
    finally:
        await sidecar.stop()


async def test_an_operators_pause_and_pins_survive_a_restart(tmp_path: Path) -> None:
    """A crash loop must not hand the knobs back to the policies the operator had stopped. A pin on a knob
    the new configuration does not bind is dropped (logged), not restored into a void."""
    cfg = _cfg(tmp_path)
    data = cfg.model_dump()
    data["gate"] = {
        "enabled": True,
        "listen_port": _free_port(),
        "upstreams": {"primary": "http://127.0.0.1:9"},
    }
    cfg = config.build(data)
    first = Sidecar(cfg, collectors=[OneValue()])
    await first.start()
    try:
        first.knobs.actuation.paused = True
        first.knobs.actuation.pins.update({"batch.max_in_flight": 24, "gpu.sm_clock_mhz": 1200.0})
    finally:
        await first.stop()
    second = Sidecar(cfg, collectors=[OneValue()])
    await second.start()
    try:
        actuation = second.knobs.actuation
        assert actuation.paused is True
        assert actuation.pins == {"batch.max_in_flight": 24}
        assert actuation.state()["paused"] is True
    finally:
        await second.stop()


def _acting(cfg: config.Config, **gate: Any) -> config.Config:
    data = _with_gate(cfg, "primary").model_dump()
    data["actuators"]["mode"] = "act"
    data["gate"].update(gate)
    return config.build(data)


async def test_the_gates_knobs_stand_where_they_stood_after_a_restart(tmp_path: Path) -> None:
    """The gate lives in the sidecar, so a restart started it at its configured limit: beside a llama.cpp
    whose slots had brought it to 8, a restart with actuation paused opened it to 64, and nothing moved
    it back while paused. Not restored when the gate's settings changed (a restart to change them)."""
    cfg = _acting(_cfg(tmp_path), max_in_flight=64)
    first = Sidecar(cfg, collectors=[OneValue()])
    await first.start()
    try:
        _, write = first.knobs.actuation.binding("batch.max_in_flight")
        await write(8)
        first.knobs.actuation.paused = True
    finally:
        await first.stop()
    second = Sidecar(cfg, collectors=[OneValue()])
    await second.start()
    try:
        assert second.knobs.gate is not None and second.knobs.gate.limit == 8
        assert second.knobs.actuation.paused is True
        [record] = [a for a in second.knobs.audit.recent(10) if a["policy"] == "restore"]
        assert (record["knob"], record["from"], record["to"]) == ("batch.max_in_flight", 64, 8)
    finally:
        await second.stop()
    # observe mode (the knobs are the configuration's there), then a changed setting: both start from it
    for changed, limit in (
        (_with_gate(_cfg(tmp_path), "primary"), 64),
        (_acting(_cfg(tmp_path), max_in_flight=32), 32),
    ):
        third = Sidecar(changed, collectors=[OneValue()])
        await third.start()
        try:
            assert third.knobs.gate is not None and third.knobs.gate.limit == limit
            assert not [a for a in third.knobs.audit.recent(10) if a["policy"] == "restore"]
        finally:
            await third.stop()


async def test_a_pin_on_an_engine_knob_survives_a_restart(
    tmp_path: Path, sim_engine: tuple[Any, str]
) -> None:
    """Engine knobs are bound once discovery has run; the state used to be restored before that, so a pin
    on one was dropped as "not bound by this configuration" at every restart."""
    _, url = sim_engine
    data = _cfg(tmp_path).model_dump()
    data.update(control={"enabled": True, "url": url}, actuators={"mode": "act"}, probe={"enabled": False})
    cfg = config.build(data)
    first = Sidecar(cfg, collectors=[OneValue()])
    await first.start()
    try:
        assert "engine.max_num_batched_tokens" in first.knobs.actuation.knobs
        first.knobs.actuation.pins["engine.max_num_batched_tokens"] = 2048
    finally:
        await first.stop()
    second = Sidecar(cfg, collectors=[OneValue()])
    await second.start()
    try:
        assert second.knobs.actuation.pins == {"engine.max_num_batched_tokens": 2048}
    finally:
        await second.stop()


async def test_a_saved_pin_outside_the_new_bounds_is_dropped_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restored pin passes the checks a new one does: the configuration may have moved the bounds."""
    data = _cfg(tmp_path).model_dump()
    data["gate"] = {
        "enabled": True,
        "listen_port": _free_port(),
        "upstreams": {"primary": "http://127.0.0.1:9"},
    }
    first = Sidecar(config.build(data), collectors=[OneValue()])
    await first.start()
    try:
        first.knobs.actuation.pins["batch.max_in_flight"] = 24
    finally:
        await first.stop()
    data["policies"]["batch_min"] = 32
    second = Sidecar(config.build(data), collectors=[OneValue()])
    await second.start()
    try:
        assert second.knobs.actuation.pins == {}
    finally:
        await second.stop()
    assert (
        "saved pin on batch.max_in_flight dropped: batch.max_in_flight must be in [32, 512], got 24"
        in caplog.text
    )


async def test_a_pin_on_an_engine_knob_waits_for_an_engine_still_loading_at_restart(tmp_path: Path) -> None:
    """The sidecar restarts while the engine is not answering yet: the saved pin is held, not dropped, and
    applies once the engine's control API answers and binds the knob."""
    import asyncio

    from aiohttp import web

    from simulator.engine import make_core
    from simulator.server import SimServer

    port = _free_port()
    data = _cfg(tmp_path).model_dump()
    data.update(
        control={"enabled": True, "url": f"http://127.0.0.1:{port}"},
        actuators={"mode": "act"},
        probe={"enabled": False},
    )
    cfg = config.build(data)

    async def engine() -> web.AppRunner:
        runner = web.AppRunner(SimServer(make_core("a100-80g", "llama-2-7b", "fp16", 256)).app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = await engine()
    first = Sidecar(cfg, collectors=[OneValue()])
    await first.start()
    try:
        first.knobs.actuation.pins["engine.max_num_batched_tokens"] = 2048
    finally:
        await first.stop()
        await runner.cleanup()  # the engine restarts too, and is slower to come back than the sidecar
    second = Sidecar(cfg, collectors=[OneValue()])
    await second.start()
    runner = None
    try:
        assert second.knobs.actuation.pins == {} and second._held_pins == {
            "engine.max_num_batched_tokens": 2048
        }
        runner = await engine()
        for _ in range(100):  # the first retry is 1 s after start
            if second.knobs.actuation.pins:
                break
            await asyncio.sleep(0.05)
        assert second.knobs.actuation.pins == {"engine.max_num_batched_tokens": 2048}
    finally:
        await second.stop()
        if runner is not None:
            await runner.cleanup()
