"""The GPU actuator on the simulated backend: permission, clamping, lease lapse, SIGTERM restore."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.actuators.gpu import GpuActuator
from agent.actuators.gpu_backend import GpuControlError, SimulatedGpuBackend, permission_problem
from agent.config import ActuatorConfig

ROOT = Path(__file__).resolve().parents[3]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _actuator(
    kind: str = "power_limit", problem: str | None = None, registry: CollectorRegistry | None = None
) -> tuple[GpuActuator, SimulatedGpuBackend, Clock]:
    backend, clock = SimulatedGpuBackend(count=2), Clock()
    cfg = ActuatorConfig(mode="act", gpu=kind, gpu_backend="simulated", gpu_lease_s=10)  # type: ignore[arg-type]
    actuator = GpuActuator(
        cfg, backend, registry or CollectorRegistry(), clock=clock, permission=lambda: problem, watchdog=False
    )
    return actuator, backend, clock


def test_power_limit_is_set_on_every_gpu() -> None:
    actuator, backend, _ = _actuator()
    assert actuator.set(300) == 300
    assert [backend.power_limit_w(i) for i in (0, 1)] == [300, 300]


def test_values_are_clamped_to_the_gpu_bounds() -> None:
    actuator, backend, _ = _actuator()
    assert actuator.set(20) == 100 and backend.power_limit_w(0) == 100


def test_without_permission_set_raises_one_line_and_the_gauge_is_0() -> None:
    registry = CollectorRegistry()
    actuator, backend, _ = _actuator(problem="needs root or CAP_SYS_ADMIN", registry=registry)
    with pytest.raises(GpuControlError, match="CAP_SYS_ADMIN"):
        actuator.set(300)
    assert backend.power_limit_w(0) == 400
    labels = {"actuator": "gpu_power_limit_w"}
    assert registry.get_sample_value("servepilot_actuator_permitted", labels) == 0


def test_permission_check_reads_cap_sys_admin() -> None:
    assert permission_problem(euid=0) is None
    assert permission_problem(euid=1000, status_text="CapEff:\t0000000000200000\n") is None
    assert "CAP_SYS_ADMIN" in (permission_problem(euid=1000, status_text="CapEff:\t0000000000000000\n") or "")


def test_lapsed_lease_restores_the_default() -> None:
    actuator, backend, clock = _actuator()
    actuator.set(250)
    clock.t += 9.9
    assert not actuator.check() and backend.power_limit_w(0) == 250
    clock.t += 0.1
    assert actuator.check() and backend.power_limit_w(0) == 400


def test_renewal_keeps_the_setting() -> None:
    actuator, backend, clock = _actuator()
    actuator.set(250)
    for _ in range(5):
        clock.t += 6
        actuator.renew()
        assert not actuator.check()
    assert backend.power_limit_w(1) == 250


def test_locked_clocks_are_set_and_reset() -> None:
    actuator, backend, _ = _actuator("locked_clocks")
    actuator.set(1005)
    assert backend.locked_max_clock_mhz(0) == 1005
    actuator.close()
    assert backend.locked_max_clock_mhz(0) is None


def test_sigterm_restores_the_simulated_gpus_power_limit(tmp_path: Path) -> None:
    state = tmp_path / "gpu.json"
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("gpu_holder.py")), str(state)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "set"
        assert [g["power_limit_w"] for g in SimulatedGpuBackend.read_state(state)] == [250, 250]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
        assert [g["power_limit_w"] for g in SimulatedGpuBackend.read_state(state)] == [400, 400]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("missing_dir", "No such file or directory"),
        ("not_json", "Expecting value"),
        ("not_ours", "unexpected keyword argument 'bogus'"),
    ],
)
def test_an_unusable_simulated_state_file_is_a_config_error_naming_the_field(
    tmp_path: Path, setup: str, reason: str
) -> None:
    """Before: a missing directory stopped `servepilot run` with exit 1 and no field named, and a file
    that was not the state's JSON with a traceback."""
    from agent.actuators.gpu import backend_for
    from agent.config import ActuatorConfig, ConfigError

    path = tmp_path / "gpu.json"
    if setup == "missing_dir":
        path = tmp_path / "no" / "gpu.json"
    elif setup == "not_json":
        path.write_text("not json")
    else:
        path.write_text('{"gpus": [{"bogus": 1}]}')
    cfg = ActuatorConfig(gpu="power_limit", gpu_backend="simulated", gpu_state_file=str(path))
    with pytest.raises(ConfigError) as info:
        backend_for(cfg)
    message = str(info.value)
    assert message.startswith(f"actuators.gpu_state_file {str(path)!r} cannot be used as the simulated GPU")
    assert reason in message and "\n" not in message


