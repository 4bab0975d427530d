"""The NVML sampler and collector, driven by ``sample_once(now)`` on the fake backend (no sleeping)."""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Sequence

import pytest

from agent.collectors.nvml import NvmlCollector, NvmlSampler, make_backend
from agent.collectors.nvml_backend import GpuSample
from agent.collectors.nvml_fake import FakeNvmlBackend
from agent.collectors.nvml_real import RealNvmlBackend
from agent.collectors.nvml_simulated import SimulatedNvmlBackend
from agent.config import ConfigError, NvmlConfig, build
from detectors.snapshot import SourceStatus


class MaxJitter(random.Random):
    """Jitter pinned to its maximum, so the backoff delays are exactly 1, 2, 4, ... seconds."""

    def random(self) -> float:
        return 1.0


def scripted(utils: Sequence[float], throttles: Sequence[int] = ()) -> FakeNvmlBackend:
    """A fake whose round ``r`` (1-based) reports ``utils[r-1]`` and ``throttles[r-1]`` on every GPU."""

    def values(gpu: int, round_no: int) -> GpuSample:
        r = round_no - 1
        return GpuSample(
            utilization_ratio=utils[r],
            power_watts=100.0 * (gpu + 1),
            memory_used_bytes=float(1000 + r),
            memory_total_bytes=8000.0,
            throttle_reasons=throttles[r] if throttles else 0,
            energy_joules=10.0 * round_no,
            power_limit_watts=700.0,
        )

    return FakeNvmlBackend(2, values=values)


def sampler_for(backend: FakeNvmlBackend, **kwargs: object) -> NvmlSampler:
    return NvmlSampler(backend, rng=MaxJitter(), **kwargs)  # type: ignore[arg-type]


def run(sampler: NvmlSampler, times: Sequence[float]) -> None:
    for now in times:
        sampler.sample_once(now)


def collector_for(backend: FakeNvmlBackend, **cfg: object) -> NvmlCollector:
    collector = NvmlCollector(NvmlConfig(backend="off", **cfg), backend=backend)  # type: ignore[arg-type]
    assert collector.sampler is not None
    collector.sampler._rng = MaxJitter()
    return collector


# -- aggregation -----------------------------------------------------------------------------------------


async def test_continuous_metric_gets_mean_max_and_last() -> None:
    collector = collector_for(scripted([0.2, 0.8, 0.5]))
    assert collector.sampler is not None
    run(collector.sampler, [0.0, 0.1, 0.2])
    values = (await collector.collect(10.0)).values
    got = [values[f"nvml.gpu0.utilization_ratio.{agg}"] for agg in ("mean", "max", "last")]
    assert got == pytest.approx([0.5, 0.8, 0.5])


async def test_sample_count_is_reported_per_gpu() -> None:
    collector = collector_for(scripted([0.1, 0.2]))
    assert collector.sampler is not None
    run(collector.sampler, [0.0, 0.1])
    values = (await collector.collect(1.0)).values
    assert (values["nvml.gpu0.samples"], values["nvml.gpu1.samples"]) == (2.0, 2.0)


async def test_memory_is_the_last_value_of_the_tick() -> None:
    collector = collector_for(scripted([0.1, 0.2, 0.3]))
    assert collector.sampler is not None
    run(collector.sampler, [0.0, 0.1, 0.2])
    values = (await collector.collect(1.0)).values
    assert (values["nvml.gpu1.memory_used_bytes"], values["nvml.gpu1.memory_total_bytes"]) == (1002.0, 8000.0)


async def test_throttle_bitmask_is_last_and_reasons_are_any_in_tick() -> None:
    collector = collector_for(scripted([0.1, 0.2], throttles=[0x04, 0x00]))
    assert collector.sampler is not None
    run(collector.sampler, [0.0, 0.1])
    values = (await collector.collect(1.0)).values
    assert values["nvml.gpu0.throttle_reasons"] == 0.0
    assert (values["nvml.gpu0.throttle.sw_power_cap"], values["nvml.gpu0.throttle.hw_slowdown"]) == (1.0, 0.0)


