"""EngineCore: stepping, fast-forward equivalence, settings, faults and request validation."""

from __future__ import annotations

import numpy as np
import pytest

from simulator import workload
from simulator.engine import EngineCore, make_core
from simulator.faults import FaultSwitches

MIB = 1024**2


def _run(
    max_steps: int, unattended: bool = False, rate: float = 4, budget: int = 8192
) -> tuple[EngineCore, workload.RunSummary]:
    core = make_core("a100-80g", "llama-3-8b", "fp16", 32, max_num_batched_tokens=budget)
    arrivals = workload.poisson_arrivals(rate, 60, (50, 900), (20, 300), seed=3)
    summary = workload.run(core, arrivals, max_steps=max_steps, unattended=unattended)
    return core, summary


@pytest.mark.parametrize(
    ("unattended", "rate", "budget"),
    [(False, 4, 8192), (True, 4, 8192), (True, 12, 8192), (False, 4, 128), (True, 4, 128), (True, 8, 256)],
)
def test_fast_forward_matches_single_stepping(unattended: bool, rate: float, budget: int) -> None:
    """At 12 requests/s the 32 sequences are full and requests wait: an end must then stop the run. A
    budget of 128 or 256 tokens cuts the prompts (50-900 tokens) into chunks beside the decoding ones."""
    (single, _), (fast, _) = _run(1, rate=rate, budget=budget), _run(4096, unattended, rate, budget)
    assert fast.stats.steps == single.stats.steps
    assert fast.stats.generation_tokens == single.stats.generation_tokens
    for name in ("itl", "ttft", "e2e", "queue", "iteration_tokens", "tpot", "decode"):
        a, b = getattr(single.stats, name), getattr(fast.stats, name)
        assert np.array_equal(a.counts, b.counts), name
        assert b.sum == pytest.approx(a.sum, rel=1e-9), name
    assert fast.gpu_counters.energy_j == pytest.approx(single.gpu_counters.energy_j, rel=1e-6)


def test_going_on_past_a_finish_saves_the_calls_at_each_end() -> None:
    """A run of decode steps used to stop where a request ended; with nothing waiting and a caller that
    acts on no finish (a replay without a gate) it goes on with the others."""
    (_, stopping), (_, going_on) = _run(4096), _run(4096, unattended=True)
    assert going_on.steps == stopping.steps and going_on.calls < stopping.calls * 0.9, (going_on, stopping)


def test_fast_forward_takes_far_fewer_calls() -> None:
    core = make_core("a100-80g", "llama-3-8b", "fp16", 32)
    summary = workload.run(core, workload.poisson_arrivals(4, 60, (50, 900), (20, 300), seed=3))
    assert summary.calls * 5 < summary.steps


def test_a_prompt_one_token_past_a_chunk_gets_its_first_token_in_a_step_of_its_own() -> None:
    """513 prompt tokens in chunks of 512 leave one: that step is prefill, not the decode a fast-forward
    may skip across. It used to be skipped, and the request's first token came with no TTFT (a replay
    then read a negative TTFT and a TPOT over its whole life), 8 to 20 requests an hour on the Azure
    conversation trace."""
    core = make_core(max_num_batched_tokens=512)
    core.submit("a", 513, 5, now=0.0)
    while core.has_work():
        core.step(core.time, max_steps=64)
    assert core.stats.ttft.count == 1 and core.stats.prompt_tokens == 513
    assert core.stats.generation_tokens == 5 and core.stats.tpot.count == 1


def test_step_never_goes_back_in_time() -> None:
    core = make_core()
    core.submit("a", 100, 5, now=10.0)
    first = core.step(10.0)
    second = core.step(10.0)  # asked for an earlier time than the core has reached
    assert second.start == pytest.approx(first.end)


def test_idle_step_does_nothing_and_takes_no_time() -> None:
    result = make_core().step(5.0)
    assert result.steps == 0 and result.duration == 0


def test_first_token_comes_after_the_whole_prompt_is_prefilled_in_chunks() -> None:
    core = make_core(max_num_batched_tokens=512)
    core.submit("a", 1200, 3, now=0.0)
    emitted = [core.step(0.0).tokens.get("a", 0) for _ in range(3)]
    assert emitted == [0, 0, 1]  # 512 + 512 + 176 prompt tokens


def test_every_request_gets_exactly_max_tokens() -> None:
    core = make_core()
    for i in range(5):
        core.submit(f"r{i}", 50 + i, 10 + i, now=0.0)
    got: dict[str, int] = {}
    while core.has_work():
        for rid, n in core.step(core.time, max_steps=64).tokens.items():
            got[rid] = got.get(rid, 0) + n
    assert got == {f"r{i}": 10 + i for i in range(5)}


def test_submit_rejects_a_request_longer_than_the_context() -> None:
    with pytest.raises(ValueError, match="maximum context length is 4096"):
        make_core().submit("a", 4000, 200, now=0.0)


def test_submit_rejects_a_duplicate_id() -> None:
    core = make_core()
    core.submit("a", 10, 10, now=0.0)
    with pytest.raises(ValueError, match="already in flight"):
        core.submit("a", 10, 10, now=0.0)


def test_abort_frees_the_blocks_and_counts_an_abort() -> None:
    core = make_core()
    core.submit("a", 500, 100, now=0.0)
    core.step(0.0)
    assert core.abort("a", now=1.0)
    assert core.scheduler.pool.used == 0
    assert core.stats.request_success["abort"] == 1


def test_fp8_grows_the_kv_pool() -> None:
    core = make_core("h100-sxm", "llama-3-8b", "fp16")
    blocks = core.budget.num_blocks
    core.apply_settings(core.with_settings(precision="fp8"), now=0.0)
    assert core.budget.num_blocks > 2 * blocks * 0.99


def test_lower_max_num_seqs_caps_the_running_batch() -> None:
    core = make_core()
    core.apply_settings(core.with_settings(max_num_seqs=4), now=0.0)
    for i in range(10):
        core.submit(f"r{i}", 20, 50, now=0.0)
    core.step(0.0)
    assert core.num_running == 4 and core.num_waiting == 6


def test_latency_factor_multiplies_step_time() -> None:
    plain, slow = make_core(), make_core()
    slow.set_faults(FaultSwitches(latency_factor=3.0), now=0.0)
    for core in (plain, slow):
        core.submit("a", 100, 5, now=0.0)
    assert slow.step(0.0).duration == pytest.approx(3 * plain.step(0.0).duration)


def test_leak_grows_in_whole_stairs() -> None:
    core = make_core()
    core.set_faults(FaultSwitches(leak_bytes_per_hour=1024 * MIB, leak_step_bytes=256 * MIB), now=0.0)
    assert core.leaked_bytes(899.0) == 0
    assert core.leaked_bytes(900.0) == 256 * MIB
    assert core.leaked_bytes(3599.0) == 768 * MIB


def test_make_core_rejects_an_unknown_precision() -> None:
    with pytest.raises(ValueError, match="unknown precision"):
        make_core(precision="int3")


def test_model_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        make_core("a100-80g", "llama-3-70b", "fp16")
