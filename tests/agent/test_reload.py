"""Config reload (agent/reload.py): the gate's business-line rules change in place, anything else is
refused whole, a bad file changes nothing, and secrets never reach the log, the audit or the answer."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent import config
from agent.audit import AuditLog
from agent.config import ActuatorConfig, AuditConfig, GateConfig, PolicyConfig
from agent.reload import Reloader, changed_fields

BASE = """\
agent: {interval_s: 1}
gate:
  enabled: true
  upstreams: {primary: "http://127.0.0.1:9"}
  lines: {batch: {requests_per_min: 60}}
  api_keys: {sk-old-key-0123456789: batch}
policies: {set: auto, ttft_slo_s: 2.0, itl_slo_s: 0.1, batch_max: 512}
actuators: {mode: advise, gpu: "off"}
"""


class Setup:
    def __init__(self, tmp_path: Path, environ: dict[str, str] | None = None) -> None:
        self.path = tmp_path / "servepilot.yaml"
        self.path.write_text(BASE)
        self.environ = environ or {}
        self.cfg = config.load(self.path, self.environ)
        self.registry = CollectorRegistry()
        self.audit = AuditLog(AuditConfig(path=None), self.registry)
        self.applied: list[GateConfig] = []
        self.retuned: list[PolicyConfig] = []
        self.modes: list[ActuatorConfig] = []
        self.refuse_policies: str | None = None  # a ValueError that apply_policies raises, as a policy would
        self.reloader = Reloader(
            self.path,
            self.environ,
            self.cfg,
            self.registry,
            self.audit,
            apply_gate=self.applied.append,
            apply_policies=self._retune,
            apply_actuators=self.modes.append,
        )

    def _retune(self, policies: PolicyConfig) -> None:
        if self.refuse_policies is not None:
            raise ValueError(self.refuse_policies)
        self.retuned.append(policies)

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def edit(self, old: str, new: str) -> None:
        text = self.path.read_text()
        assert old in text
        self.path.write_text(text.replace(old, new))


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


def test_changed_fields_names_each_leaf_that_differs() -> None:
    old = config.build({"gate": {"lines": {"batch": {"requests_per_min": 60}}}})
    new = config.build(
        {"gate": {"lines": {"batch": {"requests_per_min": 120}, "chat": {"priority": "high"}}}}
    )
    changes = changed_fields(old, new)
    assert changes["gate.lines.batch.requests_per_min"] == (60.0, 120.0)
    assert changes["gate.lines.chat.priority"] == (None, "high")  # a new line: each of its fields
    assert all(path.startswith("gate.lines.") for path in changes)


def test_an_unchanged_file_is_a_successful_no_op(setup: Setup) -> None:
    result = setup.reloader.reload("SIGHUP")
    assert (result.result, result.ok) == ("unchanged", True)
    assert setup.applied == []
    assert setup.metric("servepilot_config_reloads_total", result="unchanged") == 1
    assert setup.metric("servepilot_config_last_reload_successful") == 1


def test_a_line_rate_change_is_applied_to_the_gate_and_audited(setup: Setup) -> None:
    setup.edit("requests_per_min: 60", "requests_per_min: 600")
    result = setup.reloader.reload("SIGHUP")
    assert result.result == "applied", result.message
    assert result.changed == {"gate.lines.batch.requests_per_min": (60.0, 600.0)}
    assert [g.lines["batch"].requests_per_min for g in setup.applied] == [600.0]
    assert setup.reloader.current.gate.lines["batch"].requests_per_min == 600.0
    (action,) = setup.audit.recent()
    assert action["knob"] == "config" and action["policy"] == "reload" and action["result"] == "ok"
    assert action["from"] == {"gate.lines.batch.requests_per_min": 60.0}
    assert action["to"] == {"gate.lines.batch.requests_per_min": 600.0}
    assert "SIGHUP" in action["reason"]
    # the next reload diffs against what now runs
    assert setup.reloader.reload("SIGHUP").result == "unchanged"


def test_a_change_that_needs_a_restart_refuses_the_whole_file(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    setup.edit("requests_per_min: 60", "requests_per_min: 600")
    setup.edit("interval_s: 1", "interval_s: 2")
    with caplog.at_level(logging.ERROR, logger="agent.reload"):
        result = setup.reloader.reload("SIGHUP")
    assert result.result == "refused"
    assert result.message.startswith("agent.interval_s changed, which needs a restart; nothing was applied")
    assert "gate.lines" in result.message  # says what can change without one
    assert setup.applied == [] and setup.reloader.current is setup.cfg  # not even the line's rate
    assert setup.audit.recent() == []
    assert setup.metric("servepilot_config_last_reload_successful") == 0
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
    # put the interval back: the rate change alone now applies, and the gauge recovers
    setup.edit("interval_s: 2", "interval_s: 1")
    assert setup.reloader.reload("SIGHUP").result == "applied"
    assert setup.metric("servepilot_config_last_reload_successful") == 1
    assert setup.metric("servepilot_config_reloads_total", result="refused") == 1
    assert setup.metric("servepilot_config_reloads_total", result="applied") == 1


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("requests_per_min: 60", "requests_per_min: 0", "gate.lines.batch.requests_per_min must be in (0,"),
        ("requests_per_min: 60", "requests_per_min: [", "is not valid YAML at line 5"),
        ("lines:", "linez:", "gate.linez is not a known setting"),
    ],
)
def test_a_bad_file_changes_nothing_and_says_which_field(
    setup: Setup, old: str, new: str, expected: str
) -> None:
    setup.edit(old, new)
    result = setup.reloader.reload("admin API")
    assert result.result == "invalid"
    assert expected in result.message and result.message.endswith("the running config is unchanged")
    assert "\n" not in result.message
    assert setup.applied == [] and setup.reloader.current is setup.cfg
    assert setup.metric("servepilot_config_last_reload_successful") == 0
    assert setup.metric("servepilot_config_reloads_total", result="invalid") == 1


def test_a_missing_file_is_invalid_not_a_crash(setup: Setup) -> None:
    setup.path.unlink()
    result = setup.reloader.reload("SIGHUP")
    assert result.result == "invalid" and "cannot read config" in result.message


def test_api_keys_are_applied_but_never_shown(setup: Setup, caplog: pytest.LogCaptureFixture) -> None:
    setup.edit("{sk-old-key-0123456789: batch}", "{sk-new-key-9876543210: batch, sk-two-key-5555555555: x}")
    with caplog.at_level(logging.INFO, logger="agent.reload"):
        result = setup.reloader.reload("SIGHUP")
    assert result.result == "applied"
    assert setup.applied[0].api_keys == {"sk-new-key-9876543210": "batch", "sk-two-key-5555555555": "x"}
    assert result.changed == {"gate.api_keys": ("<1 keys>", "<2 keys>")}
    said = json.dumps(result.to_json()) + json.dumps(setup.audit.recent()) + caplog.text
    assert "sk-" not in said


def test_environment_overrides_apply_to_the_reloaded_file_too(tmp_path: Path) -> None:
    setup = Setup(tmp_path, {"SERVEPILOT_AGENT__INTERVAL_S": "2"})
    assert setup.cfg.agent.interval_s == 2
    # without the same overrides the file would read interval_s 1: a change that needs a restart
    assert setup.reloader.reload("SIGHUP").result == "unchanged"


def test_file_changed_sees_an_edit_once_and_a_refused_file_is_not_retried(setup: Setup) -> None:
    assert not setup.reloader.file_changed()
    setup.edit("interval_s: 1", "interval_s: 2")
    assert setup.reloader.file_changed()
    assert setup.reloader.reload("file changed").result == "refused"
    assert not setup.reloader.file_changed()  # the same refused content: no reload every check
    setup.edit("interval_s: 2", "interval_s: 1")
    assert setup.reloader.file_changed()
    setup.path.unlink()
    assert setup.reloader.file_changed()  # a file that disappears is a change (reported as invalid)


def test_slo_targets_and_batch_bounds_are_applied_to_the_policies_and_audited(setup: Setup) -> None:
    setup.edit(
        "ttft_slo_s: 2.0, itl_slo_s: 0.1, batch_max: 512", "ttft_slo_s: 1.5, itl_slo_s: 0.1, batch_max: 96"
    )
    result = setup.reloader.reload("SIGHUP")
    assert result.result == "applied", result.message
    assert result.changed == {"policies.batch_max": (512, 96), "policies.ttft_slo_s": (2.0, 1.5)}
    assert [(p.ttft_slo_s, p.batch_max) for p in setup.retuned] == [(1.5, 96)]
    assert setup.applied[0] == setup.cfg.gate  # the gate's part is applied too (unchanged here)
    (action,) = setup.audit.recent()
    assert action["to"] == {"policies.batch_max": 96, "policies.ttft_slo_s": 1.5}


def test_a_gate_only_change_does_not_retune_the_policies(setup: Setup) -> None:
    setup.edit("requests_per_min: 60", "requests_per_min: 600")
    assert setup.reloader.reload("SIGHUP").result == "applied"
    assert setup.retuned == []  # the controllers' parameters are rebuilt only when they changed


def test_a_value_the_running_policies_refuse_applies_nothing(setup: Setup) -> None:
    setup.edit("ttft_slo_s: 2.0", "ttft_slo_s: 1.5")
    setup.edit("requests_per_min: 60", "requests_per_min: 600")
    setup.refuse_policies = "bounds must satisfy 0 < lower <= initial <= upper"
    result = setup.reloader.reload("admin API")
    assert result.result == "invalid"
    assert result.message == (
        "the policies do not take the new values: bounds must satisfy 0 < lower <= initial <= upper; "
        "the running config is unchanged"
    )
    assert setup.applied == [] and setup.reloader.current is setup.cfg  # nor the gate's line rate
    assert setup.audit.recent() == []
    assert setup.metric("servepilot_config_last_reload_successful") == 0


def test_the_policy_set_itself_still_needs_a_restart(setup: Setup) -> None:
    setup.edit("set: auto", "set: seed")
    result = setup.reloader.reload("SIGHUP")
    assert result.result == "refused"
    assert result.message.startswith("policies.set changed, which needs a restart")
    assert setup.retuned == []


def test_keys_rotated_in_their_file_are_applied_and_the_file_is_watched(tmp_path: Path) -> None:
    """A mounted Secret is rotated in place: the keys file changes while the config file does not."""
    keys = tmp_path / "api-keys.yaml"
    keys.write_text("sk-file-old-0123456789: batch\n")
    setup = Setup(tmp_path, {"SERVEPILOT_GATE__API_KEYS_FILE": str(keys)})
    assert setup.cfg.gate.api_keys == {"sk-old-key-0123456789": "batch", "sk-file-old-0123456789": "batch"}
    assert not setup.reloader.file_changed()
    keys.write_text("sk-file-new-9876543210: batch\nsk-file-two-5555555555: chat\n")
    assert setup.reloader.file_changed()
    result = setup.reloader.reload("file changed")
    assert result.result == "applied", result.message
    assert result.changed == {"gate.api_keys": ("<2 keys>", "<3 keys>")}
    assert setup.applied[-1].api_keys == {
        "sk-old-key-0123456789": "batch",
        "sk-file-new-9876543210": "batch",
        "sk-file-two-5555555555": "chat",
    }
    assert not setup.reloader.file_changed()
    assert "sk-" not in json.dumps(result.to_json()) + json.dumps(setup.audit.recent())


def test_a_keys_file_that_cannot_be_read_keeps_the_running_keys(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys.yaml"
    keys.write_text("sk-file-old-0123456789: batch\n")
    setup = Setup(tmp_path, {"SERVEPILOT_GATE__API_KEYS_FILE": str(keys)})
    keys.write_text("- sk-file-new-9876543210\n")  # a list, not key -> line
    result = setup.reloader.reload("file changed")
    assert result.result == "invalid"
    named = "gate.api_keys_file (from SERVEPILOT_GATE__API_KEYS_FILE)"  # the variable set it
    assert result.message.startswith(f"{named} {str(keys)!r}: must be a mapping of API key")
    assert "sk-" not in result.message.replace(str(keys), "")
    assert setup.applied == [] and setup.reloader.current is setup.cfg
    keys.unlink()  # a Secret removed: refused too, the keys in force stay
    assert setup.reloader.reload("file changed").message.startswith(
        f"{named} {str(keys)!r}: cannot read it: No such file or directory"
    )
    assert setup.reloader.current is setup.cfg


def test_the_mode_is_applied_and_the_other_actuator_fields_still_need_a_restart(setup: Setup) -> None:
    setup.edit("mode: advise", "mode: act")
    result = setup.reloader.reload("SIGHUP")
    assert result.result == "applied" and result.changed == {"actuators.mode": ("advise", "act")}
    assert [a.mode for a in setup.modes] == ["act"]
    setup.edit('gpu: "off"', "gpu: power_limit")
    assert setup.reloader.reload("SIGHUP").message.startswith("actuators.gpu changed, which needs a restart")
    assert len(setup.modes) == 1


class WebhookSetup(Setup):
    """The base file with the signed generic webhook on; ``prepare_webhooks`` records what it is given
    and what it applied, and raises what ``refuse_webhooks`` says (as an unreadable secret would)."""

    def __init__(self, tmp_path: Path) -> None:
        self.secret = tmp_path / "webhook-secret"
        self.secret.write_text("whsec_b2xk\n")
        environ = {
            "SERVEPILOT_WEBHOOKS__ENABLED": "true",
            "SERVEPILOT_WEBHOOKS__GENERIC_URL": "http://127.0.0.1:9/hook",
            "SERVEPILOT_WEBHOOKS__SECRET_FILE": str(self.secret),
        }
        self.prepared: list[config.WebhookConfig] = []
        self.committed: list[config.WebhookConfig] = []
        self.refuse_webhooks: str | None = None
        super().__init__(tmp_path, environ)
        self.reloader.prepare_webhooks = self._prepare

    def _prepare(self, webhooks: config.WebhookConfig) -> Callable[[], None]:
        if self.refuse_webhooks is not None:
            raise ValueError(self.refuse_webhooks)
        self.prepared.append(webhooks)
        return lambda: self.committed.append(webhooks)


def test_webhook_receivers_severity_and_labels_are_applied_without_a_restart(tmp_path: Path) -> None:
    setup = WebhookSetup(tmp_path)
    setup.path.write_text(
        BASE + "webhooks: {alertmanager_url: 'http://127.0.0.1:9093', min_severity: critical, "
        "labels: {cluster: eu-2}}\n"
    )
    result = setup.reloader.reload("SIGHUP")
    assert result.result == "applied", result.message
    assert set(result.changed) == {
        "webhooks.alertmanager_url",
        "webhooks.min_severity",
        "webhooks.labels.cluster",
    }
    [applied] = setup.committed
    assert applied.min_severity == "critical" and applied.labels == {"cluster": "eu-2"}
    assert setup.retuned == []  # a webhooks-only change touches nothing else


def test_a_rotated_secret_file_is_seen_applied_and_never_shown(tmp_path: Path) -> None:
    """A mounted Secret changes while the config file does not: the file watch sees it, and the reload
    applies it as a change of the secret file's content, redacted everywhere."""
    setup = WebhookSetup(tmp_path)
    assert not setup.reloader.file_changed()
    setup.secret.write_text("whsec_b2xk whsec_bmV3\n")
    assert setup.reloader.file_changed()
    result = setup.reloader.reload("file changed")
    assert result.result == "applied", result.message
    assert result.changed == {"webhooks.secret_file.content": ("<redacted>", "<redacted>")}
    assert len(setup.committed) == 1
    assert not setup.reloader.file_changed()
    assert setup.reloader.reload("SIGHUP").result == "unchanged"  # rotated once, applied once
    shown = json.dumps(result.to_json()) + json.dumps(setup.audit.recent())
    assert "whsec_" not in shown and "b2xk" not in shown


