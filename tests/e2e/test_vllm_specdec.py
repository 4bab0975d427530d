"""Speculative decoding end to end: a real vLLM 0.32 (CPU) drafting 3 tokens by n-gram prompt lookup.

The sidecar's collector maps vLLM's real ``vllm:spec_decode_*`` counters, per draft position too, and the
spec-decode detector, built as the sidecar builds it, learns the acceptance of greedy traffic (the tiny
random model repeats itself, so most drafts match) and finds it when sampled traffic makes drafting a
loss. The same drop is saved in ``tests/fixtures/expo/vllm-0.32-cpu/*ngram3*`` for the unit tests. vLLM
observes its inter-token latency once per step, which brings several tokens when drafts are accepted;
the collector reads it per token, and that is checked against vLLM's own time per output token.

In CI after ``scripts/engines.sh vllm``; locally skipped with that command when vLLM is not installed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from agent.assembly import build_detectors
from agent.collectors.engine_metrics import EngineMetricsCollector
from agent.config import EngineConfig
from agent.engines.launcher import LaunchOptions, RunningEngine
from agent.loop import Loop
from agent.state import AgentState
from agent.store import Store
from detectors.base import Finding, Severity
from detectors.specdec import POSITION_PREFIX, SpecDecodeDetector
from tests.engines.client import completion, gate_for, gate_tokens, stream
from tests.engines.fixture import running

DRAFT_TOKENS = 3
TICK_GAP_S = 0.25
"""Real seconds between ticks; each tick is 1 s of the loop's (virtual) clock."""


@pytest.fixture(scope="module")
def engine() -> Iterator[RunningEngine]:
    with running("vllm", LaunchOptions(speculative_ngram=DRAFT_TOKENS)) as server:
        yield server


