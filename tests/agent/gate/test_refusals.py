"""``servepilot_gate_refused_total{line, reason}``: why the gate turned a request away, per business line.
"Why did my tenant get 429s?" has five answers that the outcome alone (``rejected``, ``expired``) does
not tell apart: its request rate, its token budget, a full queue, shed for a higher class, or no slot in
time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp

from agent.config import GateLineConfig
from tests.agent.gate.parked import ParkedCompletions
from tests.engines.client import ONE_AT_A_TIME, gate_for

TIMEOUT = 5.0
BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not check():
            await asyncio.sleep(0.005)


def _refused(registry: Any, line: str, reason: str) -> float | None:
    return registry.get_sample_value("servepilot_gate_refused_total", {"line": line, "reason": reason})


async def test_a_lines_buckets_say_which_of_them_refused(parked: ParkedCompletions) -> None:
    parked.go.set()
    lines = {
        "slow": GateLineConfig(requests_per_min=1, burst_ratio=1.0),
        "wordy": GateLineConfig(requests_per_min=100, burst_ratio=1.0, tokens_per_min=10),
    }
    async with (
        gate_for(parked.url, lines=lines) as (_, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        for line, expected in (("slow", [200, 429]), ("wordy", [200, 429])):
            got = []
            for _ in expected:  # the first from a full bucket (the token charge into debt), the next refused
                body = {**BODY, "max_tokens": 20}  # over wordy's whole budget of 10 tokens
                async with client.post(
                    f"{base}/v1/completions", json=body, headers={"x-servepilot-line": line}
                ) as resp:
                    got.append(resp.status)
            assert got == expected
    assert (
        _refused(registry, "slow", "request_rate") == 1 and _refused(registry, "slow", "token_rate") is None
    )
    assert (
        _refused(registry, "wordy", "token_rate") == 1 and _refused(registry, "wordy", "request_rate") is None
    )


async def test_the_queue_says_full_shed_or_timed_out(parked: ParkedCompletions) -> None:
    """One slot, a queue of one: a low request waits; a second low finds the queue full; a high one
    sheds the waiting low; and the high one, still without a slot at the deadline, times out."""
    settings = {**ONE_AT_A_TIME, "queue_size": 1, "max_queue_wait_s": 0.3}
    low, high = {"x-servepilot-priority": "low"}, {"x-servepilot-priority": "high"}
    async with (
        gate_for(parked.url, **settings) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        url = f"{base}/v1/completions"
        held = asyncio.create_task(client.post(url, json=BODY))
        await _until(lambda: parked.running == 1)
        waiting = asyncio.create_task(client.post(url, json=BODY, headers=low))
        await _until(lambda: gate.admission.queue_depth == 1)
        async with client.post(url, json=BODY, headers=low) as full:
            assert full.status == 429
        pushing = asyncio.create_task(client.post(url, json=BODY, headers=high))
        shed = await waiting
        assert shed.status == 429
        timed_out = await pushing
        assert timed_out.status == 503
        parked.go.set()
        assert (await held).status == 200
    reasons = {r: _refused(registry, "default", r) for r in ("queue_full", "shed", "queue_timeout")}
    assert reasons == {"queue_full": 1, "shed": 1, "queue_timeout": 1}
