"""``servepilot validate-config NEW --against RUNNING``: would a reload apply this edit, or is a restart
needed? (exit 0 / 3; an invalid file is 2 as always.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.cli import main

RUNNING = (
    "gate: {enabled: true, lines: {batch: {requests_per_min: 60}}, api_keys: {sk-0123456789abcdef: batch}}\n"
)


def _files(tmp_path: Path, new: str) -> tuple[str, str]:
    (tmp_path / "running.yaml").write_text(RUNNING)
    (tmp_path / "new.yaml").write_text(new)
    return str(tmp_path / "new.yaml"), str(tmp_path / "running.yaml")


def test_a_rate_and_key_change_is_reloadable_and_keys_are_not_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new, running = _files(
        tmp_path,
        "gate: {enabled: true, lines: {batch: {requests_per_min: 600}},"
        " api_keys: {sk-fedcba9876543210: b}}\n",
    )
    assert main(["validate-config", new, "--against", running]) == 0
    out = capsys.readouterr().out
    assert "reload   gate.lines.batch.requests_per_min: 60.0 -> 600.0" in out
    assert "reload   gate.api_keys: '<1 keys>' -> '<1 keys>'" in out
    assert "all applied by a reload" in out and "sk-" not in out


def test_a_change_that_needs_a_restart_exits_3_and_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new, running = _files(tmp_path, "agent: {interval_s: 2}\n" + RUNNING)
    assert main(["validate-config", new, "--against", running]) == 3
    out = capsys.readouterr().out
    assert "restart  agent.interval_s: 1.0 -> 2.0" in out and "1 of 1 change(s) need a restart" in out


def test_no_change_and_an_invalid_new_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    new, running = _files(tmp_path, RUNNING)
    assert main(["validate-config", new, "--against", running]) == 0
    assert "no change" in capsys.readouterr().out
    Path(new).write_text("gate: {lines: {batch: {requests_per_min: 0}}}\n")
    assert main(["validate-config", new, "--against", running]) == 2
    assert "gate.lines.batch.requests_per_min must be in (0, 10000000], got 0" in capsys.readouterr().err
