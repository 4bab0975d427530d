"""A real ``servepilot run`` (gate on) reloads its config on SIGHUP, with a stream in flight through it.

The upstream is in-process: a completions route that answers at once, and a streaming one that holds
its stream open until the test releases it, so the reload demonstrably lands while a client is being
served. The only real-time waits are the process's start-up and polling its /metrics for the reload.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from agent.engines.launcher import free_port
from tests.faults.conftest import held_stream_upstream, serve

ROOT = Path(__file__).resolve().parents[2]
LINE = {"x-servepilot-line": "batch"}


def _config(
    upstream: str,
    agent_port: int,
    gate_port: int,
    *,
    rate: int,
    interval: int = 1,
    watch_s: float = 0,
    ttft_slo_s: float = 2.0,
) -> str:
    return (
        f"agent: {{listen_port: {agent_port}, interval_s: {interval}, config_watch_s: {watch_s}}}\n"
        f"engine: {{url: '{upstream}'}}\n"
        "nvml: {backend: 'off'}\nprobe: {enabled: false}\naudit: {path: null}\n"
        f"gate: {{enabled: true, listen_port: {gate_port}, health_interval_s: 600,"
        f" upstreams: {{primary: '{upstream}'}},"
        f" lines: {{batch: {{requests_per_min: {rate}, burst_ratio: 1}}}}}}\n"
        f"policies: {{ttft_slo_s: {ttft_slo_s}}}\n"
    )


async def _metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float | None:
    async with http.get(url) as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


async def _until(http: aiohttp.ClientSession, url: str, name: str, value: float, **labels: str) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            if await _metric(http, url, name, **labels) == value:
                return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)  # polling a real process
    raise AssertionError(f"{name}{labels} never read {value}")


async def _terminate(run: subprocess.Popen[str]) -> int:
    """SIGTERM, and the exit code within 20 s; killed if it does not exit (a test must not leak it)."""
    run.send_signal(signal.SIGTERM)
    try:
        return await asyncio.to_thread(run.wait, 20)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


async def _status(http: aiohttp.ClientSession, gate: str) -> int:
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    async with http.post(f"{gate}/v1/completions", json=body, headers=LINE) as response:
        await response.read()
        return response.status


async def test_sighup_applies_a_new_line_rate_without_cutting_a_stream(tmp_path: Path) -> None:
    release = asyncio.Event()
    agent_port, gate_port = free_port(), free_port()
    path = tmp_path / "servepilot.yaml"
    async with serve(held_stream_upstream(release)) as upstream, aiohttp.ClientSession() as http:
        path.write_text(_config(upstream, agent_port, gate_port, rate=1))
        run = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--config", str(path)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        gate, metrics = f"http://127.0.0.1:{gate_port}", f"http://127.0.0.1:{agent_port}/metrics"
        try:
            await _until(http, metrics, "servepilot_config_last_reload_successful", 1.0)
            # one request a minute, burst 1: a stream takes it, the next request is refused
            stream = await http.post(
                f"{gate}/v1/completions", json={"model": "m", "prompt": "p", "stream": True}, headers=LINE
            )
            assert stream.status == 200
            assert (await stream.content.readuntil(b"\n\n")).startswith(b"data: ")
            assert await _status(http, gate) == 429

            path.write_text(_config(upstream, agent_port, gate_port, rate=6000))
            run.send_signal(signal.SIGHUP)
            await _until(http, metrics, "servepilot_config_reloads_total", 1.0, result="applied")
            await asyncio.sleep(0.05)  # 100 requests/s refill: a few tokens by now
            assert await _status(http, gate) == 200
            release.set()
            rest = await stream.read()
            assert rest.endswith(b"data: [DONE]\n\n")  # the stream admitted before the reload ran on

            # a change that needs a restart: refused whole, the process runs on with the applied rate
            path.write_text(_config(upstream, agent_port, gate_port, rate=1, interval=2))
            run.send_signal(signal.SIGHUP)
            await _until(http, metrics, "servepilot_config_last_reload_successful", 0.0)
            assert run.poll() is None
            assert await _status(http, gate) == 200
        finally:
            release.set()
            code = await _terminate(run)
    output = run.stdout.read() if run.stdout else ""
    assert code == 0, output
    assert "config reload (SIGHUP): 1 field(s) changed: gate.lines.batch.requests_per_min" in output
    assert "config reload (SIGHUP) refused: agent.interval_s changed, which needs a restart" in output


async def test_with_config_watch_an_edited_file_is_applied_without_a_signal(tmp_path: Path) -> None:
    agent_port, gate_port = free_port(), free_port()
    path = tmp_path / "servepilot.yaml"
    async with serve(held_stream_upstream(asyncio.Event())) as upstream, aiohttp.ClientSession() as http:
        path.write_text(_config(upstream, agent_port, gate_port, rate=1, watch_s=0.1))
        run = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--config", str(path)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        gate, metrics = f"http://127.0.0.1:{gate_port}", f"http://127.0.0.1:{agent_port}/metrics"
        try:
            await _until(http, metrics, "servepilot_config_last_reload_successful", 1.0)
            assert [await _status(http, gate) for _ in range(2)] == [200, 429]
            assert await _metric(http, metrics, "servepilot_slo_ttft_seconds") == 2.0
            edited = _config(upstream, agent_port, gate_port, rate=6000, watch_s=0.1, ttft_slo_s=1.5)
            path.write_text(edited)
            await _until(http, metrics, "servepilot_config_reloads_total", 1.0, result="applied")
            await asyncio.sleep(0.05)  # 100 requests/s refill
            assert await _status(http, gate) == 200
            # the SLO target too: what the alert rules and panels compare against follows the file
            assert await _metric(http, metrics, "servepilot_slo_ttft_seconds") == 1.5
        finally:
            assert await _terminate(run) == 0


async def test_api_keys_rotated_in_their_file_apply_without_a_signal(tmp_path: Path) -> None:
    """Keys in a file (a mounted Secret in the pod manifests): the kubelet rewrites it, the config file
    stays as it was, and the watch applies the new keys. Key ``sk-a`` names the 1/min line ``batch`` until
    the rotation; after it, ``sk-a`` is unknown (the default line) and ``sk-b`` is the one on ``batch``."""
    agent_port, gate_port = free_port(), free_port()
    path, keys = tmp_path / "servepilot.yaml", tmp_path / "gate-api-keys"
    keys.write_text("sk-a-0123456789abcdef: batch\n")
    async with serve(held_stream_upstream(asyncio.Event())) as upstream, aiohttp.ClientSession() as http:
        text = _config(upstream, agent_port, gate_port, rate=1, watch_s=0.1)
        path.write_text(
            text.replace("health_interval_s: 600,", f"health_interval_s: 600, api_keys_file: '{keys}',")
        )
        run = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--config", str(path)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        gate, metrics = f"http://127.0.0.1:{gate_port}", f"http://127.0.0.1:{agent_port}/metrics"

        async def status(key: str) -> int:
            body = {"model": "m", "prompt": "hi", "max_tokens": 1}
            auth = {"Authorization": f"Bearer {key}"}
            async with http.post(f"{gate}/v1/completions", json=body, headers=auth) as response:
                await response.read()
                return response.status

        try:
            await _until(http, metrics, "servepilot_config_last_reload_successful", 1.0)
            assert [await status("sk-a-0123456789abcdef") for _ in range(2)] == [200, 429]
            keys.write_text("sk-b-0123456789abcdef: batch\n")
            await _until(http, metrics, "servepilot_config_reloads_total", 1.0, result="applied")
            assert await status("sk-a-0123456789abcdef") == 200  # now unknown: the default line's rate
            assert await status("sk-b-0123456789abcdef") == 429  # on batch, whose bucket is still empty
        finally:
            code = await _terminate(run)
    output = run.stdout.read() if run.stdout else ""
    assert code == 0, output
    assert "config reload (file changed): 1 field(s) changed: gate.api_keys" in output
    assert "sk-" not in output


async def test_the_standalone_gate_reloads_on_sighup_keeping_its_command_line_overrides(
    tmp_path: Path,
) -> None:
    """``servepilot gate --config F --upstream URL``: the re-read file gets the same overrides, so only the
    edited rate is a change; an edit that needs a restart is refused and the gate serves on. Its metrics
    port shows both reloads, and the gate's own series (the gate's port passes /metrics upstream), the
    late-request count included."""
    gate_port, metrics_port = free_port(), free_port()
    path = tmp_path / "gate.yaml"

    def config(rate: int, interval: int = 1) -> str:  # upstreams in the file are replaced by --upstream
        return (
            f"agent: {{interval_s: {interval}}}\naudit: {{path: null}}\n"
            "gate: {health_interval_s: 600, upstreams: {primary: 'http://127.0.0.1:9'},"
            f" lines: {{batch: {{requests_per_min: {rate}, burst_ratio: 1}}}}}}\n"
        )

    release = asyncio.Event()
    async with serve(held_stream_upstream(release)) as upstream, aiohttp.ClientSession() as http:
        path.write_text(config(rate=1))
        run = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "gate", "--config", str(path), "--upstream", upstream,
             "--port", str(gate_port), "--metrics-port", str(metrics_port), "--log-level", "info"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        gate = f"http://127.0.0.1:{gate_port}"
        try:
            deadline = time.monotonic() + 15
            while True:  # up once /v1/models passes through to the upstream
                try:
                    async with http.get(f"{gate}/v1/models") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "the gate did not come up"
                await asyncio.sleep(0.05)  # polling a real process
            assert [await _status(http, gate) for _ in range(2)] == [200, 429]
            path.write_text(config(rate=6000))
            run.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 15
            while await _status(http, gate) != 200:  # a minute's refill at the old rate: only a reload
                assert time.monotonic() < deadline, "the raised rate never applied"
                await asyncio.sleep(0.05)
            path.write_text(config(rate=6000, interval=2))
            run.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.3)  # the refusal is only logged: no change to wait for
            assert run.poll() is None and await _status(http, gate) == 200
            async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as response:
                metrics = await response.text()
            assert 'servepilot_config_reloads_total{result="applied"} 1.0' in metrics
            assert 'servepilot_config_reloads_total{result="refused"} 1.0' in metrics
            assert 'servepilot_gate_requests_total{line="batch",outcome="ok",priority="normal"}' in metrics
            assert 'servepilot_build_info{event_loop="uvloop",python_version=' in metrics  # what runs here
            async with http.get(f"http://127.0.0.1:{metrics_port}/readyz") as response:
                assert response.status == 200 and (await response.json())["healthy_upstreams"] == ["primary"]
            # judged by the policies' SLO (0.1 s ITL): a stream held 0.3 s after its first token with
            # max_tokens 3 will miss it, and is counted late while it is held
            body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}
            async with http.post(f"{gate}/v1/completions", json=body, headers=LINE) as held:
                await held.content.readuntil(b"\n\n")
                await asyncio.sleep(0.3)  # real time: the gate is another process
                async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as response:
                    assert 'servepilot_gate_late_requests{upstream="primary"} 1.0' in await response.text()
                held.close()  # the client gives up
            release.set()  # and the upstream's handler ends, so the test server stops at once
        finally:
            code = await _terminate(run)
    output = run.stdout.read() if run.stdout else ""
    assert code == 0, output
    assert "config reload (SIGHUP): 1 field(s) changed: gate.lines.batch.requests_per_min" in output
    assert "config reload (SIGHUP) refused: agent.interval_s changed, which needs a restart" in output


async def test_the_standalone_gate_ignores_sighup_while_it_stops(tmp_path: Path) -> None:
    """``servepilot gate --config F``: a SIGHUP while it drains a stream (drain_s 60) is logged and ignored
    (it was a reload racing the stop, and once the loop closed SIGHUP's default, an exit); a second
    SIGTERM then ends it, exit 0."""
    gate_port = free_port()
    path = tmp_path / "gate.yaml"
    path.write_text("audit: {path: null}\ngate: {health_interval_s: 600, drain_s: 60}\n")
    release = asyncio.Event()
    async with serve(held_stream_upstream(release)) as upstream, aiohttp.ClientSession() as http:
        run = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "gate", "--config", str(path), "--upstream", upstream,
             "--port", str(gate_port), "--no-metrics", "--log-level", "info"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        gate = f"http://127.0.0.1:{gate_port}"
        try:
            deadline = time.monotonic() + 15
            while True:  # up once a request passes through to the upstream
                try:
                    if await _status(http, gate) == 200:
                        break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "the gate did not come up"
                await asyncio.sleep(0.05)  # polling a real process
            body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}
            async with http.post(f"{gate}/v1/completions", json=body) as held:
                await held.content.readuntil(b"\n\n")
                run.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)  # a real process, draining the held stream
                run.send_signal(signal.SIGHUP)
                await asyncio.sleep(0.5)
                assert run.poll() is None  # still draining, not ended by the SIGHUP
                run.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(run.wait, 20)
            release.set()
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    output = run.stdout.read() if run.stdout else ""
    assert code == 0, output
    assert "SIGHUP ignored: stopping" in output
    assert "gate: cutting 1 request(s) in progress short" in output
