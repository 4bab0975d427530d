"""SIGTERM in the middle of an action, and restart with persisted state.

The SIGTERM test runs a real child process (a signal in the pytest process would end the run): it drives
a simulated GPU's power limit, reports "set", and is killed with SIGTERM while its lease is still held.
The GPU must be back at its default and the process must exit with 128 + SIGTERM. Restart tests reopen
the files a previous run wrote: forecaster tracks (atomic JSON) and a torn temp file that must not win.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.actuators.gpu_backend import SimulatedGpuBackend
from agent.forecast_state import Track, load_state, state_document, write_atomically

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import sys, threading
    from prometheus_client import CollectorRegistry
    from agent.actuators.gpu import GpuActuator
    from agent.actuators.gpu_backend import SimulatedGpuBackend
    from agent.config import ActuatorConfig

    cfg = ActuatorConfig(mode="act", gpu="power_limit", gpu_lease_s=3600)
    backend = SimulatedGpuBackend(2, state_file=sys.argv[1])
    actuator = GpuActuator(cfg, backend, CollectorRegistry(), permission=lambda: None)
    actuator.install_signal_restore()
    actuator.set(250.0)
    print("set", flush=True)
    threading.Event().wait(60)  # mid-action: the lease is held, nothing renews it
    """
)


def test_sigterm_mid_action_restores_the_gpu_defaults(tmp_path: Path) -> None:
    state = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(state)], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "set"
        assert {g["power_limit_w"] for g in SimulatedGpuBackend.read_state(state)} == {250.0}
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
    assert code == 128 + signal.SIGTERM
    assert {g["power_limit_w"] for g in SimulatedGpuBackend.read_state(state)} == {400.0}


def _tracks() -> dict[str, Track]:
    return {"requests_per_s": Track("requests_per_s", keep=120)}


def test_forecaster_history_survives_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "forecast.json")
    before = _tracks()
    for minute in range(30):
        before["requests_per_s"].add(minute, 10.0 + minute)
    write_atomically(path, state_document(before, capacity_rps=42.0, last_refit_s=1234.0))
    after = _tracks()
    assert load_state(path, after) == (42.0, 1234.0, {})
    assert after["requests_per_s"].to_json() == before["requests_per_s"].to_json()


def test_a_torn_write_leaves_the_previous_state_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "forecast.json")
    tracks = _tracks()
    tracks["requests_per_s"].add(0, 5.0)
    write_atomically(path, state_document(tracks, 1.0, None))
    good = Path(path).read_text()

    def crash(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", crash)  # the disk fills while the new state is written
    with pytest.raises(OSError):
        write_atomically(path, state_document(tracks, 2.0, None))
    assert Path(path).read_text() == good
    assert [p.name for p in tmp_path.iterdir()] == ["forecast.json"]  # no temp file left behind


def test_a_corrupt_state_file_means_a_fresh_start_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "forecast.json"
    path.write_text(json.dumps({"version": "nope"})[:-3])
    assert load_state(str(path), _tracks()) is None
