"""Which asyncio event loop a long-running command runs on: uvloop where it is installed, else asyncio's.

The sidecar's hot path is loopback networking: the gate relays every SSE chunk of every request, and
each tick scrapes the engine and the probe over HTTP. uvloop (libuv under the asyncio API, a dependency
on Linux and macOS) does the same socket work in far fewer CPU cycles; ``bench/gate.py`` and
``bench/tick.py`` print the figures for both (``--event-loop``). ``agent.event_loop`` chooses:

* ``auto`` (default): uvloop when it imports, asyncio's own loop otherwise (Windows, or a build without
  it); the sidecar's start-up log line says which it runs;
* ``uvloop``: uvloop or a clear start-up error (exit 2), for a pod that must not silently run slower;
* ``asyncio``: the standard loop, the fallback should a uvloop release misbehave.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar, get_args

T = TypeVar("T")
EventLoopChoice = Literal["auto", "uvloop", "asyncio"]
#: the choices, for command-line flags that pick a loop
CHOICES: tuple[EventLoopChoice, ...] = get_args(EventLoopChoice)


def resolve(choice: EventLoopChoice) -> Literal["uvloop", "asyncio"]:
    """The loop ``choice`` stands for on this machine; a :class:`~agent.config.ConfigError` naming
    ``agent.event_loop`` when the choice is ``uvloop`` and it does not import."""
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError as error:
        if choice == "uvloop":
            from agent.config import ConfigError

            raise ConfigError(
                "agent.event_loop", f"is uvloop, but it does not import ({error}): pip install uvloop"
            ) from None
        return "asyncio"
    return "uvloop"


def runner(choice: EventLoopChoice) -> Callable[[Coroutine[Any, Any, T]], T]:
    """``asyncio.run`` or ``uvloop.run`` for ``choice`` (see :func:`resolve`)."""
    if resolve(choice) == "uvloop":
        import uvloop

        return uvloop.run
    return asyncio.run


def running_loop_name() -> str:
    """``uvloop`` or ``asyncio``: what the running loop is (the sidecar's start-up log line)."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
