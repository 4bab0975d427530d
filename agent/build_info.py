"""``servepilot_build_info``: which servepilot, on which Python and event loop, a pod runs.

The Prometheus convention for "what is deployed" (``prometheus_build_info``, ``node_exporter_build_info``):
one series at 1 whose labels say it. During a rolling upgrade ``count by (version)
(servepilot_build_info)`` shows how far it has got; a pod that behaves as an old one (a gate without
``servepilot_gate_upstream_role``, whose alerts are not muted: docs/alerts.md) is found by its version;
and ``event_loop`` says whether ``agent.event_loop: auto`` found uvloop in the image.

The event loop is read at scrape time from the loop serving the scrape (``none`` when scraped outside one,
as a test may), so the label cannot disagree with the loop that runs.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from agent import version
from agent.eventloop import running_loop_name


def event_loop() -> str:
    """``uvloop`` or ``asyncio`` for the loop running now, ``none`` outside one."""
    try:
        return running_loop_name()
    except RuntimeError:  # no running loop
        return "none"


class BuildInfo(Collector):
    """Yields ``servepilot_build_info{version, python_version, event_loop} 1``."""

    def collect(self) -> Iterator[Metric]:
        family = InfoMetricFamily(
            "servepilot_build", "servepilot's version, the Python it runs on and its event loop."
        )
        family.add_metric(
            [],
            {"version": version(), "python_version": platform.python_version(), "event_loop": event_loop()},
        )
        yield family


def register(registry: CollectorRegistry) -> None:
    """Add ``servepilot_build_info`` to ``registry``."""
    registry.register(BuildInfo())
