"""Fixtures the gate's test modules share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.agent.gate.parked import ParkedCompletions, serving


@pytest.fixture
async def parked() -> AsyncIterator[ParkedCompletions]:
    """A ``/v1/completions`` engine on loopback that answers once its ``go`` is set."""
    async for served in serving(ParkedCompletions()):
        yield served
