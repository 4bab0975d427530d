"""FakeNvmlBackend: plausible values and the failure switches tests and the bench rely on."""

from __future__ import annotations

import pytest

from agent.collectors.nvml_backend import GpuLostError, NvmlUnavailableError
from agent.collectors.nvml_fake import FakeNvmlBackend


def _started(gpus: int = 2) -> FakeNvmlBackend:
    fake = FakeNvmlBackend(gpus)
    fake.init()
    fake.begin_round()
    return fake


def test_values_stay_in_physical_ranges_over_many_rounds() -> None:
    fake = _started(8)
    for _ in range(200):
        fake.begin_round()
        for index in range(8):
            s = fake.sample(index, slow=True)
            assert s.utilization_ratio is not None and 0.0 <= s.utilization_ratio <= 1.0
            assert s.power_watts is not None and s.power_limit_watts is not None
            assert 0.0 < s.power_watts <= s.power_limit_watts


def test_energy_counter_only_grows() -> None:
    fake = _started()
    first = fake.sample(0, slow=True).energy_joules
    fake.begin_round()
    second = fake.sample(0, slow=True).energy_joules
    assert first is not None and second is not None and second > first


def test_library_missing_fails_init() -> None:
    fake = FakeNvmlBackend(1)
    fake.library_missing = True
    with pytest.raises(NvmlUnavailableError):
        fake.init()


def test_unsupported_switch_blanks_the_field() -> None:
    fake = _started()
    fake.unsupported = {"power_watts"}
    assert fake.sample(0, slow=False).power_watts is None


def test_lost_switch_raises_for_that_gpu_only() -> None:
    fake = _started()
    fake.lost = {1}
    assert fake.sample(0, slow=False).utilization_ratio is not None
    with pytest.raises(GpuLostError):
        fake.sample(1, slow=False)
