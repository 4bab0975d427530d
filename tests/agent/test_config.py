from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from agent import config
from agent.cli import main

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_defaults_are_valid_and_frozen() -> None:
    cfg = config.build({})
    assert cfg.agent.interval_s == 1.0
    assert (cfg.agent.listen_host, cfg.agent.listen_port) == ("127.0.0.1", 9400)
    with pytest.raises(ValidationError):
        cfg.agent.interval_s = 2.0  # type: ignore[misc]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_config_validates(path: Path) -> None:
    config.load(path, {})


def test_examples_exist_for_demo_vllm_and_sglang() -> None:
    assert {p.name for p in EXAMPLES} >= {"demo.yaml", "vllm-pod.yaml", "sglang-pod.yaml"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"agent": {"interval_s": 0}}, "agent.interval_s must be in [0.05, 60], got 0"),
        ({"agent": {"listen_port": 70000}}, "agent.listen_port must be in [1, 65535], got 70000"),
        ({"engine": {"timeout_s": 0}}, "engine.timeout_s must be in (0, 60], got 0"),
        (
            {"detectors": {"spec_draft_cost_ratio": 2}},
            "detectors.spec_draft_cost_ratio must be in [0, 1], got 2",
        ),
        (
            {"detectors": {"disabled": ["general", "nope"]}},
            "detectors.disabled unknown detector 'nope'; known: general, memory_leak,",
        ),
        (  # a section inside a mapping: the range is found through the line's name
            {"gate": {"lines": {"batch": {"burst_ratio": 200}}}},
            "gate.lines.batch.burst_ratio must be in [1, 100], got 200",
        ),
        ({"engine": {"kind": "triton"}}, "engine.kind must be one of"),
        ({"engine": {"url": "ftp://x"}}, "engine.url must start with http:// or https://, got 'ftp://x'"),
        (  # the OpenAI client's base URL, pasted: /v1/metrics scraped, /v1/v1/chat/completions sent
            {"gate": {"upstreams": {"primary": "http://127.0.0.1:8000/v1/"}}},
            "gate.upstreams.primary must be the server's base URL, without /v1",
        ),
        ({"engine": {"url": "http://vllm:8000/v1"}}, "engine.url must be the server's base URL, without /v1"),
        (  # the engine's port and the gate's mixed up: every request came back to the gate
            {"gate": {"listen_port": 8080, "upstreams": {"primary": "http://localhost:8080"}}},
            "gate.upstreams.primary is the gate's own address (port 8080): every request would come back",
        ),
        (
            {"agent": {"intervall_s": 1}},
            "agent.intervall_s is not a known setting (did you mean agent.interval_s?)",
        ),
        (  # of the close names, the one starting as the typo does (not tls_key_file, closer by ratio)
            {"agent": {"state_file": "/var/lib/servepilot/state.json"}},
            "agent.state_file is not a known setting (did you mean agent.state_path?)",
        ),
        (  # inside a mapping of sections: the line's fields
            {"gate": {"lines": {"batch": {"request_per_min": 10}}}},
            "gate.lines.batch.request_per_min is not a known setting "
            "(did you mean gate.lines.batch.requests_per_min?)",
        ),
        ({"gaet": {}}, "gaet is not a known setting (did you mean gate?)"),
        ({"agent": {"interval_s": "fast"}}, "agent.interval_s input should be a valid number"),
        (
            {"policies": {"energy": True}},
            "policies.energy needs actuators.gpu (locked_clocks or power_limit)",
        ),
        (
            {"policies": {"energy_levels": [1000, 1400]}},
            "policies.energy_levels must be positive and strictly falling (high to low), got [1000, 1400]",
        ),
        ({"policies": {"schedule": {"windows": []}}}, "policies.schedule.timezone is required"),
        (
            {
                "policies": {
                    "schedule": {
                        "timezone": "UTC",
                        "windows": [{"start": "9", "end": "17:00", "mode": "peak"}],
                    }
                }
            },
            "policies.schedule.windows[0].start must look like HH:MM, got '9'",
        ),
        (
            {"policies": {"schedule": {"timezone": "UTC", "windows": [{"start": "9:00", "end": "17:00"}]}}},
            "policies.schedule.windows[0].mode is required (peak or offpeak)",
        ),
        (  # a peak schedule with no energy policy to read it did nothing, silently
            {"policies": {"schedule": {"timezone": "UTC"}}},
            "policies.schedule needs policies.energy (its peak windows hold the energy ladder at full clock;",
        ),
        # each of these passed validation and then stopped `servepilot run` with a traceback (exit 1)
        ({"gate": {"split": {"fp8": 1.0}}}, "gate.split names 'fp8', not one of the upstreams (primary)"),
        ({"gate": {"split": {"primary": 0.0}}}, "gate.split must give shares >= 0 with a total above 0"),
        (
            {"gate": {"engine_priority": {"fp8": "vllm"}}},
            "gate.engine_priority names 'fp8', not one of the upstreams (primary)",
        ),
        (
            {"gate": {"engine_priority": {"primary": "fcfs"}}},
            "gate.engine_priority entry 'primary' must be vllm or sglang, or a map of high, normal and low",
        ),
        (
            {"gate": {"engine_priority": {"primary": {"high": 1, "normal": 0}}}},
            "gate.engine_priority.primary.low is required",
        ),
        (
            {"agent": {"engine_restart_stall_s": 60}},
            "agent.engine_restart_stall_s must be 0 (never) or >= 300 s, got 60 "
            "(a restart reloads the weights)",
        ),
        (
            {"webhooks": {"enabled": True, "generic_url": "http://127.0.0.1:9/hook"}},
            "webhooks.secret_file is required when generic_url is set",
        ),
        (
            {"policies": {"batch_min": 64, "batch_max": 8}},
            "policies.batch_min must be <= batch_max, got 64 > 8",
        ),
        (
            {"policies": {"slo_by_priority": {"urgent": {"ttft_s": 1}}}},
            "policies.slo_by_priority keys must be 'high', 'normal' or 'low', got 'urgent'",
        ),
        (
            {"policies": {"slo_by_priority": {"low": {"ttft_s": 0}}}},
            "policies.slo_by_priority.low.ttft_s must be in (0, 600], got 0",
        ),
        (
            {"policies": {"error_budget": 0.1}},  # a fast burn of 14.4 x 10 % could never happen
            "policies.error_budget must be in (0, 0.069), got 0.1",
        ),
    ],
)
def test_bad_values_name_field_range_and_value(data: dict[str, object], message: str) -> None:
    with pytest.raises(config.ConfigError) as info:
        config.build(data)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_an_unknown_setting_like_no_known_one_gets_no_suggestion() -> None:
    with pytest.raises(config.ConfigError) as info:
        config.build({"gate": {"zzzz": 1}})
    assert str(info.value) == "gate.zzzz is not a known setting"


