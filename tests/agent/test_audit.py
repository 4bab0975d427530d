"""The JSONL audit log: fields, rotation bounds, the in-memory tail, the counter, unwritable files."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.audit import Action, AuditLog
from agent.config import AuditConfig


def _action(i: int = 0, result: str = "ok") -> Action:
    return Action(1000.0 + i, "gate.limit", 64, 48 - (i % 8), "ttft p99 over SLO", "batch", "act", result)


def test_each_action_is_one_json_line_with_every_field(tmp_path: Path) -> None:
    log = AuditLog(AuditConfig(path=str(tmp_path / "audit.jsonl")), CollectorRegistry())
    log.record(_action())
    log.close()
    line = json.loads((tmp_path / "audit.jsonl").read_text().strip())
    assert line == {
        "time": 1000.0, "knob": "gate.limit", "from": 64, "to": 48, "reason": "ttft p99 over SLO",
        "policy": "batch", "mode": "act", "result": "ok",
    }  # fmt: skip


def test_rotation_keeps_the_files_bounded(tmp_path: Path) -> None:
    cfg = AuditConfig(path=str(tmp_path / "audit.jsonl"), max_bytes=4096, backups=2)
    log = AuditLog(cfg, CollectorRegistry())
    for i in range(500):
        log.record(_action(i))
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    assert all((tmp_path / f).stat().st_size <= 4096 for f in files)


def test_recent_lists_newest_first_and_is_bounded() -> None:
    log = AuditLog(AuditConfig(path=None, recent=3), CollectorRegistry())
    for i in range(5):
        log.record(_action(i))
    assert [a["time"] for a in log.recent(10)] == [1004.0, 1003.0, 1002.0]


def test_counter_is_labelled_by_knob_and_result_kind() -> None:
    registry = CollectorRegistry()
    log = AuditLog(AuditConfig(path=None), registry)
    log.record(_action(result="error: connection refused"))
    log.record(_action(result="advised"))
    assert (
        registry.get_sample_value("servepilot_actions_total", {"knob": "gate.limit", "result": "error"}) == 1
    )
    assert (
        registry.get_sample_value("servepilot_actions_total", {"knob": "gate.limit", "result": "advised"})
        == 1
    )


def test_an_unwritable_path_keeps_actions_in_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    log = AuditLog(AuditConfig(path=str(blocker / "audit.jsonl")), CollectorRegistry())
    log.record(_action())
    assert log.write_error is not None and "cannot open audit log" in log.write_error
    assert len(log.recent()) == 1
