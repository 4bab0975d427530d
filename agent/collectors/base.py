"""The collector Protocol shared by every source.

``collect(now)`` does the I/O and must never raise: failures become a :class:`Reading` with status
``error`` (or ``no_data``), so a failing source never fails the tick. The pure part of each collector is a
module-level ``parse(...)`` function that tests call on saved text.
"""

from __future__ import annotations

from typing import Protocol

from detectors.snapshot import Reading

SCRAPE_HEADERS = {"Accept-Encoding": "identity"}
"""Sent with every scrape. aiohttp asks for gzip by default, and prometheus_client's exposition apps
(SGLang's ``/metrics``, the allocator probe) then compress each answer inside the engine process: ~0.9 ms
of gzip for a 57 kB scrape, every tick, to save bytes on loopback, plus the sidecar's decompression."""


class Collector(Protocol):
    """One source of observations."""

    name: str
    # Optional attribute ``ahead_of_tick: bool``: True for a source read over the network, which
    # :meth:`agent.loop.Loop.run` starts ``agent.scrape_lead_s`` before each tick (read with getattr, so a
    # collector that lacks it is collected inside the tick).

    async def collect(self, now: float) -> Reading:
        """Fetch and parse one observation. Never raises; errors are returned as a Reading."""
        ...

    async def close(self) -> None:
        """Release connections, threads and handles."""
        ...
