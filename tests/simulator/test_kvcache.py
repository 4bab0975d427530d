"""KV pool sizing and block accounting."""

from __future__ import annotations

import pytest

from simulator.hardware import GIB, gpu_profile
from simulator.kvcache import BlockPool, blocks_for, kv_budget
from simulator.models import model_profile


def test_pool_is_memory_times_utilisation_minus_weights_and_activations() -> None:
    gpu, model = gpu_profile("a100-80g"), model_profile("llama-2-7b")
    budget = kv_budget(gpu, model, "fp16", 0.9, 8192)
    expected = 80 * GIB * 0.9 - 6.74e9 * 2 - budget.activation_bytes
    assert budget.kv_pool_bytes == pytest.approx(expected, abs=budget.block_bytes)
    assert budget.block_bytes == 16 * 2 * 32 * 32 * 128 * 2  # 16 tokens x 512 KiB


def test_tensor_parallel_splits_weights_and_kv_across_ranks() -> None:
    budget = kv_budget(gpu_profile("4xa100-80g-tp"), model_profile("llama-3-70b"), "fp16", 0.9, 8192)
    assert budget.weight_bytes == pytest.approx(70.6e9 * 2 / 4)
    assert budget.num_blocks > 10_000


def test_blocks_round_up() -> None:
    assert [blocks_for(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(10)
    assert pool.allocate(8)
    assert not pool.allocate(3)
    assert pool.used == 8 and pool.free == 2


def test_release_never_goes_negative() -> None:
    pool = BlockPool(4)
    pool.release(3)
    assert pool.used == 0 and pool.usage == 0.0
