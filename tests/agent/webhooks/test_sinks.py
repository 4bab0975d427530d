from __future__ import annotations

import json

from agent.webhooks.alerts import Alert
from agent.webhooks.signing import verify
from agent.webhooks.sinks import AlertmanagerSink, GenericSink, message_id, rfc3339

FIRING = Alert(
    {"alertname": "ServepilotFinding", "detector": "memory_leak", "severity": "critical"},
    {"summary": "s"},
    0.0,
)
OTHER = Alert({"alertname": "ServepilotSourceDown", "source": "engine", "severity": "critical"}, {}, 5.0)


def test_rfc3339_is_utc_with_milliseconds() -> None:
    assert rfc3339(1.5) == "1970-01-01T00:00:01.500Z"


def test_alertmanager_firing_alert_expires_after_four_resend_periods() -> None:
    [body] = AlertmanagerSink("http://am:9093", "http://agent:9400/", resend_s=60).render([FIRING], now=100.0)
    [item] = json.loads(body)
    assert item["labels"]["alertname"] == "ServepilotFinding"
    assert item["startsAt"] == rfc3339(0.0) and item["endsAt"] == rfc3339(340.0)
    assert item["generatorURL"] == "http://agent:9400/"


def test_alertmanager_resolved_alert_carries_its_end_time() -> None:
    [body] = AlertmanagerSink("http://am:9093").render([FIRING.resolved(42.0)], now=100.0)
    assert json.loads(body)[0]["endsAt"] == rfc3339(42.0)


def test_alertmanager_url_is_the_v2_alerts_endpoint() -> None:
    assert AlertmanagerSink("http://am:9093/").url == "http://am:9093/api/v2/alerts"


def test_generic_sink_groups_alerts_by_label() -> None:
    sink = GenericSink("http://r/hook", b"k", group_by=("alertname",))
    bodies = [json.loads(b) for b in sink.render([FIRING, OTHER, FIRING.resolved(9.0)], now=10.0)]
    assert [(b["group"]["alertname"], len(b["alerts"]), b["status"]) for b in bodies] == [
        ("ServepilotFinding", 2, "firing"),
        ("ServepilotSourceDown", 1, "firing"),
    ]


def test_generic_sink_renders_the_same_transition_to_the_same_id() -> None:
    sink = GenericSink("http://r/hook", b"k")
    first = sink.render([FIRING], now=10.0)[0]
    later = sink.render([FIRING], now=500.0)[0]
    assert message_id("generic", first) == message_id("generic", later)


def test_generic_headers_verify_with_the_shared_secret() -> None:
    sink = GenericSink("http://r/hook", b"secret")
    body = sink.render([FIRING], now=10.0)[0]
    assert verify(b"secret", sink.headers("msg_x", body, 1000.0), body, now=1000.0) == "msg_x"
