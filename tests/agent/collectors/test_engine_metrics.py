"""Engine /metrics: name table, pure parse on saved scrapes, derived signals, and the collector over HTTP."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agent.collectors.engine_metrics import EngineMetricsCollector, SignalDeriver, parse
from agent.collectors.metric_mapping import detect_engine, load_mappings, parse_mappings
from agent.config import EngineConfig
from detectors.snapshot import SourceStatus

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "expo"
MAPPINGS = load_mappings()
V1_SCRAPE = "data/expo/vllm/real_v1_full_scrape_qwen3-4b-fp8_nvcr-vllm-25.09.prom"
SHARED_DIR_ENV = "SHARED_DATA_DIR"

ServerFactory = Callable[[web.Application], Awaitable[TestServer]]
BODIES = web.AppKey("bodies", list[str])


def _read(relative: str) -> str:
    return (FIXTURES / relative).read_text(encoding="utf-8")


def _shared_v1_scrape() -> str:
    """The licence-less vLLM V1 scrape lives only in the shared folder; CI must have it. The variable
    that points elsewhere is not named SERVEPILOT_*: that prefix is the config's override namespace,
    and every `servepilot` command the suite starts would refuse an unknown SERVEPILOT_ variable."""
    shared = Path(os.environ.get(SHARED_DIR_ENV, ROOT.parent / "shared"))
    path = shared / V1_SCRAPE
    if not path.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{path} is missing in CI; set {SHARED_DIR_ENV} to the shared data folder")
        pytest.skip(f"{path} not present locally (unlicensed, never committed)")
    return path.read_text(encoding="utf-8")


# --- the name table ------------------------------------------------------------------------------


def test_every_engine_maps_the_core_signals() -> None:
    for engine, mapping in MAPPINGS.items():
        names = {s.name for s in mapping.signals}
        assert {"requests_running", "requests_waiting", "batch_size_mean"} <= names, engine


def test_every_alias_carries_its_engines_prefix() -> None:
    for mapping in MAPPINGS.values():
        for spec in mapping.signals:
            assert all(a.startswith(mapping.prefixes) for a in spec.aliases), spec.name


def test_a_bad_table_is_one_line_naming_the_entry() -> None:
    table = {"engines": {"x": {"prefixes": ["x_"], "signals": {"a": {"type": "gauge", "aliases": "x_a"}}}}}
    with pytest.raises(ValueError, match=r"^engines\.x\.signals\.a\.aliases must be a non-empty list"):
        parse_mappings(table)


def test_a_ratio_over_a_gauge_is_rejected() -> None:
    signals = {
        "g": {"type": "gauge", "aliases": ["x_g"]},
        "r": {"type": "ratio", "numerator": ["g"], "denominator": ["g"]},
    }
    with pytest.raises(ValueError, match="'g' is not a counter signal"):
        parse_mappings({"engines": {"x": {"prefixes": ["x_"], "signals": signals}}})


def test_a_difference_takes_counters_off_a_counter() -> None:
    def table(signals: dict[str, object]) -> dict[str, object]:
        return {"engines": {"x": {"prefixes": ["x_"], "signals": signals}}}

    counters = {
        "all": {"type": "counter", "aliases": ["x_all"]},
        "hit": {"type": "counter", "aliases": ["x_hit"]},
    }
    parsed = parse_mappings(table({**counters, "d": {"type": "difference", "of": "all", "less": ["hit"]}}))
    [spec] = [s for s in parsed["x"].signals if s.name == "d"]
    assert (spec.of, spec.less) == ("all", ("hit",))
    with pytest.raises(ValueError, match=r"^engines\.x\.signals\.d\.less must be a non-empty list"):
        parse_mappings(table({**counters, "d": {"type": "difference", "of": "all"}}))
    gauge = {"g": {"type": "gauge", "aliases": ["x_g"]}}
    with pytest.raises(ValueError, match=r"\.d\.of: 'g' is not a counter signal without 'by'"):
        parse_mappings(table({**counters, **gauge, "d": {"type": "difference", "of": "g", "less": ["hit"]}}))
    with pytest.raises(ValueError, match="'g' is not a counter signal without 'by'"):
        parse_mappings(table({**counters, **gauge, "d": {"type": "difference", "of": "all", "less": ["g"]}}))


def test_a_split_needs_a_label_name_on_a_gauge_or_counter_and_no_ratio_reads_one() -> None:
    def table(signals: dict[str, object]) -> dict[str, object]:
        return {"engines": {"x": {"prefixes": ["x_"], "signals": signals}}}

    with pytest.raises(ValueError, match=r"^engines\.x\.signals\.h\.by splits a gauge or counter"):
        parse_mappings(table({"h": {"type": "histogram", "aliases": ["x_h"], "by": "le"}}))
    with pytest.raises(ValueError, match=r"^engines\.x\.signals\.c\.by must be a label name"):
        parse_mappings(table({"c": {"type": "counter", "aliases": ["x_c"], "by": "a-b"}}))
    split = {"type": "counter", "aliases": ["x_c"], "by": "position"}
    ratio = {"type": "ratio", "numerator": ["c"], "denominator": ["c"]}
    with pytest.raises(ValueError, match="'c' is not a counter signal without 'by'"):
        parse_mappings(table({"c": split, "r": ratio}))


def test_per_token_reads_a_counter_and_a_histogram_of_a_histogram() -> None:
    def table(itl: dict[str, object], tokens_type: str = "counter") -> dict[str, object]:
        signals = {
            "tokens": {"type": tokens_type, "aliases": ["x_tokens"]},
            "ttft": {"type": "histogram", "aliases": ["x_ttft"]},
            "itl": {"type": "histogram", "aliases": ["x_itl"], **itl},
        }
        return {"engines": {"x": {"prefixes": ["x_"], "signals": signals}}}

    good = {"per_token": {"tokens": "tokens", "first_tokens": "ttft"}}
    assert parse_mappings(table(good))["x"].signals[2].per_token == ("tokens", "ttft")
    with pytest.raises(ValueError, match=r"^engines\.x\.signals\.itl\.per_token must be \{tokens"):
        parse_mappings(table({"per_token": {"tokens": "tokens"}}))
    with pytest.raises(
        ValueError, match=r"^engines\.x\.signals\.itl\.per_token\.tokens: 'tokens' is not a counter"
    ):
        parse_mappings(table(good, tokens_type="gauge"))
    wrong_first = {"per_token": {"tokens": "tokens", "first_tokens": "tokens"}}
    with pytest.raises(ValueError, match=r"per_token\.first_tokens: 'tokens' is not a histogram signal"):
        parse_mappings(table(wrong_first))
    twice = table(good)
    twice["engines"]["x"]["signals"]["itl2"] = {"type": "histogram", "aliases": ["x_itl2"], **good}  # type: ignore[index]
    with pytest.raises(ValueError, match=r"^engines\.x: per_token on one histogram at most"):
        parse_mappings(twice)
    on_a_gauge = table({})
    on_a_gauge["engines"]["x"]["signals"]["g"] = {"type": "gauge", "aliases": ["x_g"], **good}  # type: ignore[index]
    with pytest.raises(ValueError, match=r"^engines\.x\.signals\.g\.per_token applies to a histogram"):
        parse_mappings(on_a_gauge)


@pytest.mark.parametrize(
    ("relative", "engine"),
    [
        ("vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_busy.prom", "vllm"),
        ("aibrix/real_v0_scrape_qwen2.5-coder-1.5b_TRUNCATED.prom", "vllm"),
        ("sglang/docs_production_metrics_md_scrape_llama3.1-8b.prom", "sglang"),
        ("llamacpp/llama-server-b11434-metrics_busy.prom", "llamacpp"),
        ("dcgm-exporter/readme_sample_scrape_ELIDED.prom", None),
    ],
)
def test_auto_detects_the_engine_from_metric_prefixes(relative: str, engine: str | None) -> None:
    found = detect_engine(_read(relative), MAPPINGS)
    assert (found.engine if found else None) == engine


# --- pure parse ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*/*.prom")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_parse_never_raises_on_any_fixture(path: Path) -> None:
    for mapping in MAPPINGS.values():
        scrape = parse(path.read_text(encoding="utf-8"), mapping, now=1.0)
        assert scrape.engine == mapping.engine


def test_vllm_v1_cpu_scrape_maps_gauges_counters_and_histograms() -> None:
    scrape = parse(_read("vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_busy.prom"), MAPPINGS["vllm"], now=1.0)
    assert scrape.gauges["requests_running"] == 4.0
    assert scrape.gauges["kv_cache_usage_ratio"] == pytest.approx(0.0009768009768009733)
    assert scrape.counters["requests_finished_per_second"] == 3.0  # summed over finished_reason
    assert scrape.histograms["itl_seconds"].count == 1230.0
    assert scrape.model == "tiny-random-llama" and scrape.legacy_names == ()


def test_renamed_metrics_are_found_through_their_aliases() -> None:
    scrape = parse(_read("failures/renamed.prom"), MAPPINGS["vllm"], now=1.0)
    assert scrape.gauges["kv_cache_usage_ratio"] == 0.25
    assert scrape.counters["prefix_cache_hits_per_second"] == 50.0
    assert scrape.histograms["itl_seconds"].count == 100.0
    assert "vllm:gpu_cache_usage_perc" in scrape.legacy_names


def test_the_preferred_name_wins_when_both_generations_are_present() -> None:
    text = (
        "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n"
        "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.9\n"
    )
    scrape = parse(text, MAPPINGS["vllm"], now=1.0)
    assert scrape.gauges["kv_cache_usage_ratio"] == 0.5 and scrape.legacy_names == ()


def test_label_sets_sum_for_counts_and_average_for_ratios() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_running{engine="1"} 5\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.6\n'
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="1"} 1\n'
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf"} 2\n'
        'vllm:e2e_request_latency_seconds_bucket{engine="1",le="1"} 3\n'
        'vllm:e2e_request_latency_seconds_bucket{engine="1",le="+Inf"} 3\n'
    )
    scrape = parse(text, MAPPINGS["vllm"], now=1.0)
    assert scrape.gauges["requests_running"] == 8.0
    assert scrape.gauges["kv_cache_usage_ratio"] == pytest.approx(0.4)
    assert scrape.histograms["e2e_seconds"].counts == (4.0, 5.0)


def test_a_split_signal_is_one_value_per_label_value_and_an_exploding_label_is_capped() -> None:
    from agent.collectors.engine_metrics import MAX_SPLIT

    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    lines = [f"# TYPE {name} counter"]
    lines += [f'{name}{{engine="{e}",position="{p}"}} {10 * p + e + 1}' for e in (0, 1) for p in range(3)]
    lines += [f'{name}{{engine="0",position="a b"}} 5', f'{name}{{engine="0"}} 5']
    scrape = parse("\n".join(lines) + "\n", MAPPINGS["vllm"], now=1.0)
    split = {k: v for k, v in scrape.counters.items() if k.startswith("spec_accepted_by_position")}
    prefix = "spec_accepted_by_position_per_second.position"
    assert split == {f"{prefix}0": 3.0, f"{prefix}1": 23.0, f"{prefix}2": 43.0}  # summed over engines
    assert scrape.errors == (f"{name}: 2 series left out of the split by 'position' (first 'a b'; at most "
                             f"{MAX_SPLIT} values of [A-Za-z0-9_-])",)  # fmt: skip
    many = [f"# TYPE {name} counter"] + [f'{name}{{position="{p}"}} 1' for p in range(MAX_SPLIT + 5)]
    capped = parse("\n".join(many) + "\n", MAPPINGS["vllm"], now=1.0)
    assert sum(k.startswith("spec_accepted_by_position") for k in capped.counters) == MAX_SPLIT
    assert "5 series left out" in capped.errors[0]


def test_real_ngram_speculation_maps_to_drafts_acceptance_and_acceptance_by_position() -> None:
    """vLLM 0.32 (CPU) drafting 3 tokens by n-gram lookup (scripts/capture_vllm_specdec.py): 16 greedy
    completions, whose repetitive text the drafts mostly match, then 16 sampled ones, which they do not."""
    folder = "vllm-0.32-cpu/vllm-0.32.0-cpu-ngram3-metrics_"
    greedy = parse(_read(folder + "greedy.prom"), MAPPINGS["vllm"], now=0.0)
    assert greedy.errors == () and greedy.legacy_names == ()
    counters = greedy.counters
    by_position = [counters[f"spec_accepted_by_position_per_second.position{k}"] for k in range(3)]
    assert sum(by_position) == counters["spec_accepted_tokens_per_second"]  # every accepted token has a place
    assert by_position == sorted(
        by_position, reverse=True
    )  # a later token is accepted only after the earlier
    # a lookup may find fewer than 3 tokens to draft: drafts are at most 3 tokens long, 2.7 on average here
    assert (
        counters["spec_drafts_per_second"]
        < counters["spec_draft_tokens_per_second"]
        <= 3 * counters["spec_drafts_per_second"]
    )
    values = _derive([folder + "greedy.prom", folder + "sampled.prom"], "vllm")
    assert values["engine.spec_acceptance_ratio"] < 0.05  # sampled text has no n-grams to look up
    assert values["engine.spec_drafts_per_second"] > 10
    first = (
        values["engine.spec_accepted_by_position_per_second.position0"]
        / values["engine.spec_drafts_per_second"]
    )
    assert 0 < first < 0.1


def _zeroed(text: str) -> str:
    """``text`` with every sample at 0 but the process's start time: the same server before its first
    request."""
    return "".join(
        line
        if line.startswith(("#", "process_start_time_seconds")) or not line.strip()
        else line.rsplit(" ", 1)[0] + " 0.0\n"
        for line in text.splitlines(keepends=True)
    )


def _sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _vllm_tpot(before: str, after: str) -> float:
    """vLLM's own per-request time per output token (after the first), its mean between two scrapes."""
    name = "vllm:request_time_per_output_token_seconds"
    sums = _sample(after, name + "_sum") - _sample(before, name + "_sum")
    return sums / (_sample(after, name + "_count") - _sample(before, name + "_count"))


