"""The general anomaly detector: one streaming scorer and one thresholder per snapshot signal.

It adapts any :class:`~detectors.streaming.StreamingScorer` to the snapshot-level
:class:`~detectors.base.Detector` Protocol: every tick, each selected signal present in the snapshot is
scored (score first, then learn) and fed to its :class:`~detectors.thresholds.Thresholder`; a newly
raised alarm becomes a :class:`~detectors.base.Finding`. Signals absent from a snapshot are simply not
updated (missing data is absence, never NaN). ``max_signals`` bounds memory when a scrape explodes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from detectors.base import Finding, Severity
from detectors.snapshot import Snapshot
from detectors.streaming import StreamingScorer
from detectors.thresholds import Thresholder

#: Signals the general detector leaves alone by default: cumulative counters (always "new" values),
#: configuration-like constants, categorical bitmasks and per-pid/per-device detail, and the redundant
#: ``max``/``last``/``p50`` views of signals whose ``mean``/``p95``/``p99`` are watched. This keeps the cost
#: per tick proportional to what an operator would chart, not to the size of the scrape.
DEFAULT_EXCLUDE = (
    r"(\.(max|last|p50|samples)$)|(_total$)|(energy_joules$)|(\.throttle)|(process_used_bytes)"
    r"|(^probe\.device)|(memory_total_bytes$)|(power_limit_watts$)|(_info$)"
)


class GeneralAnomalyDetector:
    """Per-signal scoring and alarming (see the module docstring)."""

    name = "general"

    def __init__(
        self,
        scorer_factory: Callable[[], StreamingScorer],
        thresholder_factory: Callable[[], Thresholder] = Thresholder,
        signals: Iterable[str] | None = None,
        prefixes: tuple[str, ...] = ("engine.", "nvml.", "probe."),
        max_signals: int = 512,
        exclude: str | None = DEFAULT_EXCLUDE,
        hold_s: float = 300.0,
    ) -> None:
        self.scorer_factory = scorer_factory
        self.thresholder_factory = thresholder_factory
        self.signals = None if signals is None else frozenset(signals)
        self.prefixes = prefixes
        self.max_signals = max_signals
        self.exclude = exclude
        self.hold_s = hold_s
        self._exclude = re.compile(exclude) if exclude else None
        self._watch_cache: dict[str, bool] = {}
        self._keys: frozenset[str] = frozenset()
        self._order: list[str] = []
        self.active_: dict[str, Finding] = {}
        self.scorers_: dict[str, StreamingScorer] = {}
        self.thresholders_: dict[str, Thresholder] = {}
        self.last_scores_: dict[str, float] = {}

    def _watched(self, name: str) -> bool:
        known = self._watch_cache.get(name)
        if known is None:
            if self.signals is not None:
                known = name in self.signals
            else:
                known = name.startswith(self.prefixes) and not (self._exclude and self._exclude.search(name))
            if len(self._watch_cache) > 4 * self.max_signals:
                self._watch_cache.clear()
            self._watch_cache[name] = known
        return known

    def _watched_in(self, snapshot: Snapshot) -> list[str]:
        """The watched names of ``snapshot``, sorted; recomputed only when its set of names changes (a
        tick normally carries the same names as the one before)."""
        keys = snapshot.values.keys()
        if keys != self._keys:
            self._keys = frozenset(keys)
            self._order = [name for name in sorted(keys) if self._watched(name)]
        return self._order

    def update(self, snapshot: Snapshot) -> list[Finding]:
        """Score every watched signal in ``snapshot`` at ``snapshot.now``, then learn.

        Returns the active findings: an alarm stays active for ``hold_s`` after it was raised, so it is
        visible in ``/api/state`` and as ``servepilot_finding_active`` rather than for a single tick.
        """
        findings: list[Finding] = []
        values, now = snapshot.values, snapshot.now
        scorers, thresholders, last_scores = self.scorers_, self.thresholders_, self.last_scores_
        for name in self._watched_in(snapshot):
            scorer = scorers.get(name)
            if scorer is None:
                if len(scorers) >= self.max_signals:
                    continue
                scorer = scorers[name] = self.scorer_factory()
                thresholders[name] = self.thresholder_factory()
            value = values[name]
            score = scorer.update(now, value)
            last_scores[name] = score
            if thresholders[name].push(now, score):
                self.active_[name] = Finding(
                    detector=self.name,
                    signal=name,
                    severity=Severity.WARNING,
                    score=score,
                    summary=f"{name} is unusual (anomaly score {score:.2f})",
                    since=snapshot.now,
                    evidence={"value": value, "score": score},
                    hint="compare with the signal's baseline in Grafana; see other findings for a cause",
                )
        for name, finding in list(self.active_.items()):
            if snapshot.now - finding.since > self.hold_s:
                del self.active_[name]
            else:
                findings.append(finding)
        return findings
