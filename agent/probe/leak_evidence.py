"""Agent side of leak evidence: when the leak detector fires, ask the probe for a memory snapshot.

:class:`LeakEvidence` is the pure part (which findings trigger a recording, at most one per
``cooldown_s``, and how the finding links to the saved file); :func:`request_snapshot` is the one HTTP
call to the probe's ``POST /evidence/memory`` (:mod:`agent.probe.evidence`). A failed call is one log
line and an empty result, never an exception out of the tick.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp

from detectors.base import Finding

log = logging.getLogger(__name__)

LEAK_DETECTOR = "memory_leak"


class LeakEvidence:
    """Decides when to record and remembers the file each leak episode produced."""

    def __init__(self, duration_s: float = 60.0, cooldown_s: float = 3600.0) -> None:
        self.duration_s = duration_s
        self.cooldown_s = cooldown_s
        self.last_request: float | None = None
        self.file: str = ""

    def wanted(self, findings: Sequence[Finding], now: float) -> bool:
        """True when a leak finding is active and no recording was asked for within ``cooldown_s``."""
        if not any(f.detector == LEAK_DETECTOR for f in findings):
            return False
        if self.last_request is not None and now - self.last_request < self.cooldown_s:
            return False
        self.last_request = now
        return True

    def recorded(self, answer: dict[str, Any]) -> None:
        """Remember the probe's planned file (``{"file": ...}``) for the findings to link to."""
        if isinstance(answer.get("file"), str):
            self.file = answer["file"]

    def link(self, findings: Sequence[Finding]) -> list[Finding]:
        """Leak findings with ``evidence["memory_snapshot"]`` = the file (for pytorch.org/memory_viz)."""
        if not self.file:
            return list(findings)
        return [
            dataclasses.replace(f, evidence={**f.evidence, "memory_snapshot": self.file})
            if f.detector == LEAK_DETECTOR
            else f
            for f in findings
        ]


async def request_snapshot(
    session: aiohttp.ClientSession, probe_url: str, duration_s: float, timeout_s: float = 2.0
) -> dict[str, Any]:
    """``POST {probe}/evidence/memory?duration_s=...``; the probe's JSON answer, or {} on failure."""
    url = probe_url.rstrip("/").removesuffix("/metrics") + "/evidence/memory"
    try:
        async with session.post(
            url, params={"duration_s": f"{duration_s:g}"}, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            answer = await resp.json(content_type=None)
            if resp.status != 202:
                log.warning("probe refused a memory recording (HTTP %d): %s", resp.status, answer)
                return {}
            return dict(answer) if isinstance(answer, dict) else {}
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        log.warning("cannot ask the probe for a memory recording: %s", error)
        return {}
