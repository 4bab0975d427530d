"""Virtual-time driver: correctness, and the step folding a replay's speed rests on."""

from __future__ import annotations

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


def test_decode_fast_forward_folds_most_steps_into_few_calls() -> None:
    """What makes a replay fast enough (the >= 1000x figure itself is measured by bench/replay.py, not
    here: a timed assertion would flake on a busy runner): stretches of pure decode are priced in one
    vectorised call instead of one Python iteration per step."""
    core = make_core("a100-80g", "llama-3-8b", "fp16", 256)
    arrivals = workload.poisson_arrivals(5, 600, (100, 1500), (50, 400), seed=1)
    summary = workload.run(core, arrivals)
    assert summary.generated_tokens == sum(a.max_tokens for a in arrivals)
    assert summary.steps > 5 * summary.calls, (summary.steps, summary.calls)