def test_environment_overrides_come_from_the_mapping_passed_in() -> None:
    cfg = config.build({"agent": {"interval_s": 1}}, {"SERVEPILOT_AGENT__INTERVAL_S": "2.5", "OTHER": "x"})
    assert cfg.agent.interval_s == 2.5


def test_environment_override_is_validated_like_the_file_and_named() -> None:
    """A typo in a pod's env: is not in the config file the operator would search for it."""
    with pytest.raises(config.ConfigError) as info:
        config.build({}, {"SERVEPILOT_AGENT__INTERVAL_S": "0"})
    assert str(info.value) == (
        "agent.interval_s (from SERVEPILOT_AGENT__INTERVAL_S) must be in [0.05, 60], got 0"
    )
    with pytest.raises(config.ConfigError) as info:
        config.build({"agent": {"interval_s": 1}}, {"SERVEPILOT_AGENT__INTERVALS": "2"})
    assert str(info.value) == (
        "agent.intervals (from SERVEPILOT_AGENT__INTERVALS) is not a known setting "
        "(did you mean agent.interval_s?)"
    )
    with pytest.raises(config.ConfigError) as info:
        config.build({}, {"SERVEPILOT_AGNET__INTERVAL_S": "2"})
    assert str(info.value) == (
        "agnet (from SERVEPILOT_AGNET__INTERVAL_S) is not a known setting (did you mean agent?)"
    )
    with pytest.raises(config.ConfigError) as info:  # the file's own mistake is the file's
        config.build({"agent": {"intervall_s": 1}}, {"SERVEPILOT_AGENT__INTERVAL_S": "2"})
    assert str(info.value).startswith("agent.intervall_s is not a known setting")


def test_malformed_environment_key_is_an_error() -> None:
    with pytest.raises(config.ConfigError, match="SERVEPILOT_AGENTINTERVAL"):
        config.build({}, {"SERVEPILOT_AGENTINTERVAL": "1"})


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(config.ConfigError, match="mapping"):
        config.load(path)