def test_vllm_itl_under_speculation_reads_per_token_as_vllms_own_tpot() -> None:
    """vLLM observes one ITL gap per engine step, and a drafting step brings several tokens: on the
    greedy n-gram fixture, 1520 decode tokens in 536 steps. Per step the mean is 4.38 ms; per token, as
    SGLang counts and as vLLM's own request_time_per_output_token says, 1.54 ms. Every request there has
    96 tokens, so the per-request and per-token means are the same number."""
    folder = "vllm-0.32-cpu/vllm-0.32.0-cpu-ngram3-metrics_"
    greedy, sampled = _read(folder + "greedy.prom"), _read(folder + "sampled.prom")
    mapping = MAPPINGS["vllm"]
    cases = ((_zeroed(greedy), greedy, 4.380, 1520 / 536), (greedy, sampled, 3.246, 1520 / 1460))
    for before, after, per_step_ms, tokens_per_step in cases:
        deriver = SignalDeriver(mapping, window_s=60.0)
        deriver.update(parse(before, mapping, 0.0), 0.0)
        values = deriver.update(parse(after, mapping, 10.0), 10.0)
        itl = "vllm:inter_token_latency_seconds"
        steps = _sample(after, itl + "_sum") - _sample(before, itl + "_sum")
        steps /= _sample(after, itl + "_count") - _sample(before, itl + "_count")
        assert steps * 1000 == pytest.approx(per_step_ms, abs=0.001)  # what the engine's histogram says
        assert values["engine.itl_seconds.mean"] == pytest.approx(_vllm_tpot(before, after), rel=1e-3)
        assert values["engine.decode_tokens_per_step"] == pytest.approx(tokens_per_step)
        assert values["engine.itl_seconds.p50"] <= values["engine.itl_seconds.p99"] < steps * 20