def test_a_webhook_secret_the_dispatcher_cannot_use_applies_nothing(tmp_path: Path) -> None:
    """The webhooks are checked before anything is applied: a policy change in the same file waits too."""
    setup = WebhookSetup(tmp_path)
    setup.edit("ttft_slo_s: 2.0", "ttft_slo_s: 1.0")
    setup.secret.write_text("")
    setup.refuse_webhooks = "webhooks.secret_file '/s': webhook secret is empty"
    result = setup.reloader.reload("file changed")
    assert result.result == "invalid"
    assert result.message.startswith("the webhooks do not take the new values: webhooks.secret_file")
    assert setup.retuned == [] and setup.committed == [] and setup.reloader.current is setup.cfg
    assert setup.metric("servepilot_config_last_reload_successful") == 0


def test_a_webhook_change_waits_for_the_policies_check(tmp_path: Path) -> None:
    setup = WebhookSetup(tmp_path)
    setup.refuse_policies = "ttft below what the breaker allows"
    setup.path.write_text(
        BASE.replace("ttft_slo_s: 2.0", "ttft_slo_s: 1.0") + "webhooks: {min_severity: critical}\n"
    )
    assert setup.reloader.reload("SIGHUP").result == "invalid"
    assert len(setup.prepared) == 1 and setup.committed == []  # checked, never applied


