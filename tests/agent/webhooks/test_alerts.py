from __future__ import annotations

from agent.state import AgentState
from agent.webhooks.alerts import Alert, AlertTracker
from detectors.base import Finding, Severity
from detectors.snapshot import Reading, Snapshot, SourceStatus


def _state(now: float, findings: tuple[Finding, ...] = (), engine_ok: bool = True) -> AgentState:
    engine = (
        Reading("engine", now, SourceStatus.OK, {"engine.requests_running": 1.0})
        if engine_ok
        else Reading.failed("engine", now, "HTTP 503")
    )
    return AgentState(snapshot=Snapshot.from_readings(now, {"engine": engine}), findings=findings)


LEAK = Finding(
    "memory_leak", "probe.reserved_bytes", Severity.CRITICAL, 0.9, "reserved grows", 90.0, {"slope": 2.0}
)


def test_a_new_finding_fires_once() -> None:
    tracker = AlertTracker()
    first = tracker.update(_state(100.0, (LEAK,)), 100.0)
    again = tracker.update(_state(101.0, (LEAK,)), 101.0)
    assert [a.status for a in first] == ["firing"] and again == []
    assert first[0].labels["alertname"] == "ServepilotFinding"
    assert first[0].labels["detector"] == "memory_leak" and first[0].starts_at == 90.0


def test_a_finding_that_disappears_resolves_at_that_tick() -> None:
    tracker = AlertTracker()
    tracker.update(_state(100.0, (LEAK,)), 100.0)
    out = tracker.update(_state(105.0), 105.0)
    assert [(a.status, a.ends_at) for a in out] == [("resolved", 105.0)]
    assert tracker.active == {}


def test_findings_below_min_severity_are_not_sent() -> None:
    info = Finding("thermal", "nvml.gpu0.temperature_celsius", Severity.INFO, 0.2, "warm", 1.0)
    assert AlertTracker(min_severity="warning").update(_state(2.0, (info,)), 2.0) == []


def test_a_severity_change_resolves_the_old_alert_and_fires_a_new_one() -> None:
    tracker = AlertTracker()
    warn = Finding("memory_leak", "probe.reserved_bytes", Severity.WARNING, 0.5, "x", 1.0)
    tracker.update(_state(1.0, (warn,)), 1.0)
    out = tracker.update(_state(2.0, (LEAK,)), 2.0)
    assert sorted((a.labels["severity"], a.status) for a in out) == [
        ("critical", "firing"),
        ("warning", "resolved"),
    ]


def test_a_failing_source_alerts_only_after_the_grace_period() -> None:
    tracker = AlertTracker(source_down_after_s=30.0)
    assert tracker.update(_state(0.0, engine_ok=False), 0.0) == []
    assert tracker.update(_state(29.0, engine_ok=False), 29.0) == []
    fired = tracker.update(_state(30.0, engine_ok=False), 30.0)
    assert [(a.labels["alertname"], a.labels["source"], a.labels["severity"]) for a in fired] == [
        ("ServepilotSourceDown", "engine", "critical")
    ]
    assert "HTTP 503" in fired[0].annotations["description"]


def test_a_source_that_recovers_before_the_grace_period_never_alerts() -> None:
    tracker = AlertTracker(source_down_after_s=30.0)
    tracker.update(_state(0.0, engine_ok=False), 0.0)
    tracker.update(_state(10.0), 10.0)
    assert tracker.update(_state(45.0, engine_ok=False), 45.0) == []


def test_static_labels_are_on_every_alert() -> None:
    tracker = AlertTracker(static_labels={"namespace": "prod", "pod": "llm-0"})
    alert = tracker.update(_state(1.0, (LEAK,)), 1.0)[0]
    assert alert.labels["namespace"] == "prod" and alert.labels["pod"] == "llm-0"


def test_restored_alerts_are_resolved_when_no_longer_active() -> None:
    before = AlertTracker()
    fired = before.update(_state(1.0, (LEAK,)), 1.0)
    after_restart = AlertTracker()
    after_restart.restore(fired)
    out = after_restart.update(_state(50.0), 50.0)
    assert [(a.fingerprint, a.status) for a in out] == [(fired[0].fingerprint, "resolved")]


def test_alert_json_round_trips() -> None:
    alert = Alert({"alertname": "X", "a": "1"}, {"summary": "s"}, 1.5, 2.5)
    assert Alert.from_json(alert.to_json()) == alert


def test_a_blinking_finding_fires_once_and_resolves_only_after_the_hold() -> None:
    from agent.state import AgentState
    from agent.webhooks.alerts import AlertTracker
    from detectors.base import Finding, Severity

    tracker = AlertTracker(resolve_after_s=60.0)
    finding = Finding("tail_latency", "engine.ttft_seconds.p99", Severity.WARNING, 0.8, "slow", 0.0)
    changes = []
    for t in range(0, 120, 10):  # present on even ticks only: blinks every 10 s
        state = AgentState(findings=(finding,) if t % 20 == 0 else ())
        changes += tracker.update(state, float(t))
    assert [(c.labels["alertname"], c.ends_at) for c in changes] == [("ServepilotFinding", None)]
    gone = [tracker.update(AgentState(), float(t)) for t in range(120, 200, 10)]
    resolved = [c for batch in gone for c in batch]
    assert len(resolved) == 1 and resolved[0].ends_at is not None


