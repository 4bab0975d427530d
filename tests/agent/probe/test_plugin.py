"""The vLLM general plugin: off switch, port per local rank, bind only once CUDA is in use, never raise."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

import pytest

from agent.probe import plugin


class RecordingStarter:
    def __init__(self, result: object = "server") -> None:
        self.calls: list[tuple[int | None, str]] = []
        self.result = result

    def __call__(self, port: int | None = None, host: str = "127.0.0.1") -> object:
        self.calls.append((port, host))
        return self.result


def watcher(
    environ: dict[str, str], ready: Callable[[], bool], starter: RecordingStarter, device: int | None = None
) -> plugin.Watcher:
    return plugin.Watcher(9401, environ, cuda_ready=ready, device=lambda: device, starter=starter)


@pytest.fixture(autouse=True)
def _fresh_plugin_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Callable[[], None]]]:
    """No real at-fork hooks or leftover watcher threads in the test process."""
    hooks: list[Callable[[], None]] = []
    monkeypatch.setattr(os, "register_at_fork", lambda *, after_in_child: hooks.append(after_in_child))
    monkeypatch.setattr(plugin, "_fork_hook_installed", False)
    monkeypatch.setattr(plugin, "_watcher", None)
    yield hooks
    if plugin._watcher is not None:
        plugin._watcher.cancel()


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_probe_env_switches_it_off(value: str) -> None:
    assert not plugin.enabled({"SERVEPILOT_PROBE": value})


def test_probe_is_on_by_default() -> None:
    assert plugin.enabled({})


def test_local_rank_comes_from_env() -> None:
    assert plugin.local_rank({"LOCAL_RANK": "3"}, device=lambda: 0) == 3


def test_local_rank_falls_back_to_selected_device() -> None:
    assert plugin.local_rank({}, device=lambda: 2) == 2


def test_invalid_local_rank_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="servepilot.probe"):
        assert plugin.local_rank({"LOCAL_RANK": "-1"}, device=lambda: None) == 0
    assert "ignoring LOCAL_RANK='-1'" in caplog.text


def test_nothing_binds_before_cuda_is_in_use() -> None:
    starter = RecordingStarter()
    assert watcher({}, lambda: False, starter).poll_once() is False
    assert starter.calls == []


def test_worker_binds_base_port_plus_local_rank_once_cuda_is_in_use() -> None:
    starter = RecordingStarter()
    w = watcher({"LOCAL_RANK": "2"}, lambda: True, starter)
    assert w.poll_once() and w.poll_once()
    assert starter.calls == [(9403, "127.0.0.1")]
    assert w.server == "server"


def test_taken_port_stops_polling() -> None:
    starter = RecordingStarter(result=None)  # server.start warned and returned None
    w = watcher({}, lambda: True, starter, device=1)
    assert w.poll_once() and w.poll_once()
    assert starter.calls == [(9402, "127.0.0.1")]


def test_run_swallows_errors_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    def boom() -> bool:
        raise RuntimeError("driver went away")

    with caplog.at_level(logging.WARNING, logger="servepilot.probe"):
        watcher({}, boom, RecordingStarter()).run(interval_s=0)
    assert "servepilot probe disabled in this process: driver went away" in caplog.text


def test_run_stops_when_cancelled() -> None:
    w = watcher({}, lambda: False, RecordingStarter())
    w.cancel()
    w.run(interval_s=60)  # returns at once instead of waiting a minute
    assert not w.done


def test_register_with_probe_off_arms_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVEPILOT_PROBE", "0")
    plugin.register()
    assert plugin._watcher is None


def test_register_arms_one_watcher_and_one_fork_hook(
    monkeypatch: pytest.MonkeyPatch, _fresh_plugin_state: list[Callable[[], None]]
) -> None:
    monkeypatch.delenv("SERVEPILOT_PROBE", raising=False)
    monkeypatch.setenv("SERVEPILOT_PROBE_PORT", "9500")
    plugin.register()
    first = plugin._watcher
    plugin.register()
    assert first is not None and plugin._watcher is first
    assert first.base_port == 9500
    assert len(_fresh_plugin_state) == 1


def test_register_never_raises_on_bad_env(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SERVEPILOT_PROBE_PORT", "not-a-port")
    with caplog.at_level(logging.WARNING, logger="servepilot.probe"):
        plugin.register()
    assert "servepilot probe plugin not loaded: SERVEPILOT_PROBE_PORT must be an integer" in caplog.text


def test_fork_hook_rearms_a_fresh_watcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SERVEPILOT_PROBE", raising=False)
    plugin.register()
    parent = plugin._watcher
    plugin._rearm_in_child()
    assert plugin._watcher is not None and plugin._watcher is not parent
    assert parent is not None
    parent.cancel()
