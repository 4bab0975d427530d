from __future__ import annotations

import argparse
import io
import shutil
from pathlib import Path

import pytest

from agent.cli import UsageError
from agent.commands import detect
from detectors.registry import DEFAULT_SCORER

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "nab"


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="servepilot")
    detect.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["detect", *argv])
    return int(args.func(args))


def rows(path: Path) -> list[list[str]]:
    return [line.split(",") for line in path.read_text().splitlines()]


def test_one_output_row_per_input_row_in_order(tmp_path: Path) -> None:
    out = tmp_path / "out.csv"
    assert run("--input", str(FIXTURES / "art_daily_jumpsup.csv"), "--output", str(out)) == 0
    src, got = rows(FIXTURES / "art_daily_jumpsup.csv"), rows(out)
    assert got[0] == ["timestamp", "value", "anomaly_score"]
    assert [r[:2] for r in got[1:]] == src[1:]
    assert all(0.0 <= float(r[2]) <= 1.0 for r in got[1:])


def test_crlf_input_gives_crlf_output(tmp_path: Path) -> None:
    out = tmp_path / "out.csv"
    run("--input", str(FIXTURES / "rogue_agent_key_hold.csv"), "--output", str(out))
    data = out.read_bytes()
    assert data.count(b"\r\n") == data.count(b"\n") == 1883


def test_empty_and_nan_values_keep_their_row_with_score_zero(tmp_path: Path) -> None:
    src, out = tmp_path / "in.csv", tmp_path / "out.csv"
    lines = [f"2024-01-01 00:{i // 60:02d}:{i % 60:02d},{i % 7}" for i in range(300)]
    lines[250], lines[260] = "2024-01-01 00:04:10,", "2024-01-01 00:04:20,nan"
    src.write_text("timestamp,value\n" + "\n".join(lines) + "\n")
    run("--input", str(src), "--output", str(out))
    got = rows(out)
    assert len(got) == 301 and got[251][1:] == ["", "0.000000000"] and got[261][2] == "0.000000000"


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("time,val\n1,2\n", "header must contain"),
        ("timestamp,value\n1,abc\n", "in.csv:2: unparseable value"),
        ("timestamp,value\nyesterday,1\n", "unparseable timestamp"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, content: str, needle: str) -> None:
    src, out = tmp_path / "in.csv", tmp_path / "out.csv"
    src.write_text(content)
    with pytest.raises(UsageError, match=needle) as info:
        run("--input", str(src), "--output", str(out))
    assert "\n" not in str(info.value) and not out.exists()


def test_missing_input_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        run("--input", str(tmp_path / "nope.csv"), "--output", str(tmp_path / "o.csv"))


def test_unknown_detector() -> None:
    with pytest.raises(UsageError, match="unknown detector 'nope'"):
        run("--input", "x", "--output", "y", "--detector", "nope")


def test_directory_mode_mirrors_the_tree(tmp_path: Path) -> None:
    (tmp_path / "in" / "catA").mkdir(parents=True)
    shutil.copy(FIXTURES / "rogue_agent_key_hold.csv", tmp_path / "in" / "catA" / "x.csv")
    assert run("--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")) == 0
    assert len(rows(tmp_path / "out" / "catA" / "x.csv")) == 1883


def test_output_defaults_to_standard_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--input", str(FIXTURES / "art_daily_jumpsup.csv")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "timestamp,value,anomaly_score"
    assert len(out) == len(rows(FIXTURES / "art_daily_jumpsup.csv"))


def test_standard_input_in_standard_output_out(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = FIXTURES / "art_daily_jumpsup.csv"
    monkeypatch.setattr("sys.stdin", io.StringIO(source.read_text()))
    assert run("--input", "-") == 0
    assert [line.split(",")[:2] for line in capsys.readouterr().out.splitlines()[1:]] == rows(source)[1:]


def test_a_directory_needs_an_output_directory(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    shutil.copy(FIXTURES / "rogue_agent_key_hold.csv", tmp_path / "in" / "x.csv")
    with pytest.raises(UsageError, match="--output DIR is required"):
        run("--input", str(tmp_path / "in"))


def test_list_names_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--list") == 0
    assert any(
        line.startswith(DEFAULT_SCORER) and "default" in line for line in capsys.readouterr().out.splitlines()
    )
