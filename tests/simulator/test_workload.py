"""Virtual-time driver: correctness and the speed a replay needs."""

from __future__ import annotations

import time

from simulator import workload
from simulator.engine import make_core


def test_poisson_arrivals_are_sorted_and_near_the_rate() -> None:
    arrivals = workload.poisson_arrivals(5, 600, (100, 200), (10, 20), seed=1)
    times = [a.time for a in arrivals]
    assert times == sorted(times)
    assert 2700 < len(arrivals) < 3300


def test_every_arrival_is_served_to_its_max_tokens() -> None:
    arrivals = workload.poisson_arrivals(2, 60, (100, 200), (10, 20), seed=2)
    summary = workload.run(make_core(), arrivals)
    assert summary.requests == len(arrivals)
    assert summary.generated_tokens == sum(a.max_tokens for a in arrivals)


def test_core_runs_over_1000x_real_time_at_5_requests_per_second() -> None:
    core = make_core("a100-80g", "llama-3-8b", "fp16", 256)
    arrivals = workload.poisson_arrivals(5, 600, (100, 1500), (50, 400), seed=1)
    started = time.process_time()  # CPU time: not inflated by other jobs on a shared runner
    summary = workload.run(core, arrivals)
    speedup = summary.duration_s / (time.process_time() - started)
    assert speedup > 1000, f"{speedup:.0f}x"