def test_vllm_itl_without_speculation_is_left_as_observed() -> None:
    """One token per step: (tokens - first tokens) equals the gaps observed, and nothing is divided."""
    folder = "vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_"
    busy, after = _read(folder + "busy.prom"), _read(folder + "after.prom")
    values = _derive([folder + "busy.prom", folder + "after.prom"], "vllm")
    itl = "vllm:inter_token_latency_seconds"
    gaps = _sample(after, itl + "_count") - _sample(busy, itl + "_count")
    tokens = _sample(after, "vllm:generation_tokens_total") - _sample(busy, "vllm:generation_tokens_total")
    assert gaps == tokens == 3791
    mean = (_sample(after, itl + "_sum") - _sample(busy, itl + "_sum")) / gaps
    assert values["engine.itl_seconds.mean"] == pytest.approx(mean, rel=1e-12)
    assert "engine.decode_tokens_per_step" not in values  # one token a step: nothing published


def test_per_token_holds_off_when_the_token_counter_and_the_histogram_cover_different_spans() -> None:
    """A token counter absent from the first scrape starts its window later than the histogram's: the
    tokens per step cannot be told, so the histogram is left per step rather than divided wrongly."""
    folder = "vllm-0.32-cpu/vllm-0.32.0-cpu-ngram3-metrics_"
    greedy = _read(folder + "greedy.prom")
    without_tokens = "".join(
        line for line in _zeroed(greedy).splitlines(keepends=True) if "generation_tokens_total" not in line
    )
    mapping = MAPPINGS["vllm"]
    deriver = SignalDeriver(mapping, window_s=60.0)
    deriver.update(parse(without_tokens, mapping, 0.0), 0.0)
    values = deriver.update(parse(greedy, mapping, 10.0), 10.0)
    assert values["engine.itl_seconds.mean"] == pytest.approx(2.3478382600005716 / 536)
    # 1536 more tokens in the counter's 10 s would make 2.8 per step of the histogram's 20 s: held off
    doubled = greedy.replace(
        'vllm:generation_tokens_total{engine="0",model_name="tiny-random-llama"} 1536.0',
        'vllm:generation_tokens_total{engine="0",model_name="tiny-random-llama"} 3072.0',
    )
    assert doubled != greedy
    values = deriver.update(parse(doubled, mapping, 20.0), 20.0)
    assert values["engine.itl_seconds.mean"] == pytest.approx(2.3478382600005716 / 536)


