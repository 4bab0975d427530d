"""Leak evidence: a bounded recording of the CUDA allocator's history, saved for PyTorch's visualiser.

When the agent's memory-leak detector fires, a number ("+2 GiB in an hour") says *that* memory grows,
not *what* holds it. PyTorch can record every allocation and free with its stack
(``torch.cuda.memory._record_memory_history``) and dump the result (``_dump_snapshot``) as a pickle that
https://pytorch.org/memory_viz renders as a timeline. Recording costs time on every allocation, so it is
bounded: at most ``max_duration_s`` seconds and ``max_entries`` events, one recording at a time, and
off again once the snapshot is saved.

Runs inside the engine process (the probe). The HTTP face is :func:`wsgi_app`, which wraps the probe's
metrics app:

* ``POST /evidence/memory?duration_s=60`` starts a recording (202 with the planned file, 409 if one runs,
  503 without CUDA here);
* ``GET /evidence/memory`` says what is recording and the saved files.

A daemon timer stops the recording and writes the file; :meth:`MemoryRecorder.poll` does the same work
and is what the tests call with their own clock. torch is imported lazily and can be injected.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

log = logging.getLogger("servepilot.probe")

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class RecorderBusy(RuntimeError):
    """A recording is already running."""


class NoCuda(RuntimeError):
    """CUDA is not in use in this process: nothing to record."""


class MemoryRecorder:
    """One bounded allocator-history recording at a time; snapshots written to ``directory``."""

    def __init__(
        self,
        directory: str | Path,
        *,
        max_duration_s: float = 300.0,
        max_entries: int = 100_000,
        torch_module: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Path(directory)
        self.max_duration_s = max_duration_s
        self.max_entries = max_entries
        self._torch = torch_module
        self.clock = clock
        self._lock = threading.Lock()
        self.until: float | None = None
        self.pending: Path | None = None
        self.saved: list[str] = []

    def _memory(self) -> Any:
        torch = self._torch
        if torch is None:
            import torch as torch_module  # lazily: the probe must load without torch's import cost

            torch = self._torch = torch_module
        if not torch.cuda.is_initialized():
            raise NoCuda("CUDA is not in use in this process")
        return torch.cuda.memory

    def start(self, duration_s: float) -> Path:
        """Start recording for ``duration_s`` (clamped to (0, max_duration_s]); returns the file to come."""
        with self._lock:
            if self.until is not None:
                raise RecorderBusy(f"a recording runs until {self.pending}")
            memory = self._memory()
            duration = min(max(duration_s, 1.0), self.max_duration_s)
            memory._record_memory_history(max_entries=self.max_entries)
            self.directory.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            self.pending = self.directory / f"servepilot-memory-{os.getpid()}-{stamp}.pickle"
            self.until = self.clock() + duration
            log.info("recording CUDA allocator history for %.0f s -> %s", duration, self.pending)
            return self.pending

    def poll(self) -> Path | None:
        """Stop and save when the recording's time is up; returns the saved file then, else None."""
        with self._lock:
            if self.until is None or self.clock() < self.until:
                return None
            path, self.until, self.pending = self.pending, None, None
            memory = self._memory()
            try:
                memory._dump_snapshot(str(path))
            finally:
                memory._record_memory_history(enabled=None)  # recording costs time: always stop it
            self.saved.append(str(path))
            log.info("saved CUDA memory snapshot %s (open it at https://pytorch.org/memory_viz)", path)
            return path

    def start_timer(self, duration_s: float) -> Path:
        """:meth:`start`, plus a daemon timer that calls :meth:`poll` when the time is up."""
        path = self.start(duration_s)
        delay = (self.until or self.clock()) - self.clock()
        timer = threading.Timer(max(0.0, delay) + 0.01, self._poll_quietly)
        timer.daemon = True
        timer.start()
        return path

    def _poll_quietly(self) -> None:
        try:
            self.poll()
        except Exception as error:  # never raise into the engine
            log.warning("saving the CUDA memory snapshot failed: %s", error)

    def status(self) -> dict[str, Any]:
        return {
            "recording": self.until is not None,
            "file": str(self.pending or ""),
            "saved": list(self.saved),
        }


def wsgi_app(recorder: MemoryRecorder, metrics_app: WsgiApp) -> WsgiApp:
    """The probe's WSGI app: ``/evidence/memory`` here, everything else to ``metrics_app``."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/evidence/memory":
            return metrics_app(environ, start_response)
        status, body = "200 OK", recorder.status()
        if environ.get("REQUEST_METHOD") == "POST":
            query = parse_qs(environ.get("QUERY_STRING", ""))
            try:
                duration = float(query.get("duration_s", ["60"])[0])
                body = {"recording": True, "file": str(recorder.start_timer(duration))}
                status = "202 Accepted"
            except ValueError:
                status, body = "400 Bad Request", {"error": "duration_s must be a number of seconds"}
            except RecorderBusy as error:
                status, body = "409 Conflict", {"error": str(error)}
            except NoCuda as error:
                status, body = "503 Service Unavailable", {"error": str(error)}
        data = json.dumps(body).encode()
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    return app
