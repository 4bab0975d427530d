"""The rules file: current, valid for promtool, unit-tested by promtool, and documented."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from dashboards import rules

ROOT = Path(__file__).resolve().parents[2]
UNIT_TESTS = ROOT / "dashboards" / "rules" / "tests" / "servepilot_test.yaml"
RUNBOOK = ROOT / "docs" / "alerts.md"
ALERTS = rules.alerts(rules.PRODUCTION)
RECORDS = rules.recording(rules.PRODUCTION)


def test_committed_rules_file_is_current() -> None:
    assert rules.main(["--check"]) == 0, "run: python -m dashboards.rules"


def test_operator_resource_carries_the_same_groups() -> None:
    resource = yaml.safe_load(rules.OPERATOR_FILE.read_text(encoding="utf-8"))
    assert resource["kind"] == "PrometheusRule"
    assert resource["spec"] == yaml.safe_load(rules.RULES_FILE.read_text(encoding="utf-8"))


def test_promtool_check_rules_passes(promtool: str) -> None:
    done = subprocess.run([promtool, "check", "rules", str(rules.RULES_FILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_fast_profile_rules_also_pass_promtool(promtool: str, tmp_path: Path) -> None:
    path = tmp_path / "fast.yaml"
    path.write_text(rules.render(rules.FAST), encoding="utf-8")
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_pass(promtool: str) -> None:
    done = subprocess.run([promtool, "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a["alert"])
def test_every_alert_has_for_severity_summary_description_and_runbook(alert: dict[str, object]) -> None:
    assert alert["for"]
    assert alert["labels"] == {"severity": alert["labels"]["severity"]}  # type: ignore[index]
    assert alert["labels"]["severity"] in {"critical", "warning"}  # type: ignore[index]
    notes = alert["annotations"]
    assert set(notes) == {"summary", "description", "runbook_url"}  # type: ignore[arg-type]


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a["alert"])
def test_every_alert_has_a_runbook_section(alert: dict[str, object]) -> None:
    headings = re.findall(r"^## (\w+)", RUNBOOK.read_text(encoding="utf-8"), re.M)
    assert alert["alert"] in headings


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a["alert"])
def test_every_alert_fires_and_stays_quiet_in_the_unit_tests(alert: dict[str, object]) -> None:
    text = UNIT_TESTS.read_text(encoding="utf-8")
    blocks = re.findall(
        rf"alertname: {alert['alert']}\n\s+exp_alerts:(.*?)(?=\n\s+- eval_time|\n\s+- name|\Z)", text, re.S
    )
    assert any(b.strip() == "[]" for b in blocks), "needs a not-firing case"
    assert any("exp_labels" in b for b in blocks), "needs a firing case"


@pytest.mark.parametrize("rule", RECORDS, ids=lambda r: r["record"])
def test_recording_rules_are_named_level_metric_operations(rule: dict[str, str]) -> None:
    assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", rule["record"])


def test_fast_profile_only_shortens_durations() -> None:
    fast = rules.alerts(rules.FAST)
    assert [a["alert"] for a in fast] == [a["alert"] for a in ALERTS]
    assert all(f["for"].endswith("s") for f in fast)


def test_inhibition_names_only_alerts_we_define_and_mutes_none_of_the_causes() -> None:
    """A renamed alert would silently stop muting (or being muted): each name must be one we define. The
    alerts that may be the cause of an incident, or are about the sidecar itself, are never muted."""
    from dashboards import inhibit

    defined = {a["alert"] for a in ALERTS}
    muted = {name for targets in inhibit.MUTES.values() for name, _ in targets}
    assert set(inhibit.MUTES) <= defined and muted <= defined, (set(inhibit.MUTES) | muted) - defined
    never = {"ServepilotAgentDown", "ServepilotEngineDown", "ServepilotMemoryLeak", "ServepilotFragmentation"}
    assert not muted & never
    resource = yaml.safe_load(inhibit.OPERATOR_FILE.read_text(encoding="utf-8"))
    assert resource["kind"] == "AlertmanagerConfig"
    assert len(resource["spec"]["inhibitRules"]) == len(inhibit.inhibit_rules())
    fragment = yaml.safe_load(inhibit.FRAGMENT_FILE.read_text(encoding="utf-8"))
    assert fragment == {"inhibit_rules": inhibit.inhibit_rules()}


EXPO = ROOT / "tests" / "fixtures" / "expo"


@pytest.mark.parametrize(
    ("engine", "scrape"),
    [
        ("vllm", EXPO / "vllm-0.32-cpu" / "vllm-0.32.0-cpu-metrics_busy.prom"),
        ("sglang", EXPO / "sglang" / "docs_production_metrics_md_scrape_llama3.1-8b.prom"),
    ],
)
def test_the_ttft_bounds_are_those_the_engines_serve(engine: str, scrape: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    [family] = [
        f
        for f in text_string_to_metric_families(scrape.read_text(encoding="utf-8"))
        if f.name == f"{engine}:time_to_first_token_seconds"
    ]
    served = {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
    assert served - {float("inf")} == set(rules.TTFT_BOUNDS[engine])


def test_rules_for_another_slo_and_budget(promtool: str, tmp_path: Path) -> None:
    out, operator = tmp_path / "rules.yaml", tmp_path / "operator.yaml"
    args = ["--ttft-slo-s", "1", "--error-budget", "0.005", "--output", str(out)]
    assert rules.main([*args, "--operator-output", str(operator)]) == 0
    text = out.read_text(encoding="utf-8")
    command = "python -m dashboards.rules --ttft-slo-s 1.0 --error-budget 0.005"
    assert text.startswith(f"# Generated by `{command}`;")
    assert 'le="1.0"' in text and 'le="2.5"' not in text
    assert "ratio_rate1h > 0.072" in text and "ratio_rate6h > 0.03" in text  # 14.4 and 6 x 0.5 %
    done = subprocess.run([promtool, "check", "rules", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--ttft-slo-s", "2"], "--ttft-slo-s: 2 s is not a bucket bound of the TTFT histogram of vllm and "
         "sglang; the nearest bounds both engines have are 1 or 2.5"),
        (["--ttft-slo-s", "15"], "--ttft-slo-s: 15 s is not a bucket bound of the TTFT histogram of vllm; "
         "the nearest bounds both engines have are 10 or 20"),
        (["--error-budget", "0.1"], "--error-budget must be in (0, 0.0694), got 0.1"),
    ],
)  # fmt: skip
def test_an_slo_the_alerts_cannot_judge_is_refused(
    option: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--output", str(tmp_path / "r.yaml"), "--operator-output", str(tmp_path / "o.yaml")]
    with pytest.raises(SystemExit) as exit_:
        rules.main([*option, *out])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"python -m dashboards.rules: error: {message}"
    assert not (tmp_path / "r.yaml").exists()
