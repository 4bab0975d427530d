"""MemoryRecorder and its WSGI route, with a fake torch (no GPU here) and an injected clock."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.probe.evidence import MemoryRecorder, NoCuda, RecorderBusy, wsgi_app


class FakeMemory:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def _record_memory_history(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)

    def _dump_snapshot(self, filename: str) -> None:
        Path(filename).write_bytes(pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc"}]]}))


def _torch(initialised: bool = True) -> SimpleNamespace:
    return SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: initialised, memory=FakeMemory()))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_recording_stops_and_saves_after_its_duration(tmp_path: Path) -> None:
    torch, clock = _torch(), Clock()
    recorder = MemoryRecorder(tmp_path, torch_module=torch, clock=clock)
    planned = recorder.start(30)
    clock.now = 29.9
    assert recorder.poll() is None
    clock.now = 30.0
    saved = recorder.poll()
    assert saved == planned and pickle.loads(saved.read_bytes())["device_traces"][0][0]["action"] == "alloc"
    assert torch.cuda.memory.calls == [{"max_entries": 100_000}, {"enabled": None}]  # started, then stopped


def test_duration_is_bounded(tmp_path: Path) -> None:
    clock = Clock()
    recorder = MemoryRecorder(tmp_path, max_duration_s=60, torch_module=_torch(), clock=clock)
    recorder.start(3600)
    assert recorder.until == 60.0


def test_one_recording_at_a_time(tmp_path: Path) -> None:
    recorder = MemoryRecorder(tmp_path, torch_module=_torch(), clock=Clock())
    recorder.start(10)
    with pytest.raises(RecorderBusy):
        recorder.start(10)


def test_no_cuda_no_recording(tmp_path: Path) -> None:
    with pytest.raises(NoCuda):
        MemoryRecorder(tmp_path, torch_module=_torch(initialised=False)).start(10)


def _call(app: Any, method: str, path: str, query: str = "") -> tuple[str, dict[str, Any]]:
    seen: list[str] = []
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query, "wsgi.input": io.BytesIO()}
    body = b"".join(app(environ, lambda status, headers: seen.append(status)))
    return seen[0], json.loads(body)


def test_wsgi_route_starts_a_recording_and_passes_other_paths_on(tmp_path: Path) -> None:
    recorder = MemoryRecorder(tmp_path, torch_module=_torch(), clock=Clock())

    def metrics(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [])
        return [b'{"metrics": true}']

    app = wsgi_app(recorder, metrics)
    status, body = _call(app, "POST", "/evidence/memory", "duration_s=5")
    assert status.startswith("202") and body["file"].endswith(".pickle")
    assert _call(app, "POST", "/evidence/memory")[0].startswith("409")
    assert _call(app, "GET", "/evidence/memory")[1]["recording"] is True
    assert _call(app, "GET", "/metrics") == ("200 OK", {"metrics": True})


def test_wsgi_route_without_cuda_is_503(tmp_path: Path) -> None:
    app = wsgi_app(MemoryRecorder(tmp_path, torch_module=_torch(False)), lambda e, s: [])
    assert _call(app, "POST", "/evidence/memory")[0].startswith("503")
