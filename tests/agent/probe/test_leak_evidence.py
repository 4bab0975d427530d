"""LeakEvidence: when to record, the cooldown, linking; request_snapshot against a loopback probe."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from agent.probe.leak_evidence import LeakEvidence, request_snapshot
from detectors.base import Finding, Severity


def _finding(detector: str = "memory_leak") -> Finding:
    return Finding(
        detector, "nvml.gpu0.memory_used_bytes", Severity.WARNING, 0.8, "grows", 0.0, {"slope": 1.0}
    )


def test_leak_finding_asks_for_one_recording_per_cooldown() -> None:
    evidence = LeakEvidence(cooldown_s=600)
    assert evidence.wanted([_finding()], 0.0)
    assert not evidence.wanted([_finding()], 599.0) and evidence.wanted([_finding()], 600.0)


def test_other_findings_do_not_record() -> None:
    assert not LeakEvidence().wanted([_finding("thermal")], 0.0)


def test_leak_finding_links_to_the_snapshot_file() -> None:
    evidence = LeakEvidence()
    evidence.recorded({"file": "/tmp/servepilot-memory-1.pickle"})
    leak, other = evidence.link([_finding(), _finding("thermal")])
    assert (
        leak.evidence["memory_snapshot"] == "/tmp/servepilot-memory-1.pickle"
        and leak.evidence["slope"] == 1.0
    )
    assert "memory_snapshot" not in other.evidence


@pytest.fixture
async def probe() -> AsyncIterator[str]:
    async def handler(request: web.Request) -> web.Response:
        status = 202 if request.query.get("duration_s") == "30" else 409
        return web.json_response({"file": "/x.pickle", "recording": True}, status=status)

    app = web.Application()
    app.router.add_post("/evidence/memory", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"
    await runner.cleanup()


async def test_request_snapshot_posts_to_the_probe(probe: str) -> None:
    async with aiohttp.ClientSession() as session:
        assert (await request_snapshot(session, probe, 30))["file"] == "/x.pickle"
        assert await request_snapshot(session, probe, 10) == {}  # refused: empty, no exception


async def test_unreachable_probe_is_an_empty_answer() -> None:
    async with aiohttp.ClientSession() as session:
        assert await request_snapshot(session, "http://127.0.0.1:9", 30) == {}
