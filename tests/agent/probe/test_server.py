"""The probe HTTP server: exact families, injected sources, idempotent start, busy port, golden text."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import agent.probe
from agent.probe import server, stats

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "probe"
GOLDEN = FIXTURES / "probe_tp2.prom"
FAMILIES = {
    "servepilot_probe_up",
    "servepilot_probe_cuda_available",
    "servepilot_probe_allocated_bytes",
    "servepilot_probe_reserved_bytes",
    "servepilot_probe_active_bytes",
    "servepilot_probe_inactive_split_bytes",
    "servepilot_probe_peak_allocated_bytes",
    "servepilot_probe_peak_reserved_bytes",
    "servepilot_probe_fragmentation_ratio",
    "servepilot_probe_alloc_retries",
    "servepilot_probe_ooms",
    "servepilot_probe_info",
    "servepilot_probe_device_info",
}
#: The two GPUs of memory_stats_tp2.json, as torch.cuda.get_device_properties(d).uuid prints them.
TP2_UUIDS = {0: "5d0f2b7e-1c3a-4e7b-9a53-0b1e7c4d2f10", 1: "a8e3c6d1-77b2-4f0e-8c15-3d9b2e6f4a21"}


def tp2_uuids(devices: Any) -> dict[int, str]:
    return {d: stats.nvml_style_uuid(TP2_UUIDS[d]) for d in devices}


def tp2_source() -> dict[int, dict[str, Any]]:
    data = json.loads((FIXTURES / "memory_stats_tp2.json").read_text())
    return {int(k): v for k, v in data.items()}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def samples(text: str) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("device", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def probe() -> Iterator[server.ProbeServer]:
    running = server.serve(0, source=tp2_source, uuids=tp2_uuids)
    yield running
    running.close()


@pytest.fixture(autouse=True)
def _no_process_wide_probe() -> Iterator[None]:
    yield
    server.stop()


def test_serves_exactly_the_documented_families(probe: server.ProbeServer) -> None:
    names = {family.name for family in text_string_to_metric_families(scrape(probe.url))}
    assert names == FAMILIES


def test_serves_injected_stats_per_device(probe: server.ProbeServer) -> None:
    values = samples(scrape(probe.url))
    assert values[("servepilot_probe_reserved_bytes", "1")] == 71974961152
    assert values[("servepilot_probe_ooms_total", "1")] == 1
    assert values[("servepilot_probe_fragmentation_ratio", "0")] == pytest.approx(
        1 - 70391676928 / 71303872512
    )


def test_serves_which_gpu_each_device_is(probe: server.ProbeServer) -> None:
    served = {
        s.labels["device"]: s.labels["uuid"]
        for family in text_string_to_metric_families(scrape(probe.url))
        for s in family.samples
        if s.name == "servepilot_probe_device_info"
    }
    assert served == {"0": "GPU-" + TP2_UUIDS[0], "1": "GPU-" + TP2_UUIDS[1]}


def test_a_failing_uuid_read_still_serves_the_allocator(caplog: pytest.LogCaptureFixture) -> None:
    def broken(devices: Any) -> dict[int, str]:
        raise RuntimeError("no uuid in this torch")

    running = server.serve(0, source=tp2_source, uuids=broken)
    try:
        text = scrape(running.url)
    finally:
        running.close()
    assert "servepilot_probe_device_info{" not in text
    assert samples(text)[("servepilot_probe_reserved_bytes", "1")] == 71974961152


def test_served_text_matches_the_golden_fixture(probe: server.ProbeServer) -> None:
    """Regenerate with SERVEPILOT_UPDATE_GOLDEN=1 after an intended change of the exposition."""
    text = scrape(probe.url)
    if os.environ.get("SERVEPILOT_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    info = re.compile(r'^servepilot_probe_info\{pid="\d+",torch_version="[^"]+"\} 1\.0$', re.M)
    assert info.search(text)
    assert info.sub("INFO", text) == info.sub("INFO", GOLDEN.read_text())


def test_answers_are_never_gzipped_even_when_asked(probe: server.ProbeServer) -> None:
    """Compressing would run in the engine's process, under its GIL, to save bytes on loopback."""
    request = urllib.request.Request(probe.url, headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=5) as response:
        encoding = response.headers.get("Content-Encoding")
        text = response.read().decode()
    assert encoding is None
    assert "servepilot_probe_up 1.0" in text


def test_zero_reserved_serves_zero_fragmentation() -> None:
    running = server.serve(0, source=lambda: {0: {}})
    try:
        values = samples(scrape(running.url))
    finally:
        running.close()
    assert values[("servepilot_probe_fragmentation_ratio", "0")] == 0.0


def test_without_cuda_serves_availability_zero_and_no_devices() -> None:
    import torch  # real CPU-only torch: CUDA never initialised

    running = server.serve(0)
    try:
        text = scrape(running.url)
    finally:
        running.close()
    values = samples(text)
    assert values[("servepilot_probe_cuda_available", "")] == 0
    assert not [key for key in values if key[1]]
    assert f'torch_version="{torch.__version__}"' in text


def test_failing_source_serves_up_zero_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> dict[int, dict[str, Any]]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    running = server.serve(0, source=broken)
    try:
        with caplog.at_level(logging.WARNING, logger="servepilot.probe"):
            first, _ = scrape(running.url), scrape(running.url)
    finally:
        running.close()
    assert samples(first)[("servepilot_probe_up", "")] == 0
    assert len([r for r in caplog.records if "illegal memory access" in r.getMessage()]) == 1


def test_start_is_idempotent() -> None:
    first = agent.probe.start(port=0, source=tp2_source)
    assert first is not None
    assert agent.probe.start(port=0) is first


def test_port_in_use_warns_and_returns_none(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="servepilot.probe"):
            assert agent.probe.start(port=port, source=tp2_source) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"servepilot probe not started: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


def test_bad_port_env_warns_and_returns_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(server.PORT_ENV, "ninety")
    with caplog.at_level(logging.WARNING, logger="servepilot.probe"):
        assert agent.probe.start(source=tp2_source) is None
    assert "SERVEPILOT_PROBE_PORT must be an integer port" in caplog.text


def test_port_comes_from_argument_then_env_then_default() -> None:
    assert server.resolve_port(7000, {server.PORT_ENV: "7100"}) == 7000
    assert server.resolve_port(None, {server.PORT_ENV: "7100"}) == 7100
    assert server.resolve_port(None, {}) == server.DEFAULT_PORT


def test_close_releases_the_port() -> None:
    running = server.serve(0, source=tp2_source)
    port = running.port
    running.close()
    again = server.serve(port, source=tp2_source)
    again.close()
    assert again.port == port


def test_forget_after_fork_drops_the_inherited_server() -> None:
    closed: list[bool] = []
    httpd = type("Httpd", (), {"server_close": lambda self: closed.append(True)})()
    fake = server.ProbeServer("127.0.0.1", 1, None, _httpd=httpd, _thread=None)  # type: ignore[arg-type]
    server._running = fake
    server.forget_after_fork()
    assert server._running is None and closed == [True]


def test_the_probe_also_serves_the_leak_evidence_route() -> None:
    import json
    import urllib.request

    from agent.probe.server import serve

    server = serve(0, source=lambda: None)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/evidence/memory", timeout=5) as response:
            status = json.loads(response.read())
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            metrics = response.read().decode()
    finally:
        server.close()
    assert isinstance(status, dict)
    assert "servepilot_probe_up 1.0" in metrics
