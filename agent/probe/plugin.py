"""vLLM general plugin: ``agent.probe.plugin:register`` (entry point ``vllm.general_plugins``).

vLLM calls every general plugin in every process it starts: the API server, the engine core and each GPU
worker. Only a process whose PyTorch holds CUDA memory has anything to report, and at plugin time none
has touched CUDA yet. So ``register`` binds nothing: it arms a small daemon thread that checks once a
second whether CUDA is initialised *in this process* (without initialising it) and only then starts the
probe on ``base + local rank``. The API server never initialises CUDA and never takes a port; with tensor
parallelism worker k serves on base + k.

* base port: ``SERVEPILOT_PROBE_PORT`` (default 9401);
* local rank: ``LOCAL_RANK`` when set, else the CUDA device the worker selected (vLLM workers call
  ``torch.cuda.set_device(local_rank)``), else 0;
* ``SERVEPILOT_PROBE=0`` (or false/no/off) disables the probe;
* nothing here ever raises into vLLM: every failure is one logged warning.

Forked children inherit ``vllm.plugins.plugins_loaded = True`` and so are not offered the plugin again,
and they do not inherit our thread; an at-fork hook re-arms the watcher in the child.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Protocol

from agent.probe import stats

log = logging.getLogger("servepilot.probe")

ENABLE_ENV = "SERVEPILOT_PROBE"
RANK_ENV = "LOCAL_RANK"
POLL_INTERVAL_S = 1.0
_OFF = frozenset({"0", "false", "no", "off"})


class _Starter(Protocol):
    def __call__(self, port: int | None = ..., host: str = ...) -> object: ...


def enabled(environ: Mapping[str, str]) -> bool:
    """False when ``SERVEPILOT_PROBE`` is 0/false/no/off; the probe is on by default."""
    return environ.get(ENABLE_ENV, "1").strip().lower() not in _OFF


def current_cuda_device() -> int | None:
    """The device this process selected, if CUDA is already in use here (never initialises CUDA)."""
    if not stats.cuda_in_use():
        return None
    return int(sys.modules["torch"].cuda.current_device())


def local_rank(environ: Mapping[str, str], device: Callable[[], int | None] = current_cuda_device) -> int:
    """``LOCAL_RANK`` if set and valid, else the selected CUDA device, else 0."""
    raw = environ.get(RANK_ENV, "").strip()
    if raw:
        try:
            rank = int(raw)
        except ValueError:
            rank = -1
        if rank >= 0:
            return rank
        log.warning("servepilot probe: ignoring %s=%r (not a non-negative integer)", RANK_ENV, raw)
    selected = device()
    return selected if selected is not None else 0


class Watcher:
    """Starts the probe once this process uses CUDA. :meth:`poll_once` is the whole logic (tests call it)."""

    def __init__(
        self,
        base_port: int,
        environ: Mapping[str, str],
        *,
        host: str = "127.0.0.1",
        cuda_ready: Callable[[], bool] = stats.cuda_in_use,
        device: Callable[[], int | None] = current_cuda_device,
        starter: _Starter | None = None,
    ) -> None:
        self.base_port = base_port
        self.host = host
        self.done = False
        self.server: object | None = None
        self._environ = environ
        self._cuda_ready = cuda_ready
        self._device = device
        self._starter = starter
        self._stop = threading.Event()

    def poll_once(self) -> bool:
        """Start the probe if CUDA is now in use; True once there is nothing left to do."""
        if self.done:
            return True
        if not self._cuda_ready():
            return False
        port = self.base_port + local_rank(self._environ, self._device)
        if self._starter is None:
            from agent.probe import server

            self.server = server.start(port, self.host)
        else:
            self.server = self._starter(port, self.host)
        self.done = True  # started, or the port was taken and start() already warned: stop polling
        return True

    def run(self, interval_s: float = POLL_INTERVAL_S) -> None:
        """Poll until the probe starts or :meth:`cancel` is called. Never raises."""
        try:
            while not self.poll_once():
                if self._stop.wait(interval_s):
                    return
        except Exception as error:
            log.warning("servepilot probe disabled in this process: %s", error)

    def cancel(self) -> None:
        self._stop.set()

    def spawn(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="servepilot-probe-watch", daemon=True)
        thread.start()
        return thread


_watcher: Watcher | None = None
_fork_hook_installed = False


def _arm(environ: Mapping[str, str]) -> Watcher | None:
    global _watcher
    if not enabled(environ):
        log.info("servepilot probe disabled by %s", ENABLE_ENV)
        return None
    if _watcher is None:
        from agent.probe.server import resolve_port

        _watcher = Watcher(resolve_port(None, dict(environ)), environ)
        _watcher.spawn()
    return _watcher


def _rearm_in_child() -> None:
    """After fork: forget the parent's watcher and server (their threads did not survive) and re-arm."""
    global _watcher
    try:
        _watcher = None
        server = sys.modules.get("agent.probe.server")
        if server is not None:
            server.forget_after_fork()
        _arm(os.environ)
    except Exception as error:
        log.warning("servepilot probe not re-armed after fork: %s", error)


def register() -> None:
    """vLLM general-plugin entry point. Cheap, idempotent, and never raises."""
    global _fork_hook_installed
    try:
        _arm(os.environ)
        if not _fork_hook_installed:
            os.register_at_fork(after_in_child=_rearm_in_child)
            _fork_hook_installed = True
    except Exception as error:
        log.warning("servepilot probe plugin not loaded: %s", error)
