"""SIGTERM while the gate relays requests: accepted requests finish, new connections are refused.

In-process tests hold an upstream stream open with an event the test controls, so "in flight" is exact.
The end-to-end test runs ``servepilot sim`` and ``servepilot run`` (gate enabled) as real processes,
starts three slow streams through the gate, sends SIGTERM once each has its first token, and checks
every stream arrives whole. Only the subprocess test waits on real time (start-up, ~2 s of streaming).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from agent.config import GateConfig
from agent.engines.launcher import free_port as _free_port
from agent.gate.proxy import Gate
from tests.faults.conftest import held_stream_upstream, serve

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}


async def _refused(port: int, attempts: int = 200) -> bool:
    """True once a new connection to ``port`` is refused (each attempt yields to the event loop)."""
    for _ in range(attempts):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return True
        writer.close()
        await asyncio.sleep(0)
    return False


@pytest.fixture
async def release() -> AsyncIterator[asyncio.Event]:
    event = asyncio.Event()
    yield event
    event.set()  # never leave the upstream handler waiting


async def _gate(upstream: str, drain_s: float, shutdown_delay_s: float = 0.0) -> tuple[Gate, str]:
    cfg = GateConfig(
        enabled=True,
        upstreams={"primary": upstream},
        drain_s=drain_s,
        shutdown_delay_s=shutdown_delay_s,
        health_interval_s=600,
    )
    gate = Gate(cfg, CollectorRegistry())
    port = await gate.start("127.0.0.1", 0)
    return gate, f"http://127.0.0.1:{port}"


async def test_an_accepted_stream_finishes_while_new_connections_are_refused(release: asyncio.Event) -> None:
    async with serve(held_stream_upstream(release)) as upstream, aiohttp.ClientSession() as http:
        gate, url = await _gate(upstream, drain_s=30.0)
        response = await http.post(f"{url}/v1/completions", json=BODY)
        assert await response.content.readuntil(b"\n\n") == b"data: one\n\n"
        stopping = asyncio.create_task(gate.stop())
        assert await _refused(gate.port or 0)
        assert not stopping.done() and gate.in_progress == 1
        release.set()
        assert await response.read() == b"data: two\n\ndata: [DONE]\n\n"
        await asyncio.wait_for(stopping, timeout=5)
        assert gate.cut == 0


async def test_new_requests_are_served_through_the_shutdown_delay(release: asyncio.Event) -> None:
    """Kubernetes sends SIGTERM as it takes the pod out of the Service's endpoints, and the nodes learn it
    a moment later: connections sent meanwhile are served, not refused, for ``shutdown_delay_s``."""
    async with serve(held_stream_upstream(release)) as upstream, aiohttp.ClientSession() as http:
        gate, url = await _gate(upstream, drain_s=30.0, shutdown_delay_s=1.0)
        held = await http.post(f"{url}/v1/completions", json=BODY)
        await held.content.readuntil(b"\n\n")
        stopping = asyncio.create_task(gate.stop())
        for _ in range(1000):  # stop() ends the health checks first, then drains
            if gate.shutting_down:
                break
            await asyncio.sleep(0)
        assert gate.shutting_down
        async with aiohttp.ClientSession() as fresh, fresh.get(f"{url}/v1/models") as late:
            assert late.status == 200  # a new connection, after the shutdown began
            assert late.headers["Connection"] == "close"  # not kept: the next one goes elsewhere
        assert not stopping.done()
        assert await _refused(gate.port or 0, attempts=10_000)  # then the listener closes
        release.set()
        assert await held.read() == b"data: two\n\ndata: [DONE]\n\n"
        await asyncio.wait_for(stopping, timeout=5)
        assert gate.cut == 0


async def test_the_drain_is_bounded_by_drain_s(release: asyncio.Event) -> None:
    async with serve(held_stream_upstream(release)) as upstream, aiohttp.ClientSession() as http:
        gate, url = await _gate(upstream, drain_s=0.1)
        response = await http.post(f"{url}/v1/completions", json=BODY)
        await response.content.readuntil(b"\n\n")
        started = time.monotonic()
        await gate.stop()  # the upstream never finishes: the stream is cut at drain_s
        assert time.monotonic() - started < 2.0
        assert gate.cut == 1
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
        release.set()  # let the upstream handler end so its server stops at once


async def test_a_hurry_ends_the_delay_and_cuts_the_drain_short(release: asyncio.Event) -> None:
    """A second SIGTERM or Ctrl-C (agent/stop_signals.py): no waiting out the delay or ``drain_s``."""
    async with serve(held_stream_upstream(release)) as upstream, aiohttp.ClientSession() as http:
        gate, url = await _gate(upstream, drain_s=600.0, shutdown_delay_s=300.0)
        response = await http.post(f"{url}/v1/completions", json=BODY)
        await response.content.readuntil(b"\n\n")
        hurry = asyncio.Event()
        stopping = asyncio.create_task(gate.stop(hurry))
        for _ in range(1000):
            if gate.shutting_down:
                break
            await asyncio.sleep(0)
        assert gate.shutting_down and not stopping.done()
        hurry.set()
        await asyncio.wait_for(stopping, timeout=5)
        assert gate.cut == 1 and gate.in_progress == 0
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
        release.set()  # let the upstream handler end so its server stops at once


TOKENS = 150  # ~1.5 s per stream on the simulated A100: SIGTERM lands well inside it


async def _stream(
    http: aiohttp.ClientSession, url: str, started: asyncio.Event, tokens: int = TOKENS
) -> tuple[int, bytes]:
    body = {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "prompt": "hello " * 50}
    async with http.post(url, json={**body, "max_tokens": tokens, "stream": True}) as response:
        first = await response.content.readuntil(b"\n\n")
        started.set()
        return response.status, first + await response.read()


async def _wait_ready(http: aiohttp.ClientSession, url: str, procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a process exited during start-up"
        try:
            async with http.get(url) as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)  # polling real processes that are starting up
    raise AssertionError(f"{url} never answered")


async def _wait_status(http: aiohttp.ClientSession, url: str, status: int) -> None:
    for _ in range(100):
        async with http.get(url) as response:
            if response.status == status:
                return
        await asyncio.sleep(0.01)  # a real process reacting to a signal
    raise AssertionError(f"{url} never answered {status}")


@dataclass
class Processes:
    """``servepilot sim`` and ``servepilot run`` with its gate in front of it, as real processes."""

    sim: subprocess.Popen[str]
    run: subprocess.Popen[str]
    gate: str
    readyz: str

    def output(self) -> str:
        return self.run.stdout.read() if self.run.stdout else ""


@contextlib.contextmanager
def _sim_and_run(tmp_path: Path, gate: str, agent: str = "") -> Iterator[Processes]:
    """Both started (not yet ready), with ``gate`` and ``agent``'s settings added; killed on the way out
    if still running."""
    sim_port, gate_port, agent_port = _free_port(), _free_port(), _free_port()
    (tmp_path / "agent.yaml").write_text(
        f"agent: {{listen_port: {agent_port}, admin_listen_port: {_free_port()}{agent}}}\n"
        f"engine: {{url: 'http://127.0.0.1:{sim_port}'}}\n"
        "nvml: {backend: 'off'}\naudit: {path: null}\nforecast: {enabled: false}\n"
        f"gate: {{enabled: true, listen_port: {gate_port}, {gate},"
        f" upstreams: {{primary: 'http://127.0.0.1:{sim_port}'}}}}\n"
    )
    cli = [sys.executable, "-m", "agent.cli"]
    sim = subprocess.Popen([*cli, "sim", "--port", str(sim_port)], cwd=ROOT, stdout=subprocess.DEVNULL)
    run = subprocess.Popen(
        [*cli, "run", "--config", str(tmp_path / "agent.yaml")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        yield Processes(sim, run, f"http://127.0.0.1:{gate_port}", f"http://127.0.0.1:{agent_port}/readyz")
    finally:
        for proc in (run, sim):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def test_sigterm_drains_the_gate_of_servepilot_run(tmp_path: Path) -> None:
    with _sim_and_run(tmp_path, "drain_s: 20, shutdown_delay_s: 2") as p:
        async with aiohttp.ClientSession() as http:
            await _wait_ready(http, f"{p.gate}/v1/models", [p.sim, p.run])
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(_stream(http, f"{p.gate}/v1/completions", s)) for s in started]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), timeout=10)
            await _wait_ready(http, p.readyz, [p.sim, p.run])
            p.run.send_signal(signal.SIGTERM)
            # through the shutdown delay: unready, yet a request sent now is served
            await _wait_status(http, p.readyz, 503)
            late = _stream(
                http, f"{p.gate}/v1/completions", asyncio.Event(), 2 * TOKENS
            )  # outlasts the delay
            streams.append(asyncio.create_task(late))
            results = await asyncio.wait_for(asyncio.gather(*streams), timeout=20)
        code = await asyncio.to_thread(p.run.wait, 20)
    output = p.output()
    assert code == 0, output
    # the three streaming at SIGTERM, and the one sent after it
    for (status, body), tokens in zip(results, (TOKENS, TOKENS, TOKENS, 2 * TOKENS), strict=True):
        assert status == 200
        assert body.count(b"data: ") == tokens + 1  # every token (the last one finishes) and [DONE]
        assert body.endswith(b"data: [DONE]\n\n")
    assert "gate shutting down: new requests accepted for 2 s more" in output
    assert re.search(r"gate draining: [1-4] request\(s\) in progress", output)  # the late one at least
    assert "(0 cut at the limit)" in output


async def test_a_second_sigterm_cuts_the_stop_of_servepilot_run_short(tmp_path: Path) -> None:
    """The first SIGTERM drains (for up to a minute here); a SIGHUP meanwhile is ignored; the second
    SIGTERM cuts the stream in progress, and the rest of the stop still runs: the state is saved."""
    state = tmp_path / "state.json"
    with _sim_and_run(tmp_path, "drain_s: 60", agent=f", state_path: '{state}'") as p:
        async with aiohttp.ClientSession() as http:
            await _wait_ready(http, f"{p.gate}/v1/models", [p.sim, p.run])
            started = asyncio.Event()
            long = asyncio.create_task(
                _stream(http, f"{p.gate}/v1/completions", started, 20 * TOKENS)
            )  # ~30 s
            await asyncio.wait_for(started.wait(), timeout=10)
            await _wait_ready(http, p.readyz, [p.sim, p.run])
            p.run.send_signal(signal.SIGTERM)
            await _wait_status(http, p.readyz, 503)
            await asyncio.sleep(1.0)  # a real process draining: it must still be waiting for the stream
            assert p.run.poll() is None and not long.done() and not state.exists()
            p.run.send_signal(signal.SIGHUP)  # a reload asked for mid-stop is not SIGHUP's default, an exit
            await asyncio.sleep(0.5)
            assert p.run.poll() is None
            p.run.send_signal(signal.SIGTERM)
            hurried = time.monotonic()
            code = await asyncio.to_thread(p.run.wait, 20)
            took = time.monotonic() - hurried
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(long, timeout=5)
    output = p.output()
    assert code == 0, output
    assert took < 5.0, output  # not the minute of drain_s, nor the ~30 s the stream had left
    assert "SIGTERM: stopping (send it again to cut the requests in progress short)" in output
    assert "gate: cutting 1 request(s) in progress short" in output
    assert "(1 cut short)" in output
    assert "SIGHUP ignored: stopping" in output
    assert state.exists()  # saved after the drain, as a clean stop does