def test_a_restart_no_counter_shows_starts_every_window_over() -> None:
    """One vLLM, then another (its process start time changed): tokens and ITL observations went down,
    TTFT observations did not (7 before, 16 since), so that histogram alone would keep its old base and
    its window would span the other engine's requests too. The start time changing starts every window
    over; the next scrape reads the new engine alone, per token included."""
    mapping = MAPPINGS["vllm"]
    old = _read("vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_after.prom")
    greedy, sampled = (
        _read(f"vllm-0.32-cpu/vllm-0.32.0-cpu-ngram3-metrics_{run}.prom") for run in ("greedy", "sampled")
    )
    assert parse(old, mapping, 0.0).started_at == 1795968446.72
    deriver = SignalDeriver(mapping, window_s=60.0)
    for now, text in enumerate((old, greedy, sampled)):
        values = deriver.update(parse(text, mapping, float(now)), float(now))
    assert deriver.restarts == 1
    # the start time is a signal: its moves are restarts to the general detector (detectors/general.py)
    assert (
        values["engine.process_start_time_seconds"]
        == parse(sampled, mapping, 0.0).started_at
        != 1795968446.72
    )
    ttft = "vllm:time_to_first_token_seconds"
    assert values["engine.ttft_seconds.mean"] == pytest.approx(
        (_sample(sampled, ttft + "_sum") - _sample(greedy, ttft + "_sum")) / 16
    )
    assert values["engine.decode_tokens_per_step"] == pytest.approx(1520 / 1460)
    assert values["engine.itl_seconds.mean"] == pytest.approx(_vllm_tpot(greedy, sampled), rel=1e-3)
    without = "".join(line for line in greedy.splitlines(keepends=True) if "process_start" not in line)
    assert parse(without, mapping, 0.0).started_at is None  # SGLang, llama.cpp: what went down tells


