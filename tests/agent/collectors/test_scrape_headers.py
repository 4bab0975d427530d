"""Every scraping collector asks for an uncompressed answer.

prometheus_client's exposition apps (SGLang's ``/metrics``, the allocator probe) gzip whenever the
request accepts gzip, which aiohttp's client does by default: the engine process would compress every
scrape only for the sidecar to decompress it on loopback.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agent.collectors.engine_metrics import EngineMetricsCollector
from agent.collectors.llamacpp_slots import LlamaCppSlotsCollector
from agent.collectors.probe import ProbeCollector
from agent.config import EngineConfig, ProbeConfig
from detectors.snapshot import SourceStatus

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
ServerFactory = Callable[[web.Application], Awaitable[TestServer]]


def _recording_app(path: str, body: str, content_type: str, seen: list[str]) -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Accept-Encoding", "<none>"))
        return web.Response(text=body, content_type=content_type)

    app = web.Application()
    app.router.add_get(path, handler)
    return app


@pytest.mark.parametrize("kind", ["engine", "probe", "llamacpp_slots"])
async def test_scrapes_ask_for_identity_encoding(aiohttp_server: ServerFactory, kind: str) -> None:
    seen: list[str] = []
    if kind == "engine":
        body = (FIXTURES / "expo/vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_busy.prom").read_text(encoding="utf-8")
        server = await aiohttp_server(_recording_app("/metrics", body, "text/plain", seen))
        collector: EngineMetricsCollector | ProbeCollector | LlamaCppSlotsCollector = EngineMetricsCollector(
            EngineConfig(url=f"http://127.0.0.1:{server.port}")
        )
    elif kind == "probe":
        body = (FIXTURES / "probe/probe_tp2.prom").read_text(encoding="utf-8")
        server = await aiohttp_server(_recording_app("/metrics", body, "text/plain", seen))
        collector = ProbeCollector(ProbeConfig(url=f"http://127.0.0.1:{server.port}/metrics"))
    else:
        body = (FIXTURES / "expo/llamacpp/llama-server-b11434-slots_busy.json").read_text(encoding="utf-8")
        server = await aiohttp_server(_recording_app("/slots", body, "application/json", seen))
        collector = LlamaCppSlotsCollector(EngineConfig(url=f"http://127.0.0.1:{server.port}"))
    try:
        reading = await collector.collect(now=1.0)
    finally:
        await collector.close()
    assert reading.status is SourceStatus.OK, reading.error
    assert seen == ["identity"]
