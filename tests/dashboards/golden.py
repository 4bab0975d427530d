"""The golden ``/metrics`` of the agent: what families (and label names) it really exports.

Produced by running the real control loop, collectors and exporter against loopback servers that
replay real captures (vLLM 0.32 CPU scrapes, with and without speculative decoding, an allocator-probe
scrape) and the in-process fake NVML backend, with the webhook dispatcher, the admission gate, engine
control, the audit log, the config reloader and the watched TLS contexts attached to the agent's
registry, the breaker policy in the loop, the configured SLO targets and a live forecaster restored from
a seeded state (see :mod:`tests.dashboards.forecast_seed`), as the sidecar wires them. The result is a
sorted list of ``sample_name{label,...}`` lines, independent of values, so it only changes when the
agent's exported surface changes. Regenerate with::

    SERVEPILOT_UPDATE_GOLDEN=1 .venv/bin/pytest tests/dashboards/test_series.py
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trustme
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent import config
from agent.collectors.engine_metrics import EngineMetricsCollector
from agent.collectors.nvml import NvmlCollector
from agent.collectors.nvml_fake import FakeNvmlBackend
from agent.collectors.probe import ProbeCollector
from agent.config import (
    EngineConfig,
    ForecastConfig,
    NvmlConfig,
    ProbeConfig,
    WebhookConfig,
)
from agent.exporter import Exporter, without_created_series
from agent.forecasting import LiveForecaster
from agent.knobs import Knobs
from agent.loop import Loop
from agent.reload import Reloader
from agent.store import Store
from agent.tls import TlsFilesCollector
from agent.webhooks.dispatcher import WebhookDispatcher
from agent.webhooks.sinks import GenericSink
from policies.breaker import Breaker
from tests.dashboards.forecast_seed import write_forecast_state

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = Path(__file__).resolve().parent / "golden" / "agent_metrics.txt"
NGRAM_SCRAPES = ("ngram3-metrics_greedy", "ngram3-metrics_sampled")
ENGINE_SCRAPES = [
    FIXTURES / "expo" / "vllm-0.32-cpu" / f"vllm-0.32.0-cpu-{state}.prom"
    # then a second vLLM drafting by n-gram lookup (a restart, to the collector): the spec-decode series
    for state in ("metrics_idle", "metrics_busy", "metrics_after", "metrics_after", *NGRAM_SCRAPES)
]
PROBE_SCRAPE = FIXTURES / "probe" / "probe_tp2.prom"
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}


def surface(exposition: str) -> list[str]:
    """``name{labels}`` for every sample name a family can produce (families without samples too)."""
    lines: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        seen = False
        for sample in family.samples:
            seen = True
            labels = ",".join(sorted(sample.labels))
            lines.add(f"{sample.name}{{{labels}}}")
        if not seen:
            for suffix in _SUFFIXES.get(family.type, ("",)):
                lines.add(f"{family.name}{suffix}{{}}")
    return sorted(lines)


async def agent_exposition(tmp_path: Path, encoder: Callable[[Any], bytes] = generate_latest) -> str:
    """Run four ticks of the real loop against replayed captures; return the agent's /metrics text
    (without ``_created`` samples, as ``servepilot run`` exports it)."""
    without_created_series()
    scrapes = [p.read_text(encoding="utf-8") for p in ENGINE_SCRAPES]
    served = {"n": 0}

    async def engine(_: web.Request) -> web.Response:
        text = scrapes[min(served["n"], len(scrapes) - 1)]
        served["n"] += 1
        return web.Response(text=text + "\n", content_type="text/plain")

    async def probe(_: web.Request) -> web.Response:
        return web.Response(text=PROBE_SCRAPE.read_text(encoding="utf-8"), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", engine)
    app.router.add_get("/probe", probe)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    base = str(server.make_url("")).rstrip("/")
    nvml = NvmlCollector(NvmlConfig(backend="off"), backend=FakeNvmlBackend(gpu_count=2))
    start = 1_700_000_000.0
    state = write_forecast_state(tmp_path / "forecast.json", start, [1.0, 2.0, 3.0])
    forecaster = LiveForecaster(ForecastConfig(enabled=True, state_path=str(state)))
    assert forecaster.restore()
    collectors = [
        EngineMetricsCollector(EngineConfig(kind="vllm", url=base)),
        nvml,
        ProbeCollector(ProbeConfig(url=f"{base}/probe")),
        forecaster,
    ]
    exporter = Exporter(slo={"ttft": 2.0, "itl": 0.1})
    exporter.set_policy_itl(0.1)  # as the sidecar does at start (agent/itl_steering.py)
    # the sidecar's actuators, not started: registers servepilot_gate_*, the audit log's series,
    # servepilot_engine_control_up (control.enabled) and the GPU actuator's (a simulated GPU)
    gpu = {"gpu": "power_limit", "gpu_backend": "simulated", "gpu_state_file": str(tmp_path / "gpu.json")}
    knobs = Knobs(
        config.build(
            {
                "gate": {"enabled": True, "access_log": str(tmp_path / "access.jsonl")},
                "control": {"enabled": True},
                "audit": {"path": None},
                "actuators": gpu,
            }
        ),
        exporter.registry,
    )
    audit = knobs.audit
    # `servepilot run` always has a config file: its reloader's series (agent/reload.py)
    config_file = tmp_path / "servepilot.yaml"
    config_file.write_text("gate: {enabled: true}\n", encoding="utf-8")
    Reloader(config_file, {}, config.load(config_file), exporter.registry, audit)
    loop = Loop(collectors, Store(100, 4096), interval_s=1.0, source_timeout_s=1.0, policies=[Breaker()])
    loop.subscribe(exporter.publish)
    # a receiver with a private CA: a client TLS context, watched (servepilot_tls_*, agent/tls.py)
    trustme.CA().cert_pem.write_to_path(str(tmp_path / "receiver-ca.pem"))
    exporter.registry.register(TlsFilesCollector(lambda: None))
    hooks = WebhookDispatcher(
        WebhookConfig(
            enabled=True,
            queue_path=str(tmp_path / "outbox.sqlite"),
            tls_ca_file=str(tmp_path / "receiver-ca.pem"),
        ),
        exporter.registry,
        sinks=[GenericSink("http://127.0.0.1:9/hook", b"k")],
    )
    loop.subscribe(hooks.observe)
    try:
        for tick in range(len(ENGINE_SCRAPES)):
            now = start + tick
            assert nvml.sampler is not None
            for k in range(10):
                nvml.sampler.sample_once(tick + k * 0.1)
            await loop.tick(now)
        return encoder(exporter.registry).decode("utf-8")
    finally:
        await hooks.stop()
        audit.close()
        knobs.gpu.close()  # its lease watchdog thread
        for collector in collectors:
            await collector.close()
        await server.close()


def read_golden() -> list[str]:
    return [
        line for line in GOLDEN.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")
    ]


def write_golden(lines: list[str]) -> None:
    header = (
        "# Golden surface of the agent's /metrics: sample names and label names, values ignored.\n"
        "# Regenerate: SERVEPILOT_UPDATE_GOLDEN=1 .venv/bin/pytest tests/dashboards/test_series.py\n"
    )
    GOLDEN.write_text(header + "\n".join(lines) + "\n", encoding="utf-8")
