"""The demo's live view, rendered to text: what an operator reads on the terminal."""

from __future__ import annotations

import io

from rich.console import Console

from agent.demo_view import Control, render
from agent.loadgen import LoadStats
from agent.state import AgentState
from detectors.snapshot import Reading, Snapshot, SourceStatus


def _text(control: Control | None, load: LoadStats | None = None) -> str:
    values = {"gate.limit": 21.0, "gate.reserved": 4.0, "gate.in_flight": 17.0, "gate.queue_depth": 3.0}
    snapshot = Snapshot.from_readings(100.0, {"gate": Reading("gate", 100.0, SourceStatus.OK, values)})
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render(AgentState(snapshot=snapshot), load or LoadStats(), 12.0, "http://x:9400", control))
    return console.export_text()


def test_observe_mode_shows_no_control_table() -> None:
    assert "control (mode" not in _text(None)


def test_act_mode_shows_the_gate_and_the_latest_decisions() -> None:
    action = {
        "time": 0.0, "knob": "batch.max_in_flight", "from": 14, "to": 21, "result": "ok",
        "policy": "batch_auto", "reason": "batch_auto: 1 queued, ITL 0.007s and KV 1% leave room",
    }  # fmt: skip
    text = _text(Control("act", [action]))
    assert "control (mode act" in text
    assert "limit 21 (reserved for high priority 4), in flight 17, queued 3" in text
    assert "batch.max_in_flight" in text and "14 -> 21" in text and "batch_auto: 1 queued" in text


def test_no_decision_yet_is_said_not_left_blank() -> None:
    assert "no decision yet" in _text(Control("advise"))


def test_a_priority_mix_shows_each_classes_ttft_and_what_was_shed_of_it() -> None:
    load = LoadStats(classes={"high": LoadStats(sent=10), "low": LoadStats(sent=40, shed=6)})
    load.classes["high"].ttft_s.extend([0.08, 0.08])
    text = _text(Control("act"), load)
    assert "high: TTFT p99 / shed" in text and "0.080 s / 0 of 10" in text
    assert "low: TTFT p99 / shed" in text and "— / 6 of 40" in text


def test_a_drafting_engine_shows_its_acceptance_and_tokens_per_step() -> None:
    def text(values: dict[str, float]) -> str:
        engine = Reading("engine", 100.0, SourceStatus.OK, values)
        snapshot = Snapshot.from_readings(100.0, {"engine": engine})
        console = Console(width=200, record=True, file=io.StringIO())
        console.print(render(AgentState(snapshot=snapshot), LoadStats(), 12.0, "http://x:9400", None))
        return console.export_text()

    drafting = {"engine.spec_drafts_per_second": 40.0, "engine.spec_acceptance_ratio": 0.65}
    shown = text({**drafting, "engine.decode_tokens_per_step": 2.84})
    assert "drafts accepted / tokens per step" in shown and "0.65 / 2.84" in shown
    assert "tokens per step" not in text({"engine.requests_running": 1.0})  # no drafts: no row


def test_the_worst_findings_come_first_and_the_title_says_how_bad() -> None:
    """An overloaded demo raised 16 info findings ("explained by load"), each scored 1: sorted by score
    alone they hid a warning scored lower, and the count said 16 as if 16 things were wrong."""
    from detectors.base import Finding, Severity

    load = [
        Finding("tail_latency", f"gate.b{i}.ttft", Severity.INFO, 1.0, "explained by load", 0.0)
        for i in range(16)
    ]
    leak = Finding("memory_leak", "nvml.gpu0.memory_used_bytes", Severity.WARNING, 0.6, "step growth", 0.0)
    snapshot = Snapshot.from_readings(100.0, {})
    console = Console(width=200, record=True, file=io.StringIO())
    state = AgentState(snapshot=snapshot, findings=(*load, leak))
    console.print(render(state, LoadStats(), 12.0, "http://x:9400", None))
    text = console.export_text()
    assert "findings: 17 (1 warning, 16 info)" in text
    assert text.index("memory_leak") < text.index("tail_latency")
