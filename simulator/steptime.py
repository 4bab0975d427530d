"""Roofline step time: how long one engine iteration (one forward pass over the batch) takes.

For a step that computes ``T`` new tokens for ``n`` sequences whose attention reads ``C`` context tokens
in total (``P`` query-context pairs), on each of ``tp`` ranks::

    bytes  = W / tp + kv * (C + T) / tp                       weights once, KV read and written
    flops  = (2 N T + a P) / tp                               matmuls + attention (a = 4 L H d)
    t_mem  = bytes / (B * eta_mem * min(1, f / f_knee))       HBM streaming; starves at low SM clock
    t_comp = flops / (F[precision] * eta_c * f / f_max)       tensor cores scale with the SM clock
    t      = max(t_mem, t_comp) + t0 + t_seq * n + t_comm     t_comm: 2 all-reduces per layer under TP

``eta_mem`` and ``eta_c`` are the achieved fractions of datasheet bandwidth and FLOPs that well-tuned
kernels reach (about 0.88 for weight-streaming GEMV, 0.6-0.72 for large GEMMs); ``t0`` is the fixed
per-step cost CUDA graphs leave (launch, scheduler, sampler) and ``t_seq`` the per-sequence part of it.
The result is a decode that is memory-bound at small batch and compute-bound at large batch, which is
the shape real engines show.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from simulator.hardware import GpuProfile
from simulator.models import ModelProfile

DecodeArrays = tuple[npt.NDArray[np.float64], ...]

ETA_MEM = 0.88
ETA_COMPUTE = {"fp16": 0.72, "bf16": 0.72, "fp8": 0.62}
#: Weight-only fp8 (no native fp8 tensor cores) pays for dequantisation inside the GEMM.
ETA_WEIGHT_ONLY = 0.6
KNEE_CLOCK_SHARE = 0.55
STEP_OVERHEAD_S = 0.35e-3
PER_SEQ_OVERHEAD_S = 15e-6


@dataclass(frozen=True)
class StepCost:
    """One step's roofline terms; ``mem_share`` is the HBM-bandwidth share used while it runs."""

    duration_s: float
    mem_s: float
    compute_s: float
    bytes_moved: float
    flops: float

    @property
    def compute_share(self) -> float:
        """How compute-bound the step is (1 = tensor cores are the limit), for the power model."""
        busy = self.duration_s
        return min(1.0, self.compute_s / busy) if busy > 0 else 0.0

    @property
    def mem_share(self) -> float:
        busy = self.duration_s
        return min(1.0, self.mem_s / busy) if busy > 0 else 0.0


class StepTimeModel:
    """Step time of one model in one precision on one GPU profile; cheap to call in the hot loop."""

    def __init__(self, gpu: GpuProfile, model: ModelProfile, precision: str) -> None:
        self.gpu = gpu
        self.model = model
        self.precision = precision
        tp = gpu.tp
        self._weights = model.weight_bytes(precision) / tp
        self._kv = model.kv_bytes_per_token(precision) / tp
        self._lin = model.linear_flops_per_token() / tp
        self._attn = model.attention_flops_per_pair() / tp
        eta = ETA_COMPUTE[precision] if gpu.supports_native(precision) else ETA_WEIGHT_ONLY
        self._flops_peak = gpu.flops(precision) * eta
        self._bw_peak = gpu.bandwidth_bps * ETA_MEM
        self._knee = gpu.clock_max_mhz * KNEE_CLOCK_SHARE
        self._fmax = gpu.clock_max_mhz
        if tp > 1:
            # Ring all-reduce moves 2 (tp-1)/tp of the fp16 activations over a link, twice per layer.
            self._comm_per_token = (
                2 * model.layers * 2 * (tp - 1) / tp * model.hidden * 2 / gpu.link_bandwidth_bps
            )
            self._comm_fixed = 2 * model.layers * gpu.link_latency_s
        else:
            self._comm_per_token = 0.0
            self._comm_fixed = 0.0

    def _rates(self, clock_mhz: float) -> tuple[float, float]:
        bandwidth = self._bw_peak * min(1.0, clock_mhz / self._knee)
        flops = self._flops_peak * clock_mhz / self._fmax
        return bandwidth, flops

    def cost(
        self, new_tokens: int, num_seqs: int, context_tokens: float, pairs: float, clock_mhz: float
    ) -> StepCost:
        """Cost of one step.

        ``context_tokens``: KV tokens already in the cache that attention reads (sum over sequences);
        ``pairs``: (query, key) pairs attention computes, sum of ``new * (cached + (new + 1) / 2)``.
        """
        bandwidth, flops_rate = self._rates(clock_mhz)
        moved = self._weights + self._kv * (context_tokens + new_tokens)
        flops = self._lin * new_tokens + self._attn * pairs
        t_mem = moved / bandwidth
        t_comp = flops / flops_rate
        extra = STEP_OVERHEAD_S + PER_SEQ_OVERHEAD_S * num_seqs
        if self._comm_fixed:
            extra += self._comm_fixed + self._comm_per_token * new_tokens
        return StepCost(max(t_mem, t_comp) + extra, t_mem, t_comp, moved, flops)

    def decode_arrays(
        self, num_seqs: int, context_tokens: float, steps: int, clock_mhz: float
    ) -> DecodeArrays:
        """Per-step terms of ``steps`` consecutive pure-decode steps of ``num_seqs`` sequences whose
        summed context starts at ``context_tokens`` and grows by ``num_seqs`` each step, vectorised so a
        replay can skip across stretches where nothing but decoding happens. Returns (durations, t_mem,
        t_comp, bytes, flops), one entry per step."""
        bandwidth, flops_rate = self._rates(clock_mhz)
        ctx = context_tokens + num_seqs * np.arange(steps, dtype=np.float64)
        moved = self._weights + self._kv * (ctx + num_seqs)
        flops = self._lin * num_seqs + self._attn * (ctx + num_seqs)
        t_mem = moved / bandwidth
        t_comp = flops / flops_rate
        extra = STEP_OVERHEAD_S + PER_SEQ_OVERHEAD_S * num_seqs
        if self._comm_fixed:
            extra += self._comm_fixed + self._comm_per_token * num_seqs
        return np.maximum(t_mem, t_comp) + extra, t_mem, t_comp, moved, flops

    @staticmethod
    def summarise(arrays: DecodeArrays, steps: int) -> StepCost:
        """One :class:`StepCost` for the first ``steps`` entries of :meth:`decode_arrays`."""
        if steps == 1:  # the common case (a power-limit check on the first step): no reductions
            durations, t_mem, t_comp, moved, flops = (a[0] for a in arrays)
        else:
            durations, t_mem, t_comp, moved, flops = (a[:steps].sum() for a in arrays)
        return StepCost(float(durations), float(t_mem), float(t_comp), float(moved), float(flops))
