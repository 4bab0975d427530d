"""The paged KV cache: a pool of fixed-size blocks, sized the way vLLM sizes it at start-up.

vLLM allocates the whole pool once: ``gpu_memory_utilization`` x GPU memory, less the weights and the peak
activation memory measured by a profiling forward pass; what is left is cut into blocks of
``block_size`` tokens. A sequence holds ``ceil(tokens / block_size)`` blocks. Only block *counts* matter
to timing and preemption, so the pool is a counter, not a free list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simulator.hardware import GIB, GpuProfile
from simulator.models import ModelProfile

BLOCK_SIZE = 16


def activation_reserve_bytes(model: ModelProfile, max_num_batched_tokens: int, tp: int = 1) -> float:
    """Peak activation memory per GPU of the profiling pass: a fixed 1 GiB (CUDA graphs, workspace,
    sampler) plus about 16 bytes per hidden unit per batched token (fp16 intermediates of one layer)."""
    return 1.0 * GIB + max_num_batched_tokens * model.hidden * 16.0 / tp


@dataclass(frozen=True)
class KvBudget:
    """How GPU memory (per GPU) splits at start-up; all values in bytes."""

    usable_bytes: float
    weight_bytes: float
    activation_bytes: float
    kv_pool_bytes: float
    block_bytes: float
    num_blocks: int


def kv_budget(
    gpu: GpuProfile,
    model: ModelProfile,
    precision: str,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    block_size: int = BLOCK_SIZE,
) -> KvBudget:
    """Size the block pool; raises ValueError when the weights and activations leave no room."""
    usable = gpu.memory_bytes * gpu_memory_utilization
    weights = model.weight_bytes(precision) / gpu.tp
    activations = activation_reserve_bytes(model, max_num_batched_tokens, gpu.tp)
    block_bytes = block_size * model.kv_bytes_per_token(precision) / gpu.tp
    pool = usable - weights - activations
    blocks = math.floor(pool / block_bytes) if pool > 0 else 0
    if blocks < 1:
        raise ValueError(
            f"{model.key} in {precision} does not fit on {gpu.key} at gpu_memory_utilization="
            f"{gpu_memory_utilization}: {weights / GIB:.1f} GiB weights + {activations / GIB:.1f} GiB "
            f"activations > {usable / GIB:.1f} GiB usable"
        )
    return KvBudget(usable, weights, activations, blocks * block_bytes, block_bytes, blocks)


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks a sequence of ``tokens`` tokens occupies (ceiling division)."""
    return -(-tokens // block_size)


class BlockPool:
    """Counts free and used blocks. ``allocate`` is all-or-nothing, as vLLM's block manager is."""

    __slots__ = ("num_blocks", "used")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.used = 0

    @property
    def free(self) -> int:
        return self.num_blocks - self.used

    @property
    def usage(self) -> float:
        """Share of blocks in use, 0-1 (``vllm:kv_cache_usage_perc``)."""
        return self.used / self.num_blocks

    def allocate(self, blocks: int) -> bool:
        """Take ``blocks`` blocks if all are free; return whether it happened."""
        if blocks > self.num_blocks - self.used:
            return False
        self.used += blocks
        return True

    def release(self, blocks: int) -> None:
        """Give ``blocks`` back (a finished or preempted sequence)."""
        self.used = max(0, self.used - blocks)

    def resize(self, num_blocks: int) -> None:
        """Change the pool size (a precision switch re-sizes the pool); ``used`` may exceed it until the
        scheduler preempts enough sequences."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
