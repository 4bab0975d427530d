"""How many findings the detectors raised, and how many they held back: the noise an operator tunes.

Findings are level-based (every tick repeats the standing ones, see :mod:`detectors.base`), so a count
of findings per tick says how long problems lasted, not how many there were. :class:`FindingTally`
counts *raisings*: a finding whose (detector, signal) was not standing on the last tick, or stands with
a new ``since`` (a new episode), or stands at a higher severity than it was raised at (an escalation is
a new alert for the webhooks too). It remembers only the findings standing now, so its memory is bounded
by what is active, not by every signal ever seen. ``servepilot_findings_raised_total{detector,severity}``
exports the counts; ``bench/soak.py`` counts a healthy day's false alarms with the same class.

Suppressed alarms are the ones a detector's alarm budget dropped (:class:`detectors.thresholds.AlarmBudget`:
the general detector's per-signal budget, the multivariate detector's two a day). A detector with a
budget says how many through a ``suppressed_total()`` method; :func:`suppressed_by_detector` reads them
for ``servepilot_findings_suppressed_total{detector}``. A rising count of suppressed alarms says a budget
is spent on something that repeats: a fault the operator already knows of, or a detector to tune.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from detectors.base import Detector, Finding, Severity


class FindingTally:
    """Counts findings as they are raised, by (detector, severity). ``detectors``: names whose counts
    start at 0 for every severity, so a first raising is an increase Prometheus can see (a series born
    at 1 has none)."""

    def __init__(self, detectors: Iterable[str] = ()) -> None:
        self.raised: Counter[tuple[str, str]] = Counter()
        for name in detectors:
            for severity in Severity:
                self.raised[(name, severity.value)] = 0
        #: per standing (detector, signal): the episode's ``since`` and the highest severity counted for it
        self._standing: dict[tuple[str, str], tuple[float, int]] = {}

    def observe(self, findings: Iterable[Finding]) -> list[Finding]:
        """Count this tick's findings; returns the ones raised on this tick."""
        standing: dict[tuple[str, str], tuple[float, int]] = {}
        raised: list[Finding] = []
        for finding in findings:
            key = (finding.detector, finding.signal)
            rank = finding.severity.rank
            since, counted = self._standing.get(key, (None, -1))
            if since != finding.since:
                counted = -1
            if rank > counted:
                self.raised[(finding.detector, finding.severity.value)] += 1
                raised.append(finding)
                counted = rank
            standing[key] = (finding.since, counted)
        self._standing = standing
        return raised

    def counts(self) -> dict[tuple[str, str], int]:
        return dict(self.raised)


def suppressed_by_detector(detectors: Iterable[Detector]) -> Mapping[str, int]:
    """Alarms each detector with an alarm budget has suppressed so far (module docstring)."""
    out: dict[str, int] = {}
    for detector in detectors:
        count = getattr(detector, "suppressed_total", None)
        if callable(count):
            out[detector.name] = int(count())
    return out
