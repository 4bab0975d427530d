"""``agent``: the sidecar process itself (its listeners, tick, state and probes)."""

from __future__ import annotations

from pydantic import Field, model_validator

from agent.config.base import Port, Section, is_loopback
from agent.eventloop import EventLoopChoice

MIN_ENGINE_RESTART_STALL_S = 300.0
"""The shortest stall ``agent.engine_restart_stall_s`` may restart the engine after (5 minutes)."""


class AgentConfig(Section):
    """The sidecar process itself."""

    interval_s: float = Field(1.0, ge=0.05, le=60, description="tick interval of the control loop")
    listen_host: str = Field("127.0.0.1", description="address of the agent API and /metrics")
    listen_port: Port = Field(9400, description="port of the agent API and /metrics")
    history_points: int = Field(3600, ge=10, le=1_000_000, description="points kept per series in the store")
    max_series: int = Field(4096, ge=16, le=1_000_000, description="most series the store keeps")
    source_timeout_s: float = Field(
        0.8, ge=0.01, le=60, description="a source slower than this is abandoned for the tick"
    )
    scrape_lead_s: float = Field(
        0.1,
        ge=0,
        le=10,
        description="the engine's /metrics, the probe and llama.cpp's slots are read this long before each "
        "tick (at most half of interval_s), so the tick does not wait for the engine to render and for the "
        "text to be parsed; 0: read inside the tick",
    )
    admin_listen_host: str = Field("127.0.0.1", description="address of the admin/override routes")
    admin_listen_port: Port | None = Field(
        9402, description="admin port; null mounts admin on the API listener (only if that is loopback)"
    )
    tls_cert_file: str | None = Field(None, description="PEM certificate: serve the agent API over TLS")
    tls_key_file: str | None = Field(None, description="PEM private key for tls_cert_file")
    tls_client_ca_file: str | None = Field(
        None,
        description="PEM CA certificates: mutual TLS, the agent API answers only clients with a certificate "
        "they signed (the kubelet's probes /healthz, /readyz, /engine/livez excepted); needs tls_cert_file",
    )
    tls_watch_s: float = Field(
        60.0,
        ge=0,
        le=86400,
        description="re-read the TLS files this often (the API's certificate, key and client CA, and those "
        "of engine.tls_*, gate.upstream_tls_*, webhooks.tls_*) and load new content without a restart (a "
        "renewed Secret); 0: never",
    )
    state_path: str | None = Field(
        None, description="brain state (breaker, detector baselines) kept across restarts; null: off"
    )
    state_save_interval_s: float = Field(60.0, ge=1, le=86400, description="brain state is saved this often")
    config_watch_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description="reload the config file when its content changes, checked this often; 0: only on "
        "SIGHUP or POST /api/admin/reload",
    )
    engine_restart_stall_s: float = Field(
        0.0,
        ge=0,
        le=86400,
        description="/engine/livez answers 503 once the engine has been stalled this long, for the engine "
        "container's liveness probe (a restart); 0: never",
    )
    event_loop: EventLoopChoice = Field(
        "auto",
        description="event loop of run, gate and demo: auto = uvloop where installed (the gate relays in "
        "fewer CPU cycles), else asyncio's; uvloop: required (start-up fails without it)",
    )
    unready_when_engine_stalled: bool = Field(
        True,
        description="/readyz answers 503 while the engine_stall detector finds the engine hung, so the "
        "Service sends new requests to other replicas",
    )

    @model_validator(mode="after")
    def _admin_stays_local(self) -> AgentConfig:
        if self.admin_listen_port is None and not is_loopback(self.listen_host):
            raise ValueError(
                "admin_listen_port must be set when listen_host is not loopback (admin stays off the pod IP)"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be set together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file (mutual TLS is TLS)")
        if 0 < self.engine_restart_stall_s < MIN_ENGINE_RESTART_STALL_S:
            raise ValueError(
                f"engine_restart_stall_s must be 0 (never) or >= {MIN_ENGINE_RESTART_STALL_S:g} s, got "
                f"{self.engine_restart_stall_s:g} (a restart reloads the weights)"
            )
        return self
