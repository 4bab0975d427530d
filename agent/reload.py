"""Reloading the config file while the sidecar runs: ``SIGHUP``, ``POST /api/admin/reload``, or on its
own when the file changes (``agent.config_watch_s``).

A restart is not free here: with the gate in the sidecar it takes the pod's data path down, and the
detectors' baselines start over. What operators change while traffic runs is who may send how much
(business lines and their rates, API keys), what the policies aim for (the latency SLO, the batch
bounds, the peak schedule), whether servepilot acts at all (``actuators.mode``: advise for weeks,
then act) and where its alerts go (webhook receivers, their signing secret, severity and labels; a
rotated secret file is re-read). Those fields (:data:`HOT`) are applied in place: the gate's buckets
keep their levels, so a reload hands no line a fresh burst; each policy keeps its state, so a controller
carries on from the batch it stands at rather than from its start value; the webhook outbox and the
firing alerts are kept, so nothing queued is lost and nothing fires twice. Leaving act mode hands back
what servepilot had set (the GPU's defaults, the engine's lease, the gate's configured limit and split),
as a restart would.

A reload is all or nothing, as Prometheus and Alertmanager do it: a file that does not validate, or
that changes any other field (those need a restart), is refused with one line naming the field, and the
running config stays as it was. ``servepilot_config_last_reload_successful`` goes to 0 until a reload
succeeds (the ``ServepilotConfigReloadFailed`` alert), so a ConfigMap edit that did not take is seen,
not assumed. Each applied reload is one audit record (knob ``config``) with the changed fields' old and
new values; API keys and webhook secrets are never written out (keys by count, a secret as redacted).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.audit import Action, AuditLog
from agent.config import ActuatorConfig, Config, ConfigError, GateConfig, PolicyConfig, WebhookConfig, load

log = logging.getLogger(__name__)

#: Fields applied without a restart (a field, or every field under a prefix).
HOT = (
    "gate.lines",
    "gate.default_requests_per_min",
    "gate.api_keys",
    "gate.api_keys_file",
    "gate.require_api_key",  # read per request
    "gate.default_line",
    "gate.line_header",
    "gate.priority_header",
    "gate.max_body_bytes",
    "gate.retry_statuses",  # read per request: the next error answer follows the new rule
    "gate.retry_budget_ratio",
    "gate.admit_paths",  # read per request, like retry_statuses
    "gate.engine_priority",  # read per request: the next request sent carries the new value
    "policies.ttft_slo_s",
    "policies.itl_slo_s",
    "policies.error_budget",  # the breaker's: retuned, its state kept
    "policies.slo_by_priority",
    "policies.itl_steering",
    "policies.served_window_s",
    "policies.batch_min",
    "policies.batch_max",
    "policies.initial_batch",  # where a controller starts: the running one carries on, held to its bounds
    "policies.schedule",
    "actuators.mode",  # leaving act hands back what servepilot set, as a restart would
    # receivers and what they are sent; the outbox and the firing alerts are kept (``enabled`` and
    # ``queue_path`` need a restart: they make or move the outbox)
    "webhooks.alertmanager_url",
    "webhooks.generic_url",
    "webhooks.secret_file",  # and its content: a rotated Secret is re-read (see SECRET_CONTENT)
    "webhooks.timeout_s",
    "webhooks.backoff_base_s",
    "webhooks.backoff_max_s",
    "webhooks.max_age_s",
    "webhooks.max_pending",
    "webhooks.resend_s",
    "webhooks.min_severity",
    "webhooks.source_down_after_s",
    "webhooks.resolve_after_s",
    "webhooks.group_by",
    "webhooks.labels",
    "webhooks.generator_url",
)
#: The change of a secret file's content, reported as a change of this pseudo-field (never its value).
SECRET_CONTENT = "webhooks.secret_file.content"
#: Fields whose values are secrets: a change is reported by count, never by value.
SECRET = ("gate.api_keys", SECRET_CONTENT)
RESULTS = ("applied", "unchanged", "refused", "invalid")


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, Mapping) and prefix not in SECRET:
        for key, inner in value.items():
            _flatten(inner, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value
    return out


def changed_fields(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """Dotted field path -> (old, new) for every leaf that differs (a line added or removed is each of
    its fields; a secret field is one entry)."""
    before = _flatten(old.model_dump(mode="json"), "", {})
    after = _flatten(new.model_dump(mode="json"), "", {})
    missing = object()
    return {
        path: (before.get(path), after.get(path))
        for path in sorted(before.keys() | after.keys())
        if before.get(path, missing) != after.get(path, missing)
    }


def _secret_digest(cfg: Config) -> str | None:
    """A digest of the webhook secret file's content (None without one, or when it cannot be read)."""
    name = cfg.webhooks.secret_file
    if not name:
        return None
    try:
        return hashlib.sha256(Path(name).read_bytes()).hexdigest()
    except OSError:
        return None


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def _touches(changes: Mapping[str, Any], section: str) -> bool:
    return any(_under(path, (section,)) for path in changes)


