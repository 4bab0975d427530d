import json
from pathlib import Path

import numpy as np
import pytest

from agent.commands.forecast import parse_duration


def _series(tmp_path: Path, days: int = 4) -> Path:
    rng = np.random.default_rng(0)
    t = np.arange(days * 48) * 1800.0
    counts = rng.poisson(100 + 50 * np.sin(2 * np.pi * t / 86_400.0))
    path = tmp_path / "rate.csv"
    path.write_text("timestamp,count\n" + "".join(f"{int(a)},{c}\n" for a, c in zip(t, counts, strict=True)))
    return path


def _main(argv: list[str]) -> int:
    """The real ``servepilot`` entry point (exit codes, one-line errors) with only this subcommand."""
    from agent import cli

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "COMMANDS", ("agent.commands.forecast",))
        return cli.main(argv)


def test_parse_duration_understands_units() -> None:
    assert [parse_duration(s) for s in ("90", "90s", "30m", "1h")] == [90.0, 90.0, 1800.0, 3600.0]


def test_json_has_the_contract_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    models = "last_value,seasonal_naive_1d,holt_winters"
    argv = ["forecast", "--input", str(_series(tmp_path)), "--step", "30m", "--horizon", "1h", "--json"]
    assert _main([*argv, "--models", models, "--stride", "30m"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["horizon_s"] == 3600 and report["step_s"] == 1800
    names = [m["name"] for m in report["models"]]
    assert names[:3] == models.split(",") and report["selected"] in names
    assert all(m["mase"] > 0 and 0 <= m["smape"] <= 2 for m in report["models"])


@pytest.mark.parametrize("flag", ["--input", "--trace"])
def test_text_table_lists_every_model(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str) -> None:
    argv = ["forecast", flag, str(_series(tmp_path)), "--step", "30m", "--models", "last_value"]
    assert _main(argv) == 0
    out = capsys.readouterr().out
    assert "last_value" in out and "selected at 30 min: last_value" in out


def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("nothing useful\n")
    assert _main(["forecast", "--input", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognised header" in err


def test_unknown_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["forecast", "--input", str(_series(tmp_path)), "--step", "30m", "--models", "prophet"]
    assert _main(argv) == 2
    assert "unknown models" in capsys.readouterr().err
