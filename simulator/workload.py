"""Drive an :class:`EngineCore` in virtual time: Poisson or trace arrivals, no clock, no asyncio.

This is the loop a replay runs (and what the calibration tests and the performance figure use): jump to
the next arrival when idle, otherwise step with fast-forward up to the next arrival, so decode stretches
between events cost one vectorised call instead of one Python step per token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from simulator.engine import EngineCore


@dataclass(frozen=True)
class Arrival:
    """One request of a workload: arrival time (s), prompt and output lengths (tokens)."""

    time: float
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class RunSummary:
    """Totals of a virtual-time run."""

    start: float
    end: float
    requests: int
    generated_tokens: int
    energy_j: float
    steps: int
    calls: int

    @property
    def duration_s(self) -> float:
        return self.end - self.start

    @property
    def throughput_tps(self) -> float:
        return self.generated_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def energy_per_token_j(self) -> float:
        return self.energy_j / self.generated_tokens if self.generated_tokens else 0.0


def poisson_arrivals(
    rate_per_s: float,
    duration_s: float,
    prompt_tokens: tuple[int, int],
    max_tokens: tuple[int, int],
    seed: int = 0,
    start: float = 0.0,
) -> list[Arrival]:
    """Poisson arrivals at ``rate_per_s`` for ``duration_s``; lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng(seed)
    count = int(rng.poisson(rate_per_s * duration_s))
    times = np.sort(rng.uniform(start, start + duration_s, size=count))
    prompts = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, size=count)
    outputs = rng.integers(max_tokens[0], max_tokens[1] + 1, size=count)
    return [Arrival(float(t), int(p), int(o)) for t, p, o in zip(times, prompts, outputs, strict=True)]


def run(
    core: EngineCore, arrivals: Iterable[Arrival], *, max_steps: int = 4096, unattended: bool = False
) -> RunSummary:
    """Feed ``arrivals`` (sorted by time) to ``core`` and step until every request has finished
    (``unattended``: :meth:`EngineCore.step`'s, as nothing here acts between steps)."""
    pending = list(arrivals)
    start = pending[0].time if pending else core.time
    energy0 = core.gpu_counters.energy_j
    tokens0 = core.stats.generation_tokens
    steps0 = core.stats.steps
    index = 0
    calls = 0
    now = start
    while index < len(pending) or core.has_work():
        next_time = pending[index].time if index < len(pending) else None
        if next_time is not None and (not core.has_work() or next_time <= core.time):
            now = max(now, next_time)
            while index < len(pending) and pending[index].time <= now:
                item = pending[index]
                core.submit(f"r{index}", item.prompt_tokens, item.max_tokens, item.time)
                index += 1
            continue
        core.step(now, max_steps=max_steps, until=next_time, unattended=unattended)
        calls += 1
        now = core.time
    return RunSummary(
        start=start,
        end=core.time,
        requests=index,
        generated_tokens=core.stats.generation_tokens - tokens0,
        energy_j=core.gpu_counters.energy_j - energy0,
        steps=core.stats.steps - steps0,
        calls=calls,
    )


def closed_batch(
    core: EngineCore, count: int, prompt_tokens: int, max_tokens: int, now: float = 0.0
) -> RunSummary:
    """Submit ``count`` identical requests at once and run them to completion (a throughput probe)."""
    return run(core, [Arrival(now, prompt_tokens, max_tokens)] * count)