def needs_restart(changes: Mapping[str, Any]) -> list[str]:
    """The changed fields that a reload cannot apply (outside :data:`HOT`), in order."""
    return [path for path in changes if not _under(path, HOT)]


def shown(path: str, value: Any) -> Any:
    """What a log line or the audit may say about ``value``: a secret's size, not its content."""
    if _under(path, SECRET):
        return f"<{len(value)} keys>" if isinstance(value, Mapping) else "<redacted>"
    return value


@dataclass(frozen=True)
class ReloadResult:
    """``result`` is one of :data:`RESULTS`; ``message`` one line; ``changed``: path -> (old, new), shown."""

    result: str
    message: str
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.result in ("applied", "unchanged")

    def to_json(self) -> dict[str, Any]:
        return {
            "result": self.result,
            "message": self.message,
            "changed": {path: {"from": a, "to": b} for path, (a, b) in self.changed.items()},
        }


class Reloader:
    """Re-reads ``path`` (with the same environment overrides) and applies the :data:`HOT` fields.

    ``apply_gate`` takes the new gate section (None without a gate); ``apply_policies`` the new policies
    section, and raises ValueError, having changed nothing, when a value does not fit a running policy
    (the reload is then refused as invalid, before the gate's part is applied); ``apply_actuators`` the
    new actuators section (the mode); ``prepare_webhooks`` the new webhooks section, raising ValueError
    when a receiver cannot be built (its secret file), and returns what applies it once every other
    check has passed. ``current`` is the config in force; after an applied reload it is
    the new one, so the next reload diffs against what runs. ``read`` turns the file into a config when
    the running one is more than the file (``servepilot gate`` adds its command-line overrides); by
    default the file and the environment overrides alone.
    """

    def __init__(
        self,
        path: str | Path,
        environ: Mapping[str, str],
        current: Config,
        registry: CollectorRegistry,
        audit: AuditLog,
        *,
        apply_gate: Callable[[GateConfig], None] | None = None,
        apply_policies: Callable[[PolicyConfig], None] | None = None,
        apply_actuators: Callable[[ActuatorConfig], None] | None = None,
        prepare_webhooks: Callable[[WebhookConfig], Callable[[], None]] | None = None,
        read: Callable[[Path, Mapping[str, str]], Config] = load,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.environ = dict(environ)
        self.read = read
        self.current = current
        self.audit = audit
        self.apply_gate = apply_gate
        self.apply_policies = apply_policies
        self.apply_actuators = apply_actuators
        self.prepare_webhooks = prepare_webhooks
        self.clock = clock
        self._secret = _secret_digest(current)
        self._successful = Gauge(
            "servepilot_config_last_reload_successful",
            "1 when the last config reload succeeded (or none was tried), 0 when it was refused.",
            registry=registry,
        )
        self._success_at = Gauge(
            "servepilot_config_last_reload_success_timestamp_seconds",
            "When the config in force was loaded (start or the last successful reload).",
            registry=registry,
        )
        self._total = Counter(
            "servepilot_config_reloads", "Config reloads by result.", ["result"], registry=registry
        )
        for result in RESULTS:
            self._total.labels(result)
        self._successful.set(1)
        self._success_at.set(clock())
        self._seen = self._digest()

    def _digest(self) -> str | None:
        """Of the config file and the files whose content is part of the config (``gate.api_keys_file``,
        ``webhooks.secret_file``)."""
        digest = hashlib.sha256()
        files = (self.current.gate.api_keys_file, self.current.webhooks.secret_file)
        for path in (self.path, *(Path(name) for name in files if name)):
            try:
                digest.update(path.read_bytes())
            except OSError:
                digest.update(b"\0unreadable")
            digest.update(b"\0")
        return digest.hexdigest()

    def file_changed(self) -> bool:
        """True when the file's content, or that of the API keys file it names, differs from the last one
        read (start or reload). A Kubernetes ConfigMap or Secret volume swaps the whole file at once, so a
        change is seen whole, never half-written."""
        return self._digest() != self._seen

    def reload(self, trigger: str) -> ReloadResult:
        """Reload now; ``trigger`` (``SIGHUP``, ``admin API``) goes into the log and the audit."""
        result = self._reload(trigger)
        self._total.labels(result.result).inc()
        self._successful.set(1 if result.ok else 0)
        if result.ok:
            self._success_at.set(self.clock())
            log.info("config reload (%s): %s", trigger, result.message)
        else:
            log.error("config reload (%s) refused: %s", trigger, result.message)
        return result

    def _reload(self, trigger: str) -> ReloadResult:
        self._seen = self._digest()  # a refused file is not retried until it changes again
        try:
            new = self.read(self.path, self.environ)
        except ConfigError as error:
            return ReloadResult("invalid", f"{error}; the running config is unchanged")
        changes = changed_fields(self.current, new)
        secret = _secret_digest(new)
        if secret != self._secret and new.webhooks.secret_file == self.current.webhooks.secret_file:
            changes[SECRET_CONTENT] = (self._secret, secret)  # the same file, a new secret in it
        shown_changes = {path: (shown(path, a), shown(path, b)) for path, (a, b) in changes.items()}
        if not changes:
            return ReloadResult("unchanged", f"no change in {self.path}")
        cold = needs_restart(changes)
        if cold:
            more = f" (and {len(cold) - 3} more)" if len(cold) > 3 else ""
            return ReloadResult(
                "refused",
                f"{', '.join(cold[:3])}{more} changed, which needs a restart; nothing was applied "
                f"(applied without one: {', '.join(HOT)})",
                shown_changes,
            )
        commit_webhooks: Callable[[], None] | None = None
        if self.prepare_webhooks is not None and _touches(changes, "webhooks"):
            try:
                commit_webhooks = self.prepare_webhooks(new.webhooks)
            except ValueError as error:
                message = f"the webhooks do not take the new values: {error}; the running config is unchanged"
                return ReloadResult("invalid", message, shown_changes)
        if self.apply_policies is not None and _touches(changes, "policies"):
            try:
                self.apply_policies(new.policies)
            except ValueError as error:
                message = f"the policies do not take the new values: {error}; the running config is unchanged"
                return ReloadResult("invalid", message, shown_changes)
        if self.apply_gate is not None:
            self.apply_gate(new.gate)
        if self.apply_actuators is not None and _touches(changes, "actuators"):
            self.apply_actuators(new.actuators)
        if commit_webhooks is not None:
            commit_webhooks()
        self.current = new
        self._secret = secret
        self._seen = self._digest()  # the keys file it reads now, should the reload have named another
        self.audit.record(
            Action(
                self.clock(),
                "config",
                {path: a for path, (a, _) in shown_changes.items()},
                {path: b for path, (_, b) in shown_changes.items()},
                f"config reloaded from {self.path} ({trigger})",
                "reload",
                new.actuators.mode,
                "ok",
            )
        )
        return ReloadResult(
            "applied", f"{len(changes)} field(s) changed: {', '.join(list(changes)[:5])}", shown_changes
        )
