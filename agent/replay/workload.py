"""Turn a trace file into the replay's workload: arrival times and token lengths, scaled and clipped.

Per-request traces (Azure 2023 CSV, Mooncake JSONL) come from :func:`agent.traces.read_requests`; their
rate is scaled by compressing time (``t / rate_scale``), the usual way replay tools speed a trace up.
Count series (``timestamp,count``, the Azure 2024 10-s week) carry no lengths: each bin's count times
``rate_scale`` is drawn as a Poisson number of arrivals spread uniformly over the bin, and each request
takes the (prompt, output) pair of a random row of a per-request ``lengths`` trace, so the week keeps its
real arrival shape and the 2023 service's real length mix. Mooncake stamps arrivals on ~3-s ticks; those
requests are spread uniformly over their tick, as the dataset's notes advise. Prompts longer than the
model's context are clipped (the engine would refuse them; clipping keeps the arrival pattern).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from agent.traces import COUNT_KINDS, TraceError, read_counts, read_requests, trace_kind

#: Mooncake quantises arrivals to ticks of about this many seconds.
MOONCAKE_TICK_S = 3.0


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival: ``arrivals`` (s from 0), ``prompts`` and ``outputs`` (tokens)."""

    name: str
    arrivals: NDArray[np.float64]
    prompts: NDArray[np.int64]
    outputs: NDArray[np.int64]
    clipped: int = 0

    def __len__(self) -> int:
        return int(self.arrivals.size)

    @property
    def duration_s(self) -> float:
        return float(self.arrivals[-1]) if self.arrivals.size else 0.0

    def until(self, duration_s: float) -> Workload:
        """The requests arriving in the first ``duration_s`` seconds."""
        return self.between(0.0, duration_s)

    def between(self, start_s: float, end_s: float = float("inf")) -> Workload:
        """The requests arriving in ``[start_s, end_s)``, re-timed so that ``start_s`` is 0 (a window such
        as the peak hours of a week; the span then runs from the window's start)."""
        keep = (self.arrivals >= start_s) & (self.arrivals < end_s)
        arrivals = self.arrivals[keep] - start_s
        return Workload(self.name, arrivals, self.prompts[keep], self.outputs[keep], self.clipped)


#: What a trace file's name ends with, as the folder hint lists them.
TRACE_SUFFIXES = (".csv", ".jsonl", ".csv.gz", ".jsonl.gz")


def load(
    path: str | Path,
    *,
    rate_scale: float = 1.0,
    max_model_len: int,
    lengths: str | Path | None = None,
    seed: int = 0,
) -> Workload:
    """Read ``path`` into a :class:`Workload`; raises :class:`TraceError` (one line) on bad input."""
    path = Path(path)
    if not rate_scale > 0 or not np.isfinite(rate_scale):
        raise TraceError(f"rate scale must be a positive number, got {rate_scale}")
    if path.is_dir():  # a folder of traces (../shared/data/traces/azure_llm_2023): name what it holds
        held = sorted(p.name for p in path.iterdir() if p.name.endswith(TRACE_SUFFIXES))
        raise TraceError(
            f"{path} is a folder; name a trace file in it ({', '.join(held) or 'it holds none'})"
        )
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    rng = np.random.default_rng(seed)
    kind = trace_kind(path)
    if kind in COUNT_KINDS:
        if lengths is None:
            raise TraceError(
                f"{path}: a count series needs a per-request trace for token lengths (--lengths)"
            )
        series = read_counts(path)
        counts = rng.poisson(np.asarray(series.values, dtype=np.float64) * rate_scale)
        starts = np.arange(counts.size, dtype=np.float64) * series.step_s
        times = np.repeat(starts, counts) + rng.uniform(0.0, series.step_s, int(counts.sum()))
        pool = read_requests(lengths)
        rows = pool[rng.integers(0, len(pool), times.size)]
        prompts, outputs = rows[:, 1], rows[:, 2]
    else:
        table = read_requests(path)
        times = table[:, 0] - table[0, 0]
        if kind == "mooncake":  # by what it holds: a .jsonl.gz is one too
            times = times + rng.uniform(0.0, MOONCAKE_TICK_S, times.size)
        times = times / rate_scale
        prompts, outputs = table[:, 1], table[:, 2]
    order = np.argsort(times, kind="stable")
    times = np.asarray(times[order], dtype=np.float64)
    outputs_out: NDArray[np.int64] = np.clip(np.asarray(outputs[order], dtype=np.int64), 1, max_model_len - 1)
    limit = max_model_len - outputs_out
    raw_prompts = np.maximum(np.asarray(prompts[order], dtype=np.int64), 1)
    clipped = int(np.count_nonzero(raw_prompts > limit))
    prompts_out = np.minimum(raw_prompts, limit)
    if times.size == 0:
        raise TraceError(f"{path}: no requests at rate scale {rate_scale:g}")
    name = path.name.removesuffix(".gz").rsplit(".", 1)[0]  # the trace's, compressed or not
    return Workload(name, times - times[0], prompts_out, outputs_out, clipped)
