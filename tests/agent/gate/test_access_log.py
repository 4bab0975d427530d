"""The gate's access log (``gate.access_log``): one JSON line per request, whatever became of it, written
off the data path; dropped and counted, never waited for, when the writer falls behind."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from agent.config import ConfigError, GateConfig, GateLineConfig
from agent.gate.access_log import QUEUE_LINES, AccessLog
from agent.gate.proxy import Gate
from simulator.engine import make_core
from simulator.server import SimServer

TIMEOUT = 10.0


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    runner = web.AppRunner(SimServer(make_core("h100-sxm", "llama-3-8b", "fp16", 64), speed=50.0).app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _one(log: AccessLog, path: str = "/") -> None:
    log.write(
        method="GET", path=path, status=200, held_s=0.0, headers={}, remote=None, record=None, bucket=None
    )


async def test_every_request_gets_one_line_saying_what_became_of_it(engine: str, tmp_path: Path) -> None:
    log = tmp_path / "access.jsonl"
    lines = {"batch": GateLineConfig(requests_per_min=1, burst_ratio=1.0)}
    cfg = GateConfig(
        enabled=True, upstreams={"primary": engine}, health_interval_s=600, access_log=str(log), lines=lines,
        max_body_bytes=4096,
    )  # fmt: skip
    gate = Gate(cfg, CollectorRegistry())
    port = await gate.start("127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    body = {
        "prompt": "hello " * 40,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as http:
            async with http.post(
                f"{base}/v1/completions",
                json=body,
                headers={"X-Request-Id": "req-1", "X-Forwarded-For": "203.0.113.7"},
            ) as r:
                assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
            for _ in range(2):  # the line's one request a minute: the second is refused
                async with http.post(
                    f"{base}/v1/completions",
                    json={"prompt": "hi", "max_tokens": 8},
                    headers={"x-servepilot-line": "batch"},
                ) as r:
                    await r.read()
            async with http.get(f"{base}/health") as r:  # passed through, not admitted
                assert r.status == 200
            async with http.post(f"{base}/v1/completions", json={**body, "prompt": "x" * 5000}) as r:
                assert r.status == 413
            async with http.post(f"{base}/v1/completions", json={**body, "max_tokens": 4000}) as r:
                await r.content.readuntil(b"\n\n")  # the first event, then the client leaves
            async with asyncio.timeout(TIMEOUT):
                while gate.in_progress:
                    await asyncio.sleep(0.01)
    finally:
        await gate.stop()  # writes what is queued and closes the file
    streamed, batch_ok, batch_refused, health, too_large, left = _lines(log)
    assert streamed["request_id"] == "req-1" and streamed["status"] == 200 and streamed["outcome"] == "ok"
    assert (streamed["method"], streamed["path"], streamed["line"], streamed["priority"]) == (
        "POST", "/v1/completions", "default", "normal",
    )  # fmt: skip
    assert (
        streamed["upstream"] == "primary" and streamed["output_tokens"] == 8 and streamed["bucket"] == "le256"
    )
    assert 0 < streamed["ttft_s"] <= streamed["duration_s"] and streamed["start"].endswith("Z")
    assert streamed["remote"] == "127.0.0.1" and streamed["forwarded_for"] == "203.0.113.7"
    assert streamed["queue_wait_s"] >= 0 and 0 <= streamed["gate_s"] < streamed["ttft_s"]
    assert (batch_ok["line"], batch_ok["status"], batch_ok["outcome"]) == ("batch", 200, "ok")
    assert (batch_refused["status"], batch_refused["outcome"], batch_refused["refused"]) == (
        429, "rejected", "request_rate",
    )  # fmt: skip
    assert "refused" not in batch_ok
    assert "upstream" not in batch_refused and "ttft_s" not in batch_refused and "gate_s" not in batch_refused
    assert (health["path"], health["status"]) == ("/health", 200) and "line" not in health
    assert too_large["status"] == 413 and "line" not in too_large
    assert left["outcome"] == "disconnected" and left["output_tokens"] < 4000
    assert not any(key in json.dumps(line) for line in _lines(log) for key in ("hello", "authorization"))


def test_lines_are_dropped_and_counted_when_the_writer_falls_behind(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    log = AccessLog(str(tmp_path / "access.jsonl"), registry)  # not started: nothing drains the queue
    for i in range(QUEUE_LINES + 5):
        _one(log, f"/{i}")
    assert registry.get_sample_value("servepilot_gate_access_log_dropped_total") == 5
    log.start()
    log.stop()
    assert len(_lines(tmp_path / "access.jsonl")) == QUEUE_LINES  # what was queued is written at stop


def test_the_file_is_rotated_and_a_path_that_cannot_be_opened_names_the_field(tmp_path: Path) -> None:
    log = AccessLog(str(tmp_path / "access.jsonl"), CollectorRegistry(), max_bytes=2000, backups=2)
    log.start()
    for batch in range(4):  # lines queued together are written together: rotation between batches
        for i in range(20):
            _one(log, f"/{batch}/{i}")
        deadline = time.monotonic() + 5
        while log.pending and time.monotonic() < deadline:
            time.sleep(0.01)
    log.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["access.jsonl", "access.jsonl.1", "access.jsonl.2"]
    with pytest.raises(ConfigError, match=r"^gate\.access_log cannot open /nonexistent/access\.jsonl"):
        Gate(GateConfig(enabled=True, access_log="/nonexistent/access.jsonl"), CollectorRegistry())


def test_a_write_that_fails_is_counted_once_per_line_without_a_traceback(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    registry = CollectorRegistry()
    log = AccessLog("/dev/full", registry)  # every write: ENOSPC, a full disk
    log.start()
    for i in range(3):
        _one(log, f"/{i}")
    log.stop()
    assert registry.get_sample_value("servepilot_gate_access_log_dropped_total") == 3
    assert "Traceback" not in capsys.readouterr().err
    assert [r.message for r in caplog.records].count(
        "the access log /dev/full cannot be written: OSError(28, 'No space left on device')"
    ) == 1


def test_a_stalled_writer_does_not_hold_the_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """stdout's reader stopped reading: the writer thread blocks in a write, and the stop gives up on it
    after STOP_WAIT_S rather than hang the sidecar's shutdown."""
    import threading

    from agent.gate import access_log

    release = threading.Event()

    class Stalled:
        def write(self, _: str) -> int:
            release.wait(10)
            return 0

        def flush(self) -> None:
            pass

    monkeypatch.setattr(access_log, "STOP_WAIT_S", 0.1)
    monkeypatch.setattr(access_log.sys, "stdout", Stalled())
    log = AccessLog("stdout", CollectorRegistry())
    log.start()
    _one(log)
    started = time.monotonic()
    log.stop()
    assert time.monotonic() - started < 1.0
    release.set()


def test_stdout_is_the_containers_log_and_an_env_override_can_name_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from agent.config import build

    cfg = build({}, {"SERVEPILOT_GATE__ACCESS_LOG": "stdout"})  # "-" would read as a YAML list
    log = AccessLog(cfg.gate.access_log or "", CollectorRegistry())
    log.start()
    _one(log, "/health")
    log.stop()
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["path"] == "/health"
