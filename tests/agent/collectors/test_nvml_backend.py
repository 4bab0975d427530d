"""The backend value types: throttle-reason table and decoding."""

from __future__ import annotations

import pynvml
import pytest

from agent.collectors.nvml_backend import THROTTLE_REASONS, GpuLostError, decode_throttle_reasons


@pytest.mark.parametrize(("bit", "name"), THROTTLE_REASONS)
def test_throttle_bits_match_the_nvml_abi(bit: int, name: str) -> None:
    camel = "".join(part.capitalize() for part in name.split("_"))
    assert getattr(pynvml, f"nvmlClocksEventReason{camel}") == bit


def test_decode_names_each_set_bit_in_table_order() -> None:
    assert decode_throttle_reasons(0x24) == ("sw_power_cap", "sw_thermal_slowdown")


def test_decode_ignores_unknown_bits() -> None:
    assert decode_throttle_reasons(0x1000 | 0x1) == ("gpu_idle",)


def test_gpu_lost_message_names_the_gpu() -> None:
    error = GpuLostError(3, "GPU is lost")
    assert (str(error), error.index) == ("gpu3: GPU is lost", 3)
