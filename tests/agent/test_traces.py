from pathlib import Path

import numpy as np
import pytest

from agent.traces import TraceError, read_counts, read_requests

FIXTURES = Path(__file__).parent.parent / "fixtures" / "traces"


def test_azure_trace_rows_become_arrival_prompt_output() -> None:
    requests = read_requests(FIXTURES / "azure2023_code_head40.csv")
    assert requests.shape == (40, 3)
    assert requests[0].tolist() == pytest.approx([1700158623.97996, 4808.0, 10.0])  # 7th digit cut
    assert np.all(np.diff(requests[:, 0]) >= 0)


def test_mooncake_timestamps_are_milliseconds() -> None:
    requests = read_requests(FIXTURES / "mooncake_conversation_head30.jsonl")
    assert requests[0].tolist() == [0.0, 6758.0, 500.0]
    assert requests[:, 0].max() < 10.0


def test_azure_2024_counts_use_column_two_as_the_count() -> None:
    series = read_counts(FIXTURES / "azure2024_coding_counts_10s_head2h.csv")
    assert series.step_s == 10.0 and len(series) == 720 and series.values[:2].tolist() == [146.0, 238.0]


def test_counts_aggregate_to_a_coarser_step_and_drop_partial_edge_bins(tmp_path: Path) -> None:
    path = tmp_path / "c.csv"
    path.write_text("timestamp,count\n" + "".join(f"{60 + 10 * i},{i}\n" for i in range(13)))
    series = read_counts(path, 60.0)
    assert series.values.tolist() == [15.0, 51.0]  # the 13th row alone would be a partial bin
    assert series.start_s == 60.0


def test_per_request_trace_counts_arrivals_per_step() -> None:
    series = read_counts(FIXTURES / "azure2023_code_head40.csv", 1.0)
    assert series.values.sum() == 40 and series.gap_count == 0


def test_unknown_header_is_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceError, match="unrecognised header 'a,b,c': a trace is Azure's") as error:
        read_counts(path)
    assert "\n" not in str(error.value)


def test_empty_file_says_so(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("")
    with pytest.raises(TraceError, match="empty \\(no header line\\)"):
        read_counts(path)


def test_bad_row_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("timestamp,count\n0,1\n60,oops\n")
    with pytest.raises(TraceError, match=":3: cannot parse"):
        read_counts(path)


def test_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="No such file"):
        read_requests(tmp_path / "none.csv")


def test_a_file_that_is_not_text_is_a_trace_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "counts.csv"
    path.write_bytes(b"Time,TIMESTAMP\n0,\xff\xfe\n")  # the header reads; a row does not
    for read in (read_counts, read_requests):
        with pytest.raises(TraceError, match=r"counts.csv: not UTF-8 text at byte \d+"):
            read(path)
