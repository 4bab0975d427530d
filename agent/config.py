"""One frozen, typed, validated configuration object, built once at start-up.

Loaded from YAML, with overrides from an environment *passed in as a mapping* (never read from
``os.environ`` here): ``SERVEPILOT_AGENT__INTERVAL_S=2`` sets ``agent.interval_s``. Validation is
pydantic's; :class:`ConfigError` turns its first error into one line that names the field, the allowed
range and the value, e.g. ``agent.interval_s must be in [0.05, 60], got 0``.
"""

from __future__ import annotations

import json
import math
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.eventloop import EventLoopChoice

ENV_PREFIX = "SERVEPILOT_"


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Port = Annotated[int, Field(ge=1, le=65535)]


class AgentConfig(_Section):
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
        if self.admin_listen_port is None and not _is_loopback(self.listen_host):
            raise ValueError(
                "admin_listen_port must be set when listen_host is not loopback (admin stays off the pod IP)"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be set together")
        if 0 < self.engine_restart_stall_s < MIN_ENGINE_RESTART_STALL_S:
            raise ValueError(
                f"engine_restart_stall_s must be 0 (never) or >= {MIN_ENGINE_RESTART_STALL_S:g} s, got "
                f"{self.engine_restart_stall_s:g} (a restart reloads the weights)"
            )
        return self


MIN_ENGINE_RESTART_STALL_S = 300.0
"""The shortest stall ``agent.engine_restart_stall_s`` may restart the engine after (5 minutes)."""


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class EngineConfig(_Section):
    """The inference engine's Prometheus endpoint."""

    kind: Literal["auto", "vllm", "sglang", "llamacpp", "tgi"] = Field(
        "auto", description="metric-name table to use; auto detects from the scrape"
    )
    url: str = Field("http://127.0.0.1:8000", description="engine base URL")
    metrics_path: str = Field("/metrics", description="path of the Prometheus endpoint")
    timeout_s: float = Field(2.0, gt=0, le=60, description="HTTP timeout of one scrape")
    quantile_window_s: float = Field(
        60.0,
        ge=1,
        le=3600,
        description="window of histogram quantiles and window means; older scrape baselines count as stale",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("metrics_path")
    @classmethod
    def _absolute_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with /")
        return value


class NvmlConfig(_Section):
    """GPU telemetry. ``backend`` is chosen explicitly: there is no silent fallback to a fake."""

    backend: Literal["nvml", "simulated", "off"] = Field("nvml", description="real NVML, simulator, or off")
    sample_interval_s: float = Field(0.1, ge=0.01, le=10, description="NVML sampling period")
    process_interval_s: float = Field(
        1.0, ge=1.0, le=60, description="per-process memory period (>= 1 s: takes the driver lock)"
    )
    energy_interval_s: float = Field(
        1.0, ge=0.1, le=60, description="energy counter and power limit period (the counter is slow to read)"
    )
    simulated_url: str = Field("http://127.0.0.1:8000", description="simulator serving simulated NVML")
    simulated_timeout_s: float = Field(0.5, gt=0, le=10, description="HTTP timeout of one simulated read")
    gpus: tuple[int, ...] = Field((), description="GPU indices to watch; empty = all")

    @field_validator("simulated_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("gpus")
    @classmethod
    def _gpu_indices(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(index < 0 for index in value) or len(set(value)) != len(value):
            raise ValueError("must be distinct GPU indices >= 0")
        return value


class ProbeConfig(_Section):
    """The allocator probe loaded inside the engine process."""

    enabled: bool = Field(True, description="scrape the allocator probe")
    url: str = Field("http://127.0.0.1:9401/metrics", description="probe endpoint")
    timeout_s: float = Field(1.0, gt=0, le=60, description="HTTP timeout of one probe scrape")
    ranks: int = Field(
        1, ge=1, le=64, description="probed engine workers (tensor parallel size); rank k is url's port + k"
    )

    @field_validator("url")
    @classmethod
    def _probe_url(cls, value: str) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        return value


def _check_http_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://")
    return value.rstrip("/")


class GateLineConfig(_Section):
    """Admission limits of one business line (a tenant, product or API-key group)."""

    requests_per_min: float = Field(1000.0, gt=0, le=1e7, description="token-bucket refill rate")
    burst_ratio: float = Field(
        2.0, ge=1, le=100, description="bucket size as a multiple of one minute's rate"
    )
    tokens_per_min: float | None = Field(None, gt=0, description="optional prompt+output token budget")
    priority: Literal["high", "normal", "low"] = Field("normal", description="class when no header says")
    max_in_flight_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="most of the gate's in-flight limit this line may hold (queued or at the engine); its "
        "other requests wait in the line's own queue, so one tenant cannot fill the engine; null = no cap",
    )


class GateConfig(_Section):
    """The admission gate: a reverse proxy in front of the engine's OpenAI API. Off unless configured."""

    enabled: bool = Field(False, description="run the admission gate")
    listen_host: str = Field(
        "127.0.0.1", description="gate address (0.0.0.0 when the pod's service points at it)"
    )
    listen_port: Port = Field(8080, description="gate port")
    upstreams: dict[str, str] = Field(
        default_factory=lambda: {"primary": "http://127.0.0.1:8000"}, description="upstream name -> base URL"
    )
    split: dict[str, float] = Field(
        default_factory=lambda: {"primary": 1.0}, description="initial traffic share per upstream"
    )
    upstream_models: dict[str, str] = Field(
        default_factory=dict,
        description="upstream name -> model name sent to it, for one serving another model (e.g. small)",
    )
    max_in_flight: int = Field(
        64, ge=1, le=65536, description="effective batch: requests sent upstream at once"
    )
    queue_size: int = Field(1024, ge=0, le=1_000_000, description="requests that may wait; beyond -> 429")
    max_queue_wait_s: float = Field(
        10.0, gt=0, le=3600, description="longest wait before 503; set it to the TTFT SLO (auto moves it)"
    )
    high_reserved_ratio: float = Field(0.2, ge=0, lt=1, description="share of the limit only high may use")
    aging_s: float = Field(0.2, gt=0, le=60, description="wait after which a request is promoted one class")
    line_header: str = Field("x-servepilot-line", description="header naming the business line")
    priority_header: str = Field("x-servepilot-priority", description="header naming the priority class")
    max_wait_header: str = Field(
        "x-servepilot-max-wait-ms",
        description="header with the client's own queue deadline in ms (the shorter wins; 0: never wait)",
    )
    api_keys: dict[str, str] = Field(default_factory=dict, description="bearer API key -> business line")
    api_keys_file: str | None = Field(
        None,
        description="file of more API keys (a YAML mapping: key -> business line), merged into api_keys; "
        "re-read at every reload and watched with agent.config_watch_s, so keys from a mounted Secret "
        "rotate without a restart",
    )
    default_line: str = Field("default", description="line of requests that name none (or an unknown one)")
    lines: dict[str, GateLineConfig] = Field(default_factory=dict, description="per-line limits")
    default_requests_per_min: float = Field(1000.0, gt=0, le=1e7, description="rate of lines not listed")
    max_body_bytes: int = Field(4 << 20, ge=1024, le=1 << 30, description="larger request bodies get 413")
    connect_timeout_s: float = Field(5.0, gt=0, le=600, description="upstream connect timeout")
    read_timeout_s: float = Field(300.0, gt=0, le=86400, description="longest silence from the upstream")
    eject_stalled_s: float = Field(
        60.0,
        ge=0,
        le=86400,
        description=(
            "an upstream holding streams that sends nothing this long leaves the split, as does this pod's "
            "engine while the engine_stall detector finds it hung (docs/gate.md); 0: off"
        ),
    )
    cut_stalled_streams: bool = Field(
        True,
        description="for an upstream found hung (eject_stalled_s): end its started streams with an "
        "error event, and send the requests it never answered to the next upstream, instead of "
        "waiting read_timeout_s",
    )
    retry_statuses: tuple[int, ...] = Field(
        (502, 503, 504),
        description="an upstream answering one of these statuses (it did not take the request) is not "
        "passed on: the request goes to the next healthy upstream, if there is one and the retry budget "
        "allows; empty: never",
    )
    retry_budget_ratio: float = Field(
        0.2,
        ge=0,
        le=1,
        description="retries at most this share of the requests at upstreams (at least 3 at a time), so a "
        "failing upstream cannot double the load on the others (Envoy's retry budget)",
    )
    drain_s: float = Field(
        10.0, ge=0.1, le=3600, description="on shutdown, in-flight requests get this long to finish"
    )
    admit_paths: tuple[str, ...] = Field(
        (),
        description="more request paths admitted through the queue (a custom or newer engine route), "
        "beside the generation, embedding, pooling, scoring and audio routes of vLLM, SGLang and "
        "llama.cpp (docs/gate.md); any other path is passed straight through",
    )
    health_path: str = Field("/health", description="upstream health-check path")
    health_interval_s: float = Field(5.0, ge=0.1, le=600, description="upstream health-check period")
    length_edges: tuple[int, ...] = Field((256, 1024, 4096), description="prompt-token bucket edges")
    stats_window_s: float = Field(60.0, ge=1, le=3600, description="window of the gate's quantile signals")
    isolation_threshold_tokens: int = Field(
        0, ge=0, le=10_000_000, description="prompts this long (est. tokens) go to the long pool; 0 = off"
    )
    isolation_upstream: str = Field("long", description="upstream name of the long-context pool")
    isolation_max_in_flight: int = Field(8, ge=1, le=65536, description="in-flight limit of the long pool")
    isolation_queue_size: int = Field(256, ge=0, le=1_000_000, description="long-pool queue; beyond -> 429")
    cache_enabled: bool = Field(False, description="serve repeated deterministic requests from a cache")
    cache_max_bytes: int = Field(64 << 20, ge=1024, le=1 << 40, description="in-memory tier size bound")
    cache_max_entry_bytes: int = Field(
        1 << 20, ge=64, le=1 << 30, description="larger responses are not kept"
    )
    cache_ttl_s: float = Field(300.0, gt=0, le=86400 * 30, description="entry lifetime")
    cache_dir: str | None = Field(None, description="directory of the optional on-disk tier; null = none")
    cache_disk_max_bytes: int = Field(1 << 30, ge=1024, le=1 << 44, description="on-disk tier size bound")
    cache_lines: tuple[str, ...] = Field((), description="business lines that may use the cache; empty = all")
    cache_bloom_capacity: int = Field(
        100_000, ge=16, le=1 << 30, description="distinct keys the admission Bloom filter is sized for"
    )
    cache_bloom_error_rate: float = Field(0.01, gt=0, lt=0.5, description="Bloom false-positive target")

    @model_validator(mode="before")
    @classmethod
    def _keys_from_file(cls, data: Any) -> Any:
        """``api_keys_file``'s keys merged into ``api_keys``: one set of keys for the gate, and a change of
        the file is a change of ``api_keys`` to a reload. No message names a key."""
        if not isinstance(data, Mapping) or not data.get("api_keys_file"):
            return data
        path = str(data["api_keys_file"])
        keys = read_api_keys(path)
        inline = data.get("api_keys") or {}
        if not isinstance(inline, Mapping):
            return data  # the field's own check says what is wrong with it
        clash = sum(1 for key, line in keys.items() if key in inline and inline[key] != line)
        if clash:
            raise ValueError(
                f"api_keys_file {path!r}: {clash} of its keys also in api_keys for another business line "
                "(keys are never shown)"
            )
        return {**data, "api_keys": {**inline, **keys}}

    @field_validator("upstreams")
    @classmethod
    def _upstream_urls(cls, value: dict[str, str]) -> dict[str, str]:
        if not value:
            raise ValueError("must name at least one upstream")
        return {name: _check_http_url(url) for name, url in value.items()}

    @model_validator(mode="after")
    def _upstream_models_known(self) -> GateConfig:
        for name, model in self.upstream_models.items():
            if name not in self.upstreams:
                known = ", ".join(self.upstreams)
                raise ValueError(f"upstream_models names {name!r}, not one of the upstreams ({known})")
            if not model.strip():
                raise ValueError(f"upstream_models.{name} must be a model name, got {model!r}")
        return self

    @model_validator(mode="after")
    def _split_known(self) -> GateConfig:
        known = ", ".join(self.upstreams)
        for name in self.split:
            if name not in self.upstreams:
                raise ValueError(f"split names {name!r}, not one of the upstreams ({known})")
        shares = self.split.values()
        if any(not math.isfinite(share) or share < 0 for share in shares) or sum(shares) <= 0:
            raise ValueError(f"split must give shares >= 0 with a total above 0, got {dict(self.split)}")
        return self

    @model_validator(mode="after")
    def _isolation_upstream_known(self) -> GateConfig:
        if self.isolation_threshold_tokens > 0 and self.isolation_upstream not in self.upstreams:
            raise ValueError(
                f"isolation_upstream {self.isolation_upstream!r} is not one of the upstreams "
                f"({', '.join(self.upstreams)})"
            )
        return self

    @field_validator("retry_statuses")
    @classmethod
    def _retry_statuses(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(not 500 <= status <= 599 for status in value):
            raise ValueError(
                f"must be 5xx statuses (a 4xx is the client's, and would fail again), got {value}"
            )
        return tuple(sorted(set(value)))

    @field_validator("admit_paths")
    @classmethod
    def _admit_paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if not path.startswith("/") or any(c in path for c in "?# ") or "*" in path:
                raise ValueError(
                    "each must be a path such as /v1/rerank (starting with /, no query or wildcard)"
                )
        return tuple(dict.fromkeys(value))

    @field_validator("length_edges")
    @classmethod
    def _edges(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or value[0] <= 0 or list(value) != sorted(set(value)):
            raise ValueError("must be positive and strictly increasing")
        return value


def read_api_keys(path: str) -> dict[str, str]:
    """The API keys in ``path``: a YAML (or JSON) mapping of key -> business line. ValueError, in one line
    that names the file and never a key, when it cannot be read or is not such a mapping."""
    where = f"api_keys_file {path!r}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        why = getattr(error, "strerror", None) or type(error).__name__
        raise ValueError(f"{where}: cannot read it: {why}") from None
    try:
        keys = yaml.safe_load(text)
    except yaml.YAMLError:
        raise ValueError(f"{where}: is not valid YAML") from None
    if keys is None:
        return {}  # an empty file: no keys (all revoked)
    if not isinstance(keys, Mapping) or not all(
        isinstance(k, str) and k.strip() and isinstance(v, str) and v.strip() for k, v in keys.items()
    ):
        raise ValueError(f"{where}: must be a mapping of API key -> business line, both non-empty strings")
    return dict(keys)


class ControlConfig(_Section):
    """The engine control client (DESIGN.md section 4). Off unless configured."""

    enabled: bool = Field(False, description="use the engine's runtime control endpoints")
    url: str = Field("http://127.0.0.1:8000", description="engine base URL")
    adapter: Literal["auto", "generic", "sglang", "vllm"] = Field("auto", description="API flavour")
    lease_s: float = Field(30.0, ge=1, le=3600, description="the engine reverts to defaults after this")
    release_on_stop: bool = Field(
        True, description="a clean stop ends the lease at once (else the engine reverts when it lapses)"
    )
    timeout_s: float = Field(2.0, gt=0, le=60, description="HTTP timeout of one control call")
    token_file: str | None = Field(None, description="bearer token for the engine's control API (file)")

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return _check_http_url(value)


class ActuatorConfig(_Section):
    """What servepilot may change. ``mode: observe`` (the default) changes nothing."""

    mode: Literal["observe", "advise", "act"] = Field("observe", description="observe, advise or act")
    gpu: Literal["off", "power_limit", "locked_clocks"] = Field("off", description="GPU knob to drive")
    gpu_backend: Literal["nvml", "simulated"] = Field("nvml", description="real NVML or a simulated GPU")
    gpu_state_file: str | None = Field(None, description="simulated GPU state file (tests, demos)")
    gpu_lease_s: float = Field(60.0, ge=1, le=3600, description="restore GPU defaults when not renewed")
    gpus: tuple[int, ...] = Field((), description="GPU indices to drive; empty = all")
    admin_token_file: str | None = Field(None, description="bearer token file for the override routes")


class AuditConfig(_Section):
    """The JSONL audit log of every action, taken or advised."""

    path: str | None = Field("servepilot-audit.jsonl", description="audit file; null keeps memory only")
    max_bytes: int = Field(10 << 20, ge=4096, le=1 << 34, description="rotate the file past this size")
    backups: int = Field(3, ge=0, le=100, description="rotated files kept")
    recent: int = Field(500, ge=1, le=100_000, description="actions kept in memory for /api/actions")


class WebhookConfig(_Section):
    """Alert webhooks from the agent: Alertmanager v2 and a signed generic JSON webhook. Off by default."""

    enabled: bool = Field(False, description="send findings and source outages as alerts")
    alertmanager_url: str | None = Field(None, description="Alertmanager base URL (POST /api/v2/alerts)")
    generic_url: str | None = Field(None, description="generic JSON webhook URL, signed (Standard Webhooks)")
    secret_file: str | None = Field(
        None,
        description="file holding the signing secret (whsec_<base64>); several, space-separated, sign with "
        "each (rotation); re-read at every reload and watched with agent.config_watch_s",
    )
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

    @field_validator("alertmanager_url", "generic_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return None if value is None else _check_http_url(value)

    @model_validator(mode="after")
    def _generic_needs_a_secret(self) -> WebhookConfig:
        if self.enabled and self.generic_url and not self.secret_file:
            raise ValueError("secret_file is required when generic_url is set (messages are signed)")
        return self


class ForecastConfig(_Section):
    """Traffic forecasting (issue 5): 1-minute request and token rates, forecast 5-60 minutes ahead,
    the model chosen by a rolling-origin backtest, and a replica recommendation. Off by default."""

    enabled: bool = Field(False, description="forecast request and token rates")
    horizons_min: tuple[int, ...] = Field((5, 15, 30, 60), description="published horizons, minutes")
    quantiles: tuple[float, ...] = Field((0.1, 0.5, 0.9), description="published quantiles")
    selection_horizon_min: int = Field(30, ge=1, le=240, description="horizon the backtest selects at")
    models: tuple[str, ...] = Field(
        ("last_value", "seasonal_naive_1d", "holt_winters", "arima", "level_shape", "lstm"),
        description="candidate forecasters (the LSTM is used only once it beats the baselines)",
    )
    refit_interval_s: float = Field(21600.0, ge=60, le=7 * 86400, description="backtest + refit period")
    history_days: float = Field(14.0, ge=1, le=60, description="1-minute history kept for refits")
    backtest_days: float = Field(2.0, ge=0.25, le=14, description="span the selection backtest scores")
    state_path: str | None = Field("servepilot-forecast.json", description="saved state; null: memory only")
    save_interval_s: float = Field(300.0, ge=10, le=86400, description="state is saved this often")
    ttft_slo_s: float = Field(2.0, gt=0, le=600, description="p99 TTFT within which load counts as served")
    replica_quantile: float = Field(0.9, gt=0, lt=1, description="forecast quantile replicas are sized for")
    target_utilization: float = Field(0.8, gt=0, le=1, description="share of learned capacity to plan for")
    min_replicas: int = Field(1, ge=0, le=10_000, description="smallest recommended replica count")
    max_replicas: int = Field(64, ge=1, le=10_000, description="largest recommended replica count")

    @field_validator("horizons_min")
    @classmethod
    def _horizons(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or min(value) < 1 or max(value) > 240:
            raise ValueError("must be minutes in [1, 240]")
        return tuple(sorted(set(value)))

    @field_validator("quantiles")
    @classmethod
    def _quantiles(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not value or any(not 0 < q < 1 for q in value):
            raise ValueError("must be levels in (0, 1)")
        return tuple(sorted(set(value)))


class PolicyConfig(_Section):
    """Which decision rules run, against which latency SLO (actions still follow actuators.mode)."""

    set: Literal["none", "auto", "seed"] = Field(
        "auto",
        description="auto: SLO-aware batch + breaker (+ the gate's queue deadline; + the token budget where "
        "the engine offers it); seed: the published rule; none: observe only",
    )
    ttft_slo_s: float = Field(2.0, gt=0, le=600, description="time-to-first-token target (P99)")
    itl_slo_s: float = Field(0.1, gt=0, le=60, description="inter-token latency target (mean)")
    batch_min: int = Field(8, ge=1, le=65536, description="lowest effective batch the policies may set")
    batch_max: int = Field(512, ge=1, le=65536, description="highest effective batch the policies may set")
    initial_batch: int = Field(64, ge=1, le=65536, description="batch the auto policy starts from")
    energy: bool = Field(
        False,
        description="SLO-gated energy saving: step the GPU knob (actuators.gpu) down while latency has room, "
        "back up at once when it is at risk; needs actuators.gpu, or an engine control API with sm_clock_mhz",
    )
    energy_levels: tuple[float, ...] = Field(
        (),
        description="the energy ladder, high to low, in MHz (locked_clocks) or W (power_limit); empty: 8 "
        "even steps from the GPU's top down to 45% of it",
    )
    schedule: dict[str, Any] | None = Field(
        None,
        description="time of day: {timezone (required), windows: [{days, start, end, mode}], default}; "
        "in a window whose mode is peak the energy ladder stays at the top",
    )
    sleep: bool = Field(
        False,
        description="put the engine to sleep when idle and the upper traffic forecast is low, wake it ahead "
        "of the forecast rise; needs forecast.enabled and an engine control API that offers sleep",
    )
    sleep_below_rps: float = Field(
        0.05, ge=0, le=1e6, description="sleep only while the upper forecast stays below this (requests/s)"
    )
    wake_above_rps: float = Field(
        0.2, gt=0, le=1e6, description="wake when the upper forecast reaches this (requests/s)"
    )
    sleep_min_idle_s: float = Field(
        600.0, ge=0, le=86400, description="continuous idleness (nothing in flight or queued) before sleep"
    )

    @model_validator(mode="after")
    def _ordered(self) -> PolicyConfig:
        if self.batch_min > self.batch_max:
            raise ValueError(f"batch_min must be <= batch_max, got {self.batch_min} > {self.batch_max}")
        if not self.batch_min <= self.initial_batch <= self.batch_max:
            raise ValueError(
                f"initial_batch must lie in [batch_min, batch_max] = [{self.batch_min}, {self.batch_max}],"
                f" got {self.initial_batch}"
            )
        if self.sleep_below_rps >= self.wake_above_rps:
            raise ValueError("sleep_below_rps must be below wake_above_rps (the gap is the hysteresis)")
        return self

    @field_validator("energy_levels")
    @classmethod
    def _ladder(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(not math.isfinite(v) or v <= 0 for v in value) or list(value) != sorted(
            set(value), reverse=True
        ):
            raise ValueError("must be positive and strictly falling (high to low)")
        return value

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            from policies.schedule import Schedule

            Schedule.from_data(value)  # ScheduleError (a ValueError) names the field in one line
        return value


class CanaryConfig(_Section):
    """The precision canary (issue 6): a perplexity gate, then a stepped fp8 rollout. Off by default;
    needs the gate (its split carries the fp8 share), and it starts only through POST /api/admin/canary."""

    enabled: bool = Field(False, description="run the precision canary policy and its perplexity gate")
    validation_file: str | None = Field(
        None, description="validation texts: one per line, or JSONL with a text field"
    )
    primary: str = Field("primary", description="gate upstream serving the reference precision")
    candidate: str = Field("fp8", description="gate upstream serving the fp8 candidate")
    model: str | None = Field(None, description="model name sent to both; null: the first of /v1/models")
    max_ppl_delta: float = Field(0.005, gt=0, lt=1, description="fp8 passes when its PPL rises by less")
    steps: tuple[float, ...] = Field((0.05, 0.25, 0.5, 1.0), description="fp8 traffic shares, in order")
    step_s: float = Field(300.0, ge=0.01, le=86400, description="healthy time before the next step")
    failure_limit: int = Field(2, ge=0, le=1000, description="failed checks tolerated before a rollback")
    gate_timeout_s: float = Field(600.0, ge=1, le=86400, description="no perplexity by then: rollback")
    timeout_s: float = Field(30.0, gt=0, le=600, description="HTTP timeout of one perplexity request")
    concurrency: int = Field(4, ge=1, le=256, description="perplexity requests in flight per upstream")
    retry_s: float = Field(30.0, ge=0.1, le=3600, description="a failed measurement is retried after")

    @field_validator("steps")
    @classmethod
    def _steps(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not value or any(not 0 < s <= 1 for s in value) or list(value) != sorted(set(value)):
            raise ValueError("must be strictly increasing shares in (0, 1]")
        return value


class CostConfig(_Section):
    """Cost and energy per token, from measured throughput and power."""

    price_per_gpu_hour_usd: float | None = Field(
        None, ge=0, le=1000, description="price of one GPU-hour; null: no cost series, energy only"
    )
    window_s: float = Field(300.0, ge=10, le=86400, description="window of the per-token averages")


class Config(_Section):
    """The whole configuration. Every field has a default that is safe on a GPU node."""

    agent: AgentConfig = AgentConfig()
    engine: EngineConfig = EngineConfig()
    nvml: NvmlConfig = NvmlConfig()
    probe: ProbeConfig = ProbeConfig()
    gate: GateConfig = GateConfig()
    control: ControlConfig = ControlConfig()
    actuators: ActuatorConfig = ActuatorConfig()
    audit: AuditConfig = AuditConfig()
    webhooks: WebhookConfig = WebhookConfig()
    forecast: ForecastConfig = ForecastConfig()
    cost: CostConfig = CostConfig()
    policies: PolicyConfig = PolicyConfig()
    canary: CanaryConfig = CanaryConfig()

    @model_validator(mode="after")
    def _energy_wiring(self) -> Config:
        if self.policies.energy and self.actuators.gpu == "off" and not self.control.enabled:
            raise ValueError(
                "policies.energy needs actuators.gpu (locked_clocks or power_limit) to drive, or"
                " control.enabled with an engine control API that offers sm_clock_mhz"
            )
        return self

    @model_validator(mode="after")
    def _sleep_wiring(self) -> Config:
        if not self.policies.sleep:
            return self
        if not self.forecast.enabled:
            raise ValueError("policies.sleep needs forecast.enabled (it sleeps only on a low forecast)")
        if not self.control.enabled:
            raise ValueError(
                "policies.sleep needs control.enabled (sleep and wake go through the engine's API)"
            )
        if self.policies.set == "none":
            raise ValueError("policies.sleep needs a policy set (policies.set auto or seed)")
        return self

    @model_validator(mode="after")
    def _canary_wiring(self) -> Config:
        canary = self.canary
        if not canary.enabled:
            return self
        if not self.gate.enabled:
            raise ValueError("canary.enabled needs gate.enabled (the gate's split carries the fp8 share)")
        if canary.validation_file is None:
            raise ValueError("canary.validation_file is required when the canary is enabled")
        known = ", ".join(self.gate.upstreams)
        for field in ("primary", "candidate"):
            name = getattr(canary, field)
            if name not in self.gate.upstreams:
                raise ValueError(f"canary.{field} {name!r} is not one of gate.upstreams ({known})")
        if canary.primary == canary.candidate:
            raise ValueError("canary.candidate must differ from canary.primary")
        return self


class ConfigError(ValueError):
    """A configuration problem, as one line that names the field."""

    def __init__(self, field: str, message: str) -> None:
        text = f"{field} {message}" if field else message
        # one line, always: a newline smuggled in through a key or a value cannot forge a log line
        super().__init__(text.replace("\r", "\\r").replace("\n", "\\n"))
        self.field = field


def _fmt(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        return str(int(value))
    return repr(value) if isinstance(value, str) else str(value)


def _bounds(loc: tuple[str | int, ...]) -> tuple[str, str] | None:
    """The [lower, upper] bounds declared on the field at ``loc``, for a complete range message."""
    model: Any = Config
    info = None
    for part in loc:
        if get_origin(model) is dict:  # a mapping of sections (gate.lines.<name>): the key names no field
            model, info = get_args(model)[1], None
            continue
        if not isinstance(part, str) or not hasattr(model, "model_fields") or part not in model.model_fields:
            return None
        info = model.model_fields[part]
        model = info.annotation
    if info is None:
        return None
    lo, hi, lo_open, hi_open = "-inf", "inf", False, False
    for meta in info.metadata:
        if isinstance(meta, Ge):
            lo = _fmt(meta.ge)
        elif isinstance(meta, Gt):
            lo, lo_open = _fmt(meta.gt), True
        elif isinstance(meta, Le):
            hi = _fmt(meta.le)
        elif isinstance(meta, Lt):
            hi, hi_open = _fmt(meta.lt), True
    if (lo, hi) == ("-inf", "inf"):
        return None
    return ("(" if lo_open else "[") + lo, hi + (")" if hi_open else "]")


def _describe(error: ValidationError) -> ConfigError:
    first = error.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    field = ".".join(str(p) for p in loc)
    kind, value = first["type"], first.get("input")
    if kind == "extra_forbidden":
        return ConfigError(field, "is not a known setting")
    if kind == "missing":
        return ConfigError(field, "is required")
    if kind in {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}:
        bounds = _bounds(loc)
        if bounds:
            return ConfigError(field, f"must be in {bounds[0]}, {bounds[1]}, got {_fmt(value)}")
    if kind == "literal_error":
        expected = first.get("ctx", {}).get("expected", "")
        return ConfigError(field, f"must be one of {expected}, got {_fmt(value)}")
    message = first["msg"].removeprefix("Value error, ")
    last = str(loc[-1]) if loc else ""
    if last and message.startswith(last + "."):  # a rule that names a part of its field (schedule.timezone)
        name, _, rest = message.partition(" ")
        return ConfigError(".".join([*(str(p) for p in loc[:-1]), name]), rest)
    if len(loc) <= 1 and isinstance(value, Mapping):  # a section-level rule names its field first
        name, _, rest = message.partition(" ")
        return ConfigError(f"{field}.{name}" if field else name, rest)
    return ConfigError(field, f"{message[0].lower()}{message[1:]}, got {_fmt(value)}")


def _parse_env_value(raw: str) -> Any:
    """Environment values are YAML scalars, so ``2``, ``true`` and ``[0, 1]`` get their types."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_env(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Return ``data`` with ``SERVEPILOT_SECTION__FIELD`` overrides from ``environ`` applied."""
    merged: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for key, raw in sorted(environ.items()):
        if not key.startswith(ENV_PREFIX):
            continue
        path = key[len(ENV_PREFIX) :].lower().split("__")
        if len(path) != 2 or not all(path):
            raise ConfigError(key, "must look like SERVEPILOT_<SECTION>__<FIELD>")
        section = merged.setdefault(path[0], {})
        if not isinstance(section, dict):
            raise ConfigError(path[0], "must be a mapping")
        section[path[1]] = _parse_env_value(raw)
    return merged


def build(data: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> Config:
    """Validate a parsed mapping (plus environment overrides) into a :class:`Config`."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError("", f"config must be a YAML mapping at the top level, got {type(data).__name__}")
    merged = apply_env(dict(data), environ or {})
    try:
        return Config.model_validate(merged)
    except ValidationError as error:
        raise _describe(error) from None


def load(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    """Read ``path`` (YAML) and build the config; every problem is a one-line :class:`ConfigError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError("", f"config {str(path)!r} is not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise ConfigError("", f"cannot read config {str(path)!r}: {error.strerror or error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError("", f"config {str(path)!r} is not valid YAML{where}") from None
    return build(data, environ)


def reference_markdown() -> str:
    """The config reference as a Markdown table, generated from the model (the README embeds it). A map
    of named sub-sections (``gate.lines``) is followed by its entries' fields, as ``gate.lines.<name>.x``."""
    rows = ["| setting | default | allowed | meaning |", "|---|---|---|---|"]
    for section_name, section in Config.model_fields.items():
        model = section.annotation
        assert model is not None
        for name, info in model.model_fields.items():
            rows.append(_reference_row(f"{section_name}.{name}", info))
            args = typing.get_args(info.annotation)
            entry = args[1] if typing.get_origin(info.annotation) is dict and len(args) == 2 else None
            if isinstance(entry, type) and issubclass(entry, BaseModel):
                for sub, sub_info in entry.model_fields.items():
                    rows.append(_reference_row(f"{section_name}.{name}.<name>.{sub}", sub_info))
    return "\n".join(rows)


def _reference_row(setting: str, info: Any) -> str:
    default = info.get_default(call_default_factory=True)  # {} rather than PydanticUndefined
    default = list(default) if isinstance(default, tuple) else default
    allowed = []
    for meta in info.metadata:
        for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if hasattr(meta, attr):
                allowed.append(f"{symbol} {_fmt(getattr(meta, attr))}")
    choices = getattr(info.annotation, "__args__", ()) if "Literal" in str(info.annotation) else ()
    if choices:
        allowed.append(" \\| ".join(str(c) for c in choices))
    if isinstance(default, bool):
        default_text = str(default).lower()
    elif isinstance(default, dict):
        default_text = json.dumps(default)  # as YAML reads it
    elif default is None:
        default_text = "null"  # as YAML writes it
    else:
        default_text = str(default)
    meaning = info.description or ""
    return f"| `{setting}` | `{default_text}` | {', '.join(allowed)} | {meaning} |"
