"""The engine's GPUs by UUID: matching, the loop subscriber, and the sidecar on a shared simulated node."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agent import config
from agent.engine_gpus import EngineGpus, indices_of
from agent.engines.launcher import free_port
from agent.sidecar import Sidecar
from agent.state import AgentState
from detectors.snapshot import Reading, Snapshot, SourceStatus


def test_indices_follow_the_probe_s_order_and_unknown_uuids_are_told_apart() -> None:
    known = {0: "GPU-aa", 1: "GPU-bb", 2: "GPU-cc", 3: ""}
    assert indices_of(["gpu-CC", "GPU-aa", "GPU-zz"], known) == ([2, 0], ["GPU-zz"])
    assert indices_of([], known) == ([], [])


class Recorder:
    def __init__(self) -> None:
        self.calls: list[Sequence[str] | None] = []

    def follow(self, uuids: Sequence[str] | None) -> None:
        self.calls.append(None if uuids is None else list(uuids))


def _state(status: SourceStatus, info: dict[str, str]) -> AgentState:
    reading = Reading("probe", 0.0, status, {"probe.reserved_bytes": 1.0}, info=info)
    return AgentState(snapshot=Snapshot.from_readings(0.0, {"probe": reading}))


def test_the_followers_hear_of_each_change_once_and_never_of_a_probe_that_is_down() -> None:
    follower = Recorder()
    gpus = EngineGpus([follower])
    gpus.on_state(AgentState())  # before the first tick
    gpus.on_state(_state(SourceStatus.ERROR, {}))
    gpus.on_state(_state(SourceStatus.NO_DATA, {}))  # model still loading
    assert follower.calls == []
    gpus.on_state(_state(SourceStatus.OK, {"gpu_uuids": "GPU-b,GPU-a"}))
    gpus.on_state(_state(SourceStatus.OK, {"gpu_uuids": "GPU-b,GPU-a"}))
    gpus.on_state(_state(SourceStatus.OK, {}))  # a probe restarted older: the last list stands
    gpus.on_state(_state(SourceStatus.OK, {"gpu_uuids": "GPU-c"}))
    assert follower.calls == [["GPU-b", "GPU-a"], ["GPU-c"]]


def test_a_probe_that_never_names_gpus_is_said_once() -> None:
    follower = Recorder()
    gpus = EngineGpus([follower])
    for _ in range(3):
        gpus.on_state(_state(SourceStatus.OK, {"pid": "7"}))
    assert follower.calls == [None]


@pytest.fixture
async def shared_node() -> Any:
    """The simulator on a node of 3 GPUs, its engine on the last one (GPU 2)."""
    from simulator.engine import make_core
    from simulator.server import SimServer

    server = SimServer(make_core("a100-80g", "llama-2-7b", "fp16", 256), node_gpus=3)
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield server, f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_on_a_shared_node_the_sidecar_watches_and_drives_only_its_engine_s_gpu(
    shared_node: tuple[Any, str], tmp_path: Path
) -> None:
    server, url = shared_node
    nvml = server.nvml.read(server.sim_now())["gpus"]
    state = tmp_path / "gpu.json"  # the simulated actuator's node: the same three GPUs, by UUID
    defaults = {"power_limit_w": 400.0, "default_power_limit_w": 400.0}
    state.write_text(json.dumps({"gpus": [{**defaults, "uuid": g["uuid"]} for g in nvml]}))
    cfg = config.build(
        {
            "agent": {"listen_port": free_port(), "admin_listen_port": None},
            "engine": {"url": url},
            "nvml": {"backend": "simulated", "simulated_url": url},
            "probe": {"enabled": True, "url": url + "/sim/probe/metrics"},
            "actuators": {
                "mode": "act",
                "gpu": "power_limit",
                "gpu_backend": "simulated",
                "gpu_state_file": str(state),
            },
            "audit": {"path": None},
            "forecast": {"enabled": False},
        }
    )
    sidecar = Sidecar(cfg)
    gpu = sidecar.knobs.gpu
    gpu.problem = None  # the simulated backend needs no privilege
    try:
        assert gpu.waiting is not None  # three GPUs seen, none named: nothing is set before the probe says
        await sidecar.loop.tick(0.0)
        assert gpu.waiting is None and gpu.indices == [2]
        assert server.nvml.engine_uuids == [nvml[2]["uuid"]]
        for t in range(1, 100):  # until the NVML sampler thread (10 Hz, real time) has samples for a tick
            await asyncio.sleep(0.1)
            await sidecar.loop.tick(float(t))
            reading = sidecar.loop.state.snapshot.readings["nvml"]
            if reading.status is SourceStatus.OK:
                break
        assert reading.info["gpus"] == "1", reading
        assert gpu.set(300) == 300
        assert [g["power_limit_w"] for g in json.loads(state.read_text())["gpus"]] == [400, 400, 300]
    finally:
        await sidecar.stop()
    assert [g["power_limit_w"] for g in json.loads(state.read_text())["gpus"]] == [400, 400, 400]
