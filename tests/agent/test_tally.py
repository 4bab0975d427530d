"""FindingTally and the suppressed counts: raisings, not ticks, and what the alarm budgets dropped."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.assembly import build_detectors
from agent.exporter import Exporter
from agent.loop import Loop
from agent.store import Store
from agent.tally import FindingTally, suppressed_by_detector
from detectors.base import Finding, Severity
from detectors.general import GeneralAnomalyDetector
from detectors.multivariate import MultivariateAnomalyDetector
from detectors.snapshot import Reading, Snapshot, SourceStatus
from tests.agent.test_loop import StaticCollector


def _f(signal: str, severity: Severity, since: float, detector: str = "d") -> Finding:
    return Finding(detector, signal, severity, 0.5, "x", since)


def test_a_standing_finding_is_one_raising_however_many_ticks_it_lasts() -> None:
    tally = FindingTally()
    raised = [tally.observe([_f("a", Severity.WARNING, 10.0)]) for _ in range(100)]
    assert [len(r) for r in raised] == [1] + [0] * 99
    assert tally.counts() == {("d", "warning"): 1}


def test_a_new_episode_and_an_escalation_count_a_de_escalation_does_not() -> None:
    tally = FindingTally()
    tally.observe([_f("a", Severity.WARNING, 10.0)])
    tally.observe([_f("a", Severity.CRITICAL, 10.0)])  # escalated: a new alert for the webhooks too
    tally.observe([_f("a", Severity.WARNING, 10.0)])  # back down within the episode: nothing new
    tally.observe([_f("a", Severity.CRITICAL, 10.0)])  # up again to a level already counted
    tally.observe([_f("a", Severity.WARNING, 20.0)])  # a new episode (new since)
    tally.observe([])  # it ends
    tally.observe([_f("a", Severity.WARNING, 20.0)])  # back, same since: after a gap, raised again
    assert tally.counts() == {("d", "warning"): 3, ("d", "critical"): 1}


def test_findings_on_other_signals_and_detectors_count_apart() -> None:
    tally = FindingTally(["d", "e"])
    info = Severity.INFO
    tally.observe([_f("a", info, 1.0), _f("b", info, 1.0), _f("a", info, 1.0, "e")])
    counts = tally.counts()
    assert counts[("d", "info")] == 2 and counts[("e", "info")] == 1
    assert counts[("e", "critical")] == 0  # declared: a first raising is an increase Prometheus sees
    assert len(counts) == 6


def test_only_standing_findings_are_remembered() -> None:
    tally = FindingTally()
    for i in range(1000):
        tally.observe([_f(f"pid{i}", Severity.INFO, float(i))])
    assert len(tally._standing) == 1
    assert tally.counts() == {("d", "info"): 1000}


def _snap(now: float, value: float) -> Snapshot:
    return Snapshot.from_readings(now, {"e": Reading("e", now, SourceStatus.OK, {"engine.x": value})})


def test_the_general_detector_says_what_its_budgets_dropped() -> None:
    # a budget of one alarm a day per signal: a level that doubles every 200 s is new each time; the
    # first is raised, the rest of the hour's are dropped
    [general] = [d for d in build_detectors() if isinstance(d, GeneralAnomalyDetector)]
    for i in range(6000):
        general.update(_snap(float(i), 0.0 if i < 2000 else 2.0 ** ((i - 2000) // 200)))
    budget = general.thresholders_["engine.x"]
    assert budget.raised_total_ == 1
    assert general.suppressed_total() == budget.suppressed_total_ > 0
    assert suppressed_by_detector([general]) == {"general": general.suppressed_total()}


def test_detectors_without_a_budget_are_not_listed() -> None:
    multivariate = MultivariateAnomalyDetector()
    assert suppressed_by_detector([multivariate, object()]) == {"multivariate": 0}  # type: ignore[list-item]


class Flapping:
    """A detector whose finding on one signal starts a new episode every 5 ticks."""

    name = "flapping"

    def update(self, snapshot: Snapshot) -> list[Finding]:
        episode = snapshot.now // 5
        return [Finding(self.name, "engine.x", Severity.WARNING, 0.9, "x", episode * 5)]

    def suppressed_total(self) -> int:
        return 7


async def test_the_loop_exports_raisings_and_suppressions() -> None:
    exporter = Exporter()
    loop = Loop(
        [StaticCollector("engine", {"engine.x": 1.0})],
        Store(100, 100),
        interval_s=1.0,
        source_timeout_s=0.05,
        detectors=[Flapping()],
    )
    loop.subscribe(exporter.publish)
    for t in range(20):
        await loop.tick(float(t))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(exporter.registry).decode())
        for s in family.samples
    }
    raised = "servepilot_findings_raised_total"
    assert samples[(raised, (("detector", "flapping"), ("severity", "warning")))] == 4.0  # 20 ticks
    assert samples[(raised, (("detector", "flapping"), ("severity", "critical")))] == 0.0
    assert samples[("servepilot_findings_suppressed_total", (("detector", "flapping"),))] == 7.0
