"""SIGTERM and Ctrl-C: the first signal stops cleanly, a second cuts the stop short.

A clean stop takes a while on purpose: the gate serves on for ``gate.shutdown_delay_s`` (while the
Service forgets the pod), then lets the requests in progress finish for up to ``gate.drain_s``. That is
right for Kubernetes, which sends one SIGTERM. An operator at a terminal who presses Ctrl-C a second time
does not want to wait out a long stream: the second signal ends the delay and cuts the requests still in
progress (as uvicorn and docker compose do). The GPU and engine settings are put back to their defaults
either way: that part of the stop is what makes a stop safe, and it takes well under a second.
"""

from __future__ import annotations

import asyncio
import logging
import signal

log = logging.getLogger("servepilot")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """``stop`` is set on the first SIGINT or SIGTERM, ``hurry`` on the next."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.received, sig)

    def received(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if not self.stop.is_set():
            log.info("%s: stopping (send it again to cut the requests in progress short)", name)
            self.stop.set()
        elif not self.hurry.is_set():
            log.warning("%s again: cutting the stop short; settings still go back to their defaults", name)
            self.hurry.set()


def ignore_hangup_while_stopping(loop: asyncio.AbstractEventLoop) -> None:
    """A SIGHUP (a reload) from now on is logged and ignored: no reload racing the stop, and not
    SIGHUP's default either, which ends the process before the settings are put back."""
    loop.add_signal_handler(signal.SIGHUP, log.info, "SIGHUP ignored: stopping")


def ignore_hangup_until_exit(loop: asyncio.AbstractEventLoop) -> None:
    """Once the stop is done: SIGHUP ignored while the loop closes and the process exits (removing a
    loop's handler puts back the default, an exit)."""
    loop.remove_signal_handler(signal.SIGHUP)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
