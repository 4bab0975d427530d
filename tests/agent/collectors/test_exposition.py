"""parse_exposition: real scrapes, every failure mode, sentinels, and the pre-parse family filter."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agent.collectors.exposition import DCGM_INT64_BLANK_MIN, parse_exposition

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "expo"
REAL = sorted(p for p in FIXTURES.glob("*/*.prom") if p.parent.name != "failures")
ALL = sorted(FIXTURES.glob("*/*.prom"))


def _read(relative: str) -> str:
    return (FIXTURES / relative).read_text(encoding="utf-8")


@pytest.mark.parametrize("path", REAL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_real_fixture_parses_without_errors(path: Path) -> None:
    expo = parse_exposition(path.read_text(encoding="utf-8"), now=5.0)
    assert expo.errors == ()
    assert expo.series_count > 0


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_value_is_finite_and_stamped_with_now(path: Path) -> None:
    expo = parse_exposition(path.read_text(encoding="utf-8"), now=7.5)
    for series in (*expo.counters.values(), *expo.gauges.values()):
        for s in series:
            assert math.isfinite(s.value) and s.observed_at == 7.5
    for hists in expo.histograms.values():
        for h in hists:
            assert all(math.isfinite(c) for c in h.counts) and h.observed_at == 7.5
            assert list(h.counts) == sorted(h.counts)  # cumulative
            assert list(h.bounds) == sorted(h.bounds)


def test_counter_keeps_total_suffix_and_label_sets() -> None:
    expo = parse_exposition(_read("vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_busy.prom"), now=0.0)
    success = expo.counters["vllm:request_success_total"]
    reasons = {dict(s.labels)["finished_reason"]: s.value for s in success}
    assert reasons == {"stop": 0.0, "length": 3.0, "abort": 0.0, "error": 0.0, "repetition": 0.0}


def test_counter_declared_without_total_is_named_with_it() -> None:
    text = "# TYPE tgi_request_success counter\ntgi_request_success 12\n"
    expo = parse_exposition(text, now=0.0)
    assert expo.counters["tgi_request_success_total"][0].value == 12.0


def test_histogram_has_cumulative_buckets_count_and_sum() -> None:
    expo = parse_exposition(_read("sglang/docs_production_metrics_md_scrape_llama3.1-8b.prom"), now=0.0)
    (ttft,) = expo.histograms["sglang:time_to_first_token_seconds"]
    assert ttft.bounds[0] == 0.001 and ttft.bounds[-1] == math.inf
    assert ttft.counts[ttft.bounds.index(1.0)] == 27.0
    assert ttft.count == 11008.0
    assert ttft.sum == pytest.approx(2.3518979474117756e06)


def test_e_notation_values_parse() -> None:
    expo = parse_exposition(_read("sglang/docs_production_metrics_md_scrape_llama3.1-8b.prom"), now=0.0)
    assert expo.counters["sglang:prompt_tokens_total"][0].value == 8128902.0


def test_histogram_without_inf_bucket_takes_it_from_count() -> None:
    text = '# TYPE h histogram\nh_bucket{le="1"} 2\nh_bucket{le="2"} 5\nh_count 6\nh_sum 7.5\n'
    (h,) = parse_exposition(text, now=0.0).histograms["h"]
    assert h.bounds == (1.0, 2.0, math.inf) and h.counts == (2.0, 5.0, 6.0) and h.count == 6.0


def test_truncated_histogram_has_unknown_count() -> None:
    expo = parse_exposition(_read("aibrix/real_v0_scrape_qwen2.5-coder-1.5b_TRUNCATED.prom"), now=0.0)
    (h,) = expo.histograms["vllm:iteration_tokens_total"]
    assert h.count is None and h.bounds[-1] == 96.0


def test_decreasing_buckets_drop_the_series_with_an_error() -> None:
    text = '# TYPE h histogram\nh_bucket{le="1"} 5\nh_bucket{le="+Inf"} 3\n'
    expo = parse_exposition(text, now=0.0)
    assert "h" not in expo.histograms
    assert expo.errors == ("h: bucket counts decrease, series dropped",)


def test_elision_lines_are_skipped_silently() -> None:
    expo = parse_exposition(_read("vllm/docs_design_metrics_snippet_ELIDED.prom"), now=0.0)
    assert expo.errors == ()
    assert expo.gauges["vllm:num_requests_running"][0].value == 8.0
    # block 1 has no TYPE lines: untyped samples are kept as gauges
    assert expo.gauges["http_requests_total"][0].value == 201.0


def test_missing_final_newline_keeps_the_last_sample() -> None:
    expo = parse_exposition("# TYPE a gauge\na 1\n# TYPE b gauge\nb 2", now=0.0)
    assert expo.gauges["b"][0].value == 2.0


def test_dcgm_blank_sentinel_is_dropped_and_declared_type_applied() -> None:
    expo = parse_exposition(_read("dcgm-exporter/readme_sample_scrape_ELIDED.prom"), now=0.0)
    assert "DCGM_FI_DEV_MEMORY_TEMP" not in expo.gauges
    assert expo.dropped == 1
    (clock,) = expo.gauges["DCGM_FI_DEV_SM_CLOCK"]
    assert clock.value == 139.0 and dict(clock.labels)["gpu"] == "0"


def test_dcgm_float_blank_is_dropped() -> None:
    expo = parse_exposition("DCGM_FI_DEV_POWER_USAGE 140737488355328\nDCGM_FI_DEV_GPU_TEMP 41\n", now=0.0)
    assert set(expo.gauges) == {"DCGM_FI_DEV_GPU_TEMP"}


def test_huge_values_outside_dcgm_are_kept() -> None:
    name = "vllm:estimated_flops_per_gpu_total"  # FLOPs pass 2**63 within hours on a busy GPU
    expo = parse_exposition(f"# TYPE {name} counter\n{name} {DCGM_INT64_BLANK_MIN}\n", now=0.0)
    assert expo.counters[name][0].value == float(DCGM_INT64_BLANK_MIN)


def test_nan_and_infinities_are_dropped_and_counted() -> None:
    expo = parse_exposition(_read("failures/nan_inf.prom"), now=0.0)
    assert "vllm:num_requests_running" not in expo.gauges  # NaN
    assert "vllm:kv_cache_usage_perc" not in expo.gauges  # +Inf
    assert "vllm:prompt_tokens_total" not in expo.counters  # -Inf
    assert expo.gauges["vllm:num_requests_waiting"][0].value == 3.0
    (ttft,) = expo.histograms["vllm:time_to_first_token_seconds"]
    assert ttft.sum is None and ttft.count == 7.0  # NaN _sum dropped, buckets kept
    assert expo.dropped == 4


def test_truncated_body_keeps_what_parsed_and_names_the_bad_line() -> None:
    expo = parse_exposition(_read("failures/truncated.prom"), now=0.0)
    assert expo.counters["vllm:generation_tokens_total"][0].value == 1237.0
    assert len(expo.errors) == 1 and expo.errors[0].startswith("line 298: cannot parse")
    (ttft,) = expo.histograms["vllm:time_to_first_token_seconds"]
    assert ttft.count is None and ttft.bounds[-1] == 0.08


def test_a_bad_line_in_the_middle_loses_only_itself() -> None:
    text = "# TYPE a gauge\na 1\nthis is not a sample\n# TYPE b_total counter\nb_total 2\n"
    expo = parse_exposition(text, now=0.0)
    assert expo.gauges["a"][0].value == 1.0 and expo.counters["b_total"][0].value == 2.0
    assert expo.errors == ("line 3: cannot parse 'this is not a sample'",)


@pytest.mark.parametrize("name", ["garbage.prom", "empty.prom"])
def test_garbage_and_empty_bodies_yield_no_series(name: str) -> None:
    expo = parse_exposition(_read(f"failures/{name}"), now=0.0)
    assert expo.series_count == 0
    assert bool(expo.errors) is (name == "garbage.prom")


def test_errors_are_capped_at_twenty_lines_plus_a_count() -> None:
    expo = parse_exposition("\n".join(f"bad line {i}" for i in range(30)), now=0.0)
    assert len(expo.errors) == 21 and expo.errors[-1] == "... and 10 more errors"


def test_wanted_keeps_only_the_named_families() -> None:
    text = _read("vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_busy.prom")
    wanted = ["vllm:num_requests_running", "vllm:prompt_tokens_total", "vllm:e2e_request_latency_seconds"]
    expo = parse_exposition(text, now=0.0, wanted=wanted)
    assert set(expo.gauges) == {"vllm:num_requests_running"}
    assert set(expo.counters) == {"vllm:prompt_tokens_total"}
    assert set(expo.histograms) == {"vllm:e2e_request_latency_seconds"}


@pytest.mark.parametrize("path", ALL, ids=[f"{p.parent.name}/{p.name}" for p in ALL])
def test_memoised_parse_equals_the_library_plain_parse(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The series-key memo is an optimisation only: same series, values and errors as the plain path."""
    from agent.collectors import exposition

    text = path.read_text(encoding="utf-8")
    monkeypatch.setattr(exposition, "USE_MEMO", False)
    plain = parse_exposition(text, 5.0)
    monkeypatch.setattr(exposition, "USE_MEMO", True)
    first = parse_exposition(text, 5.0)  # fills the memo
    again = parse_exposition(text, 5.0)  # served from it
    for result in (first, again):
        assert result.counters == plain.counters
        assert result.gauges == plain.gauges
        assert result.histograms == plain.histograms
        assert result.errors == plain.errors
        assert result.dropped == plain.dropped


