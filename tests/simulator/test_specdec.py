"""Speculative decoding in the simulated engine: acceptance, cost, counters and the run-time switch."""

from __future__ import annotations

import pytest

from agent.collectors.engine_metrics import SignalDeriver, parse
from agent.collectors.metric_mapping import load_mappings
from simulator import workload
from simulator.engine import EngineCore, make_core
from simulator.faults import FaultError
from simulator.metrics import VllmCollector, registry_with, render
from simulator.specdec import SpecDecodeConfig


def _core(k: int = 0, acceptance: float = 0.8, draft_cost: float = 0.0) -> EngineCore:
    return make_core("h100-sxm", "llama-3-8b", "fp16", 64, spec=SpecDecodeConfig(k, acceptance, draft_cost))


def _serve(core: EngineCore, requests: int = 16, output: int = 400) -> dict[str, int]:
    """``requests`` at once, run to completion; tokens each got."""
    for i in range(requests):
        core.submit(f"r{i}", 300, output, now=0.0)
    got: dict[str, int] = {}
    while core.has_work():
        for rid, n in core.step(core.time, max_steps=64).tokens.items():
            got[rid] = got.get(rid, 0) + n
    return got


def test_the_config_is_checked() -> None:
    for bad in ({"draft_tokens": 17}, {"acceptance": 1.5}, {"draft_cost": -0.1}):
        with pytest.raises(ValueError, match="spec "):
            SpecDecodeConfig(**bad)  # type: ignore[arg-type]
    assert make_core(spec=SpecDecodeConfig(0)).spec is None  # no drafts: the plain engine


def test_drafts_give_each_request_exactly_its_tokens_in_fewer_steps() -> None:
    plain, drafting = _core(), _core(3, 0.8)
    assert _serve(plain) == _serve(drafting) == {f"r{i}": 400 for i in range(16)}
    assert drafting.stats.generation_tokens == plain.stats.generation_tokens == 16 * 400
    tokens_per_step = 16 * 399 / drafting.spec.drafts  # type: ignore[union-attr]
    assert tokens_per_step == pytest.approx(1 + 0.8 + 0.8**2 + 0.8**3, rel=0.03)  # (1 - a^4) / (1 - a)
    assert drafting.stats.steps < plain.stats.steps / 2.5
    # one inter-token gap per request and step, as vLLM observes it: a step's accepted tokens come together
    assert drafting.stats.itl.count == pytest.approx(plain.stats.itl.count / tokens_per_step, rel=0.03)


def test_acceptance_is_a_prefix_run_counted_per_position() -> None:
    core = _core(4, 0.6)
    _serve(core)
    spec = core.spec
    assert spec is not None and spec.draft_tokens == 4 * spec.drafts
    assert sum(spec.accepted_per_position) == spec.accepted
    shares = [n / spec.drafts for n in spec.accepted_per_position]
    assert shares == pytest.approx([0.6 ** (j + 1) for j in range(4)], abs=0.02)


def test_drafting_pays_when_accepted_and_costs_when_not() -> None:
    """The roofline prices the verified draft tokens and the draft model's passes: at batch 16 a 3-token
    draft accepted 80% of the time makes the answers much sooner; accepted 5%, with a draft model costing
    5% of a step per token, later than without it."""
    durations = {}
    for name, core in (
        ("plain", _core()),
        ("accepted", _core(3, 0.8)),
        ("rejected", _core(3, 0.05, draft_cost=0.05)),
    ):
        _serve(core)
        durations[name] = core.time
    assert durations["accepted"] < durations["plain"] / 2 < durations["plain"] < durations["rejected"]


def test_the_acceptance_switch_changes_it_at_run_time() -> None:
    core = _core(3, 0.8)
    core.set_faults(core.faults.updated({"spec_acceptance": 0.0}), core.time)
    _serve(core, requests=4, output=50)
    assert core.spec is not None and core.spec.drafts > 0 and core.spec.accepted == 0
    restored = core.faults.updated({"spec_acceptance": None})
    assert restored.spec_acceptance is None
    with pytest.raises(FaultError, match=r"spec_acceptance must be in \[0, 1\]"):
        core.faults.updated({"spec_acceptance": 1.2})


