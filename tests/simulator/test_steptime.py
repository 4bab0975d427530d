"""The roofline step-time model."""

from __future__ import annotations

import pytest

from simulator.hardware import gpu_profile
from simulator.models import model_profile
from simulator.steptime import STEP_OVERHEAD_S, StepTimeModel


def _model(gpu: str = "a100-80g", model: str = "llama-2-7b", precision: str = "fp16") -> StepTimeModel:
    return StepTimeModel(gpu_profile(gpu), model_profile(model), precision)


def test_small_decode_is_memory_bound() -> None:
    cost = _model().cost(1, 1, 100, 101, 1410)
    assert cost.mem_s > cost.compute_s
    assert cost.duration_s == pytest.approx(cost.mem_s + STEP_OVERHEAD_S + 15e-6)


def test_large_prefill_is_compute_bound() -> None:
    cost = _model().cost(4096, 1, 0, 4096 * 4097 / 2, 1410)
    assert cost.compute_s > 5 * cost.mem_s


def test_halving_the_clock_doubles_compute_time() -> None:
    m = _model()
    fast, slow = m.cost(4096, 1, 0, 0, 1410), m.cost(4096, 1, 0, 0, 705)
    assert slow.compute_s == pytest.approx(2 * fast.compute_s)


def test_tensor_parallel_adds_communication() -> None:
    one = _model("a100-80g", "llama-3-8b").cost(1, 1, 0, 1, 1410)
    four = _model("4xa100-80g-tp", "llama-3-8b").cost(1, 1, 0, 1, 1410)
    assert four.mem_s == pytest.approx(one.mem_s / 4)
    assert four.duration_s - four.mem_s > one.duration_s - one.mem_s + 0.4e-3  # 64 all-reduces of ~8 us


def test_decode_arrays_match_single_costs() -> None:
    m = _model()
    arrays = m.decode_arrays(4, 400, 3, 1410)
    for j in range(3):
        context = 400 + 4 * j
        single = m.cost(4, 4, context, context + 4, 1410)
        assert arrays[0][j] == pytest.approx(single.duration_s)
