"""NVML faults: no driver, one GPU lost, every GPU lost, and recovery. The sampler is driven by hand
(``sample_once(now)``), so no thread and no sleep are involved."""

from __future__ import annotations

from agent.collectors.nvml import NvmlCollector
from agent.collectors.nvml_fake import FakeNvmlBackend
from agent.config import NvmlConfig
from detectors.snapshot import SourceStatus


def _collector(gpus: int = 2) -> tuple[NvmlCollector, FakeNvmlBackend]:
    backend = FakeNvmlBackend(gpus)
    return NvmlCollector(NvmlConfig(backend="nvml"), backend=backend), backend


async def test_missing_driver_is_an_error_reading_not_an_exception() -> None:
    collector, backend = _collector()
    backend.library_missing = True
    assert collector.sampler is not None
    collector.sampler.sample_once(1.0)
    reading = await collector.collect(1.0)
    assert reading.status is SourceStatus.ERROR and reading.error and "\n" not in reading.error
    assert not collector.up


async def test_a_lost_gpu_is_reported_while_the_others_keep_reporting() -> None:
    collector, backend = _collector(gpus=2)
    assert collector.sampler is not None
    collector.sampler.sample_once(1.0)
    backend.lost = {1}
    collector.sampler.sample_once(1.1)
    reading = await collector.collect(1.2)
    assert reading.status is SourceStatus.OK
    assert any(k.startswith("nvml.gpu0.") for k in reading.values)
    assert "lost" in (reading.error or "")  # the problem rides along with the good values


async def test_every_gpu_lost_takes_nvml_down_with_the_reason() -> None:
    collector, backend = _collector(gpus=2)
    assert collector.sampler is not None
    collector.sampler.sample_once(1.0)
    collector.sampler.drain()
    backend.lost = {0, 1}
    collector.sampler.sample_once(1.1)
    reading = await collector.collect(1.2)
    assert reading.status is SourceStatus.ERROR and "lost" in (reading.error or "")


async def test_nvml_recovers_when_the_driver_returns() -> None:
    collector, backend = _collector()
    assert collector.sampler is not None
    backend.library_missing = True
    collector.sampler.sample_once(1.0)
    await collector.collect(1.0)
    backend.library_missing = False
    for step in range(40):  # the sampler retries init with backoff; bounded rounds of virtual time
        collector.sampler.sample_once(2.0 + step)
        if collector.up:
            collector.sampler.sample_once(2.05 + step)
            break
    reading = await collector.collect(50.0)
    assert collector.up and reading.status is SourceStatus.OK
