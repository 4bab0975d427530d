"""What the loop publishes after each tick: an immutable view for the API, the exporter and the demo."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from detectors.base import Finding
from detectors.snapshot import Snapshot
from policies.base import Proposal


@dataclass(frozen=True)
class TickStats:
    """Cost and health of the loop itself."""

    ticks: int = 0
    last_duration_s: float = 0.0
    last_collect_s: float = 0.0
    last_think_s: float = 0.0
    last_cpu_s: float = 0.0
    overruns: int = 0
    detector_errors: Mapping[str, int] = field(default_factory=dict)
    policy_errors: Mapping[str, int] = field(default_factory=dict)
    #: findings raised so far, by (detector, severity) (:class:`agent.tally.FindingTally`)
    findings_raised: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: alarms dropped by a detector's alarm budget so far, by detector
    findings_suppressed: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentState:
    """The latest snapshot with what the brain made of it. Replaced wholesale each tick, never mutated."""

    snapshot: Snapshot | None = None
    findings: tuple[Finding, ...] = ()
    proposals: tuple[Proposal, ...] = ()
    knobs: Mapping[str, float | str] = field(default_factory=lambda: MappingProxyType({}))
    stats: TickStats = TickStats()
    policy_states: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Each policy's state after this tick, by policy name (the breaker's level is exported from it)."""

    def to_json(self) -> dict[str, object]:
        snap = self.snapshot
        return {
            "now": snap.now if snap else None,
            "sources": {
                name: {
                    "status": r.status.value,
                    "observed_at": r.observed_at,
                    "duration_s": r.duration_s,
                    "error": r.error,
                    "info": dict(r.info),
                }
                for name, r in (snap.readings.items() if snap else ())
            },
            "values": dict(sorted(snap.values.items())) if snap else {},
            "findings": [f.to_json() for f in self.findings],
            "proposals": [p.to_json() for p in self.proposals],
            "knobs": dict(self.knobs),
            "loop": {
                "ticks": self.stats.ticks,
                "last_duration_s": self.stats.last_duration_s,
                "overruns": self.stats.overruns,
            },
        }
