"""Audit log on a full disk: the action still happens, stays in memory and in the counter, the write error
is kept (one line), and writing resumes when space is back. ENOSPC is injected through the file-writer
seam (the handler's ``_open``), since mounting a tiny tmpfs needs privileges CI may not have."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent import audit
from agent.audit import Action, AuditLog
from agent.config import AuditConfig


class _Disk:
    """Wraps the real file; while ``full``, every write fails as a full disk does."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.full = True

    def write(self, text: str) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return int(self.stream.write(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _action(knob: str, at: float) -> Action:
    return Action(at, knob, 64, 48, "p99 TTFT above SLO", "batch", "act", "ok")


def test_a_full_disk_keeps_actions_in_memory_and_resumes_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disks: list[_Disk] = []
    real_open = audit._Handler._open

    def full_open(self: audit._Handler) -> Any:
        disks.append(_Disk(real_open(self)))
        return disks[-1]

    monkeypatch.setattr(audit._Handler, "_open", full_open)
    path = tmp_path / "audit.jsonl"
    registry = CollectorRegistry()
    log = AuditLog(AuditConfig(path=str(path)), registry)
    try:
        log.record(_action("gate.limit", 1.0))
        assert "No space left" in (log.write_error or "") and "\n" not in (log.write_error or "")
        assert [a["knob"] for a in log.recent()] == ["gate.limit"]
        assert (
            registry.get_sample_value("servepilot_actions_total", {"knob": "gate.limit", "result": "ok"}) == 1
        )
        disks[-1].full = False  # space is back
        log.record(_action("gpu.power_limit_w", 2.0))
    finally:
        log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["knob"] for line in lines] == ["gpu.power_limit_w"]


def test_an_unwritable_audit_directory_still_lets_the_agent_start(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    log = AuditLog(AuditConfig(path=str(blocker / "audit.jsonl")), CollectorRegistry())
    log.record(_action("gate.limit", 1.0))
    assert log.write_error and "cannot open audit log" in log.write_error
    assert len(log.recent()) == 1
