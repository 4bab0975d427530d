import argparse
import json
import re
from pathlib import Path

import pytest

from agent.commands import replay
from agent.commands.replay import parse_slo

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "replay" / "azure_conv_head300.csv"


@pytest.fixture
def conv() -> Path:
    return FIXTURE


def _main(argv):
    from agent.cli import UsageError

    parser = argparse.ArgumentParser()
    replay.register(parser.add_subparsers())
    args = parser.parse_args(["replay", *argv])
    try:
        return args.func(args)
    except UsageError as error:
        return str(error)


def test_json_output_has_the_contract_keys(conv, capsys):
    assert _main(["--trace", str(conv), "--policy", "static:32", "--rate-scale", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"policy", "goodput_tps", "slo_attainment", "actions"} <= set(out)


def test_sweep_reports_the_best_static(conv, capsys):
    _main(["--trace", str(conv), "--rate-scale", "5", "--sweep", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["best_static"]["policy"].startswith("static:") and len(out["sweep"]) > 3


def test_sweep_says_auto_against_the_best_static_and_the_engine_default(conv, capsys):
    """The issue's yardsticks in the command's own words, not worked out by hand from the table."""
    _main(["--trace", str(conv), "--rate-scale", "5", "--sweep", "--json"])
    out = json.loads(capsys.readouterr().out)
    rows = {row["policy"]: row for row in out["sweep"]}
    versus = out["versus"]
    assert versus["engine_default"]["policy"] == "static:256"  # vLLM V1's max_num_seqs on the A100
    for key in ("best_static", "engine_default"):
        other = rows[versus[key]["policy"]]
        assert versus[key]["goodput_ratio"] == pytest.approx(out["goodput_tps"] / other["goodput_tps"])
    assert versus["best_static"]["policy"] == out["best_static"]["policy"]
    _main(["--trace", str(conv), "--rate-scale", "5", "--sweep", "--default-batch", "200"])
    text = capsys.readouterr().out
    assert "static:200 " in text  # a default the grid lacks is replayed beside it
    assert re.search(
        r"^auto goodput: \d\.\d{3}x the best static \(static:[\d/]+\), \d\.\d{3}x the engine default "
        r"\(static:200\), at \d+\.\d\d% SLO attainment$",
        text,
        re.MULTILINE,
    ), text


def test_report_file_is_written(conv, tmp_path):
    target = tmp_path / "r.html"
    _main(["--trace", str(conv), "--policy", "static:32", "--rate-scale", "5", "--report", str(target)])
    assert "<svg" in target.read_text()


def test_bad_policy_is_one_line_usage_error(conv):
    assert "--policy" in _main(["--trace", str(conv), "--policy", "fast"])


def test_missing_trace_is_one_line_usage_error(tmp_path):
    assert "no such file" in _main(["--trace", str(tmp_path / "x.csv")])


def test_slo_accepts_milliseconds():
    assert parse_slo("ttft=500ms,itl=80ms") == pytest.approx((0.5, 0.08))


def test_slo_needs_both_targets():
    with pytest.raises(argparse.ArgumentTypeError, match="both"):
        parse_slo("ttft=2")


def test_a_non_positive_queue_timeout_is_one_line_usage_error(conv):
    assert "--queue-timeout" in _main(["--trace", str(conv), "--queue-timeout", "0"])


def test_queue_timeout_defaults_to_the_ttft_slo_and_inf_turns_it_off(conv, capsys):
    base = ["--trace", str(conv), "--policy", "static:256", "--rate-scale", "8", "--slo", "ttft=1,itl=0.1"]
    _main([*base, "--json"])
    gated = json.loads(capsys.readouterr().out)
    _main([*base, "--queue-timeout", "inf", "--json"])
    alone = json.loads(capsys.readouterr().out)
    assert gated["expired"] > 0 and alone["expired"] == 0
    assert gated["ttft_p99_s"] < alone["ttft_p99_s"]


def test_classes_print_a_line_each_and_are_in_the_json(conv, capsys):
    argv = ["--trace", str(conv), "--policy", "static:32", "--rate-scale", "5"]
    argv += [
        "--priority-mix",
        "high=0.2,low=0.8",
        "--class-slo",
        "low:ttft=60",
        "--class-slo",
        "high:itl=50ms",
    ]
    assert _main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("high ") for line in lines) and any(line.startswith("low ") for line in lines)
    assert _main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["classes"]
    assert out["high"]["slo"] == {"ttft_s": 10.0, "itl_s": 0.05} and out["low"]["slo"] == {
        "ttft_s": 60.0,
        "itl_s": 0.1,
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--class-slo", "low:ttft=60"], "need a priority mix"),
        (["--itl-steering", "served_classes"], "need a priority mix"),
        (
            ["--priority-mix", "high=1", "--class-slo", "high:ttft=900"],
            "policies.slo_by_priority.high.ttft_s",
        ),
    ],
)
def test_class_settings_without_a_mix_or_out_of_range_are_one_line_usage_errors(conv, argv, message):
    assert message in _main(["--trace", str(conv), *argv])


@pytest.mark.parametrize("bad", ["urgent:ttft=1", "high", "high:ttft=0", "high:speed=2"])
def test_a_malformed_class_slo_names_the_flag(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="--class-slo"):
        replay.parse_class_slo(bad)


def test_a_config_gives_the_classes_their_targets(conv, tmp_path, capsys):
    config = tmp_path / "servepilot.yaml"
    config.write_text(
        "gate: {enabled: true, max_queue_wait_s: 4}\n"
        "policies: {ttft_slo_s: 4, itl_slo_s: 0.1, slo_by_priority: {low: {ttft_s: 40}}}\n",
        encoding="utf-8",
    )
    argv = ["--trace", str(conv), "--policy", "static:32", "--rate-scale", "5", "--config", str(config)]
    assert _main([*argv, "--priority-mix", "high=0.5,low=0.5", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["classes"]["low"]["slo"] == {"ttft_s": 40.0, "itl_s": 0.1}
    assert "from the config: SLO ttft=4s itl=0.1s" in captured.err and "queue timeout 4s" in captured.err


def test_a_bad_config_is_one_line_naming_the_field(conv, tmp_path):
    config = tmp_path / "servepilot.yaml"
    config.write_text("policies: {itl_slo_s: -1}\n", encoding="utf-8")
    assert (
        _main(["--trace", str(conv), "--config", str(config)])
        == "policies.itl_slo_s must be in (0, 60], got -1"
    )
