"""Test-session hooks shared by every test directory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

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


@pytest.fixture
async def sim_engine() -> AsyncIterator[tuple[Any, str]]:
    """The simulator's engine with its generic control API, on loopback: (server, url)."""
    from aiohttp import web

    from simulator.engine import make_core
    from simulator.server import SimServer

    server = SimServer(make_core("a100-80g", "llama-2-7b", "fp16", 256))
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield server, f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()