def test_invalid_yaml_reports_the_line_and_the_parsers_words(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("agent:\n  interval_s: [1\n")
    with pytest.raises(config.ConfigError, match="not valid YAML at line 3, column 1: expected ','"):
        config.load(path)
    path.write_text("agent:\n\tinterval_s: 1\n")  # a tab: YAML indents with spaces only
    with pytest.raises(config.ConfigError) as raised:
        config.load(path)
    assert str(raised.value).endswith(
        "is not valid YAML at line 2, column 1: found character '\\t' that cannot start any token"
    )


def test_validate_config_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("agent:\n  interval_s: 0\n")
    assert main(["validate-config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "servepilot validate-config: agent.interval_s must be in [0.05, 60], got 0"


def test_validate_config_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate-config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read config" in capsys.readouterr().err


def test_validate_config_prints_effective_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate-config", "--json", str(EXAMPLES[0])]) == 0
    assert '"interval_s"' in capsys.readouterr().out


def test_validate_config_json_never_prints_an_api_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "api-keys.yaml"
    keys.write_text("sk-from-file-0123456789: batch\n")
    path = tmp_path / "servepilot.yaml"
    path.write_text(f"gate: {{api_keys: {{sk-inline-0123456789: chat}}, api_keys_file: '{keys}'}}\n")
    assert main(["validate-config", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["gate"]["api_keys"] == "<2 keys>" and "sk-" not in out


def test_api_keys_file_is_merged_and_every_problem_names_the_file_never_a_key(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys.yaml"
    keys.write_text("sk-from-file-0123456789: batch\n")
    gate = {"api_keys": {"sk-inline-0123456789": "chat"}, "api_keys_file": str(keys)}
    cfg = config.build({"gate": gate})
    assert cfg.gate.api_keys == {"sk-inline-0123456789": "chat", "sk-from-file-0123456789": "batch"}
    assert config.build(
        {"gate": {**gate, "api_keys": {"sk-from-file-0123456789": "batch"}}}
    )  # same line: fine
    keys.write_text("")
    assert config.build({"gate": gate}).gate.api_keys == {"sk-inline-0123456789": "chat"}  # all revoked
    problems = {
        "sk-from-file-0123456789: chat\n": "1 of its keys also in api_keys for another business line",
        "[sk-from-file-0123456789]\n": "must be a mapping of API key -> business line",
        "sk-from-file-0123456789: ''\n": "must be a mapping of API key -> business line",
        "sk-from-file-0123456789: [\n": "is not valid YAML",
    }
    for text, expected in problems.items():
        keys.write_text(text)
        inline = {"sk-from-file-0123456789": "batch"} if "chat" in text else {}
        with pytest.raises(config.ConfigError) as raised:
            config.build({"gate": {"api_keys": inline, "api_keys_file": str(keys)}})
        assert str(raised.value).startswith(f"gate.api_keys_file {str(keys)!r}: {expected}")
        assert "sk-" not in str(raised.value).replace(str(keys), "")


def test_demo_example_matches_what_the_demo_runs() -> None:
    from agent.commands.demo import demo_config

    example = config.load(next(p for p in EXAMPLES if p.name == "demo.yaml"), {})
    assert example == config.build(demo_config(9400, 8000))


def test_reference_shows_factory_defaults_as_yaml_reads_them() -> None:
    reference = config.reference_markdown()
    assert "PydanticUndefined" not in reference
    assert '| `gate.split` | `{"primary": 1.0}` |' in reference
    assert "| `gate.api_keys` | `{}` |" in reference


def test_a_class_slo_fills_an_unset_target_from_the_policies_own() -> None:
    cfg = config.build(
        {"policies": {"ttft_slo_s": 2.0, "itl_slo_s": 0.1, "slo_by_priority": {"low": {"ttft_s": 30}}}}
    )
    assert config.priority_targets(cfg.policies) == {"low": (30.0, 0.1)}
    assert config.priority_targets(config.build({}).policies) == {}


def test_an_unquoted_off_in_yaml_means_off_in_a_file_and_an_environment_override(tmp_path: Path) -> None:
    # YAML 1.1 reads `off` as false; both choice fields that offer "off" were refused with "got False"
    path = tmp_path / "sidecar.yaml"
    path.write_text("nvml:\n  backend: off\nactuators:\n  gpu: off\n", encoding="utf-8")
    cfg = config.load(path, {})
    assert (cfg.nvml.backend, cfg.actuators.gpu) == ("off", "off")
    path.write_text("nvml:\n  backend: simulated\n", encoding="utf-8")
    assert config.load(path, {"SERVEPILOT_NVML__BACKEND": "off"}).nvml.backend == "off"


def test_a_yaml_boolean_in_a_choice_field_is_refused_with_the_quoting_hint(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text("nvml:\n  backend: on\n", encoding="utf-8")  # true, not a choice; not taken as "nvml"
    with pytest.raises(config.ConfigError) as caught:
        config.load(path, {})
    assert str(caught.value) == (
        "nvml.backend must be one of 'nvml', 'simulated' or 'off', got True "
        "(YAML reads an unquoted on/off/yes/no as a boolean: quote the word)"
    )


def test_a_server_behind_a_path_prefix_is_a_base_url() -> None:
    """Only the OpenAI API base (``.../v1``) is refused: an engine behind an ingress's prefix is fine."""
    cfg = config.build(
        {"engine": {"url": "http://gw/llm/"}, "gate": {"upstreams": {"primary": "http://gw/v1x"}}}
    )
    assert cfg.engine.url == "http://gw/llm" and cfg.gate.upstreams["primary"] == "http://gw/v1x"