def test_values_outside_the_valid_range_are_dropped() -> None:
    scrape = parse("# TYPE sglang:token_usage gauge\nsglang:token_usage 1.7\n", MAPPINGS["sglang"], now=1.0)
    assert "kv_cache_usage_ratio" not in scrape.gauges


def test_parse_on_the_real_v1_gpu_scrape_prefers_new_names() -> None:
    scrape = parse(_shared_v1_scrape(), MAPPINGS["vllm"], now=1.0)
    assert scrape.errors == ()
    assert scrape.gauges["kv_cache_usage_ratio"] == pytest.approx(0.0011764705882353343)
    assert scrape.counters["prefix_cache_hits_per_second"] == 80.0
    assert scrape.legacy_names == ("vllm:time_per_output_token_seconds",)  # the only name this build has
    assert scrape.model == "Qwen/Qwen3-4B-Instruct-2507-FP8"


# --- derived signals -----------------------------------------------------------------------------


def _derive(relatives: list[str], engine: str, step_s: float = 10.0) -> dict[str, float]:
    deriver = SignalDeriver(MAPPINGS[engine], window_s=60.0)
    values: dict[str, float] = {}
    for i, relative in enumerate(relatives):
        now = i * step_s
        values = deriver.update(parse(_read(relative), MAPPINGS[engine], now), now)
    return values


def test_first_scrape_has_gauges_but_no_rates_or_quantiles() -> None:
    values = _derive(["vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_busy.prom"], "vllm")
    assert values["engine.requests_running"] == 4.0
    assert "engine.generation_tokens_per_second" not in values
    assert "engine.ttft_seconds.p99" not in values


