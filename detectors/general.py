"""The general anomaly detector: one streaming scorer and one thresholder per snapshot signal.

It adapts any :class:`~detectors.streaming.StreamingScorer` to the snapshot-level
:class:`~detectors.base.Detector` Protocol: every tick, each selected signal present in the snapshot is
scored (score first, then learn) and fed to its :class:`~detectors.thresholds.Thresholder`; a newly
raised alarm becomes a :class:`~detectors.base.Finding`. Signals absent from a snapshot are simply not
updated (missing data is absence, never NaN). ``max_signals`` bounds memory when a scrape explodes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from detectors.base import Finding, Severity
from detectors.snapshot import Snapshot
from detectors.streaming import StreamingScorer
from detectors.thresholds import Thresholder


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
    ) -> None:
        self.scorer_factory = scorer_factory
        self.thresholder_factory = thresholder_factory
        self.signals = None if signals is None else frozenset(signals)
        self.prefixes = prefixes
        self.max_signals = max_signals
        self.scorers_: dict[str, StreamingScorer] = {}
        self.thresholders_: dict[str, Thresholder] = {}
        self.last_scores_: dict[str, float] = {}

    def _watched(self, name: str) -> bool:
        if self.signals is not None:
            return name in self.signals
        return name.startswith(self.prefixes)

    def update(self, snapshot: Snapshot) -> list[Finding]:
        """Score every watched signal in ``snapshot`` at ``snapshot.now``, then learn; return new alarms."""
        findings: list[Finding] = []
        for name in sorted(snapshot.values):
            if not self._watched(name):
                continue
            scorer = self.scorers_.get(name)
            if scorer is None:
                if len(self.scorers_) >= self.max_signals:
                    continue
                scorer = self.scorers_[name] = self.scorer_factory()
                self.thresholders_[name] = self.thresholder_factory()
            value = snapshot.values[name]
            score = scorer.update(snapshot.now, value)
            self.last_scores_[name] = score
            event = self.thresholders_[name].update(snapshot.now, score)
            if event.raised:
                findings.append(
                    Finding(
                        detector=self.name,
                        signal=name,
                        severity=Severity.WARNING,
                        score=score,
                        summary=f"{name} is unusual (anomaly score {score:.2f})",
                        since=snapshot.now,
                        evidence={"value": value, "score": score},
                        hint="compare with the signal's baseline in Grafana; see other findings for a cause",
                    )
                )
        return findings