async def test_drain_starts_a_fresh_tick() -> None:
    collector = collector_for(scripted([0.9, 0.1]))
    assert collector.sampler is not None
    run(collector.sampler, [0.0])
    await collector.collect(1.0)
    run(collector.sampler, [0.1])
    values = (await collector.collect(2.0)).values
    assert (values["nvml.gpu0.samples"], values["nvml.gpu0.utilization_ratio.max"]) == (1.0, 0.1)


async def test_non_finite_sample_is_skipped_not_averaged() -> None:
    collector = collector_for(scripted([0.5, math.nan, math.inf]))
    assert collector.sampler is not None
    run(collector.sampler, [0.0, 0.1, 0.2])
    values = (await collector.collect(1.0)).values
    assert values["nvml.gpu0.utilization_ratio.mean"] == 0.5


async def test_unsupported_field_is_absent_and_others_remain() -> None:
    backend = FakeNvmlBackend(1)
    backend.unsupported = {"power_watts"}
    collector = collector_for(backend)
    assert collector.sampler is not None
    run(collector.sampler, [0.0])
    values = (await collector.collect(1.0)).values
    assert "nvml.gpu0.power_watts.mean" not in values
    assert "nvml.gpu0.temperature_celsius.mean" in values


# -- cadences -------------------------------------------------------------------------------------------


def test_energy_is_read_at_most_once_per_energy_interval() -> None:
    backend = scripted([0.5] * 11)
    sampler = sampler_for(backend, energy_interval_s=1.0)
    run(sampler, [i / 10 for i in range(11)])  # 0.0 .. 1.0 s
    assert sampler.drain().gpus[0].energy_joules == 110.0  # read at round 1 (t=0) and round 11 (t=1.0)


async def test_slow_values_carry_over_into_ticks_without_a_slow_read() -> None:
    collector = collector_for(scripted([0.5, 0.5]))
    assert collector.sampler is not None
    run(collector.sampler, [0.0])
    await collector.collect(1.0)
    run(collector.sampler, [0.1])  # not a slow round
    values = (await collector.collect(2.0)).values
    assert (values["nvml.gpu0.energy_joules"], values["nvml.gpu0.power_limit_watts"]) == (10.0, 700.0)


def test_processes_are_read_at_most_once_per_process_interval() -> None:
    backend = FakeNvmlBackend(2)
    sampler = sampler_for(backend, process_interval_s=1.0)
    run(sampler, [i / 10 for i in range(20)])  # 0.0 .. 1.9 s
    assert backend.process_calls == 2 * 2  # at t=0 and t=1.0, on each of 2 GPUs


async def test_process_memory_is_named_by_pid() -> None:
    backend = FakeNvmlBackend(1)
    backend.processes_by_gpu = {0: {4242: 123}}
    collector = collector_for(backend)
    assert collector.sampler is not None
    run(collector.sampler, [0.0])
    assert (await collector.collect(1.0)).values["nvml.gpu0.process_used_bytes.pid4242"] == 123.0


# -- failures ---------------------------------------------------------------------------------------------


async def test_missing_library_gives_an_error_reading_and_up_false() -> None:
    backend = FakeNvmlBackend(1)
    backend.library_missing = True
    collector = collector_for(backend)
    assert collector.sampler is not None
    run(collector.sampler, [0.0])
    reading = await collector.collect(1.0)
    assert (reading.status, collector.up) == (SourceStatus.ERROR, False)
    assert reading.error is not None and "Library Not Found" in reading.error


def test_missing_library_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    backend = FakeNvmlBackend(1)
    backend.library_missing = True
    with caplog.at_level(logging.INFO, logger="agent.collectors.nvml"):
        run(sampler_for(backend), [float(t) for t in range(20)])
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_init_is_retried_with_exponential_backoff() -> None:
    backend = FakeNvmlBackend(1)
    backend.library_missing = True
    run(sampler_for(backend), [i / 10 for i in range(100)])  # 0.0 .. 9.9 s
    assert backend.init_calls == 4  # t = 0, 1, 3, 7 (delays 1, 2, 4)


def test_backend_recovers_after_the_driver_returns() -> None:
    backend = FakeNvmlBackend(1)
    backend.library_missing = True
    sampler = sampler_for(backend)
    run(sampler, [0.0])
    backend.library_missing = False
    run(sampler, [0.5, 1.0])
    assert (sampler.up, sampler.rounds) == (True, 1)


