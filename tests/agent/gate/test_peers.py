"""The lines' rates are the deployment's where ``gate.peers_dns`` names the gates' headless Service: each of
N gates enforces 1/N of them (agent/gate/peers.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.config import GateConfig, GateLineConfig
from agent.gate import peers as peers_module
from agent.gate.peers import PeerCount, gates_in, peers_loop, resolve
from agent.gate.ratelimit import LineLimits
from tests.agent.gate.parked import ParkedEngine, serving
from tests.engines.client import gate_for

TIMEOUT = 5.0


class Answers:
    """A resolver that gives its answers in turn: a set of addresses, or an exception to raise."""

    def __init__(self, *answers: set[str] | Exception) -> None:
        self.answers = list(answers)

    async def __call__(self, name: str) -> set[str]:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_the_count_follows_the_addresses_and_a_failed_lookup_keeps_the_last() -> None:
    peers = PeerCount(
        "gates",
        Answers(
            {"10.0.0.1", "10.0.0.2", "10.0.0.3"},
            OSError("Name or service not known"),
            set(),  # nobody ready (this pod neither): not "no gates"
            {"10.0.0.1"},
        ),
    )
    assert peers.count == 1  # before any lookup: each line's whole rate
    assert await peers.refresh() == 3 and not peers.error
    assert await peers.refresh() == 3 and "Name or service not known" in peers.error
    assert await peers.refresh() == 3 and peers.error == "no addresses"
    assert await peers.refresh() == 1 and not peers.error


async def test_a_lookup_that_hangs_counts_as_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    async def hangs(name: str) -> set[str]:
        await asyncio.Event().wait()
        return set()

    monkeypatch.setattr(peers_module, "RESOLVE_TIMEOUT_S", 0.05)
    peers = PeerCount("gates", hangs)
    assert await peers.refresh() == 1
    assert peers.error.startswith("TimeoutError")


async def test_the_system_resolver_gives_distinct_addresses() -> None:
    found = await resolve("localhost")
    assert found and found <= {"127.0.0.1", "::1"}
    assert gates_in(found) == 1  # one host, whether it answers in one family or two


@pytest.mark.parametrize(
    ("addresses", "gates"),
    [
        ({"10.0.0.1", "10.0.0.2", "10.0.0.3"}, 3),
        ({"fd00::1", "fd00::2"}, 2),
        ({"10.0.0.1", "10.0.0.2", "fd00::1", "fd00::2"}, 2),  # dual stack: each pod has one of each
        ({"10.0.0.1", "fd00::1", "fd00::2"}, 2),  # a pod whose IPv4 address is not out yet
        (set(), 0),
    ],
)
def test_a_dual_stack_pod_is_one_gate(addresses: set[str], gates: int) -> None:
    assert gates_in(addresses) == gates


async def test_the_loop_applies_each_count_until_stopped() -> None:
    counts: list[int] = []
    stop = asyncio.Event()
    two, four = {"10.0.0.1", "10.0.0.2"}, {"10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"}
    peers = PeerCount("gates", Answers(two, four, OSError("gone")))

    def apply(count: int) -> None:
        counts.append(count)
        if len(counts) == 3:
            stop.set()

    await asyncio.wait_for(peers_loop(peers, 0.001, apply, stop), TIMEOUT)
    assert counts == [2, 4, 4]


def _admitted(limits: LineLimits, line: str, until_s: float, every_s: float = 0.01) -> int:
    """Requests of ``line`` admitted when one is offered every ``every_s`` from 0 to ``until_s``."""
    admitted, now = 0, 0.0
    while now < until_s:
        admitted += limits.get(line, now).admit(0.0, now).granted
        now += every_s
    return admitted


def test_each_gate_enforces_its_share_of_the_rate_and_the_burst() -> None:
    """600 requests a minute with a 2x burst, shared by 4 gates: each admits 300 at once (its burst),
    then 150 a minute; together the 4 hold the line to its rate."""
    cfg = GateConfig(lines={"a": GateLineConfig(requests_per_min=600, burst_ratio=2)})
    alone = _admitted(LineLimits(cfg, 0.0), "a", 60.0)
    shared = _admitted(LineLimits(cfg, 0.0, share=0.25), "a", 60.0)
    assert alone == pytest.approx(1200 + 600, abs=2)
    assert shared == pytest.approx(300 + 150, abs=2)
    # a line the config does not list gets its share of default_requests_per_min too
    assert _admitted(LineLimits(cfg, 0.0, share=0.25), "other", 60.0) == pytest.approx(
        (2000 + 1000) / 4, abs=2
    )


def test_a_new_share_keeps_what_the_buckets_hold_capped_at_the_smaller_bucket() -> None:
    cfg = GateConfig(lines={"a": GateLineConfig(requests_per_min=60, burst_ratio=1, tokens_per_min=6000)})
    limits = LineLimits(cfg, 0.0)
    assert limits.get("a", 0.0).admit(100.0, 0.0).granted  # 59 requests and 5,900 tokens left
    fewer = limits.reconfigured(cfg, 0.0, share=0.5)  # a second gate: buckets of 30 and 3,000
    assert fewer.share == 0.5 and fewer.reconfigured(cfg, 0.0).share == 0.5  # a reload keeps the share
    line = fewer.get("a", 0.0)
    assert line.requests.tokens(0.0) == 30 and line.tokens is not None and line.tokens.tokens(0.0) == 3000
    more = fewer.reconfigured(cfg, 0.0, share=1.0)  # back to one: a larger bucket, not refilled by it
    assert more.get("a", 0.0).requests.tokens(0.0) == 30
    with pytest.raises(ValueError, match="share"):
        LineLimits(cfg, 0.0, share=0.0)


class Answering(ParkedEngine):
    path = "/v1/completions"

    def __init__(self) -> None:
        super().__init__()
        self.go.set()

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"choices": [{"text": "a"}]})


@pytest.fixture
async def engine() -> AsyncIterator[Answering]:
    async for served in serving(Answering()):
        yield served


async def test_a_gate_with_peers_admits_its_share_and_exports_the_count(engine: Answering) -> None:
    """A line of 6 requests a minute (burst 1x) behind 3 gates: this gate admits 2, then 429s; the
    count comes from a real lookup (``localhost``) at the start, and is exported."""
    lines = {"a": GateLineConfig(requests_per_min=6, burst_ratio=1)}
    expected = gates_in(await resolve("localhost"))
    async with (
        gate_for(engine.url, lines=lines, peers_dns="localhost") as (gate, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as client,
    ):
        for _ in range(100):  # the first lookup runs as the gate starts
            if (
                registry.get_sample_value("servepilot_gate_peers") == expected
                and gate.peers.count == expected
            ):
                break
            await asyncio.sleep(0.01)
        assert registry.get_sample_value("servepilot_gate_peers") == expected
        now = [1000.0]
        gate.clock = lambda: now[0]
        gate.set_peers(3)
        assert registry.get_sample_value("servepilot_gate_peers") == 3

        async def status() -> int:
            body = {"prompt": "hi", "max_tokens": 1}
            async with client.post(
                f"{base}/v1/completions", json=body, headers={"x-servepilot-line": "a"}
            ) as r:
                return r.status

        statuses = [await status() for _ in range(3)]
        now[0] += 30.0  # a third of the line's 6 a minute: 2 a minute here, one more after 30 s
        statuses.append(await status())
    assert statuses == [200, 200, 429, 200]