def test_the_counters_map_through_the_name_table_as_a_real_vllms_do() -> None:
    mapping = load_mappings()["vllm"]
    core = _core(3, 0.7)
    registry = registry_with(VllmCollector(core, "m"))  # one engine process: one start time
    text = render(registry).decode()
    assert "vllm:spec_decode_num_drafts_total" in text
    deriver = SignalDeriver(mapping, window_s=60.0)
    deriver.update(parse(text, mapping, 0.0), 0.0)
    workload.run(core, workload.poisson_arrivals(8, 20, (100, 400), (50, 200), seed=1))
    after = parse(render(registry).decode(), mapping, 20.0)
    assert after.errors == ()
    values = deriver.update(after, 20.0)
    assert values["engine.spec_acceptance_ratio"] == pytest.approx((0.7 + 0.49 + 0.343) / 3, rel=0.05)
    positions = [values[f"engine.spec_accepted_by_position_per_second.position{j}"] for j in range(3)]
    assert sum(positions) == pytest.approx(values["engine.spec_accepted_tokens_per_second"])


def test_without_drafts_no_spec_family_is_served() -> None:
    assert "spec_decode" not in render(registry_with(VllmCollector(_core(), "m"))).decode()


def test_the_spec_decode_detector_sees_the_acceptance_the_switch_takes_away() -> None:
    """Through the real chain: the simulator's /metrics text, the name table, the derived rates, the
    detector the sidecar builds. 16 answers in flight on an H100, a tick per simulated second."""
    from detectors.base import Severity
    from detectors.snapshot import Reading, Snapshot, SourceStatus
    from detectors.specdec import SpecDecodeDetector

    mapping = load_mappings()["vllm"]
    core, deriver, detector = (
        _core(3, 0.8, draft_cost=0.05),
        SignalDeriver(mapping, 60.0),
        SpecDecodeDetector(),
    )
    severities: list[tuple[int, Severity]] = []
    started = 0
    registry = registry_with(VllmCollector(core, "m"))  # one engine process: one start time
    for tick in range(90):
        if tick == 60:  # the traffic turns to what the drafts do not predict
            core.set_faults(core.faults.updated({"spec_acceptance": 0.05}), core.time)
        while core.time < tick:  # a closed loop: a new answer starts as soon as one ends
            while core.num_running + core.num_waiting < 16:
                core.submit(f"r{started}", 200, 600, now=core.time)
                started += 1
            core.step(core.time)
        text = render(registry).decode()
        values = deriver.update(parse(text, mapping, float(tick)), float(tick))
        snapshot = Snapshot.from_readings(tick, {"engine": Reading("engine", tick, SourceStatus.OK, values)})
        severities += [(tick, f.severity) for f in detector.update(snapshot)]
    assert detector.baseline_ == pytest.approx((0.8 + 0.64 + 0.512) / 3, rel=0.05)
    # nothing while the drafts paid; from the third tick after the switch (3 of 5 ticks) critical, as
    # acceptance 0.05 makes 1.05 tokens a step against a cost of 1.15: the drop is shown within it
    assert [tick for tick, _ in severities] == list(range(62, 90)), severities
    assert {severity for _, severity in severities} == {Severity.CRITICAL}


@pytest.mark.parametrize("k", [0, 3])
def test_iteration_tokens_count_what_vllm_counts_prompt_computed_and_tokens_generated(k: int) -> None:
    """vLLM observes per step the prompt tokens it computed plus the tokens it generated, accepted drafts
    included (its real scrapes: 560 prompt + 1536 generated = 2096 with n-gram drafts, 70 + 5028 = 5098
    without; tests/fixtures/expo/vllm-0.32-cpu). Long prompts here take several chunked-prefill steps."""
    core = make_core(
        "h100-sxm", "llama-3-8b", "fp16", 8, max_num_batched_tokens=512, spec=SpecDecodeConfig(k, 0.8)
    )
    for i in range(12):
        core.submit(f"r{i}", 100 + 300 * (i % 4), 50 + 20 * i, now=0.0)
    while core.has_work():
        core.step(core.time, max_steps=64)
    stats = core.stats
    assert stats.iteration_tokens.count == stats.steps
    assert stats.iteration_tokens.sum == stats.prompt_tokens + stats.generation_tokens


def test_the_real_scrapes_hold_the_iteration_token_identity() -> None:
    """The fact the test above holds the simulator to, read from the saved vLLM 0.32 scrapes."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "fixtures" / "expo" / "vllm-0.32-cpu"
    for name in ("vllm-0.32.0-cpu-ngram3-metrics_greedy.prom", "vllm-0.32.0-cpu-metrics_after.prom"):
        text = (folder / name).read_text(encoding="utf-8")

        def value(metric: str, text: str = text) -> float:
            return sum(
                float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(metric + "{")
            )

        assert value("vllm:iteration_tokens_total_sum") == value("vllm:prompt_tokens_total") + value(
            "vllm:generation_tokens_total"
        )