def test_backend_lost_mid_run_goes_down_and_shuts_nvml_down() -> None:
    backend = FakeNvmlBackend(1)
    sampler = sampler_for(backend)
    run(sampler, [0.0])
    backend.library_missing = True
    run(sampler, [0.1])
    assert (sampler.up, backend.shutdown_calls) == (False, 1)


async def test_lost_gpu_stops_alone_and_is_reported() -> None:
    backend = FakeNvmlBackend(2)
    collector = collector_for(backend)
    assert collector.sampler is not None
    backend.lost = {1}
    run(collector.sampler, [0.0, 0.1])
    reading = await collector.collect(1.0)
    assert reading.status is SourceStatus.OK and "nvml.gpu0.samples" in reading.values
    assert not any(name.startswith("nvml.gpu1.") for name in reading.values)
    assert reading.error is not None and "gpu1" in reading.error


def test_every_gpu_lost_reinitialises_to_rediscover_them() -> None:
    backend = FakeNvmlBackend(1)
    sampler = sampler_for(backend)
    backend.lost = {0}
    run(sampler, [0.0])
    backend.lost = set()
    run(sampler, [1.0])
    assert (sampler.up, backend.init_calls, sampler.drain().gpus[0].acc.samples) == (True, 2, 1)


def test_unexpected_backend_exception_never_escapes() -> None:
    def broken(gpu: int, round_no: int) -> GpuSample:
        raise ZeroDivisionError("bug")

    sampler = sampler_for(FakeNvmlBackend(1, values=broken))
    run(sampler, [0.0])
    assert sampler.up is False and sampler.error is not None and "ZeroDivisionError" in sampler.error


async def test_collect_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    collector = collector_for(FakeNvmlBackend(1))
    assert collector.sampler is not None

    def explode() -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(collector.sampler, "drain", explode)
    reading = await collector.collect(1.0)
    assert (reading.status, reading.error) == (SourceStatus.ERROR, "RuntimeError: boom")


async def test_tick_without_samples_is_no_data() -> None:
    collector = collector_for(FakeNvmlBackend(1))
    assert collector.sampler is not None
    run(collector.sampler, [0.0])
    await collector.collect(1.0)
    assert (await collector.collect(2.0)).status is SourceStatus.NO_DATA


# -- configuration ----------------------------------------------------------------------------------------


async def test_configured_gpus_limit_what_is_watched() -> None:
    collector = collector_for(FakeNvmlBackend(2), gpus=(1,))
    assert collector.sampler is not None
    run(collector.sampler, [0.0])
    values = (await collector.collect(1.0)).values
    assert "nvml.gpu1.samples" in values and "nvml.gpu0.samples" not in values


async def test_the_engine_s_gpus_named_by_uuid_are_watched_alone_and_kept_after_a_reinit() -> None:
    collector = collector_for(FakeNvmlBackend(4))
    sampler = collector.sampler
    assert sampler is not None
    run(sampler, [0.0])
    sampler.follow(["GPU-FAKE-0003", "gpu-fake-0001"])  # as the probe names them, any case
    run(sampler, [0.1])
    reading = await collector.collect(1.0)
    watched = {key.split(".")[1] for key in reading.values if key.endswith(".samples")}
    assert watched == {"gpu1", "gpu3"} and reading.info["gpus"] == "2"
    sampler.backend.library_missing = True  # type: ignore[attr-defined]
    run(sampler, [0.2])
    sampler.backend.library_missing = False  # type: ignore[attr-defined]
    run(sampler, [100.0, 100.1])  # past the backoff: initialised afresh
    watched = {k.split(".")[1] for k in (await collector.collect(101.0)).values if k.endswith(".samples")}
    assert watched == {"gpu1", "gpu3"}


