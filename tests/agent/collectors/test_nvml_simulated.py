"""SimulatedNvmlBackend: the pure parser on saved documents, and the HTTP client against a loopback server."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agent.collectors.nvml_backend import GpuLostError, NvmlUnavailableError
from agent.collectors.nvml_simulated import SimulatedNvmlBackend, parse_payload

FIXTURES = Path(__file__).parents[2] / "fixtures" / "nvml"


def _load(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


# -- parse_payload (pure) ---------------------------------------------------------------------------


def test_parse_converts_to_base_units() -> None:
    gpu = parse_payload(_load("sim_nvml_2gpu.json"))[0]
    s = gpu.sample
    assert (s.sm_clock_hz, s.memory_clock_hz, s.power_watts) == (1.755e9, 2.619e9, 612.5)
    assert (s.utilization_ratio, s.energy_joules, s.throttle_reasons) == (0.87, 18234567.125, 36)


def test_parse_keeps_identity_and_driver() -> None:
    info = parse_payload(_load("sim_nvml_2gpu.json"))[1].info
    assert (info.index, info.uuid, info.driver_version) == (
        1,
        "GPU-7c9d2f10-1b2c-4e3f-9a8b-0c1d2e3f4a5b",
        "550.54.15",
    )


def test_parse_reads_processes_by_pid() -> None:
    assert parse_payload(_load("sim_nvml_2gpu.json"))[0].processes == {4242: 75161927680, 4250: 536870912}


def test_parse_drops_each_bad_field_alone() -> None:
    s = parse_payload(_load("sim_nvml_bad_fields.json"))[0].sample
    dropped = (
        s.utilization_ratio,
        s.memory_bandwidth_utilization_ratio,
        s.memory_clock_hz,
        s.temperature_celsius,
        s.power_watts,
        s.energy_joules,
        s.throttle_reasons,
    )
    assert dropped == (None,) * 7
    assert (s.sm_clock_hz, s.power_limit_watts) == (1.71e9, 300.0)


def test_parse_drops_malformed_process_entries() -> None:
    assert parse_payload(_load("sim_nvml_bad_fields.json"))[0].processes == {}


def test_parse_rejects_a_document_whose_gpus_is_not_a_list() -> None:
    with pytest.raises(NvmlUnavailableError, match="'gpus' must be a list"):
        parse_payload(_load("sim_nvml_gpus_not_list.json"))


def test_parse_rejects_duplicate_indices() -> None:
    with pytest.raises(NvmlUnavailableError, match="appears twice"):
        parse_payload({"gpus": [{"index": 0}, {"index": 0}]})


# -- over HTTP ----------------------------------------------------------------------------------------


class SimServer:
    """A loopback server for /sim/nvml whose answer a test can change."""

    def __init__(self) -> None:
        self.body = (FIXTURES / "sim_nvml_2gpu.json").read_bytes()
        self.status = 200
        self.requests = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        return web.Response(body=self.body, status=self.status, content_type="application/json")


@pytest.fixture
async def sim(aiohttp_server: Any) -> tuple[SimServer, SimulatedNvmlBackend]:
    state = SimServer()
    app = web.Application()
    app.router.add_get("/sim/nvml", state.handle)
    server = await aiohttp_server(app, host="127.0.0.1", port=0)
    return state, SimulatedNvmlBackend(str(server.make_url("/")), timeout_s=2.0)


async def test_init_lists_the_simulated_gpus(sim: tuple[SimServer, SimulatedNvmlBackend]) -> None:
    _, backend = sim
    infos = await asyncio.to_thread(backend.init)
    assert [i.index for i in infos] == [0, 1]


def _round(backend: SimulatedNvmlBackend) -> list[Any]:
    backend.begin_round()
    return [backend.sample(i, slow=False) for i in (0, 1)] + [backend.processes(0)]


async def test_one_request_per_round_for_all_gpus(sim: tuple[SimServer, SimulatedNvmlBackend]) -> None:
    state, backend = sim
    await asyncio.to_thread(backend.init)
    await asyncio.to_thread(_round, backend)
    assert state.requests == 2  # one for init, one for the round covering both GPUs and processes


async def test_fast_sample_leaves_slow_fields_empty(sim: tuple[SimServer, SimulatedNvmlBackend]) -> None:
    _, backend = sim
    await asyncio.to_thread(backend.init)
    fast = (await asyncio.to_thread(_round, backend))[0]
    assert (fast.energy_joules, fast.power_limit_watts, fast.power_watts) == (None, None, 612.5)


async def test_http_error_makes_the_backend_unavailable(sim: tuple[SimServer, SimulatedNvmlBackend]) -> None:
    state, backend = sim
    state.status = 503
    with pytest.raises(NvmlUnavailableError, match="HTTP 503"):
        await asyncio.to_thread(backend.init)


async def test_invalid_json_makes_the_backend_unavailable(
    sim: tuple[SimServer, SimulatedNvmlBackend],
) -> None:
    state, backend = sim
    state.body = b"{not json"
    with pytest.raises(NvmlUnavailableError, match="invalid JSON"):
        await asyncio.to_thread(backend.init)


async def test_gpu_missing_from_a_later_round_is_lost(sim: tuple[SimServer, SimulatedNvmlBackend]) -> None:
    state, backend = sim
    await asyncio.to_thread(backend.init)
    document = _load("sim_nvml_2gpu.json")
    document["gpus"] = document["gpus"][:1]
    state.body = json.dumps(document).encode()
    await asyncio.to_thread(backend.begin_round)
    with pytest.raises(GpuLostError):
        backend.sample(1, slow=False)


def test_unreachable_simulator_is_unavailable() -> None:
    # A bound but not listening loopback socket refuses connections at once, and holds the port meanwhile.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        backend = SimulatedNvmlBackend(f"http://127.0.0.1:{holder.getsockname()[1]}", timeout_s=0.5)
        with pytest.raises(NvmlUnavailableError, match="unreachable"):
            backend.init()
