"""Per-request latency targets: the replay's SLO, and each priority class's own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slo:
    """Per-request latency targets (seconds): TTFT, and mean inter-token latency."""

    ttft_s: float
    itl_s: float