def test_turning_webhooks_on_or_moving_the_outbox_still_needs_a_restart(setup: Setup) -> None:
    setup.path.write_text(BASE + "webhooks: {enabled: true, alertmanager_url: 'http://127.0.0.1:9093'}\n")
    result = setup.reloader.reload("SIGHUP")
    assert result.result == "refused"
    assert result.message.startswith("webhooks.enabled changed, which needs a restart")
    setup.path.write_text(BASE + "webhooks: {queue_path: /tmp/elsewhere.sqlite}\n")
    assert setup.reloader.reload("SIGHUP").message.startswith("webhooks.queue_path changed")


def test_the_gate_retry_rule_is_applied_without_a_restart(setup: Setup) -> None:
    setup.path.write_text(
        BASE.replace("gate:\n", "gate:\n  retry_statuses: [503]\n  retry_budget_ratio: 0.5\n")
    )
    result = setup.reloader.reload("SIGHUP")
    assert result.result == "applied", result.message
    assert setup.applied[-1].retry_statuses == (503,) and setup.applied[-1].retry_budget_ratio == 0.5


def test_the_engines_priority_order_is_applied_without_a_restart(setup: Setup) -> None:
    """An operator who turns on vLLM's priority scheduling (an engine restart) turns on the gate's side
    of it by a reload: the data path stays up."""
    setup.path.write_text(BASE.replace("gate:\n", "gate:\n  engine_priority: {primary: vllm}\n"))
    result = setup.reloader.reload("SIGHUP")
    assert result.result == "applied", result.message
    assert setup.applied[-1].priority_value("primary", "high") == -1
