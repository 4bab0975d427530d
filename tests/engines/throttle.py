"""CPU-quota throttling of a running engine, the way a container's CFS quota throttles a pod.

A container that exceeds its CPU quota is stopped for the rest of each scheduling period. This thread
does the same to a process with SIGSTOP/SIGCONT: stopped ``stopped_s`` out of every ``period_s``. Unlike
busy-loop neighbours on a shared 2-core machine (whose effect ranges from nothing to a full stall,
depending on what else runs), the slowdown is a fixed share, so a test can rely on it. The process is
always continued when the context exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def throttled(pid: int, *, period_s: float = 0.2, stopped_s: float = 0.15) -> Iterator[None]:
    if not 0 < stopped_s < period_s:
        raise ValueError("need 0 < stopped_s < period_s")
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            done.wait(stopped_s)
            os.kill(pid, signal.SIGCONT)
            done.wait(period_s - stopped_s)

    thread = threading.Thread(target=cycle, name="engine-throttle", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
