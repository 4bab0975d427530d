"""The detector Protocol, the Finding value type and the explicit registry of detectors.

Detectors follow river's streaming convention: for each snapshot they *score first, then learn*, so a
score never uses the observation it is scoring. During warm-up a detector returns no findings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Protocol

from detectors.snapshot import Snapshot


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        """0, 1, 2 from info to critical: what orders findings, counts a raise and filters alerts."""
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


@dataclass(frozen=True)
class Finding:
    """Something a detector believes is wrong (or noteworthy), with the evidence for it.

    ``score`` is in [0, 1]; ``evidence`` holds the numbers that led to the finding so an operator can
    check the reasoning; ``hint`` says what to look at or do next.
    """

    detector: str
    signal: str
    severity: Severity
    score: float
    summary: str
    since: float
    evidence: Mapping[str, float | str] = field(default_factory=dict)
    hint: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "score", min(1.0, max(0.0, float(self.score))))
        object.__setattr__(self, "evidence", MappingProxyType(dict(self.evidence)))

    def to_json(self) -> dict[str, object]:
        return {
            "detector": self.detector,
            "signal": self.signal,
            "severity": self.severity.value,
            "score": self.score,
            "summary": self.summary,
            "since": self.since,
            "evidence": dict(self.evidence),
            "hint": self.hint,
        }


class Detector(Protocol):
    """A streaming detector fed one snapshot per tick.

    A detector with an alarm budget also has ``suppressed_total() -> int``, the alarms its budget has
    dropped so far (exported as ``servepilot_findings_suppressed_total``; see :mod:`agent.tally`)."""

    name: str

    def update(self, snapshot: Snapshot) -> list[Finding]:
        """Score ``snapshot`` against what was learned so far, then learn from it."""
        ...


@dataclass(frozen=True)
class Registration:
    factory: Callable[[], Detector]
    default_enabled: bool
    description: str


#: Detectors by name. Filled by explicit ``register`` calls in :mod:`detectors.registry`; no import-time
#: side effects elsewhere.
REGISTRY: dict[str, Registration] = {}


def register(name: str, factory: Callable[[], Detector], *, default_enabled: bool, description: str) -> None:
    if name in REGISTRY:
        raise ValueError(f"detector {name!r} is already registered")
    REGISTRY[name] = Registration(factory, default_enabled, description)
