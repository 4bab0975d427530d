"""The allocator probe: a tiny Prometheus endpoint that runs *inside* the inference engine's process.

Load it with ``import agent.probe; agent.probe.start()`` (any engine) or through the vLLM general plugin
``agent.probe.plugin:register``. Importing this package costs nothing: prometheus_client is imported on
``start`` and torch is never imported by the probe (it reads the engine's already-loaded torch).
See docs/probe.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.probe.server import ProbeServer
    from agent.probe.stats import StatsSource

__all__ = ["start", "stop"]


def start(
    port: int | None = None, host: str = "127.0.0.1", source: StatsSource | None = None
) -> ProbeServer | None:
    """Serve allocator stats on ``host:port`` (port from the argument, ``SERVEPILOT_PROBE_PORT`` or 9401).

    Idempotent within a process; returns ``None`` with one logged warning when the port is taken.
    ``source`` replaces ``torch.cuda.memory_stats`` (tests, other allocators).
    """
    from agent.probe import server, stats

    return server.start(port, host, source or stats.torch_stats)


def stop() -> None:
    """Stop the probe started by :func:`start`, if any."""
    from agent.probe import server

    server.stop()