def test_vllm_busy_then_after_gives_rates_quantiles_and_ratio() -> None:
    values = _derive(
        [
            "vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_busy.prom",
            "vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_after.prom",
        ],
        "vllm",
    )
    assert values["engine.generation_tokens_per_second"] == pytest.approx((5028 - 1237) / 10)
    assert values["engine.requests_finished_per_second"] == pytest.approx(0.4)
    assert (
        0
        < values["engine.itl_seconds.p50"]
        <= values["engine.itl_seconds.p95"]
        <= values["engine.itl_seconds.p99"]
    )
    assert values["engine.e2e_seconds.mean"] > 0
    assert values["engine.batch_size_mean"] == 2.0  # running 4 then 0
    assert "engine.prefix_cache_hit_ratio" not in values  # no prefix queries between the two scrapes


def test_vllm_prompt_tokens_the_prefix_cache_served_are_taken_off_the_computed_rate() -> None:
    """A real vLLM 0.32 (scripts/capture_vllm_cachehit.py): three prompts sharing a 480-token history,
    1,443 prompt tokens of which its prefix cache served 1,152 (72 blocks of 16); the steps computed 291."""
    values = _derive(
        [
            "vllm-0.32-cpu/vllm-0.32.0-cpu-cachehit-metrics_before.prom",
            "vllm-0.32-cpu/vllm-0.32.0-cpu-cachehit-metrics_after.prom",
        ],
        "vllm",
    )
    assert values["engine.prompt_tokens_per_second"] == pytest.approx(1443 / 10)
    assert values["engine.prompt_tokens_cached_per_second"] == pytest.approx(1152 / 10)
    assert values["engine.prompt_tokens_computed_per_second"] == pytest.approx(291 / 10)
    assert values["engine.prefix_cache_hit_ratio"] == pytest.approx(1152 / 1443)


def test_llamacpp_prefix_hit_ratio_counts_cached_against_all_prompt_tokens() -> None:
    values = _derive(
        ["llamacpp/llama-server-b11434-metrics_idle.prom", "llamacpp/llama-server-b11434-metrics_busy.prom"],
        "llamacpp",
    )
    # prompt 60 -> 244 (+184), cached 0 -> 66 (+66): 66 / 250
    assert values["engine.prefix_cache_hit_ratio"] == pytest.approx(66 / 250)
    assert "engine.kv_cache_usage_ratio" not in values  # llama.cpp has none: absent, never 0


def test_sglang_single_scrape_maps_its_gauges() -> None:
    values = _derive(["sglang/docs_production_metrics_md_scrape_llama3.1-8b.prom"], "sglang")
    assert values["engine.requests_waiting"] == 2826.0
    assert values["engine.kv_cache_usage_ratio"] == 0.28
    assert values["engine.prefix_cache_hit_ratio"] == pytest.approx(0.007507552643049313)
    assert "engine.decode_tokens_per_step" not in values  # no speculation in that scrape


def test_sglang_prompt_tokens_its_radix_cache_served_are_taken_off_the_computed_rate() -> None:
    """SGLang counts a finished request's whole prompt in prompt_tokens_total and its cache hits in
    cached_tokens_total (names and labels from its metrics collector; no real SGLang here), split by
    cache_source in later releases. Before the first hit the cached family has no sample, and the computed
    rate is left out: the policies then read every prompt token as computed, which it is."""
    mapping = MAPPINGS["sglang"]

    def scrape(prompt: float, cached: dict[str, float]) -> str:
        lines = [
            "# TYPE sglang:prompt_tokens_total counter",
            f'sglang:prompt_tokens_total{{model_name="m"}} {prompt}',
        ]
        if cached:
            lines.append("# TYPE sglang:cached_tokens_total counter")
            lines += [
                f'sglang:cached_tokens_total{{model_name="m",cache_source="{source}"}} {value}'
                for source, value in cached.items()
            ]
        return "\n".join(lines) + "\n"

    deriver = SignalDeriver(mapping, 60.0)
    for now, text in enumerate(
        [
            scrape(1000, {}),
            scrape(3000, {}),  # no hit yet
            scrape(5000, {"device": 600, "host": 200}),  # the first hits (the family appears)
            scrape(9000, {"device": 2600, "host": 1200}),
        ]
    ):
        values = deriver.update(parse(text, mapping, now * 10.0), now * 10.0)
        if now == 1:
            assert values["engine.prompt_tokens_per_second"] == pytest.approx(200.0)
            assert "engine.prompt_tokens_computed_per_second" not in values
    assert values["engine.prompt_tokens_per_second"] == pytest.approx(400.0)
    assert values["engine.prompt_tokens_cached_per_second"] == pytest.approx(300.0)  # 3,000 hits in 10 s
    assert values["engine.prompt_tokens_computed_per_second"] == pytest.approx(100.0)


