"""Virtual-time lever replays on the simulator core, over the first 2000 requests of the Azure 2023
code trace (tests/fixtures/gate/SOURCES.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.gate.levers_replay import (
    compress,
    default_core,
    replay_cache,
    replay_isolation,
    run_core,
    with_repeats,
)
from agent.traces import read_requests

FIXTURES = Path(__file__).parents[2] / "fixtures" / "gate"
CODE_TRACE = FIXTURES / "azure_code_2023_first2000.csv"
CONV_TRACE = FIXTURES / "azure_conv_2023_first2000.csv"


@pytest.fixture(scope="module")
def code_trace() -> np.ndarray:
    return compress(read_requests(CODE_TRACE), speedup=1.0)


def test_isolation_cuts_short_request_p99_ttft_by_at_least_30_percent(code_trace: np.ndarray) -> None:
    mixed = replay_isolation(code_trace, 2048, isolate=False)
    isolated = replay_isolation(code_trace, 2048, isolate=True)
    assert isolated.p99(long=False) <= 0.7 * mixed.p99(long=False)


def test_isolation_costs_the_long_requests_tail(code_trace: np.ndarray) -> None:
    """The trade is not free: the long pool carries most prompt tokens, so its tail grows."""
    mixed = replay_isolation(code_trace, 2048, isolate=False)
    isolated = replay_isolation(code_trace, 2048, isolate=True)
    assert isolated.p99(long=True) > mixed.p99(long=True)


def test_run_core_reports_one_ttft_per_request(code_trace: np.ndarray) -> None:
    ttft = run_core(default_core(), code_trace[:50])
    assert ttft.shape == (50,) and np.all(ttft > 0) and np.all(np.isfinite(ttft))


def test_compress_divides_gaps_and_keeps_lengths() -> None:
    rows = np.array([[100.0, 5, 1], [102.0, 6, 2], [110.0, 7, 3]])
    out = compress(rows, speedup=2.0, limit=2)
    assert out[:, 0].tolist() == [0.0, 1.0] and out[:, 1].tolist() == [5.0, 6.0]


@pytest.fixture(scope="module")
def conv_with_repeats() -> tuple[np.ndarray, list[str], np.ndarray]:
    rows = compress(read_requests(CONV_TRACE), speedup=2.0)
    return with_repeats(rows, repeat_share=0.3, seed=0)


def test_cache_lowers_ttft_and_engine_work_on_a_trace_with_repeats(
    conv_with_repeats: tuple[np.ndarray, list[str], np.ndarray],
) -> None:
    rows, keys, cacheable = conv_with_repeats
    off = replay_cache(rows, keys, cacheable, enabled=False)
    on = replay_cache(rows, keys, cacheable, enabled=True)
    assert on.hit_ratio > 0.05 and off.hit_ratio == 0.0
    assert np.percentile(on.ttft_s, 99) < np.percentile(off.ttft_s, 99)
    assert on.engine_tokens < off.engine_tokens


def test_cache_replay_never_hits_a_non_deterministic_request(
    conv_with_repeats: tuple[np.ndarray, list[str], np.ndarray],
) -> None:
    rows, keys, cacheable = conv_with_repeats
    on = replay_cache(rows, keys, cacheable, enabled=True)
    assert on.hit.any() and not (on.hit & ~cacheable).any()


def test_repeats_reuse_the_popular_prompts_lengths() -> None:
    rows = np.array([[float(i), 10.0 + i, 5.0] for i in range(200)])
    out, keys, _ = with_repeats(rows, repeat_share=1.0, popular=1, seed=1)
    assert set(keys) == {"popular-0"} and set(out[:, 1]) == {10.0}
