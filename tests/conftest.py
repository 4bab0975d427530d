"""Test-session hooks shared by every test directory."""

from __future__ import annotations

import pytest

_RERUNS: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Remember why a test marked ``flaky`` was rerun (pytest-rerunfailures reports outcome ``rerun``)."""
    if report.outcome == "rerun":  # type: ignore[comparison-overlap]  # the plugin adds this outcome
        lines = [line[1:].strip() for line in report.longreprtext.splitlines() if line.startswith("E ")]
        _RERUNS.append((report.nodeid, " | ".join(lines[:3]) or "(no assertion message)"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print each rerun's reason, so a pass after a rerun in CI still says what failed the first time."""
    if _RERUNS:
        terminalreporter.section("why tests were rerun")
        for nodeid, reason in _RERUNS:
            terminalreporter.write_line(f"{nodeid}: {reason}")
