"""Fuzz the Prometheus parsing path: exposition text, the engine mapping and the allocator probe.

Properties (the collectors' contract): no exception escapes, no NaN or Inf comes out, every error is one
bounded line, and the error list stays bounded however bad the input, so a hostile or broken endpoint
costs one failed reading and a little memory, never the tick.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from agent.collectors import engine_metrics, probe
from agent.collectors.exposition import parse_exposition
from agent.collectors.metric_mapping import load_mappings
from detectors.snapshot import SourceStatus
from tests.fuzz.strategies import FUZZ, exposition_text, mutated

EXPO = Path(__file__).resolve().parents[1] / "fixtures" / "expo"
PROBE = Path(__file__).resolve().parents[1] / "fixtures" / "probe"
REAL = {
    "vllm": EXPO / "vllm-0.32-cpu" / "vllm-0.32.0-cpu-metrics_busy.prom",
    "sglang": EXPO / "sglang" / "docs_production_metrics_md_scrape_llama3.1-8b.prom",
}
MAX_ERROR_LINES = 21  # the parser keeps 20 and one "... and N more" line


@cache
def _real(name: str) -> str:
    return REAL[name].read_text()


def _assert_clean_errors(errors: tuple[str, ...]) -> None:
    assert len(errors) <= MAX_ERROR_LINES
    for error in errors:
        assert error and "\n" not in error and len(error) < 1000


@FUZZ
@given(text=st.one_of(exposition_text(), st.text(max_size=300)))
def test_parse_exposition_never_raises_and_yields_only_finite_values(text: str) -> None:
    expo = parse_exposition(text, now=123.0)
    _assert_clean_errors(expo.errors)
    for series in (*expo.counters.values(), *expo.gauges.values()):
        assert all(math.isfinite(s.value) and s.observed_at == 123.0 for s in series)
    for histograms in expo.histograms.values():
        for h in histograms:
            assert all(math.isfinite(c) for c in h.counts) and list(h.bounds) == sorted(h.bounds)


@FUZZ
@given(data=st.data())
def test_a_damaged_real_scrape_keeps_its_undamaged_families(data: st.DataObject) -> None:
    text = data.draw(mutated(_real("vllm")))
    expo = parse_exposition(text, now=1.0)
    _assert_clean_errors(expo.errors)
    assert expo.series_count > 0  # at most 8 damaged lines cannot take out every family


@FUZZ
@given(engine=st.sampled_from(sorted(REAL)), data=st.data())
def test_engine_parse_of_a_damaged_scrape_gives_finite_signals(engine: str, data: st.DataObject) -> None:
    text = data.draw(st.one_of(mutated(_real(engine)), exposition_text()))
    scrape = engine_metrics.parse(text, load_mappings()[engine], now=5.0)
    _assert_clean_errors(scrape.errors)
    assert all(math.isfinite(v) for v in (*scrape.gauges.values(), *scrape.counters.values()))


@FUZZ
@given(data=st.data())
def test_probe_parse_always_returns_a_reading(data: st.DataObject) -> None:
    real = (PROBE / "probe_tp2.prom").read_text()
    text = data.draw(st.one_of(mutated(real), exposition_text(), st.text(max_size=200)))
    reading = probe.parse(text, now=7.0)
    assert reading.source == "probe" and reading.observed_at == 7.0
    if reading.status is SourceStatus.OK:
        assert reading.values and all(math.isfinite(v) for v in reading.values.values())
    else:
        assert reading.error and "\n" not in reading.error
