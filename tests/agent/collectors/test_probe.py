"""The probe collector: pure parse on saved probe text, and end-to-end scrapes of the real probe server."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agent.collectors import probe as collector
from agent.collectors.probe import ProbeCollector, ProbeScrape, merge, parse, rank_urls
from agent.config import ProbeConfig
from agent.probe import server
from detectors.snapshot import SourceStatus

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "probe"
ALLOC = (70391676928, 70387482624)
RESERVED = (71303872512, 71974961152)


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def tp2_source() -> dict[int, dict[str, Any]]:
    return {int(k): v for k, v in json.loads(fixture("memory_stats_tp2.json")).items()}


# --- pure parse -------------------------------------------------------------------------------------


def test_parse_sums_devices() -> None:
    reading = parse(fixture("probe_tp2.prom"), now=5.0)
    assert reading.status is SourceStatus.OK and reading.observed_at == 5.0
    assert reading.values["probe.allocated_bytes"] == sum(ALLOC)
    assert reading.values["probe.reserved_bytes"] == sum(RESERVED)
    assert reading.values["probe.peak_reserved_bytes"] == 72058847232 + 72729935872
    assert reading.values["probe.alloc_retries_total"] == 2
    assert reading.values["probe.ooms_total"] == 1


def test_parse_fragmentation_is_recomputed_from_the_sums() -> None:
    reading = parse(fixture("probe_tp2.prom"), now=0.0)
    assert reading.values["probe.fragmentation_ratio"] == pytest.approx(1 - sum(ALLOC) / sum(RESERVED))


def test_parse_keeps_per_device_signals() -> None:
    values = parse(fixture("probe_tp2.prom"), now=0.0).values
    assert values["probe.device1.inactive_split_bytes"] == 1044381696
    assert values["probe.device0.fragmentation_ratio"] == pytest.approx(1 - ALLOC[0] / RESERVED[0])
    assert values["probe.device1.ooms_total"] == 1


def test_parse_carries_process_info() -> None:
    info = parse(fixture("probe_tp2.prom"), now=0.0).info
    assert info["torch_version"] and info["pid"].isdigit()


def test_no_cuda_is_no_data_not_an_error() -> None:
    reading = parse(fixture("probe_no_cuda.prom"), now=0.0)
    assert reading.status is SourceStatus.NO_DATA
    assert reading.values == {}
    assert "CUDA is not initialised" in (reading.error or "")


def test_other_exporters_text_is_an_error() -> None:
    reading = parse(fixture("not_a_probe_llamacpp_idle.prom"), now=0.0)
    assert reading.status is SourceStatus.ERROR
    assert reading.error == "no servepilot_probe_up sample: not a servepilot probe endpoint"


def test_garbage_is_a_one_line_error() -> None:
    reading = parse(fixture("garbage_html.prom"), now=0.0)
    assert reading.status is SourceStatus.ERROR
    assert (reading.error or "").startswith("not Prometheus text") and "\n" not in (reading.error or "")


def test_up_zero_is_an_error() -> None:
    text = "servepilot_probe_up 0\nservepilot_probe_cuda_available 1\n"
    assert parse(text, now=0.0).error == "probe could not read the allocator (servepilot_probe_up 0)"


def test_non_finite_samples_never_reach_the_reading() -> None:
    text = (
        "servepilot_probe_up 1\nservepilot_probe_cuda_available 1\n"
        'servepilot_probe_reserved_bytes{device="0"} NaN\n'
        'servepilot_probe_allocated_bytes{device="0"} +Inf\n'
        'servepilot_probe_ooms_total{device="0"} 3\n'
    )
    values = parse(text, now=0.0).values
    assert "probe.device0.reserved_bytes" not in values
    assert values["probe.reserved_bytes"] == 0 and values["probe.ooms_total"] == 3


def test_bad_device_label_is_an_error() -> None:
    text = 'servepilot_probe_up 1\nservepilot_probe_ooms_total{device="x"} 1\n'
    assert parse(text, now=0.0).error == "bad device label 'x': expected a CUDA device index"


def scrape_of(*devices: int) -> ProbeScrape:
    return ProbeScrape(
        True, True, {d: {"reserved_bytes": 100.0 + d, "allocated_bytes": 50.0} for d in devices}
    )


def test_ranks_with_distinct_devices_keep_their_indices() -> None:
    values = merge([scrape_of(0), scrape_of(1)], now=0.0).values
    assert values["probe.device1.reserved_bytes"] == 101 and values["probe.reserved_bytes"] == 201


def test_ranks_that_all_see_device_zero_are_numbered_by_rank() -> None:
    reading = merge([scrape_of(0), scrape_of(0)], now=0.0)
    assert {"probe.device0.reserved_bytes", "probe.device1.reserved_bytes"} <= set(reading.values)
    assert reading.info["device_numbering"] == "rank_order"


def test_one_rank_without_cuda_makes_the_reading_no_data() -> None:
    reading = merge([scrape_of(0), ProbeScrape(True, False)], now=0.0)
    assert reading.status is SourceStatus.NO_DATA and (reading.error or "").startswith("rank 1: ")


def test_rank_urls_step_the_port() -> None:
    assert rank_urls("http://127.0.0.1:9401/metrics", 3) == [
        "http://127.0.0.1:9401/metrics",
        "http://127.0.0.1:9402/metrics",
        "http://127.0.0.1:9403/metrics",
    ]
    assert rank_urls("http://[::1]:9401/m", 2)[1] == "http://[::1]:9402/m"


# --- end to end against the real probe server -------------------------------------------------------


@pytest.fixture
def probe() -> Iterator[server.ProbeServer]:
    running = server.serve(0, source=tp2_source)
    yield running
    running.close()


async def test_scrapes_the_real_probe_end_to_end(probe: server.ProbeServer) -> None:
    col = ProbeCollector(ProbeConfig(url=probe.url))
    try:
        reading = await col.collect(now=42.0)
    finally:
        await col.close()
    assert reading.status is SourceStatus.OK and reading.source == "probe"
    assert reading.values["probe.reserved_bytes"] == sum(RESERVED)
    assert reading.values["probe.device0.allocated_bytes"] == ALLOC[0]
    assert reading.values["probe.fragmentation_ratio"] == pytest.approx(1 - sum(ALLOC) / sum(RESERVED))
    assert reading.duration_s > 0


def consecutive_free_ports() -> int:
    for _ in range(20):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
        return int(base)
    pytest.skip("no two consecutive free loopback ports")


async def test_scrapes_two_ranks_on_consecutive_ports() -> None:
    base = consecutive_free_ports()
    rank0 = server.serve(base, source=lambda: {0: tp2_source()[0]})
    rank1 = server.serve(base + 1, source=lambda: {1: tp2_source()[1]})
    col = ProbeCollector(ProbeConfig(url=rank0.url, ranks=2))
    try:
        reading = await col.collect(now=1.0)
    finally:
        await col.close()
        rank0.close()
        rank1.close()
    assert reading.values["probe.reserved_bytes"] == sum(RESERVED)
    assert reading.info["pid"].count(",") == 1


async def test_refused_connection_is_an_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    col = ProbeCollector(ProbeConfig(url=f"http://127.0.0.1:{port}/metrics"))
    reading = await col.collect(now=0.0)
    await col.close()
    assert reading.status is SourceStatus.ERROR
    assert reading.error == f"cannot connect to http://127.0.0.1:{port}/metrics: Connection refused"


@pytest.fixture
async def fake_probe() -> AsyncIterator[tuple[TestServer, asyncio.Event]]:
    never = asyncio.Event()

    async def slow(_: web.Request) -> web.Response:
        await never.wait()
        return web.Response(text="")

    async def big(_: web.Request) -> web.Response:
        return web.Response(text="#" * (collector.MAX_BODY_BYTES + 10))

    app = web.Application()
    app.router.add_get("/slow", slow)
    app.router.add_get("/big", big)

    async def garbage(_: web.Request) -> web.Response:
        return web.Response(text=fixture("garbage_html.prom"))

    app.router.add_get("/garbage", garbage)
    test_server = TestServer(app, host="127.0.0.1", port=0)
    await test_server.start_server()
    yield test_server, never
    never.set()
    await test_server.close()


@pytest.mark.parametrize(
    ("path", "timeout_s", "expected"),
    [
        ("/slow", 0.05, "timed out after 0.05 s fetching http://127.0.0.1:{port}/slow"),
        ("/missing", 1.0, "http://127.0.0.1:{port}/missing answered HTTP 404 Not Found"),
        ("/big", 1.0, "http://127.0.0.1:{port}/big sent more than 1048576 bytes: not a servepilot probe"),
        ("/garbage", 1.0, "http://127.0.0.1:{port}/garbage: not Prometheus text"),
    ],
)
async def test_failing_endpoints_give_one_line_errors(
    fake_probe: tuple[TestServer, asyncio.Event], path: str, timeout_s: float, expected: str
) -> None:
    test_server, _ = fake_probe
    col = ProbeCollector(ProbeConfig(url=f"http://127.0.0.1:{test_server.port}{path}", timeout_s=timeout_s))
    reading = await col.collect(now=0.0)
    await col.close()
    assert reading.status is SourceStatus.ERROR
    assert (reading.error or "").startswith(expected.format(port=test_server.port))
    assert "\n" not in (reading.error or "")


async def test_unexpected_exception_never_escapes_collect(monkeypatch: pytest.MonkeyPatch) -> None:
    col = ProbeCollector(ProbeConfig())

    async def broken(url: str) -> ProbeScrape:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(col, "_scrape", broken)
    reading = await col.collect(now=0.0)
    assert reading.error == "unexpected RuntimeError: boom second line"


async def test_injected_session_is_left_open(probe: server.ProbeServer) -> None:
    async with aiohttp.ClientSession() as session:
        col = ProbeCollector(ProbeConfig(url=probe.url), session=session)
        await col.collect(now=0.0)
        await col.close()
        assert not session.closed


async def test_own_session_is_closed(probe: server.ProbeServer) -> None:
    col = ProbeCollector(ProbeConfig(url=probe.url))
    await col.collect(now=0.0)
    session = col._session
    await col.close()
    assert session is not None and session.closed


def test_parse_names_the_engine_s_gpus_by_uuid() -> None:
    info = parse(fixture("probe_tp2.prom"), now=0.0).info
    assert info["gpu_uuids"] == (
        "GPU-5d0f2b7e-1c3a-4e7b-9a53-0b1e7c4d2f10,GPU-a8e3c6d1-77b2-4f0e-8c15-3d9b2e6f4a21"
    )


def test_a_probe_that_names_only_some_devices_names_none() -> None:
    """Half a list would make the sidecar let go of one of the engine's GPUs."""
    text = "\n".join(
        line for line in fixture("probe_tp2.prom").splitlines() if 'device_info{device="1"' not in line
    )
    assert "gpu_uuids" not in parse(text + "\n", now=0.0).info


def test_ranks_name_their_gpus_in_rank_order() -> None:
    def scrape(device: int, uuid: str | None) -> ProbeScrape:
        return ProbeScrape(True, True, {device: {"reserved_bytes": 1.0}}, {}, {device: uuid} if uuid else {})

    merged = merge([scrape(0, "GPU-b"), scrape(0, "GPU-a")], now=0.0)
    assert merged.info["gpu_uuids"] == "GPU-b,GPU-a"
    assert "gpu_uuids" not in merge([scrape(0, "GPU-b"), scrape(0, None)], now=0.0).info
