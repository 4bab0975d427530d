import gzip

import numpy as np
import pytest

from agent.replay.workload import load
from agent.traces import TraceError


def test_azure_trace_starts_at_zero_in_arrival_order(conv):
    w = load(conv, max_model_len=4096)
    assert w.arrivals[0] == 0.0 and np.all(np.diff(w.arrivals) >= 0)


def test_rate_scale_compresses_time(conv):
    assert load(conv, max_model_len=4096, rate_scale=2.0).duration_s == pytest.approx(
        load(conv, max_model_len=4096).duration_s / 2
    )


def test_prompts_longer_than_the_context_are_clipped(code):
    w = load(code, max_model_len=2048)
    assert int((w.prompts + w.outputs).max()) <= 2048 and w.clipped > 0


def test_mooncake_ticks_are_spread_within_three_seconds(mooncake):
    w = load(mooncake, max_model_len=8192)
    assert len(np.unique(w.arrivals)) == len(w)


def test_count_series_needs_a_lengths_trace(counts):
    with pytest.raises(TraceError, match="--lengths"):
        load(counts, max_model_len=4096)


def test_count_series_draws_about_the_scaled_count(counts, code):
    w = load(counts, max_model_len=4096, lengths=code, rate_scale=0.1)
    total = sum(int(line.split(",")[1]) for line in counts.read_text().splitlines()[1:])
    assert abs(len(w) - 0.1 * total) < 4 * np.sqrt(0.1 * total)


def test_count_series_takes_lengths_from_the_lengths_trace(counts, code):
    w = load(counts, max_model_len=8192, lengths=code, rate_scale=0.1)
    pool = {int(line.split(",")[2]) for line in code.read_text().splitlines()[1:]}
    assert set(w.outputs.tolist()) <= pool


def test_same_seed_same_workload(counts, code):
    a = load(counts, max_model_len=4096, lengths=code, rate_scale=0.1, seed=3)
    b = load(counts, max_model_len=4096, lengths=code, rate_scale=0.1, seed=3)
    assert np.array_equal(a.arrivals, b.arrivals)


def test_missing_file_is_one_line_error(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        load(tmp_path / "nope.csv", max_model_len=4096)


def test_a_folder_is_refused_naming_the_traces_in_it(tmp_path):
    """``--trace ../shared/data/traces/azure_llm_2023`` said "no such file" of a folder that exists."""
    (tmp_path / "AzureLLMInferenceTrace_conv.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    (tmp_path / "LICENSE").write_text("")
    with pytest.raises(
        TraceError, match=r"is a folder; name a trace file in it \(AzureLLMInferenceTrace_conv.csv\)"
    ):
        load(tmp_path, max_model_len=4096)


def test_zero_rate_scale_is_refused(conv):
    with pytest.raises(TraceError, match="rate scale"):
        load(conv, max_model_len=4096, rate_scale=0.0)


def test_a_window_keeps_its_requests_and_starts_at_zero(conv):
    w = load(conv, max_model_len=4096)
    start, end = float(w.arrivals[100]), float(w.arrivals[200])
    window = w.between(start, end)
    inside = (w.arrivals >= start) & (w.arrivals < end)
    assert len(window) == int(inside.sum()) and window.arrivals[0] == 0.0
    assert np.array_equal(window.prompts, w.prompts[inside])
    assert window.duration_s == pytest.approx(float(w.arrivals[inside][-1]) - start)


def test_a_gzip_compressed_trace_is_read_as_the_plain_one(tmp_path, code, counts, mooncake):
    """The demo's bundled trace is gzip-compressed; replay said "'utf-8' codec can't decode byte 0x8b in
    position 1" of any .gz trace (it sniffed the header from the raw bytes), counts included; and a
    Mooncake trace told by its ".jsonl" would have lost the spreading of its 3-s ticks."""
    for plain in (code, counts, mooncake):
        packed = tmp_path / (plain.name + ".gz")
        packed.write_bytes(gzip.compress(plain.read_bytes()))
        lengths = None if plain == code else code
        a = load(plain, max_model_len=8192, lengths=lengths, rate_scale=0.1)
        b = load(packed, max_model_len=8192, lengths=lengths, rate_scale=0.1)
        assert len(a) > 0 and np.array_equal(a.arrivals, b.arrivals) and np.array_equal(a.prompts, b.prompts)
        assert a.name == b.name


def test_a_binary_file_is_one_line_naming_it(tmp_path):
    packed = tmp_path / "trace.csv"  # compressed, without its .gz
    packed.write_bytes(gzip.compress(b"TIMESTAMP,ContextTokens,GeneratedTokens\n"))
    with pytest.raises(TraceError, match=r"trace.csv: not UTF-8 text at byte 1: a trace is a CSV or JSONL"):
        load(packed, max_model_len=4096)
