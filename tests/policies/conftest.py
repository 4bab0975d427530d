"""Snapshots for policy tests, built by hand: one helper, explicit values, no clock."""

from __future__ import annotations

import pytest

from detectors.snapshot import Reading, Snapshot, SourceStatus


def make_snapshot(now: float = 0.0, **values: float) -> Snapshot:
    """A snapshot whose values are ``values`` with ``__`` standing for ``.`` in the names."""
    flat = {name.replace("__", "."): value for name, value in values.items()}
    return Snapshot.from_readings(now, {"test": Reading("test", now, SourceStatus.OK, flat)})


@pytest.fixture
def snap():
    return make_snapshot