def test_sglang_s_accept_length_is_its_decode_tokens_per_step() -> None:
    """SGLang's spec_accept_length (tokens per verify step, the bonus token included; names from its
    docs, no real drafting scrape here) is what each stream event brings; a 0 while nothing drafts is
    dropped rather than passed on as a fraction of a token."""
    mapping = MAPPINGS["sglang"]

    def values(length: float) -> dict[str, float]:
        text = (
            f'# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length{{model_name="m"}} {length}\n'
        )
        return SignalDeriver(mapping, 60.0).update(parse(text, mapping, 0.0), 0.0)

    assert values(3.2)["engine.decode_tokens_per_step"] == 3.2
    assert "engine.decode_tokens_per_step" not in values(0.0)


# --- the collector over loopback HTTP ------------------------------------------------------------


def _app(body: str = "", status: int = 200, hang: bool = False) -> web.Application:
    bodies = [body]

    async def metrics(request: web.Request) -> web.Response:
        if hang:
            await asyncio.Event().wait()
        return web.Response(text=bodies[0], status=status, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app[BODIES] = bodies
    return app


def _collector(server: TestServer, **overrides: object) -> EngineMetricsCollector:
    cfg = EngineConfig(url=f"http://127.0.0.1:{server.port}", **overrides)  # type: ignore[arg-type]
    return EngineMetricsCollector(cfg, timer=iter(range(1000)).__next__)  # type: ignore[arg-type]


async def test_collect_reports_values_and_engine_info(aiohttp_server: ServerFactory) -> None:
    server = await aiohttp_server(_app(_read("vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_busy.prom")))
    collector = _collector(server)
    try:
        reading = await collector.collect(now=100.0)
    finally:
        await collector.close()
    assert reading.status is SourceStatus.OK and reading.error is None
    assert reading.source == "engine" and reading.observed_at == 100.0
    assert reading.values["engine.requests_running"] == 4.0
    assert dict(reading.info) == {"engine": "vllm", "model": "tiny-random-llama"}
    assert reading.duration_s == 1.0  # from the injected timer


async def test_second_collect_adds_rates(aiohttp_server: ServerFactory) -> None:
    app = _app(_read("vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_busy.prom"))
    server = await aiohttp_server(app)
    collector = _collector(server)
    try:
        await collector.collect(now=0.0)
        app[BODIES][0] = _read("vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_after.prom")
        reading = await collector.collect(now=5.0)
    finally:
        await collector.close()
    assert reading.values["engine.generation_tokens_per_second"] == pytest.approx((5028 - 1237) / 5)


async def test_http_404_is_an_error_reading(aiohttp_server: ServerFactory) -> None:
    server = await aiohttp_server(_app("not here", status=404))
    collector = _collector(server)
    reading = await collector.collect(now=1.0)
    await collector.close()
    assert reading.status is SourceStatus.ERROR
    assert reading.error == f"HTTP 404 Not Found from http://127.0.0.1:{server.port}/metrics"


async def test_timeout_is_an_error_reading(aiohttp_server: ServerFactory) -> None:
    server = await aiohttp_server(_app(hang=True))
    collector = _collector(server, timeout_s=0.05)
    reading = await collector.collect(now=1.0)
    await collector.close()
    assert reading.status is SourceStatus.ERROR
    assert reading.error is not None and reading.error.startswith("timeout after 0.05 s scraping")


async def test_connection_refused_is_an_error_reading() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    collector = EngineMetricsCollector(EngineConfig(url=f"http://127.0.0.1:{port}"))
    reading = await collector.collect(now=1.0)
    await collector.close()
    assert reading.status is SourceStatus.ERROR
    assert reading.error is not None and reading.error.startswith(
        f"cannot connect to http://127.0.0.1:{port}"
    )
    assert "\n" not in reading.error


async def test_empty_body_is_no_data(aiohttp_server: ServerFactory) -> None:
    server = await aiohttp_server(_app(_read("failures/empty.prom")))
    collector = _collector(server)
    reading = await collector.collect(now=1.0)
    await collector.close()
    assert reading.status is SourceStatus.NO_DATA and reading.values == {}


async def test_garbage_body_is_an_error_naming_the_line(aiohttp_server: ServerFactory) -> None:
    server = await aiohttp_server(_app(_read("failures/garbage.prom")))
    collector = _collector(server)
    reading = await collector.collect(now=1.0)
    await collector.close()
    assert reading.status is SourceStatus.ERROR
    assert reading.error is not None and "not Prometheus text" in reading.error and "line 1" in reading.error


async def test_metrics_of_no_known_engine_are_no_data(aiohttp_server: ServerFactory) -> None:
    server = await aiohttp_server(_app(_read("dcgm-exporter/readme_sample_scrape_ELIDED.prom")))
    collector = _collector(server)
    reading = await collector.collect(now=1.0)
    await collector.close()
    assert reading.status is SourceStatus.NO_DATA
    assert reading.error is not None and "no engine metrics" in reading.error


async def test_truncated_body_keeps_what_parsed_with_a_warning(aiohttp_server: ServerFactory) -> None:
    server = await aiohttp_server(_app(_read("failures/truncated.prom")))
    collector = _collector(server)
    reading = await collector.collect(now=1.0)
    await collector.close()
    assert reading.status is SourceStatus.OK
    assert reading.values["engine.requests_running"] == 4.0
    assert reading.info["parse_warnings"].startswith("1 bad lines, first: line 298: cannot parse")


async def test_nan_and_inf_never_reach_the_reading(aiohttp_server: ServerFactory) -> None:
    server = await aiohttp_server(_app(_read("failures/nan_inf.prom")))
    collector = _collector(server)
    reading = await collector.collect(now=1.0)
    await collector.close()
    assert set(reading.values) == {"engine.requests_waiting"}
    assert reading.info["parse_warnings"] == "4 non-finite or sentinel samples dropped"


async def test_explicit_kind_is_used_without_detection(aiohttp_server: ServerFactory) -> None:
    server = await aiohttp_server(_app(_read("vllm-0.32-cpu/vllm-0.32.0-cpu-metrics_busy.prom")))
    collector = _collector(server, kind="sglang")
    reading = await collector.collect(now=1.0)
    await collector.close()
    assert reading.status is SourceStatus.NO_DATA
    assert reading.error == "no known sglang metrics in scrape"


async def test_a_borrowed_session_is_left_open(aiohttp_server: ServerFactory) -> None:
    server = await aiohttp_server(_app(_read("llamacpp/llama-server-b11434-metrics_busy.prom")))
    async with aiohttp.ClientSession() as session:
        collector = EngineMetricsCollector(EngineConfig(url=f"http://127.0.0.1:{server.port}"), session)
        reading = await collector.collect(now=1.0)
        await collector.close()
        assert not session.closed
    assert reading.info["engine"] == "llamacpp" and "model" not in reading.info


async def test_engine_body_with_no_parseable_line_is_an_error(aiohttp_server: ServerFactory) -> None:
    server = await aiohttp_server(_app('vllm:num_requests_running{engine="0" 3\n'))
    collector = _collector(server)
    reading = await collector.collect(now=1.0)
    await collector.close()
    assert reading.status is SourceStatus.ERROR
    assert reading.error is not None and reading.error.startswith("1 bad lines, first: line 1: cannot parse")


def test_vllm_speculative_decoding_counters_map_to_rates_and_an_acceptance_ratio() -> None:
    """Names as vLLM V1 serves them with speculation on (vllm/v1/spec_decode/metrics.py)."""
    from agent.collectors.engine_metrics import SignalDeriver, load_mappings, parse

    mapping = load_mappings()["vllm"]
    deriver = SignalDeriver(mapping, 60.0)

    def text(drafts: int, draft_tokens: int, accepted: int) -> str:
        lines = []
        for name, value in (
            ("vllm:spec_decode_num_drafts_total", drafts),
            ("vllm:spec_decode_num_draft_tokens_total", draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens_total", accepted),
        ):
            lines += [f"# TYPE {name} counter", f'{name}{{engine="0",model_name="m"}} {value}']
        return "\n".join(lines) + "\n"

    deriver.update(parse(text(100, 400, 200), mapping, 0.0), 0.0)
    values = deriver.update(parse(text(200, 800, 440), mapping, 10.0), 10.0)
    assert values["engine.spec_drafts_per_second"] == 10.0
    assert values["engine.spec_draft_tokens_per_second"] == 40.0
    assert values["engine.spec_accepted_tokens_per_second"] == 24.0
    assert abs(values["engine.spec_acceptance_ratio"] - 0.6) < 1e-9
