"""A business line's share of the gate (``lines.<name>.max_in_flight_share``): one tenant cannot fill the
engine while another waits, whatever its request rate allows."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from agent.config import GateConfig
from agent.gate.line_slots import LineSlots, line_cap
from tests.agent.gate.parked import ParkedCompletions
from tests.engines.client import ONE_AT_A_TIME, gate_for

TIMEOUT = 5.0
BATCH = {"x-servepilot-line": "batch"}
CHAT = {"x-servepilot-line": "chat"}


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def _lines(share: float | None) -> dict[str, Any]:
    return {"batch": {"max_in_flight_share": share}, "chat": {}}


def test_the_cap_is_the_share_of_the_limit_rounded_down_and_never_zero() -> None:
    assert [line_cap(0.5, n) for n in (1, 2, 3, 4, 64)] == [1, 1, 1, 2, 32]
    assert line_cap(0.25, 64) == 16 and line_cap(1.0, 7) == 7


@pytest.mark.parametrize("share", [0.5, None])
async def test_a_line_at_its_share_waits_in_its_own_queue_and_the_others_pass(
    parked: ParkedCompletions, share: float | None
) -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 3}
    settings = {**ONE_AT_A_TIME, "max_in_flight": 4}
    async with (
        gate_for(parked.url, lines=_lines(share), **settings) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        url = f"{base}/v1/completions"
        batch = [asyncio.create_task(client.post(url, json=body, headers=BATCH)) for _ in range(4)]
        if share is None:  # without a share the batch line takes every slot
            await _until(lambda: parked.running == 4)
        else:  # with one, 2 of 4 slots; the other two wait in the line's queue, not the gate's
            await _until(lambda: parked.running == 2 and gate.line_slots.waiting("batch") == 2)
            assert gate.admission.queue_depth == 0
        chat = [asyncio.create_task(client.post(url, json=body, headers=CHAT)) for _ in range(2)]
        if share is None:
            await _until(lambda: gate.admission.queue_depth == 2)  # chat waits behind the batch job
            assert parked.running == 4
        else:
            await _until(lambda: parked.running == 4)  # chat goes straight to the engine
            assert gate.admission.queue_depth == 0 and gate.line_slots.waiting("batch") == 2
        waiting = registry.get_sample_value("servepilot_gate_line_waiting", {"line": "batch"})
        assert waiting == (None if share is None else 2)  # the series exists only for a line with a share
        parked.go.set()
        answers = [await task for task in [*batch, *chat]]
        assert [r.status for r in answers] == [200] * 6
    assert parked.peak == 4  # the in-flight limit holds either way
    assert gate.line_slots.held == {} and gate.line_slots.waiting("batch") == 0  # nothing leaked


async def test_a_line_that_waits_past_the_deadline_for_its_share_gets_a_503_naming_it(
    parked: ParkedCompletions,
) -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 3}
    settings = {**ONE_AT_A_TIME, "max_in_flight": 2}
    async with (
        gate_for(parked.url, lines=_lines(0.5), max_queue_wait_s=0.2, **settings) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        url = f"{base}/v1/completions"
        first = asyncio.create_task(client.post(url, json=body, headers=BATCH))
        await _until(lambda: parked.running == 1)
        late = await client.post(url, json=body, headers=BATCH)  # the line's one slot is taken
        error = await late.json()
        parked.go.set()
        assert (await first).status == 200
    assert late.status == 503 and late.headers["Retry-After"] == "1"
    assert error["error"]["code"] == "line_share_full"
    assert "'batch' holds its share of the gate (1 of 2 slots)" in error["error"]["message"]
    expired = {"line": "batch", "priority": "normal", "outcome": "expired"}
    assert registry.get_sample_value("servepilot_gate_requests_total", expired) == 1
    assert gate.line_slots.held == {}


async def test_a_client_that_leaves_while_its_line_is_full_frees_its_place(
    parked: ParkedCompletions,
) -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 3}
    settings = {**ONE_AT_A_TIME, "max_in_flight": 2}
    async with (
        gate_for(parked.url, lines=_lines(0.5), **settings) as (gate, base, _),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        url = f"{base}/v1/completions"
        first = asyncio.create_task(client.post(url, json=body, headers=BATCH))
        await _until(lambda: parked.running == 1)
        leaving = asyncio.create_task(client.post(url, json=body, headers=BATCH))
        await _until(lambda: gate.line_slots.waiting("batch") == 1)
        leaving.cancel()
        await _until(lambda: gate.line_slots.waiting("batch") == 0)
        third = asyncio.create_task(client.post(url, json=body, headers=BATCH))
        await _until(lambda: gate.line_slots.waiting("batch") == 1)
        parked.go.set()
        assert [(await t).status for t in (first, third)] == [200, 200]
    assert parked.peak == 1  # the line never had more than its one slot
    assert gate.line_slots.held == {}


async def test_a_raised_limit_hands_the_line_its_new_slots_at_once(parked: ParkedCompletions) -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 3}
    settings = {**ONE_AT_A_TIME, "max_in_flight": 2}
    async with (
        gate_for(parked.url, lines=_lines(0.5), **settings) as (gate, base, _),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        url = f"{base}/v1/completions"
        batch = [asyncio.create_task(client.post(url, json=body, headers=BATCH)) for _ in range(3)]
        await _until(lambda: parked.running == 1 and gate.line_slots.waiting("batch") == 2)
        gate.set_limit(6)  # cap 1 -> 3: both waiters go now, not when the first answer ends
        await _until(lambda: parked.running == 3)
        parked.go.set()
        assert [(await t).status for t in batch] == [200] * 3


async def _hold_and_count(
    slots: LineSlots, cap: int, hold_for: Awaitable[None], order: list[int], i: int
) -> None:
    assert await slots.acquire("a", lambda: cap, TIMEOUT)
    try:
        order.append(i)
        await hold_for
    finally:
        slots.release("a")


async def test_slots_go_to_the_line_s_waiters_first_come_first_served() -> None:
    slots, order, release = LineSlots(), [], asyncio.Event()
    tasks = [asyncio.create_task(_hold_and_count(slots, 1, release.wait(), order, i)) for i in range(4)]
    await _until(lambda: order == [0] and slots.waiting("a") == 3)
    release.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3] and slots.held == {} and slots.waiting("a") == 0


async def test_a_share_given_by_a_reload_caps_the_line_from_its_next_request(
    parked: ParkedCompletions,
) -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 3}
    settings = {**ONE_AT_A_TIME, "max_in_flight": 4}
    async with (
        gate_for(parked.url, lines=_lines(None), **settings) as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        gate.set_admission_rules(gate.cfg.model_copy(update={"lines": GateConfig(lines=_lines(0.25)).lines}))
        url = f"{base}/v1/completions"
        batch = [asyncio.create_task(client.post(url, json=body, headers=BATCH)) for _ in range(2)]
        await _until(lambda: parked.running == 1 and gate.line_slots.waiting("batch") == 1)
        assert registry.get_sample_value("servepilot_gate_line_waiting", {"line": "batch"}) == 1
        parked.go.set()
        assert [(await t).status for t in batch] == [200, 200]


async def test_a_line_s_slots_count_sequences() -> None:
    """A share of 4 slots: a request for 3 sequences holds 3, one for 2 waits until they are back, and one
    for 9 (more than the share) holds all 4 once nothing else of the line runs."""
    slots = LineSlots()
    assert await slots.acquire("a", lambda: 4, TIMEOUT, weight=3) == 3
    pair = asyncio.create_task(slots.acquire("a", lambda: 4, TIMEOUT, weight=2))
    await _until(lambda: slots.waiting("a") == 1)
    big = asyncio.create_task(slots.acquire("a", lambda: 4, TIMEOUT, weight=9))
    await _until(lambda: slots.waiting("a") == 2)
    slots.release("a", 3)
    assert await pair == 2 and not big.done()
    slots.release("a", 2)
    assert await big == 4 and slots.held == {"a": 4}
    slots.release("a", 4)
    assert slots.held == {} and slots.waiting("a") == 0
    assert await slots.acquire("a", lambda: 4, 0.01, weight=1) == 1
    assert await slots.acquire("a", lambda: 4, 0.01, weight=4) == 0  # 3 free of 4: timed out
