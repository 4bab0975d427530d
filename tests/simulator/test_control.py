"""Control plane: validation, idempotency and leases (time passed in, nothing sleeps)."""

from __future__ import annotations

import pytest

from simulator.control import ControlError, ControlPlane
from simulator.engine import make_core


def _plane() -> ControlPlane:
    core = make_core("h100-sxm", "llama-3-8b", "fp16", 64)
    return ControlPlane(core, core.settings)


def _body(key: str = "k", **settings: object) -> dict[str, object]:
    return {"settings": settings or {"max_num_seqs": 16}, "idempotency_key": key, "lease_s": 30}


def test_apply_sets_absolute_values() -> None:
    plane = _plane()
    answer = plane.apply(_body(max_num_seqs=16, precision="fp8"), now=0.0)
    assert plane.core.settings.max_num_seqs == 16 and plane.core.settings.precision == "fp8"
    assert answer["lease_expires_at"] == 30.0


def test_same_key_twice_applies_once_and_answers_the_same() -> None:
    plane = _plane()
    first = plane.apply(_body("same"), now=0.0)
    second = plane.apply(_body("same"), now=5.0)
    assert second == first and plane.generation == 1


def test_same_key_with_another_body_is_a_conflict() -> None:
    plane = _plane()
    plane.apply(_body("same", max_num_seqs=16), now=0.0)
    with pytest.raises(ControlError) as error:
        plane.apply(_body("same", max_num_seqs=32), now=1.0)
    assert error.value.status == 409


def test_out_of_bounds_is_a_422_naming_the_range() -> None:
    with pytest.raises(ControlError, match=r"power_limit_w must be in \[200, 700\], got 900") as error:
        _plane().apply(_body(power_limit_w=900), now=0.0)
    assert error.value.status == 422


def test_bad_apply_changes_nothing() -> None:
    plane = _plane()
    before = plane.core.settings
    with pytest.raises(ControlError):
        plane.apply(_body(max_num_seqs=8, precision="int4"), now=0.0)
    assert plane.core.settings == before


def test_unknown_knob_is_a_422() -> None:
    with pytest.raises(ControlError, match="not a knob"):
        _plane().apply(_body(turbo=True), now=0.0)


def test_lease_expiry_restores_safe_defaults() -> None:
    plane = _plane()
    plane.apply(_body(max_num_seqs=8), now=0.0)
    assert plane.state(29.9)["settings"]["max_num_seqs"] == 8
    state = plane.state(30.0)
    assert state["settings"] == state["safe_defaults"] and state["last_revert_at"] == 30.0


def test_renew_extends_the_lease() -> None:
    plane = _plane()
    plane.apply(_body(max_num_seqs=8), now=0.0)
    plane.renew({"lease_s": 30}, now=25.0)
    assert not plane.expire(50.0)
    assert plane.expire(55.0)


def test_release_returns_to_safe_defaults_at_once_and_ends_the_lease() -> None:
    plane = _plane()
    plane.apply(_body(max_num_seqs=8), now=0.0)
    answer = plane.release(None, now=5.0)
    assert answer["released"] and answer["settings"]["max_num_seqs"] == 64
    state = plane.state(5.0)
    assert state["settings"] == state["safe_defaults"] and state["last_revert_at"] == 5.0
    assert not state["lease"]["active"] and answer["generation"] == state["generation"] == 2


def test_release_without_a_lease_changes_nothing() -> None:
    plane = _plane()
    plane.apply(_body(max_num_seqs=8), now=0.0)
    assert not plane.release(None, now=31.0)["released"]  # lapsed at 30: reverted then, not now
    assert plane.state(31.0)["last_revert_at"] == 31.0 and plane.generation == 2
    assert not plane.release({}, now=32.0)["released"] and plane.generation == 2


def test_release_with_a_body_is_a_422() -> None:
    plane = _plane()
    plane.apply(_body(max_num_seqs=8), now=0.0)
    with pytest.raises(ControlError) as error:
        plane.release({"lease_s": 1}, now=1.0)
    assert error.value.status == 422 and plane.state(1.0)["settings"]["max_num_seqs"] == 8


def test_renew_without_a_lease_is_a_conflict() -> None:
    with pytest.raises(ControlError) as error:
        _plane().renew({}, now=0.0)
    assert error.value.status == 409


def test_state_publishes_knob_bounds() -> None:
    caps = _plane().state(0.0)["capabilities"]
    assert caps["sm_clock_mhz"] == {"type": "number", "minimum": 345.0, "maximum": 1980.0}
    assert caps["precision"]["enum"] == ["fp16", "bf16", "fp8"]
