from policies import knobs
from policies.batch_seed import SeedBatch, SeedState
from tests.policies.conftest import make_snapshot


def _value(state: SeedState | None, **values: float) -> float:
    _, proposals = SeedBatch().decide(make_snapshot(**values), [], state, 0.0)
    return float(proposals[0].value)


def test_idle_gpu_grows_the_batch_by_half():
    assert (
        _value(
            SeedState(16),
            nvml__gpu0__utilization_ratio__mean=0.3,
            nvml__gpu0__memory_bandwidth_utilization_ratio__mean=0.2,
        )
        == 24
    )


def test_queue_with_headroom_grows_by_a_fifth():
    assert (
        _value(
            SeedState(20),
            nvml__gpu0__utilization_ratio__mean=0.7,
            nvml__gpu0__memory_bandwidth_utilization_ratio__mean=0.8,
            engine__requests_waiting=30,
        )
        == 24
    )


def test_behind_the_gate_its_queue_counts():
    """The gate holds back what its limit does not admit; the engine's own queue is then empty."""
    busy = {
        "nvml__gpu0__utilization_ratio__mean": 0.7,
        "nvml__gpu0__memory_bandwidth_utilization_ratio__mean": 0.8,
    }
    assert _value(SeedState(20), **busy, engine__requests_waiting=0, gate__queue_depth=30) == 24
    assert _value(SeedState(20), **busy, engine__requests_waiting=5, gate__queue_depth=10) == 16  # 15: no


def test_busy_gpu_shrinks_the_batch():
    assert (
        _value(
            SeedState(20),
            nvml__gpu0__utilization_ratio__mean=0.95,
            nvml__gpu0__memory_bandwidth_utilization_ratio__mean=0.9,
        )
        == 16
    )


def test_result_is_clamped_to_the_bounds():
    assert (
        _value(
            SeedState(30),
            nvml__gpu0__utilization_ratio__mean=0.1,
            nvml__gpu0__memory_bandwidth_utilization_ratio__mean=0.1,
        )
        == 32
    )


def test_missing_gpu_reading_holds():
    state, proposals = SeedBatch().decide(make_snapshot(engine__requests_waiting=50), [], SeedState(16), 0.0)
    assert proposals == [] and state == SeedState(16)


def test_proposes_the_batch_knob():
    _, proposals = SeedBatch().decide(make_snapshot(nvml__gpu0__utilization_ratio__mean=0.9), [], None, 0.0)
    assert proposals[0].knob == knobs.BATCH
