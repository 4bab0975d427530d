"""Fault switch validation."""

from __future__ import annotations

import pytest

from simulator.faults import FaultError, FaultSwitches


def test_update_changes_only_the_named_switches() -> None:
    faults = FaultSwitches().updated({"error_rate": 0.25})
    assert faults.error_rate == 0.25 and faults.latency_factor == 1.0


def test_unknown_switch_is_refused() -> None:
    with pytest.raises(FaultError, match="not a fault switch"):
        FaultSwitches().updated({"meltdown": True})


def test_out_of_range_value_names_the_range() -> None:
    with pytest.raises(FaultError, match=r"latency_factor must be in \[1, 100\], got 0.5"):
        FaultSwitches().updated({"latency_factor": 0.5})


def test_non_finite_value_is_refused() -> None:
    with pytest.raises(FaultError, match="finite number"):
        FaultSwitches().updated({"metrics_delay_s": float("nan")})


def test_error_status_must_be_500_or_503() -> None:
    with pytest.raises(FaultError, match="error_status"):
        FaultSwitches().updated({"error_status": 404})
