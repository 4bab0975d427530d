"""Real Prometheus and Alertmanager processes for the end-to-end tests: finding them, running them, and
polling them until something holds.

Skipped locally when ``prometheus``/``prometheus-alertmanager`` are missing; a failure when CI=true.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest


def binaries() -> tuple[str, str]:
    """The Prometheus and Alertmanager executables (Debian's names first)."""
    prom, am = (
        shutil.which("prometheus"),
        shutil.which("prometheus-alertmanager") or shutil.which("alertmanager"),
    )
    if prom is None or am is None:
        message = (
            "prometheus / prometheus-alertmanager not installed "
            "(apt-get install -y prometheus prometheus-alertmanager)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return prom, am


async def until(check: Callable[[], Awaitable[Any]], timeout_s: float, what: str) -> Any:
    """``check()`` until it returns something truthy (returned); AssertionError naming ``what`` after
    ``timeout_s``. Connection errors while a process starts count as "not yet"."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError, KeyError, IndexError):
            last = await check()
            if last:
                return last
        await asyncio.sleep(0.5)  # polling real processes; the test's own logic never sleeps on time
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {last!r})")


@contextlib.contextmanager
def process(cmd: list[str], log: Path) -> Any:
    """Runs ``cmd`` (output to ``log``) for the ``with`` block; SIGTERM, then SIGKILL, at its end."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
