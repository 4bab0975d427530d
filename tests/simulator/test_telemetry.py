"""Simulated NVML and allocator memory."""

from __future__ import annotations

import pytest

from simulator.engine import make_core
from simulator.faults import FaultSwitches
from simulator.telemetry import NvmlView, memory_state

GIB = 1024**3


def test_idle_gpu_reports_idle_clock_and_reason() -> None:
    core = make_core()
    gpu = NvmlView(core).read(now=5.0)["gpus"][0]
    assert gpu["utilization_gpu_ratio"] == 0.0
    assert gpu["sm_clock_mhz"] == core.gpu.clock_min_mhz
    assert gpu["throttle_reasons"] == 0x1
    assert gpu["power_w"] == pytest.approx(core.gpu.idle_power_w)


def test_energy_integrates_idle_power() -> None:
    core = make_core()
    gpu = NvmlView(core).read(now=10.0)["gpus"][0]
    assert gpu["energy_j"] == pytest.approx(10 * core.gpu.idle_power_w)


def test_power_cap_shows_as_sw_power_cap() -> None:
    core = make_core(power_limit_w=150)
    view = NvmlView(core)
    core.submit("a", 2000, 200, now=0.0)
    while core.has_work():
        core.step(core.time)
    gpu = view.read(now=core.time)["gpus"][0]
    assert gpu["throttle_reasons"] & 0x4


def test_tensor_parallel_node_lists_every_gpu_with_distinct_uuids() -> None:
    gpus = NvmlView(make_core("4xa100-80g-tp", "llama-3-70b")).read(now=1.0)["gpus"]
    assert [g["index"] for g in gpus] == [0, 1, 2, 3]
    assert len({g["uuid"] for g in gpus}) == 4


def test_a_shared_node_runs_the_engine_on_its_last_gpus_and_idles_the_rest() -> None:
    core = make_core()
    view = NvmlView(core, node_gpus=3)
    core.submit("a", 2000, 200, now=0.0)
    while core.has_work():
        core.step(core.time)
    gpus = view.read(now=core.time)["gpus"]
    assert [g["index"] for g in gpus] == [0, 1, 2]
    assert view.engine_uuids == [gpus[2]["uuid"]]
    assert gpus[2]["processes"] and gpus[2]["utilization_gpu_ratio"] > 0
    for neighbour in gpus[:2]:
        assert neighbour["processes"] == [] and neighbour["utilization_gpu_ratio"] == 0.0
        assert neighbour["power_w"] == core.gpu.idle_power_w and neighbour["memory_used_bytes"] == 0


def test_a_node_cannot_have_fewer_gpus_than_the_engine_uses() -> None:
    with pytest.raises(ValueError, match="node_gpus"):
        NvmlView(make_core("4xa100-80g-tp", "llama-3-70b"), node_gpus=2)


def test_leak_raises_reserved_and_process_memory() -> None:
    core = make_core()
    before = memory_state(core, 0.0)
    core.set_faults(FaultSwitches(leak_bytes_per_hour=4 * GIB, leak_step_bytes=GIB), now=0.0)
    after = memory_state(core, 3600.0)
    assert after.reserved - before.reserved == pytest.approx(4 * GIB)
    assert after.process - before.process == pytest.approx(4 * GIB)


def test_fragmentation_fault_lowers_allocated_over_reserved() -> None:
    core = make_core()
    assert memory_state(core, 0.0).fragmentation_ratio < 0.05
    core.set_faults(FaultSwitches(fragmentation_ratio=0.3), now=0.0)
    assert memory_state(core, 0.0).fragmentation_ratio == pytest.approx(0.3)


@pytest.mark.parametrize("stalled_gpu", ["busy", "idle"])
def test_a_stalled_engine_reads_as_a_spinning_collective_or_an_idle_gpu(stalled_gpu: str) -> None:
    """A real NCCL hang reads 100% utilisation at the top clock, near idle power (spin kernels); a stuck
    host reads idle. The stall detector's hint tells the two apart, so the simulator shows both."""
    core = make_core("h100-sxm")
    view = NvmlView(core)
    view.read(now=0.0)
    core.set_faults(FaultSwitches(stalled=True, stalled_gpu=stalled_gpu), 0.0)
    gpu = view.read(now=5.0)["gpus"][0]
    if stalled_gpu == "busy":
        assert gpu["utilization_gpu_ratio"] == pytest.approx(1.0)
        assert gpu["sm_clock_mhz"] == core.settings.sm_clock_mhz == core.gpu.clock_max_mhz
        assert core.gpu.idle_power_w < gpu["power_w"] < 0.25 * core.settings.power_limit_w
        assert gpu["throttle_reasons"] & 0x1 == 0  # not idle
    else:
        assert gpu["utilization_gpu_ratio"] == 0.0 and gpu["throttle_reasons"] == 0x1
        assert gpu["power_w"] == pytest.approx(core.gpu.idle_power_w)