async def test_named_gpus_win_over_the_engine_s_and_unknown_uuids_change_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    named = collector_for(FakeNvmlBackend(3), gpus=(0,))
    unknown = collector_for(FakeNvmlBackend(3))
    for collector in (named, unknown):
        assert collector.sampler is not None
        run(collector.sampler, [0.0])
        with caplog.at_level(logging.WARNING):
            collector.sampler.follow(["GPU-fake-0002"] if collector is named else ["GPU-elsewhere"])
        run(collector.sampler, [0.1])
    assert "nvml.gpu2.samples" not in (await named.collect(1.0)).values
    assert (await unknown.collect(1.0)).info["gpus"] == "3"
    assert "GPU-elsewhere are not among those this container sees; watching every GPU" in caplog.text


async def test_configured_gpu_that_is_absent_is_an_error() -> None:
    collector = collector_for(FakeNvmlBackend(2), gpus=(5,))
    assert collector.sampler is not None
    run(collector.sampler, [0.0])
    reading = await collector.collect(1.0)
    assert reading.status is SourceStatus.ERROR and "gpu5: not present" in str(reading.error)


async def test_backend_off_reports_no_data_and_down() -> None:
    collector = NvmlCollector(NvmlConfig(backend="off"))
    collector.start()
    reading = await collector.collect(1.0)
    assert (reading.status, collector.up, collector.gpu_info) == (SourceStatus.NO_DATA, False, ())


def test_gpu_info_names_each_gpu_after_init() -> None:
    collector = collector_for(FakeNvmlBackend(2, driver_version="560.35.03"))
    assert collector.sampler is not None
    run(collector.sampler, [0.0])
    assert [(g.index, g.driver_version) for g in collector.gpu_info] == [(0, "560.35.03"), (1, "560.35.03")]


async def test_the_reading_names_the_watched_gpus_model() -> None:
    """What learned figures belong to (detectors/serving_setup.py)."""
    collector = collector_for(FakeNvmlBackend(2))
    assert collector.sampler is not None
    run(collector.sampler, [0.0])
    assert (await collector.collect(1.0)).info["gpu_names"] == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    ("backend", "kind"), [("nvml", RealNvmlBackend), ("simulated", SimulatedNvmlBackend), ("off", type(None))]
)
def test_make_backend_builds_exactly_the_configured_one(backend: str, kind: type) -> None:
    assert type(make_backend(NvmlConfig(backend=backend))) is kind  # type: ignore[arg-type]


def test_config_rejects_a_simulated_url_without_scheme() -> None:
    with pytest.raises(ConfigError, match=r"nvml\.simulated_url must start with http://"):
        build({"nvml": {"simulated_url": "127.0.0.1:8000"}})


def test_config_rejects_duplicate_gpu_indices() -> None:
    with pytest.raises(ConfigError, match=r"nvml\.gpus must be distinct GPU indices"):
        build({"nvml": {"gpus": [0, 0]}})


# -- the thread ----------------------------------------------------------------------------------------------


class SignallingFake(FakeNvmlBackend):
    def __init__(self) -> None:
        super().__init__(1)
        self.sampled = threading.Event()

    def begin_round(self) -> None:
        super().begin_round()
        self.sampled.set()


async def test_thread_samples_and_close_stops_it_and_shuts_down() -> None:
    backend = SignallingFake()
    collector = collector_for(backend)
    collector.start()
    assert backend.sampled.wait(5.0)
    await collector.close()
    assert collector.sampler is not None and collector.sampler._thread is None
    assert (backend.shutdown_calls, collector.up) == (1, False)


async def test_restart_after_close_initialises_again() -> None:
    backend = FakeNvmlBackend(1)
    collector = collector_for(backend)
    assert collector.sampler is not None
    run(collector.sampler, [0.0])
    await collector.close()
    run(collector.sampler, [0.1])
    assert (backend.init_calls, collector.up) == (2, True)


async def test_real_backend_without_driver_is_a_clear_error_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pynvml

    def no_library() -> None:
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    collector = NvmlCollector(NvmlConfig(backend="nvml"))
    assert collector.sampler is not None
    collector.sampler.sample_once(0.0)
    reading = await collector.collect(1.0)
    assert (reading.status, collector.up) == (SourceStatus.ERROR, False)
    assert reading.error == (
        "NVML init failed: NVML Shared Library Not Found "
        "(no NVIDIA driver on this node? set nvml.backend to simulated or off)"
    )
