"""The chunked-prefill token budget (``max_num_batched_tokens``) as a runtime setting."""

from __future__ import annotations

import pytest

from simulator.control import ControlError, ControlPlane
from simulator.engine import make_core


def _plane(tokens: int = 2048) -> ControlPlane:
    core = make_core("a100-80g", "llama-2-7b", "fp16", 64, max_num_batched_tokens=tokens)
    return ControlPlane(core, core.settings)


def _body(key: str = "k", **settings: object) -> dict[str, object]:
    return {"settings": settings, "idempotency_key": key, "lease_s": 30}


def test_start_budget_is_a_setting() -> None:
    core = make_core(max_num_batched_tokens=1024)
    assert core.settings.max_num_batched_tokens == 1024 == core.scheduler.max_num_batched_tokens


def test_runtime_budget_changes_the_chunk_size() -> None:
    core = make_core(max_num_batched_tokens=2048)
    core.apply_settings(core.with_settings(max_num_batched_tokens=512), 0.0)
    core.submit("a", 1200, 3, now=0.0)
    emitted = [core.step(core.time).tokens.get("a", 0) for _ in range(3)]
    assert emitted == [0, 0, 1]  # 512 + 512 + 176 prompt tokens, as with a 512 start budget


def test_runtime_budget_does_not_resize_the_kv_pool() -> None:
    core = make_core(max_num_batched_tokens=2048)
    blocks = core.scheduler.pool.num_blocks
    core.apply_settings(core.with_settings(max_num_batched_tokens=8192), 0.0)
    assert core.scheduler.pool.num_blocks == blocks and core.max_num_batched_tokens == 8192


def test_smaller_budget_shortens_a_mixed_step() -> None:
    def first_prefill_step(tokens: int) -> tuple[int, float]:
        core = make_core(max_num_batched_tokens=4096)
        core.apply_settings(core.with_settings(max_num_batched_tokens=tokens), 0.0)
        core.submit("long", 4000, 2, now=0.0)
        result = core.step(0.0)
        return result.batch_tokens, result.duration

    big_tokens, big_s = first_prefill_step(4096)
    small_tokens, small_s = first_prefill_step(1024)
    assert (big_tokens, small_tokens) == (4000, 1024)
    assert small_s < big_s


def test_control_apply_sets_and_reads_back_the_budget() -> None:
    plane = _plane()
    answer = plane.apply(_body(max_num_batched_tokens=1024), now=0.0)
    assert answer["settings"]["max_num_batched_tokens"] == 1024
    assert answer["previous"]["max_num_batched_tokens"] == 2048
    state = plane.state(1.0)
    assert state["settings"]["max_num_batched_tokens"] == 1024
    assert plane.core.scheduler.max_num_batched_tokens == 1024


def test_control_publishes_budget_bounds() -> None:
    caps = _plane().capabilities()
    assert caps["max_num_batched_tokens"] == {"type": "integer", "minimum": 16, "maximum": 65536}


@pytest.mark.parametrize("value", [8, 70000, 1024.5, "1024", True])
def test_control_rejects_a_bad_budget(value: object) -> None:
    plane = _plane()
    with pytest.raises(ControlError) as error:
        plane.apply(_body(max_num_batched_tokens=value), now=0.0)
    assert error.value.status == 422 and "max_num_batched_tokens" in str(error.value)
    assert plane.core.settings.max_num_batched_tokens == 2048


def test_lease_lapse_restores_the_start_budget() -> None:
    plane = _plane()
    plane.apply(_body(max_num_batched_tokens=512), now=0.0)
    plane.expire(30.0)
    assert plane.core.settings.max_num_batched_tokens == 2048
    assert plane.core.scheduler.max_num_batched_tokens == 2048


def test_generic_adapter_sees_the_budget_as_an_integer_knob() -> None:
    """The live agent binds ``engine.<knob>`` for every capability: the budget needs no special case."""
    from agent.control.generic import parse_capabilities

    spec = parse_capabilities(_plane().state(0.0))["max_num_batched_tokens"]
    assert (spec.type, spec.minimum, spec.maximum) == ("integer", 16, 65536)