def test_naming_no_gpu_drives_every_visible_one_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """On a node shared by several pods, a sidecar that sees every GPU (docs/deploy.md) would otherwise
    drive its neighbours' GPUs without a word."""
    with caplog.at_level("WARNING", logger="agent.actuators.gpu"):
        actuator, backend, _ = _actuator()
    assert actuator.drives_every_visible_gpu and actuator.indices == [0, 1]
    assert "drives all the GPUs this container sees (GPUs 0, 1)" in caplog.text
    caplog.clear()
    cfg = ActuatorConfig(mode="act", gpu="power_limit", gpu_backend="simulated", gpus=(1,))
    with caplog.at_level("WARNING", logger="agent.actuators.gpu"):
        named = GpuActuator(cfg, backend, CollectorRegistry(), permission=lambda: None, watchdog=False)
    assert not named.drives_every_visible_gpu and caplog.text == ""
    named.set(250)
    assert [backend.power_limit_w(i) for i in (0, 1)] == [400, 250]


def test_a_named_gpu_the_container_does_not_see_is_a_config_error_naming_the_field() -> None:
    from agent.config import ConfigError

    cfg = ActuatorConfig(mode="act", gpu="power_limit", gpu_backend="simulated", gpus=(1, 3))
    expected = r"^actuators\.gpus names GPU 3, but this container sees GPUs 0, 1$"
    with pytest.raises(ConfigError, match=expected):
        GpuActuator(cfg, SimulatedGpuBackend(count=2), CollectorRegistry(), watchdog=False)


def test_gpu_indices_must_be_distinct_and_not_negative() -> None:
    from agent.config import ConfigError, build

    for gpus in ([1, 1], [-1]):
        with pytest.raises(ConfigError, match=r"actuators\.gpus must be distinct GPU indices >= 0"):
            build({"actuators": {"gpus": gpus}})


def _node(count: int = 3) -> SimulatedGpuBackend:
    """A node with ``count`` GPUs, each with a UUID as NVML writes it."""
    backend = SimulatedGpuBackend(count=count)
    for index, gpu in enumerate(backend.gpus):
        gpu.uuid = f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd"
    return backend


def _following(
    backend: SimulatedGpuBackend, registry: CollectorRegistry | None = None, **cfg: object
) -> GpuActuator:
    config = ActuatorConfig(mode="act", gpu="power_limit", gpu_backend="simulated", **cfg)  # type: ignore[arg-type]
    return GpuActuator(
        config,
        backend,
        registry or CollectorRegistry(),
        permission=lambda: None,
        watchdog=False,
        follow_engine=True,
    )


def test_with_the_probe_on_nothing_is_set_until_it_names_the_engine_s_gpus() -> None:
    backend, registry = _node(), CollectorRegistry()
    actuator = _following(backend, registry)
    waiting = {"actuator": "gpu_power_limit_w"}
    assert actuator.waiting and "GPUs 0, 1, 2" in actuator.waiting
    assert registry.get_sample_value("servepilot_actuator_waiting", waiting) == 1
    with pytest.raises(GpuControlError, match="waiting for the allocator probe"):
        actuator.set(250)
    backend.set_power_limit_w(0, 150)  # a neighbour's setting: not this engine's knob value
    assert actuator.current() is None
    backend.set_power_limit_w(0, 400)
    actuator.follow([backend.gpus[2].uuid.upper(), backend.gpus[1].uuid])
    assert actuator.current() == 400
    assert actuator.waiting is None and actuator.indices == [2, 1]
    assert registry.get_sample_value("servepilot_actuator_waiting", waiting) == 0
    actuator.set(250)
    assert [backend.power_limit_w(i) for i in (0, 1, 2)] == [400, 250, 250]


