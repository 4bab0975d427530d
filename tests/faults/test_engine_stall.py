"""A hung engine: it holds requests and answers /health and /metrics, but no token comes.

The simulator's ``stalled`` fault on a real loopback server, the real engine collector scraping it, and
the default detectors. Ticks carry virtual times (a minute of them takes a second of real time); the
engine runs on the real clock, so between two ticks it either makes progress or it does not.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from agent.assembly import build_detectors
from agent.collectors.engine_metrics import EngineMetricsCollector
from agent.collectors.nvml import NvmlCollector
from agent.config import EngineConfig, NvmlConfig
from agent.loop import Loop
from agent.store import Store
from detectors.base import Finding
from simulator.engine import make_core
from simulator.server import SimServer
from tests.faults.conftest import serve

TIMEOUT = 10.0


@pytest.fixture
async def sim() -> AsyncIterator[str]:
    async with serve(SimServer(make_core("a100-80g", "llama-2-7b", "fp16", 64), seed=3).app()) as url:
        yield url


async def _stream(session: aiohttp.ClientSession, url: str) -> int:
    """One long streamed completion; the number of SSE events it got."""
    body = {"prompt": [1] * 16, "max_tokens": 3000, "stream": True}
    events = 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        async for line in response.content:
            events += line.startswith(b"data:")
    return events


def _stalls(findings: tuple[Finding, ...]) -> list[Finding]:
    return [f for f in findings if f.detector == "engine_stall"]


@pytest.mark.parametrize(
    "stalled_gpu, says",
    [("busy", "Its GPUs read busy while nothing progresses"), ("idle", "Its GPUs are idle")],
)
async def test_a_hung_engine_is_a_critical_finding_after_a_minute_and_clears_when_it_moves(
    sim: str, stalled_gpu: str, says: str
) -> None:
    """With the simulated NVML beside the engine's scrape, the finding also says what the GPU read: busy
    (a collective spinning) or idle (a stuck host), the first thing to know about a hang."""
    collector = EngineMetricsCollector(EngineConfig(url=sim, kind="vllm", timeout_s=2.0))
    nvml = NvmlCollector(NvmlConfig(backend="simulated", simulated_url=sim))
    nvml.start()
    loop = Loop(
        [collector, nvml], Store(100, 4096), interval_s=1.0, source_timeout_s=2.0, detectors=build_detectors()
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        streams = [asyncio.create_task(_stream(session, sim)) for _ in range(4)]
        try:
            t = 1000.0
            for _ in range(4):  # decoding: tokens between ticks
                await asyncio.sleep(0.1)
                state = await loop.tick(t)
                assert not _stalls(state.findings)
                t += 1.0
            assert state.snapshot is not None and state.snapshot.get("engine.requests_running") == 4
            stall = {"stalled": True, "stalled_gpu": stalled_gpu}
            async with session.post(f"{sim}/sim/faults", json=stall) as response:
                assert response.status == 200
            await asyncio.sleep(0.1)  # a step that was running when the stall began still ends
            state = await loop.tick(t)  # its tokens are counted here, or were at the last tick
            stalled_at = t
            verdicts: list[tuple[float, int]] = []
            for step in range(1, 8):  # 70 s of ticks, 10 s apart, with nothing moving in between
                await asyncio.sleep(0.02)
                if step == 7:  # NVML's busy window (1 s) past the stall's start, and a fresh tick's samples
                    await asyncio.sleep(1.5)
                    await loop.tick(stalled_at + 65.0)
                    await asyncio.sleep(0.5)
                state = await loop.tick(stalled_at + 10.0 * step)
                verdicts.append((10.0 * step, len(_stalls(state.findings))))
            assert verdicts == [(10.0, 0), (20.0, 0), (30.0, 0), (40.0, 0), (50.0, 0), (60.0, 1), (70.0, 1)]
            [finding] = _stalls(state.findings)
            # the episode began at the last tick with progress: this one, or the one before the stall
            assert finding.severity.value == "critical" and finding.since in (stalled_at - 1.0, stalled_at)
            still = stalled_at + 70.0 - finding.since
            assert finding.summary == f"engine stalled: 4 request(s) held, no progress for {still:.0f}s"
            assert finding.evidence["requests_held"] == 4
            assert finding.evidence.get(f"gpus_{stalled_gpu}") == "0" and says in finding.hint, (
                finding.evidence
            )
            json.dumps(finding.to_json())  # what /api/state and the webhooks carry
            async with session.get(f"{sim}/health") as response:
                assert response.status == 200  # why a health check does not see it
            async with session.post(f"{sim}/sim/faults", json={"stalled": False}) as response:
                assert response.status == 200
            await asyncio.sleep(0.1)
            state = await loop.tick(stalled_at + 80.0)
            assert not _stalls(state.findings)  # tokens again: the stall is over
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            await collector.close()
            await nvml.close()
