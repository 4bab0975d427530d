"""``control``, ``actuators``, ``audit`` and ``webhooks``: what servepilot may change, how it is recorded
and whom it tells."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from agent.config.base import GpuIndices, HttpUrl, OffMeansOff, Section, ServerUrl


class ControlConfig(Section):
    """The engine control client (DESIGN.md section 4). Off unless configured."""

    enabled: bool = Field(False, description="use the engine's runtime control endpoints")
    url: ServerUrl = Field("http://127.0.0.1:8000", description="engine base URL: the server's, without /v1")
    adapter: Literal["auto", "generic", "sglang", "vllm"] = Field("auto", description="API flavour")
    lease_s: float = Field(30.0, ge=1, le=3600, description="the engine reverts to defaults after this")
    release_on_stop: bool = Field(
        True, description="a clean stop ends the lease at once (else the engine reverts when it lapses)"
    )
    timeout_s: float = Field(2.0, gt=0, le=60, description="HTTP timeout of one control call")
    token_file: str | None = Field(None, description="bearer token for the engine's control API (file)")


class ActuatorConfig(Section):
    """What servepilot may change. ``mode: observe`` (the default) changes nothing."""

    mode: Literal["observe", "advise", "act"] = Field("observe", description="observe, advise or act")
    gpu: Annotated[Literal["off", "power_limit", "locked_clocks"], OffMeansOff] = Field(
        "off", description="GPU knob to drive"
    )
    gpu_backend: Literal["nvml", "simulated"] = Field("nvml", description="real NVML or a simulated GPU")
    gpu_state_file: str | None = Field(None, description="simulated GPU state file (tests, demos)")
    gpu_lease_s: float = Field(60.0, ge=1, le=3600, description="restore GPU defaults when not renewed")
    gpus: GpuIndices = Field(
        (),
        description="GPU indices to drive; empty = the one GPU the container sees, or, when it sees several, "
        "the engine's as the probe names them (every one, with a warning, without the probe)",
    )
    admin_token_file: str | None = Field(None, description="bearer token file for the override routes")


class AuditConfig(Section):
    """The JSONL audit log of every action, taken or advised."""

    path: str | None = Field("servepilot-audit.jsonl", description="audit file; null keeps memory only")
    max_bytes: int = Field(10 << 20, ge=4096, le=1 << 34, description="rotate the file past this size")
    backups: int = Field(3, ge=0, le=100, description="rotated files kept")
    recent: int = Field(500, ge=1, le=100_000, description="actions kept in memory for /api/actions")


class WebhookConfig(Section):
    """Alert webhooks from the agent: Alertmanager v2 and a signed generic JSON webhook. Off by default."""

    enabled: bool = Field(False, description="send findings and source outages as alerts")
    alertmanager_url: HttpUrl | None = Field(None, description="Alertmanager base URL (POST /api/v2/alerts)")
    generic_url: HttpUrl | None = Field(
        None, description="generic JSON webhook URL, signed (Standard Webhooks)"
    )
    secret_file: str | None = Field(
        None,
        description="file holding the signing secret (whsec_<base64>); several, space-separated, sign with "
        "each (rotation); re-read at every reload and watched with agent.config_watch_s",
    )
    tls_ca_file: str | None = Field(
        None, description="PEM CA certificates to verify https receivers with, besides the system's"
    )
    tls_cert_file: str | None = Field(
        None, description="PEM client certificate for receivers that ask for one (mutual TLS)"
    )
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file")
    queue_path: str = Field("servepilot-webhooks.sqlite", description="on-disk outbox (survives restarts)")
    timeout_s: float = Field(5.0, gt=0, le=120, description="HTTP timeout of one delivery attempt")
    backoff_base_s: float = Field(1.0, gt=0, le=600, description="first retry delay (doubles per attempt)")
    backoff_max_s: float = Field(60.0, gt=0, le=3600, description="longest retry delay")
    max_age_s: float = Field(86400.0, ge=60, le=30 * 86400, description="undelivered messages expire after")
    max_pending: int = Field(10_000, ge=10, le=10_000_000, description="queued messages kept per sink")
    resend_s: float = Field(
        60.0, ge=1, le=3600, description="re-post firing alerts to Alertmanager this often"
    )
    min_severity: Literal["info", "warning", "critical"] = Field("warning", description="findings sent")
    source_down_after_s: float = Field(30.0, ge=0, le=3600, description="a failing source alerts after")
    resolve_after_s: float = Field(
        60.0,
        ge=0,
        le=3600,
        description="an alert resolves after its condition is gone this long (flap damping)",
    )
    group_by: tuple[str, ...] = Field(("alertname",), description="labels grouping generic messages")
    labels: dict[str, str] = Field(default_factory=dict, description="labels added to every alert")
    generator_url: str = Field("", description="link back to the agent in each alert")

    @model_validator(mode="after")
    def _generic_needs_a_secret(self) -> WebhookConfig:
        if self.enabled and self.generic_url and not self.secret_file:
            raise ValueError("secret_file is required when generic_url is set (messages are signed)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be set together")
        return self