def test_a_gpu_the_engine_leaves_gets_its_default_back_and_one_it_joins_the_setting() -> None:
    backend = _node()
    actuator = _following(backend)
    actuator.follow([backend.gpus[0].uuid, backend.gpus[1].uuid])
    actuator.set(250)
    actuator.follow([backend.gpus[1].uuid, backend.gpus[2].uuid])
    assert [backend.power_limit_w(i) for i in (0, 1, 2)] == [400, 250, 250]
    assert actuator.restore()
    assert [backend.power_limit_w(i) for i in (0, 1, 2)] == [400, 400, 400]


def test_engine_gpus_this_container_does_not_see_stop_the_actuator_and_put_back_what_it_set() -> None:
    backend = _node()
    actuator = _following(backend)
    actuator.follow([backend.gpus[0].uuid])
    actuator.set(250)
    actuator.follow(["GPU-99999999-aaaa-bbbb-cccc-dddddddddddd"])
    assert backend.power_limit_w(0) == 400
    with pytest.raises(GpuControlError, match="are not among the GPUs 0, 1, 2 this container sees"):
        actuator.set(250)


def test_a_probe_that_cannot_name_the_gpus_ends_the_wait_on_every_gpu_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = _node()
    actuator = _following(backend)
    with caplog.at_level("WARNING", logger="agent.actuators.gpu"):
        actuator.follow(None)
    assert "drives all the GPUs this container sees (GPUs 0, 1, 2)" in caplog.text
    assert actuator.drives_every_visible_gpu and actuator.set(250) == 250
    assert [backend.power_limit_w(i) for i in (0, 1, 2)] == [250, 250, 250]


def test_gpus_an_operator_named_are_not_moved_by_the_probe() -> None:
    backend = _node()
    actuator = _following(backend, gpus=(0,))
    assert actuator.waiting is None
    actuator.follow([backend.gpus[2].uuid])
    actuator.set(250)
    assert [backend.power_limit_w(i) for i in (0, 1, 2)] == [250, 400, 400]


def test_one_visible_gpu_needs_no_probe_to_say_which() -> None:
    actuator = _following(_node(1))
    assert actuator.waiting is None and actuator.set(250) == 250


def test_the_nvml_backend_reads_each_gpu_s_uuid_as_nvml_writes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    from agent.actuators.gpu_backend import NvmlGpuBackend

    def uuid(handle: str) -> bytes | str:
        if handle == "h2":
            raise pynvml.NVMLError_GpuIsLost()
        return {"h0": b"GPU-aa", "h1": "GPU-bb"}[handle]  # bytes from older nvidia-ml-py releases

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 3)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: f"h{i}")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", uuid)
    backend = NvmlGpuBackend()
    assert [backend.gpu_uuid(i) for i in (0, 1)] == ["GPU-aa", "GPU-bb"]
    with pytest.raises(GpuControlError, match=r"^gpu2: read UUID: "):
        backend.gpu_uuid(2)


def test_gpus_with_no_uuid_cannot_be_matched_so_the_probe_s_names_end_no_drive() -> None:
    # a simulated GPU without a UUID beside a simulator whose probe names its own: not a miss
    backend = SimulatedGpuBackend(count=1)
    actuator = _following(backend)
    actuator.follow(["GPU-f5c182c2-0829-5e50-8dd0-35435c8696a5"])
    assert actuator.waiting is None and actuator.indices == [0]
    assert actuator.current() == 400 and actuator.set(250) == 250
    several = _following(SimulatedGpuBackend(count=2))
    assert several.waiting  # several GPUs, none named: waits for the probe
    several.follow(["GPU-f5c182c2-0829-5e50-8dd0-35435c8696a5"])
    assert several.waiting is None and several.drives_every_visible_gpu and several.indices == [0, 1]
