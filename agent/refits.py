"""Detector refits in a worker thread, started only once the tick that asked for them has finished.

A refit (the multivariate detector's isolation forest: ~0.1-0.5 s of sklearn, mostly holding the GIL)
already runs off the tick in a worker thread. Submitted in the middle of a tick, though, it starts at
once and takes the GIL from the tick's remaining detectors: CPython hands the GIL back only every
``sys.getswitchinterval()`` (5 ms), so each of the tick's waits for it costs up to 5 ms. Queued until the
tick is over, the refit runs in the idle second between ticks instead.

The detectors see an ordinary :class:`concurrent.futures.Executor`: ``submit`` returns a future at once,
which completes after :meth:`AfterTickExecutor.release` (subscribed to the loop, so called when each tick
ends) has handed the work to the pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any


def _run(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return  # cancelled while it waited for the tick to end
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as error:  # handed to whoever reads the future, as a pool would
        future.set_exception(error)


class AfterTickExecutor(Executor):
    """An executor whose work starts at the next :meth:`release` (the end of the current tick)."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._queued: list[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            self._queued.append((future, fn, args, kwargs))
        return future

    def release(self, _state: object = None) -> int:
        """Start everything queued so far; returns how many jobs. Takes (and ignores) the loop's state so
        it can be a loop subscriber."""
        with self._lock:
            queued, self._queued = self._queued, []
        for future, fn, args, kwargs in queued:
            self._pool.submit(_run, future, fn, args, kwargs)
        return len(queued)

    @property
    def queued(self) -> int:
        """Jobs waiting for the end of the tick."""
        with self._lock:
            return len(self._queued)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Cancel what never started (when asked), then shut the pool down."""
        if cancel_futures:
            with self._lock:
                queued, self._queued = self._queued, []
            for future, *_ in queued:
                future.cancel()
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)
