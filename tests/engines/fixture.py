"""Real engines for the end-to-end tests: found in the cache, started on loopback, never skipped silently.

An engine that is not installed fails the run under ``CI=true`` (CI installs them with
``scripts/engines.sh``); locally the test is skipped with the reason and the command that installs it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from agent.engines.launcher import ENGINES, EngineError, LaunchOptions, RunningEngine, start

#: Seconds a server may take to answer /health (vLLM compiles on its first start).
READY_TIMEOUT_S = {"llamacpp": 120.0, "vllm": 900.0}
#: Setup figures of this session (engine -> seconds to ready), printed by the tests that start engines.
SETUP_S: dict[str, float] = {}


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def require(name: str) -> None:
    """Skip (locally) or fail (CI) when engine ``name`` is not installed, saying how to install it."""
    spec = ENGINES[name]
    if spec.installed():
        return
    reason = f"{name} is not installed in {spec.home()}; install it with: {spec.install_hint()}"
    if in_ci():
        pytest.fail(f"{reason} (CI must run the real-engine tests)")
    pytest.skip(reason)


@contextmanager
def running(
    name: str, opts: LaunchOptions | None = None, poll: Callable[[str], bool] | None = None
) -> Iterator[RunningEngine]:
    """A started, ready engine; stopped on exit. A start failure fails the test with the log's last line.
    ``poll(url)`` says whether its /health answers (the launcher's plain GET by default)."""
    require(name)
    started = time.monotonic()
    try:
        engine = start(name, opts=opts)
        engine.wait_ready(READY_TIMEOUT_S[name], poll)
    except EngineError as error:
        pytest.fail(str(error))
    SETUP_S[name] = time.monotonic() - started
    try:
        yield engine
    finally:
        engine.stop()