class Traffic:
    """Four clients sending 96-token completions of random prompts back to back, at ``temperature``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.temperature = 0.0
        self.stop = asyncio.Event()
        self.answered = 0

    async def client(self, session: aiohttp.ClientSession, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            prompt = " ".join(rng.choice("abcdefgh") for _ in range(24))
            body = completion(
                prompt, 96, stream=False, temperature=self.temperature, seed=rng.randrange(1 << 30)
            )
            async with session.post(self.url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                await response.read()
            self.answered += 1


def _summed(text: str, name: str) -> float:
    """The sum of ``name``'s samples over its label sets in a /metrics body."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def test_the_collector_and_the_gate_read_vllms_per_step_itl_per_token_as_vllms_own_tpot(
    engine: RunningEngine,
) -> None:
    """Greedy drafts mostly match, so a step brings ~3 tokens in one event: vLLM's ITL histogram, one gap
    per step, means ~3x a token's time, and so do the gaps between a stream's events at the gate. vLLM's
    request_time_per_output_token (per request, after the first token) says what a token took. Requests
    all of 96 tokens, streamed through the gate with their usage, none in flight at either scrape: the
    per-request and per-token means are one number."""
    collector = EngineMetricsCollector(EngineConfig(url=engine.url, kind="vllm", timeout_s=5.0))
    async with (
        gate_for(engine.url, max_in_flight=4, high_reserved_ratio=0.0) as (_, base, registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
    ):

        async def scrape() -> str:
            async with session.get(engine.url + "/metrics") as response:
                return await response.text()

        async def client(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(4):
                prompt = " ".join(rng.choice("abcdefgh") for _ in range(24))
                body = completion(prompt, 96, stream_options={"include_usage": True})
                result = await stream(session, base, body)
                assert result.status == 200 and result.usage["completion_tokens"] == 96, result.body[-300:]

        before = await scrape()
        await collector.collect(0.0)
        await asyncio.gather(*(client(seed) for seed in range(4)))
        reading = await collector.collect(10.0)
        after = await scrape()
    await collector.close()

    def delta(name: str) -> float:
        return _summed(after, name) - _summed(before, name)

    per_step = delta("vllm:inter_token_latency_seconds_sum") / delta("vllm:inter_token_latency_seconds_count")
    tpot = "vllm:request_time_per_output_token_seconds"
    per_token = delta(tpot + "_sum") / delta(tpot + "_count")
    assert delta(tpot + "_count") == 16
    assert per_step > 1.5 * per_token  # most steps brought accepted drafts
    collected = reading.values["engine.itl_seconds.mean"]
    assert collected == pytest.approx(per_token, rel=0.01)
    bucket = {"bucket": "le256"}
    gated = registry.get_sample_value("servepilot_gate_itl_seconds_sum", bucket) / registry.get_sample_value(
        "servepilot_gate_itl_seconds_count", bucket
    )
    print(
        f"\nITL: {per_step * 1e3:.2f} ms per step, {per_token * 1e3:.2f} ms per token (vLLM's TPOT); "
        f"collector {collected * 1e3:.2f} ms, gate {gated * 1e3:.2f} ms"
    )
    # The gate times the stream as it relays it, on the 2 cores vLLM's CPU backend saturates: its clock
    # reads lag the engine's by whatever the load makes them. 2026-12-05: 2.05 ms at the gate, 1.98 in vLLM;
    # 1.82 and 1.76; once, in CI, 2.17 and 1.48. Read per step it would be ~3x (per_step above): nearer
    # to the per-token figure than to that, and within 60% of it.
    assert abs(gated - per_token) < abs(gated - per_step), (gated, per_token, per_step)
    assert gated == pytest.approx(per_token, rel=0.6)


async def test_the_gate_counts_streams_without_usage_by_the_engine_s_decode_tokens_per_step(
    engine: RunningEngine,
) -> None:
    """Most clients do not ask for the usage. A drafting vLLM sends a step's tokens in one event, so one
    token per event saw about a third of them. Told the engine's decode tokens per step, as the sidecar
    tells it each tick (engine.decode_tokens_per_step), the gate counts 16 greedy answers of 96 tokens
    within 15%: the engine's window mean, not each answer's own. Asking vLLM for the usage itself
    (``gate.stream_usage``, on by default; off for the first two counts), it counts them exactly, and
    its clients still get no usage event."""
    collector = EngineMetricsCollector(EngineConfig(url=engine.url, kind="vllm", timeout_s=5.0))
    counted: dict[str, float] = {}
    limit = {"max_in_flight": 4, "high_reserved_ratio": 0.0}
    async with (
        gate_for(engine.url, stream_usage=False, **limit) as (gate, base, registry),
        gate_for(engine.url, **limit) as (_, asking_base, asking_registry),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
    ):

        async def sixteen(seeds: range, base: str = base, registry: CollectorRegistry = registry) -> float:
            async def client(seed: int) -> None:
                rng = random.Random(seed)
                for _ in range(4):
                    prompt = " ".join(rng.choice("abcdefgh") for _ in range(24))
                    result = await stream(session, base, completion(prompt, 96))
                    assert result.status == 200 and not result.usage, result.body[-300:]

            before = gate_tokens(registry)["output"] or 0.0
            await asyncio.gather(*(client(seed) for seed in seeds))
            return (gate_tokens(registry)["output"] or 0.0) - before

        await collector.collect(0.0)
        counted["per event"] = await sixteen(range(4))
        reading = await collector.collect(10.0)
        per_step = reading.values["engine.decode_tokens_per_step"]
        gate.set_tokens_per_event("primary", per_step)
        counted["per step"] = await sixteen(range(4, 8))  # other prompts than those it was measured on
        counted["asked"] = await sixteen(range(8, 12), asking_base, asking_registry)
    await collector.close()
    print(f"\ngate output tokens of 16 x 96 = 1536: {counted}, {per_step:.2f} tokens per step")
    assert counted["per event"] < 1536 / 1.5  # most events brought accepted drafts
    assert counted["per step"] == pytest.approx(1536, rel=0.15)
    assert counted["asked"] == 1536


def _spec_findings(state: AgentState) -> list[Finding]:
    return [f for f in state.findings if f.detector == "spec_decode"]


async def test_acceptance_lost_to_sampled_traffic_is_found_on_real_ngram_drafts(
    engine: RunningEngine,
) -> None:
    detectors = build_detectors()
    spec = next(d for d in detectors if isinstance(d, SpecDecodeDetector))
    collector = EngineMetricsCollector(EngineConfig(url=engine.url, kind="vllm", timeout_s=5.0))
    loop = Loop([collector], Store(100, 4096), interval_s=1.0, source_timeout_s=5.0, detectors=detectors)
    traffic = Traffic(engine.url)
    t = 0.0

    async def tick() -> AgentState:
        nonlocal t
        t += 1.0
        await asyncio.sleep(TICK_GAP_S)
        return await loop.tick(t)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        clients = [asyncio.create_task(traffic.client(session, seed)) for seed in range(4)]
        try:
            greedy: list[AgentState] = []
            while spec.baseline_ is None and len(greedy) < 240:
                greedy.append(await tick())
            for _ in range(10):  # past the warm-up, the detector judges greedy drafts too
                greedy.append(await tick())
            traffic.temperature = 1.0
            sampled: list[AgentState] = []
            while not any(f.severity is Severity.CRITICAL for s in sampled[-1:] for f in _spec_findings(s)):
                if len(sampled) >= 120:
                    break
                sampled.append(await tick())
        finally:
            traffic.stop.set()
            await asyncio.gather(*clients)
        await collector.close()

    assert spec.baseline_ is not None, f"no baseline after {len(greedy)} ticks ({traffic.answered} answers)"
    assert spec.baseline_ > 0.5  # greedy: the random model repeats itself and the lookups find it
    assert not any(_spec_findings(s) for s in greedy)  # all 3 draft tokens pay: no advice, no alarm
    values = greedy[-1].snapshot.values if greedy[-1].snapshot else {}
    by_position = [values.get(f"{POSITION_PREFIX}{j}") for j in range(DRAFT_TOKENS)]
    assert None not in by_position and f"{POSITION_PREFIX}{DRAFT_TOKENS}" not in values, sorted(values)
    seen = [(i, f.severity) for i, s in enumerate(sampled) for f in _spec_findings(s)]
    found = _spec_findings(sampled[-1])
    assert found and found[0].severity is Severity.CRITICAL, f"{len(sampled)} sampled ticks: {seen}"
    assert "no longer pays" in found[0].summary
    assert float(found[0].evidence["acceptance_ratio"]) < 0.2 < 0.5 < float(found[0].evidence["baseline"])
    assert float(found[0].evidence["expected_speedup"]) < 1.0
    # while requests of both kinds ran, acceptance fell below its baseline (a warning) before drafting
    # stopped paying (critical), unless both rose on one tick, where the critical one is shown
    assert seen[0][1] is Severity.WARNING or seen[0][0] == len(sampled) - 1, seen
    print(
        f"\nspec-decode: baseline {spec.baseline_:.2f} after {len(greedy)} greedy ticks; sampled: "
        f"warning at tick {seen[0][0]}, critical at {len(sampled) - 1} ({found[0].summary})"
    )