def test_a_source_with_no_data_yet_is_not_an_outage() -> None:
    from agent.state import AgentState
    from agent.webhooks.alerts import AlertTracker
    from detectors.snapshot import Reading, Snapshot

    tracker = AlertTracker(source_down_after_s=5.0)
    changes = []
    for t in range(0, 60, 5):
        readings = {"forecast": Reading.empty("forecast", float(t), "learning: 3 of 120 minutes")}
        state = AgentState(snapshot=Snapshot.from_readings(float(t), readings))
        changes += tracker.update(state, float(t))
    assert changes == []


def _reconfigure(tracker: AlertTracker, now: float, **changes: object) -> list[Alert]:
    settings: dict[str, object] = {
        "min_severity": tracker.min_severity,
        "source_down_after_s": tracker.source_down_after_s,
        "resolve_after_s": tracker.resolve_after_s,
        "static_labels": tracker.static_labels,
        **changes,
    }
    return tracker.reconfigure(now, **settings)  # type: ignore[arg-type]


def test_a_raised_min_severity_resolves_the_findings_below_it_at_once() -> None:
    warn = Finding("thermal", "nvml.gpu0.temperature_celsius", Severity.WARNING, 0.5, "warm", 1.0)
    tracker = AlertTracker(resolve_after_s=60.0)
    tracker.update(_state(100.0, (LEAK, warn)), 100.0)
    out = _reconfigure(tracker, 110.0, min_severity="critical")
    assert [(a.labels["detector"], a.status, a.ends_at) for a in out] == [("thermal", "resolved", 110.0)]
    # the finding is still there, but below the floor now: it neither fires again nor resolves twice
    assert tracker.update(_state(111.0, (LEAK, warn)), 111.0) == []
    assert [a.labels["detector"] for a in tracker.active.values()] == ["memory_leak"]


def test_a_lowered_min_severity_fires_the_findings_it_now_admits_on_the_next_tick() -> None:
    info = Finding("thermal", "nvml.gpu0.temperature_celsius", Severity.INFO, 0.2, "warm", 1.0)
    tracker = AlertTracker(min_severity="warning")
    assert tracker.update(_state(1.0, (info,)), 1.0) == []
    assert _reconfigure(tracker, 2.0, min_severity="info") == []
    assert [a.status for a in tracker.update(_state(3.0, (info,)), 3.0)] == ["firing"]


def test_new_static_labels_resolve_the_old_alert_and_fire_it_again_under_the_new_ones() -> None:
    tracker = AlertTracker(static_labels={"cluster": "eu-1", "team": "llm"}, resolve_after_s=60.0)
    [fired] = tracker.update(_state(100.0, (LEAK,)), 100.0)
    out = _reconfigure(tracker, 120.0, static_labels={"cluster": "eu-2"})
    assert [(a.status, a.labels.get("cluster"), a.labels.get("team")) for a in out] == [
        ("resolved", "eu-1", "llm"),  # under the labels the receiver knows it by
        ("firing", "eu-2", None),
    ]
    assert out[0].fingerprint == fired.fingerprint and out[1].starts_at == fired.starts_at == 90.0
    assert out[1].labels["detector"] == "memory_leak" and out[1].labels["severity"] == "critical"
    # the next tick sees the same condition under the new labels: nothing more is sent
    assert tracker.update(_state(121.0, (LEAK,)), 121.0) == []


def test_settings_that_keep_every_alert_send_nothing() -> None:
    tracker = AlertTracker(static_labels={"cluster": "eu-1"})
    tracker.update(_state(100.0, (LEAK,)), 100.0)
    before = dict(tracker.active)
    assert _reconfigure(tracker, 101.0, resolve_after_s=5.0, source_down_after_s=10.0) == []
    assert tracker.active == before and tracker.resolve_after_s == 5.0


STALL = Finding("engine_stall", "engine.requests_running", Severity.CRITICAL, 1.0, "engine hung", 50.0)
BATCH = Finding("general", "engine.batch_size_mean", Severity.WARNING, 0.9, "batch is unusual", 55.0)
GPU = Finding("general", "nvml.gpu0.power_watts", Severity.WARNING, 0.9, "power is unusual", 55.0)


def _sent(changes: list[Alert]) -> list[tuple[str, str, str]]:
    return sorted((a.labels.get("detector", ""), a.labels.get("signal", ""), a.status) for a in changes)


def test_a_stall_pages_once_and_the_engine_alarms_it_causes_are_not_sent_while_they_last() -> None:
    tracker = AlertTracker()
    fired = tracker.update(_state(60.0, (STALL, BATCH, GPU)), 60.0)
    assert _sent(fired) == [
        ("engine_stall", "engine.requests_running", "firing"),
        ("general", "nvml.gpu0.power_watts", "firing"),  # another source's alarm is no consequence
    ]
    # the stall ends while the batch alarm is still held: it is the same alarm, still not sent
    assert _sent(tracker.update(_state(70.0, (BATCH, GPU)), 70.0)) == [
        ("engine_stall", "engine.requests_running", "resolved")
    ]
    assert tracker.update(_state(71.0, (BATCH, GPU)), 71.0) == []
    # once it has ended, a new one with no stall is sent
    tracker.update(_state(80.0, (GPU,)), 80.0)
    assert _sent(tracker.update(_state(90.0, (BATCH, GPU)), 90.0)) == [
        ("general", "engine.batch_size_mean", "firing")
    ]


def test_an_engine_alarm_firing_before_the_stall_goes_on() -> None:
    tracker = AlertTracker()
    tracker.update(_state(55.0, (BATCH,)), 55.0)
    fired = tracker.update(_state(60.0, (STALL, BATCH)), 60.0)
    assert _sent(fired) == [("engine_stall", "engine.requests_running", "firing")]  # nothing resolved
    assert {a.labels["detector"] for a in tracker.active.values()} == {"engine_stall", "general"}
