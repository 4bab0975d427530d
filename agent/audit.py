"""The audit log: every action, taken or advised, as one JSON line, in a bounded set of rotated files.

A line: ``{"time": 1764430000.5, "knob": "gate.limit", "from": 64, "to": 48, "reason": "...",
"policy": "batch", "mode": "act", "result": "ok"}``. Rotation is the standard library's
``RotatingFileHandler`` (``max_bytes`` per file, ``backups`` old files kept), so the log can never fill
the disk. The last ``recent`` actions stay in memory for ``GET /api/actions``, and each one counts in
``servepilot_actions_total{knob,result}``. A file that cannot be written never stops an action: the
error is kept in :attr:`AuditLog.write_error` and the in-memory log and counter carry on.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from agent.config import AuditConfig


@dataclass(frozen=True)
class Action:
    """One decision about one knob. ``result``: ok, advised, paused, waiting (the knob's actuator cannot
    act yet), unchanged, or ``error: ...``."""

    time: float
    knob: str
    from_value: Any
    to_value: Any
    reason: str
    policy: str
    mode: str
    result: str

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "knob": self.knob,
            "from": self.from_value,
            "to": self.to_value,
            "reason": self.reason,
            "policy": self.policy,
            "mode": self.mode,
            "result": self.result,
        }


class _Handler(logging.handlers.RotatingFileHandler):
    """Keeps the last write error instead of printing a traceback to stderr on every action."""

    error: str | None = None

    def handleError(self, record: logging.LogRecord) -> None:
        import sys

        exc = sys.exc_info()[1]
        self.error = f"{type(exc).__name__}: {exc}" if exc else "unknown write error"


class AuditLog:
    """Append-only JSONL audit log with rotation, an in-memory tail and a per-knob counter."""

    def __init__(self, cfg: AuditConfig, registry: CollectorRegistry) -> None:
        self._recent: deque[Action] = deque(maxlen=cfg.recent)
        self._counter = Counter(
            "servepilot_actions", "Actions taken or advised, by knob and result.", ["knob", "result"],
            registry=registry,
        )  # fmt: skip
        self._handler: _Handler | None = None
        self._logger = logging.getLogger(f"servepilot.audit.{id(self)}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._open_error: str | None = None
        if cfg.path:
            try:
                Path(cfg.path).parent.mkdir(parents=True, exist_ok=True)
                self._handler = _Handler(
                    cfg.path, maxBytes=cfg.max_bytes, backupCount=cfg.backups, encoding="utf-8", delay=True
                )  # delay: no file until the first action, so an observe-only agent writes nothing
                self._handler.setFormatter(logging.Formatter("%(message)s"))
                self._logger.addHandler(self._handler)
            except OSError as error:
                self._open_error = f"cannot open audit log {cfg.path!r}: {error.strerror or error}"
                logging.getLogger(__name__).error("%s; keeping actions in memory only", self._open_error)

    @property
    def write_error(self) -> str | None:
        return self._open_error or (self._handler.error if self._handler else None)

    def declare(self, knob: str) -> None:
        """Export ``servepilot_actions_total{knob, result="ok"}`` at 0 before the first action, so the
        first action is an increase Prometheus can see (a series born at 1 has no increase)."""
        self._counter.labels(knob, "ok")

    def record(self, action: Action) -> None:
        self._recent.append(action)
        self.count(action.knob, action.result)
        if self._handler is not None:
            self._logger.info(json.dumps(action.to_json(), separators=(",", ":"), default=str))

    def count(self, knob: str, result: str) -> None:
        """Count an action in ``servepilot_actions_total`` without writing it out: a failure that repeats
        one already recorded (see ``Actuation``), which the alerts must still see."""
        self._counter.labels(knob, result.split(":", 1)[0]).inc()

    def recent(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest ``limit`` actions, newest first."""
        return [a.to_json() for a in list(self._recent)[::-1][:limit]]

    def close(self) -> None:
        if self._handler is not None:
            self._logger.removeHandler(self._handler)
            self._handler.close()
