"""agent.event_loop: `servepilot run`, `gate` and `demo` run on uvloop where it is installed.

The pods' gate lives inside `servepilot run`; before, only `servepilot gate` used uvloop, so the gate
benchmark measured a loop production did not run."""

from __future__ import annotations

import asyncio
import os
import platform
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import agent
from agent import config, eventloop
from agent.engines.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]


async def _name() -> str:
    await asyncio.sleep(0)
    return eventloop.running_loop_name()


@pytest.mark.parametrize(
    ("choice", "expected"), [("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")]
)
def test_each_choice_runs_its_loop_where_uvloop_is_installed(
    choice: eventloop.EventLoopChoice, expected: str
) -> None:
    assert eventloop.resolve(choice) == expected
    assert eventloop.runner(choice)(_name()) == expected


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now raises ImportError
    assert eventloop.resolve("auto") == "asyncio"
    assert eventloop.runner("auto")(_name()) == "asyncio"
    with pytest.raises(config.ConfigError, match=r"^agent\.event_loop is uvloop, but it does not import"):
        eventloop.runner("uvloop")


def test_an_unknown_event_loop_is_refused_naming_the_field() -> None:
    with pytest.raises(config.ConfigError, match=r"^agent\.event_loop"):
        config.build({"agent": {"event_loop": "trio"}})


def _run_sidecar(tmp_path: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """`servepilot run` with no source to reach, until its API is up; one scrape of its /metrics; then
    SIGTERM. (exit code, log, the scrape)."""
    port = free_port()
    cfg = {
        "agent": {"listen_port": port, "admin_listen_port": free_port()},
        "engine": {"url": f"http://127.0.0.1:{free_port()}"},
        "nvml": {"backend": "off"},
        "probe": {"enabled": False},
        "audit": {"path": None},
    }
    path = tmp_path / "servepilot.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "--config", str(path)],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    watchdog = threading.Timer(60, proc.kill)  # a sidecar that never logs must not hang the suite
    watchdog.start()
    try:
        for line in proc.stdout:  # ends when the process does
            lines.append(line)
            if "agent API on" in line:
                break
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            scrape = response.read().decode()
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
    finally:
        watchdog.cancel()
    return proc.returncode, "".join(lines) + rest, scrape


@pytest.mark.parametrize(
    ("env", "expected"), [({}, "uvloop"), ({"SERVEPILOT_AGENT__EVENT_LOOP": "asyncio"}, "asyncio")]
)
def test_servepilot_run_says_which_loop_it_runs(tmp_path: Path, env: dict[str, str], expected: str) -> None:
    """In its start-up log line, and in servepilot_build_info on its /metrics (with the version)."""
    code, log, scrape = _run_sidecar(tmp_path, env)
    assert code == 0, log
    assert f"({expected} event loop)" in log, log
    families = text_string_to_metric_families(scrape)
    (info,) = [s for f in families if f.name == "servepilot_build_info" for s in f.samples]
    assert info.value == 1.0
    assert info.labels == {
        "version": agent.version(),
        "python_version": platform.python_version(),
        "event_loop": expected,
    }
    assert agent.version() != "unknown"  # the test environment installs the package (pip install -e)


def test_servepilot_run_exports_no_created_series(tmp_path: Path) -> None:
    """prometheus_client's ``_created`` samples are off in the process (exporter.without_created_series):
    Prometheus 2 ingests each as a series no dashboard or rule reads."""
    code, log, scrape = _run_sidecar(tmp_path, {})
    assert code == 0, log
    assert "servepilot_tick_duration_seconds_count" in scrape  # a histogram is there, without its _created
    assert "_created" not in scrape
