import pytest

from policies.batch_auto import AutoBatch
from tests.policies.conftest import make_snapshot

POLICY = AutoBatch(ttft_slo_s=10.0, itl_slo_s=0.1)


def _decide(**values: float) -> list[float]:
    _, proposals = POLICY.decide(make_snapshot(**values), [], None, 0.0)
    return [float(p.value) for p in proposals]


def test_grows_additively_when_queue_waits_and_latency_has_room():
    assert _decide(
        gate__limit=64,
        engine__requests_running=64,
        engine__requests_waiting=10,
        engine__kv_cache_usage_ratio=0.5,
        engine__itl_seconds__mean=0.07,
    ) == [72]


def test_grows_by_the_gradients_square_root_far_below_the_itl_target():
    """A cold start at limit 16 with ITL at a tenth of the SLO doubles instead of adding 4."""
    q = {"engine__requests_waiting": 10, "engine__kv_cache_usage_ratio": 0.1}
    assert _decide(gate__limit=16, engine__requests_running=16, engine__itl_seconds__mean=0.01, **q) == [32]
    # nearer the target: the square root of the gradient, 64 * sqrt(0.08 / 0.04 / 1.1) = 86
    assert _decide(gate__limit=64, engine__requests_running=64, engine__itl_seconds__mean=0.04, **q) == [86]


def test_shrinks_when_itl_is_over_target():
    [value] = _decide(gate__limit=64, engine__requests_running=64, engine__itl_seconds__mean=0.1)
    assert value < 64


def test_backs_off_below_running_on_preemptions():
    assert _decide(
        gate__limit=256,
        engine__requests_running=80,
        engine__preemptions_per_second=1.0,
        engine__kv_cache_usage_ratio=0.99,
        engine__itl_seconds__mean=0.03,
    ) == [76]


def test_does_not_grow_a_limit_that_does_not_bind():
    assert (
        _decide(
            gate__limit=64,
            engine__requests_running=20,
            engine__requests_waiting=0,
            engine__itl_seconds__mean=0.02,
        )
        == []
    )


def test_does_not_grow_when_kv_cache_is_near_full():
    assert (
        _decide(
            gate__limit=64,
            engine__requests_running=64,
            engine__requests_waiting=10,
            engine__kv_cache_usage_ratio=0.9,
            engine__itl_seconds__mean=0.02,
        )
        == []
    )


def test_holds_without_engine_reading():
    assert _decide(gate__limit=64) == []


def test_clamps_to_upper_bound():
    policy = AutoBatch(10.0, 0.1, upper=70.0)
    snapshot = make_snapshot(
        gate__limit=68,
        engine__requests_running=68,
        engine__requests_waiting=5,
        engine__kv_cache_usage_ratio=0.1,
        engine__itl_seconds__mean=0.01,
    )
    _, proposals = policy.decide(snapshot, [], None, 0.0)
    assert proposals[0].value == 70


def test_rejects_a_zero_slo():
    with pytest.raises(ValueError, match="SLO"):
        AutoBatch(0.0, 0.1)
