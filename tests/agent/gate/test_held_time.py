"""``servepilot_gate_held_seconds``: what the gate itself adds before the engine sees a request, its
queue wait aside (records.py, held.py). An SRE's first question of a proxy in the data path."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from agent.config import GateLineConfig
from tests.agent.gate.parked import ParkedCompletions
from tests.engines.client import gate_for

TIMEOUT = 5.0
BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}


def _held(registry: Any) -> tuple[float, float]:
    count = registry.get_sample_value("servepilot_gate_held_seconds_count")
    return count, registry.get_sample_value("servepilot_gate_held_seconds_sum")


async def test_the_time_held_leaves_out_the_queue_wait_and_counts_only_requests_sent(
    parked: ParkedCompletions,
) -> None:
    """Two requests through a gate of one slot: the second waits in the queue while the engine holds the
    first (at least 0.2 s), yet neither was held by the gate itself for more than a fraction of that. A
    request refused by its line's bucket never went upstream: not counted."""
    lines = {"one": GateLineConfig(requests_per_min=1, burst_ratio=1.0)}
    async with (
        gate_for(parked.url, max_in_flight=1, high_reserved_ratio=0.0, lines=lines) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        first = asyncio.create_task(client.post(f"{base}/v1/completions", json=BODY))
        while parked.running < 1:
            await asyncio.sleep(0.005)
        second = asyncio.create_task(client.post(f"{base}/v1/completions", json=BODY))
        while gate.admission.queue_depth < 1:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)
        parked.go.set()
        for task in (first, second):
            async with await task as resp:
                assert resp.status == 200
        for status in (200, 429):  # the line's one request a minute, then its bucket is empty
            async with client.post(
                f"{base}/v1/completions", json=BODY, headers={"x-servepilot-line": "one"}
            ) as r:
                assert r.status == status
        waited = registry.get_sample_value("servepilot_gate_queue_wait_seconds_sum", {"priority": "normal"})
    count, total = _held(registry)
    assert count == 3  # the refused one never went upstream
    assert waited >= 0.2  # the second's wait for the slot
    assert total < 0.1  # what the gate held them for itself, the wait aside
