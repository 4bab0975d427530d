"""The llamacpp section of the metric-name table, on real llama.cpp scrapes (build 11434, 4 slots)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.collectors.engine_metrics import SignalDeriver, parse
from agent.collectors.metric_mapping import load_mappings

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "expo" / "llamacpp"
MAPPING = load_mappings()["llamacpp"]


def _derive(*states: str) -> dict[str, float]:
    deriver = SignalDeriver(MAPPING, window_s=60.0)
    values: dict[str, float] = {}
    for i, state in enumerate(states):
        text = (FIXTURES / f"llama-server-b11434-metrics_{state}.prom").read_text(encoding="utf-8")
        values = deriver.update(parse(text, MAPPING, now=10.0 * i), now=10.0 * i)
    return values


def test_itl_mean_is_slot_generation_seconds_per_generated_token() -> None:
    # busy -> after: tokens_predicted 1028 -> 5028, tokens_predicted_seconds 0.870822 -> 10.7692
    values = _derive("busy", "after")
    assert values["engine.itl_seconds.mean"] == pytest.approx((10.7692 - 0.870822) / 4000, rel=1e-6)


def test_windowed_gauges_that_reset_on_scrape_are_not_mapped() -> None:
    wanted = MAPPING.wanted
    for name in (
        "prompt_tokens_seconds",
        "predicted_tokens_seconds",
        "n_busy_slots_per_decode",
        "n_tokens_max",
    ):
        assert f"llamacpp:{name}" not in wanted


def test_no_itl_before_any_request_finished() -> None:
    values = _derive("idle", "idle")
    assert "engine.itl_seconds.mean" not in values  # absent, never 0 or NaN
    assert values["engine.generation_tokens_per_second"] == 0.0


def _drafting(text: str, drafts: int, draft_tokens: int, accepted: int) -> str:
    """A real scrape with its three speculative counters set as a drafting server counts them (build 11434
    served zeros here: the tiny model drafts nothing); names, types and format stay the real ones."""
    for name, value in (("drafts", drafts), ("draft_tokens", draft_tokens), ("accepted_tokens", accepted)):
        line = f"llamacpp:spec_decode_num_{name}_total "
        assert f"\n{line}0\n" in text
        text = text.replace(f"\n{line}0\n", f"\n{line}{value}\n")
    return text


def test_speculative_counters_map_to_the_signals_the_spec_decode_detector_reads() -> None:
    """llama.cpp counts drafts as vLLM does (``spec_decode_num_drafts_total``: verification steps), so
    1 + accepted / drafts is the tokens a step emits on either engine."""
    deriver = SignalDeriver(MAPPING, window_s=60.0)
    busy = (FIXTURES / "llama-server-b11434-metrics_busy.prom").read_text(encoding="utf-8")
    idle = deriver.update(parse(busy, MAPPING, now=0.0), now=0.0)
    assert "engine.spec_acceptance_ratio" not in idle
    values = deriver.update(parse(_drafting(busy, 100, 400, 250), MAPPING, now=10.0), now=10.0)
    assert values["engine.spec_drafts_per_second"] == 10.0
    assert values["engine.spec_draft_tokens_per_second"] == 40.0
    assert values["engine.spec_accepted_tokens_per_second"] == 25.0
    assert values["engine.spec_acceptance_ratio"] == pytest.approx(0.625)
