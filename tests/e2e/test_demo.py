"""`servepilot demo` as a user runs it: a subprocess, real ports, real HTTP, Ctrl-C to stop.

Acceptance of the foundation issue: within 30 s the agent's /metrics shows live servepilot_ series from
the (simulated) NVML, engine and probe sources, and SIGINT ends the demo with exit code 0 within 5 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.engines.launcher import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()))
            values[key] = sample.value
    return values


def _live(values: dict[str, float]) -> dict[str, bool]:
    """Which sources show live values: each up, and a value that only a working source produces."""
    return {
        "nvml": values.get("servepilot_nvml_up") == 1
        and values.get("servepilot_gpu_utilization_ratio,agg=mean,gpu=0", 0) > 0,
        "engine": values.get("servepilot_engine_up") == 1
        and values.get("servepilot_engine_generation_tokens_per_second", 0) > 0,
        "probe": values.get("servepilot_probe_up") == 1
        and values.get("servepilot_allocator_reserved_bytes,device=all", 0) > 0,
    }


def test_demo_shows_live_series_from_every_source_and_stops_on_ctrl_c() -> None:
    agent_port, engine_port = _free_port(), _free_port()
    cmd = [
        sys.executable, "-m", "agent.cli", "demo", "--no-view",
        "--port", str(agent_port), "--engine-port", str(engine_port), "--duration", "120",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    started = time.monotonic()
    live: dict[str, bool] = {}
    try:
        while time.monotonic() - started < 30 and proc.poll() is None:
            try:
                live = _live(_scrape(agent_port))
            except OSError:
                live = {}
            if live and all(live.values()):
                break
            time.sleep(0.5)  # polling a real subprocess; the demo ticks once a second
        seen_after = time.monotonic() - started
        assert live and all(live.values()), f"sources not live within 30 s: {live}"
        proc.send_signal(signal.SIGINT)
        stop_started = time.monotonic()
        code = proc.wait(timeout=10)
        stop_took = time.monotonic() - stop_started
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.stdout.read() if proc.stdout else ""
    assert code == 0, output
    assert stop_took < 5, f"took {stop_took:.1f} s to stop"
    assert "Traceback" not in output, output
    print(f"live after {seen_after:.1f} s, stopped in {stop_took:.2f} s")


def test_demo_duration_ends_it_with_exit_code_0() -> None:
    agent_port, engine_port = _free_port(), _free_port()
    cmd = [
        sys.executable, "-m", "agent.cli", "demo", "--no-view",
        "--port", str(agent_port), "--engine-port", str(engine_port), "--duration", "3",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "servepilot demo: stopped after" in result.stderr


def test_demo_with_a_taken_port_fails_cleanly() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "agent.cli",
            "demo",
            "--no-view",
            "--engine-port",
            str(port),
            "--duration",
            "2",
        ]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "cannot start" in result.stderr
    assert "Traceback" not in result.stderr


def _actions(port: int) -> list[dict[str, object]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/actions", timeout=2) as response:
        return list(json.loads(response.read())["actions"])


def _batch_moves(actions: list[dict[str, object]], result: str) -> list[dict[str, object]]:
    return [a for a in actions if a["knob"] == "batch.max_in_flight" and a["result"] == result]


@pytest.mark.parametrize("mode", ["act", "advise"])
def test_demo_with_the_gate_decides_the_batch_and_acts_only_in_act_mode(mode: str) -> None:
    """From a limit of 4 the trace's load queues at the gate: auto raises the limit (act) or records that
    it would (advise, the gate staying at 4); the load goes through the gate either way."""
    agent_port, engine_port, gate_port = _free_port(), _free_port(), _free_port()
    cmd = [
        sys.executable, "-m", "agent.cli", "demo", "--no-view", "--mode", mode, "--initial-batch", "4",
        "--port", str(agent_port), "--engine-port", str(engine_port), "--gate-port", str(gate_port),
        "--duration", "120",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    wanted = "ok" if mode == "act" else "advised"
    moves: list[dict[str, object]] = []
    values: dict[str, float] = {}
    try:
        started = time.monotonic()
        while time.monotonic() - started < 60 and proc.poll() is None:
            with contextlib.suppress(OSError):  # not listening yet
                moves, values = _batch_moves(_actions(agent_port), wanted), _scrape(agent_port)
            if moves:
                break
            time.sleep(0.5)  # polling a real subprocess; the demo ticks once a second
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.stdout.read() if proc.stdout else ""
    assert code == 0 and "Traceback" not in output, output
    assert moves, f"no {wanted} batch decision within 60 s\n{output}"
    assert all(m["mode"] == mode and m["policy"] == "batch_auto" for m in moves)
    assert moves[-1]["from"] == 4 and float(str(moves[-1]["to"])) > 4  # the oldest: from the start
    assert values.get("servepilot_gate_requests_total,line=default,outcome=ok,priority=normal", 0) > 0, values
    limit = values["servepilot_gate_limit"]
    assert limit > 4 if mode == "act" else limit == 4
    assert f"gate on http://127.0.0.1:{gate_port}" in output
