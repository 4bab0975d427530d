"""The gate's access log: one JSON line per request it handled (``gate.access_log``).

The gate is in the pod's data path, so "why did my request get a 429 at 14:03" is asked of it, and the
histograms cannot answer for one request. Each line says when the request arrived, its method and path,
the status the client got, how long the gate held it, and what the gate knew of it: business line,
priority, upstream, outcome (``ok``, ``rejected``, ``expired``, ``disconnected``...), queue wait, TTFT,
prompt and output tokens, request-length bucket, and the client's ``X-Request-Id`` and the
``X-Forwarded-For`` of a proxy in front, when they came. Requests the gate passes through unadmitted
(``/metrics``, ``/health``), refuses before admission (400, 413) or answers from its cache get a line
too, with what is known of them. Bodies, other headers and API keys are never written.

Writing must not slow the data path: a line is put on a bounded queue and a thread of its own writes
it, to stdout (``stdout``, the container's log) or to a file rotated at ``access_log_max_mb`` with
``access_log_backups`` kept (``logging.handlers.RotatingFileHandler``). Should the writer fall behind
by :data:`QUEUE_LINES` lines (a full disk, a stalled pipe), or a write fail, lines are dropped and
counted in ``servepilot_gate_access_log_dropped_total``; requests never wait for the log, and a stop
never waits on a stalled writer for more than :data:`STOP_WAIT_S`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.handlers
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from agent.gate.openai import MAX_REQUEST_ID, REQUEST_ID
from agent.gate.records import RequestRecord

#: Lines waiting for the writer thread before new ones are dropped.
QUEUE_LINES = 10_000
#: Lines written together at most, when the writer finds several queued.
WRITE_BATCH = 256
#: How long a stop waits for a stalled writer.
STOP_WAIT_S = 2.0
FORWARDED_FOR = "X-Forwarded-For"
#: ``gate.access_log``'s value for the process's standard output
STDOUT = "stdout"

log = logging.getLogger(__name__)


class _CountsFailures(logging.Handler):
    """A handler whose failed write calls ``failed`` (which counts it) instead of printing a traceback
    for each line, as :meth:`logging.Handler.handleError` does."""

    #: called with each failed write's record (its lines)
    failed: Callable[[logging.LogRecord], None] | None = None

    def handleError(self, record: logging.LogRecord) -> None:
        if self.failed is not None:
            self.failed(record)


class _Stdout(_CountsFailures, logging.StreamHandler):  # type: ignore[type-arg]
    pass


class _RotatingFile(_CountsFailures, logging.handlers.RotatingFileHandler):
    pass


class AccessLog:
    """Writes access lines to ``target`` (``stdout``, else a file path) from a thread of its own,
    between :meth:`start` and :meth:`stop`. A file that cannot be opened raises OSError at construction."""

    def __init__(
        self, target: str, registry: CollectorRegistry, max_bytes: int = 100 << 20, backups: int = 5
    ) -> None:
        self.target = target
        self.dropped = Counter(
            "servepilot_gate_access_log_dropped",
            "access log lines dropped: the writer fell behind, or a write failed (gate.access_log)",
            registry=registry,
        )
        handler: _Stdout | _RotatingFile
        if target == STDOUT:
            handler = _Stdout(sys.stdout)
        else:
            handler = _RotatingFile(target, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.failed = self._write_failed
        self._handler = handler
        self._lines: queue.Queue[str | None] = queue.Queue(QUEUE_LINES)
        self._thread: threading.Thread | None = None
        self._failure = ""

    @property
    def pending(self) -> int:
        """Lines queued, not yet written."""
        return self._lines.qsize()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._write_lines, name="servepilot-access-log", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Write what is queued, then close the file. A writer stalled for :data:`STOP_WAIT_S` is left
        behind, its lines lost and said in one log line, rather than hang the stop."""
        thread, self._thread = self._thread, None
        if thread is not None:
            with contextlib.suppress(queue.Full):  # a stalled writer: said below
                self._lines.put(None, timeout=STOP_WAIT_S)  # the end, after every line queued
            thread.join(STOP_WAIT_S)
            if thread.is_alive():
                log.warning("the access log writer is stalled: %d lines not written", self.pending)
                return
        with contextlib.suppress(OSError):  # what the last flush could not write was counted already
            self._handler.close()

    def _write_lines(self) -> None:
        """Write lines as they come, those queued meanwhile together (one write and flush for a batch)."""
        while True:
            batch = [self._lines.get()]
            while batch[-1] is not None and len(batch) < WRITE_BATCH:
                try:
                    batch.append(self._lines.get_nowait())
                except queue.Empty:
                    break
            lines = [line for line in batch if line is not None]
            if lines:
                self._handler.handle(logging.makeLogRecord({"msg": "\n".join(lines)}))
            if batch[-1] is None:
                return

    def _write_failed(self, lines: logging.LogRecord) -> None:
        self.dropped.inc(str(lines.msg).count("\n") + 1)
        failure = repr(sys.exc_info()[1])
        if failure != self._failure:  # once per kind of failure, not per line
            log.error("the access log %s cannot be written: %s", self.target, failure)
        self._failure = failure

    def write(
        self,
        *,
        method: str,
        path: str,
        status: int,
        held_s: float,
        headers: Mapping[str, str],
        remote: str | None,
        record: RequestRecord | None,
        bucket: str | None,
        cached: bool = False,
    ) -> None:
        """One line: the request, held ``held_s`` by the gate until now, and its ``record`` if the gate
        made one (``bucket``: its request-length bucket)."""
        line: dict[str, Any] = {
            "start": _utc(time.time() - held_s),
            "method": method,
            "path": path,
            "status": status,
            "duration_s": round(held_s, 6),
        }
        request_id = record.request_id if record is not None else headers.get(REQUEST_ID, "")[:MAX_REQUEST_ID]
        if request_id:
            line["request_id"] = request_id
        if remote:
            line["remote"] = remote
        forwarded = headers.get(FORWARDED_FOR)
        if forwarded:  # the client behind an ingress or a load balancer
            line["forwarded_for"] = forwarded[:256]
        if cached:
            line["cache"] = "hit"
        if record is not None:
            line["line"] = record.line
            line["priority"] = record.priority
            line["outcome"] = record.outcome
            line["queue_wait_s"] = round(record.queue_wait_s, 6)
            if record.held_s is not None:  # what the gate itself held it for before it went upstream
                line["gate_s"] = round(record.held_s, 6)
            line["prompt_tokens"] = int(record.prompt_tokens)
            line["output_tokens"] = int(record.output_tokens)
            if bucket is not None:
                line["bucket"] = bucket
            if record.upstream:
                line["upstream"] = record.upstream
            if record.ttft_s is not None:
                line["ttft_s"] = round(record.ttft_s, 6)
            if record.abandoned:
                line["abandoned"] = record.abandoned
            if record.refused:
                line["refused"] = record.refused
        try:
            self._lines.put_nowait(json.dumps(line, separators=(",", ":")))
        except queue.Full:
            self.dropped.inc()


def _utc(at: float) -> str:
    """RFC 3339 in UTC with milliseconds, as log pipelines parse it."""
    seconds = int(at)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int((at - seconds) * 1000):03d}Z"
