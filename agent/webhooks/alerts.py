"""Alerts the agent sends: what is firing, derived each tick from findings and source health.

Pure (no I/O, time passed in). :class:`AlertTracker` turns the stream of :class:`AgentState` into
*transitions* — an alert is emitted once when it starts firing and once when it resolves — which is the
first half of dedup: a finding that stays active for an hour produces two messages, not 3,600. Two kinds:

* ``ServepilotFinding``: one per active finding at or above ``min_severity``, identified by
  (detector, signal, severity); a change of severity resolves the old alert and fires a new one, the way
  Alertmanager treats a change of labels;
* ``ServepilotSourceDown``: a collector (engine, nvml, probe) that has not returned OK for
  ``source_down_after_s`` seconds; a single failed scrape is not worth a page.

One incident, one message (as the Alertmanager inhibition rules do for the Prometheus alerts): while
the ``engine_stall`` detector finds the engine hung, the general detector's alarms on the engine's own
signals (``engine.*``: a batch, a queue, a token rate that stopped moving) follow from the hang and are
not sent, for as long as each lasts, the stall's end included. One that was already firing goes on;
the general detector's alarms on other sources (the GPUs, the allocator) are sent as usual.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from agent.state import AgentState
from detectors.base import Finding, Severity
from detectors.snapshot import SourceStatus

_RANK = {severity.value: severity.rank for severity in Severity}  # by the label a receiver sees
#: Labels the tracker sets itself; every other label of an alert is one of ``static_labels``.
_OWN_LABELS = frozenset({"alertname", "detector", "signal", "severity", "source"})


@dataclass(frozen=True)
class Alert:
    """One alert instance. ``ends_at`` is None while it fires and the resolve time once resolved."""

    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    starts_at: float
    ends_at: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", MappingProxyType(dict(sorted(self.labels.items()))))
        object.__setattr__(self, "annotations", MappingProxyType(dict(self.annotations)))

    @property
    def status(self) -> str:
        return "firing" if self.ends_at is None else "resolved"

    @property
    def fingerprint(self) -> str:
        """Stable identity of the condition: a hash of the label set, as Alertmanager computes one."""
        text = "\x00".join(f"{k}\x01{v}" for k, v in self.labels.items())
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    def resolved(self, now: float) -> Alert:
        return replace(self, ends_at=now)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "fingerprint": self.fingerprint,
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "starts_at": self.starts_at,
            "ends_at": self.ends_at,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Alert:
        ends = data.get("ends_at")
        return cls(
            {str(k): str(v) for k, v in data["labels"].items()},
            {str(k): str(v) for k, v in data.get("annotations", {}).items()},
            float(data["starts_at"]),
            None if ends is None else float(ends),
        )


@dataclass
class AlertTracker:
    """Keeps the set of firing alerts and reports what changed at each tick."""

    min_severity: str = "warning"
    source_down_after_s: float = 30.0
    static_labels: Mapping[str, str] = field(default_factory=dict)
    active: dict[str, Alert] = field(default_factory=dict)
    resolve_after_s: float = 0.0
    """An alert resolves only after its condition has been absent this long (flap damping, like
    Prometheus' ``keep_firing_for``): a finding that blinks tick to tick sends one alert, not hundreds."""
    _failing_since: dict[str, float] = field(default_factory=dict)
    _missing_since: dict[str, float] = field(default_factory=dict)
    _muted: set[str] = field(default_factory=set)
    """Findings not sent because they followed from an engine stall, until each ends (module docstring)."""

    def restore(self, alerts: Iterable[Alert]) -> None:
        """Resume with alerts that were firing before a restart, so their resolution is still sent."""
        self.active = {a.fingerprint: a for a in alerts if a.ends_at is None}

    def reconfigure(
        self,
        now: float,
        *,
        min_severity: str,
        source_down_after_s: float,
        resolve_after_s: float,
        static_labels: Mapping[str, str],
    ) -> list[Alert]:
        """Take new settings (a config reload); returns the transitions they make at once.

        * A firing finding below a raised ``min_severity`` resolves now: the operator asked not to be
          told of it, and a receiver must not keep an incident open that nothing will ever close.
        * New ``static_labels`` change every alert's identity, as a change of labels does in
          Alertmanager: each firing alert resolves under its old labels and fires again under the new
          ones now, with its start time kept, rather than both being open for ``resolve_after_s``.
        Alerts that still hold are kept, so nothing fires twice.
        """
        floor = _RANK[min_severity]
        changes: list[Alert] = []
        kept: dict[str, Alert] = {}
        for key, alert in self.active.items():
            severity = alert.labels.get("severity", "")
            if alert.labels.get("alertname") == "ServepilotFinding" and _RANK.get(severity, floor) < floor:
                changes.append(alert.resolved(now))
                self._missing_since.pop(key, None)
                continue
            own = {k: v for k, v in alert.labels.items() if k in _OWN_LABELS or k not in self.static_labels}
            labels = {**static_labels, **own}
            if labels == dict(alert.labels):
                kept[key] = alert
                continue
            renamed = Alert(labels, alert.annotations, alert.starts_at)
            changes.append(alert.resolved(now))
            self._missing_since.pop(key, None)
            kept[renamed.fingerprint] = renamed
        refired = [alert for key, alert in kept.items() if key not in self.active]
        self.active = kept
        self.min_severity = min_severity
        self.source_down_after_s = source_down_after_s
        self.resolve_after_s = resolve_after_s
        self.static_labels = dict(static_labels)
        return changes + refired

    def _desired(self, state: AgentState, now: float) -> dict[str, Alert]:
        floor = _RANK[self.min_severity]
        out: dict[str, Alert] = {}
        stalled = any(f.detector == STALL_DETECTOR for f in state.findings)
        muted: set[str] = set()
        for finding in state.findings:
            if finding.severity.rank < floor:
                continue
            labels = {
                **self.static_labels,
                "alertname": "ServepilotFinding",
                "detector": finding.detector,
                "signal": finding.signal,
                "severity": finding.severity.value,
            }
            notes = {"summary": finding.summary, "description": _describe(finding.evidence, finding.score)}
            if finding.hint:
                notes["hint"] = finding.hint
            alert = Alert(labels, notes, min(finding.since, now))
            key = alert.fingerprint
            if key not in self.active and (key in self._muted or (stalled and _follows_a_stall(finding))):
                muted.add(key)
                continue
            out[key] = alert
        self._muted = muted
        snapshot = state.snapshot
        if snapshot is None:
            return out
        for name, reading in snapshot.readings.items():
            # "no data" is not an outage (a forecaster still learning, an idle engine with nothing to
            # report): only errors count towards ServepilotSourceDown
            if reading.status is not SourceStatus.ERROR:
                self._failing_since.pop(name, None)
                continue
            since = self._failing_since.setdefault(name, now)
            if now - since < self.source_down_after_s:
                continue
            labels = {**self.static_labels, "alertname": "ServepilotSourceDown", "source": name}
            labels["severity"] = "critical" if name == "engine" else "warning"
            why = reading.error or "no data"
            notes = {
                "summary": f"servepilot cannot read its {name} source",
                "description": f"{reading.status.value} for {now - since:.0f} s: {why}",
            }
            alert = Alert(labels, notes, since)
            out[alert.fingerprint] = alert
        return out

    def update(self, state: AgentState, now: float) -> list[Alert]:
        """Transitions at ``now``: newly firing alerts, then newly resolved ones."""
        desired = self._desired(state, now)
        changes: list[Alert] = []
        for key, alert in desired.items():
            self._missing_since.pop(key, None)
            if key not in self.active:
                self.active[key] = alert
                changes.append(alert)
        for key in [k for k in self.active if k not in desired]:
            missing_since = self._missing_since.setdefault(key, now)
            if now - missing_since >= self.resolve_after_s:
                del self._missing_since[key]
                changes.append(self.active.pop(key).resolved(now))
        return changes


STALL_DETECTOR = "engine_stall"


def _follows_a_stall(finding: Finding) -> bool:
    """A general-detector alarm on one of the engine's own signals: a consequence of a hang."""
    return finding.detector == "general" and finding.signal.startswith("engine.")


def _describe(evidence: Mapping[str, float | str], score: float) -> str:
    parts = [f"score {score:.2f}"]
    for key, value in sorted(evidence.items())[:8]:
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return "; ".join(parts)