def test_memo_follows_new_values_for_known_series() -> None:
    before = parse_exposition('# TYPE x_total counter\nx_total{a="1"} 5\n', 1.0)
    after = parse_exposition('# TYPE x_total counter\nx_total{a="1"} 7\n', 2.0)
    assert before.counters["x_total"][0].value == 5.0
    assert after.counters["x_total"][0].value == 7.0


def test_memo_is_bounded() -> None:
    from agent.collectors.series_memo import SeriesMemo

    memo = SeriesMemo(limit=10)
    for i in range(50):
        memo.family(["# TYPE g gauge", f'g{{i="{i}"}} 1'])
    assert memo.entries + len(memo.headers) <= 11
    assert sum(len(keys) for keys in memo.series.values()) == memo.entries


def test_memoised_parse_follows_new_values_of_a_real_scrape_with_a_mapping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scrape after scrape with new values (a busy engine), the memo path equals the library's plain path."""
    import re

    from agent.collectors import exposition
    from agent.collectors.metric_mapping import load_mappings

    text = _read("vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_busy.prom")
    wanted = load_mappings()["vllm"].wanted
    number = re.compile(r"(\} |^[a-z_:]+ )(\d+(?:\.\d+)?)$", re.M)
    for step in range(3):
        factor = 1 + step / 10
        scrape = number.sub(lambda m, f=factor: m.group(1) + repr(float(m.group(2)) * f), text)
        monkeypatch.setattr(exposition, "USE_MEMO", False)
        plain = parse_exposition(scrape, float(step), wanted)
        monkeypatch.setattr(exposition, "USE_MEMO", True)
        memo = parse_exposition(scrape, float(step), wanted)
        assert plain.histograms and memo.histograms == plain.histograms
        assert memo.counters == plain.counters and memo.gauges == plain.gauges
        assert memo.errors == plain.errors == ()


def test_a_run_of_one_sample_name_takes_that_name_s_decision() -> None:
    text = 'x{a="1"} 1\nx{a="2"} 2\nx_y{a="1"} 3\nw{a="1"} 4\nw{a="2"} 5\n  w{a="3"} 6\nx{a="3"} 7\n'
    expo = parse_exposition(text, 0.0, wanted=["x_y", "w"])
    assert set(expo.gauges) == {"x_y", "w"}
    assert [g.value for g in expo.gauges["w"]] == [4.0, 5.0, 6.0]
