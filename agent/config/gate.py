"""``gate``: the admission gate, its business lines and its API keys (docs/gate.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, field_validator, model_validator

from agent.config.base import Port, Section, ServerUrl


class GateLineConfig(Section):
    """Admission limits of one business line (a tenant, product or API-key group)."""

    requests_per_min: float = Field(1000.0, gt=0, le=1e7, description="token-bucket refill rate")
    burst_ratio: float = Field(
        2.0, ge=1, le=100, description="bucket size as a multiple of one minute's rate"
    )
    tokens_per_min: float | None = Field(
        None,
        gt=0,
        description="optional prompt+output token budget: a request reserves its estimate (prompt + "
        "max_tokens per sequence) and pays what its answer used",
    )
    priority: Literal["high", "normal", "low"] = Field("normal", description="class when no header says")
    max_priority: Literal["high", "normal", "low"] = Field(
        "high",
        description="the highest class its requests may ask for in the priority header (a higher one is "
        "served as this): a tenant's line at normal cannot take the high class's reserve",
    )
    max_in_flight_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="most of the gate's in-flight limit this line may hold (queued or at the engine); its "
        "other requests wait in the line's own queue, so one tenant cannot fill the engine; null = no cap",
    )

    @model_validator(mode="after")
    def _priority_within_its_cap(self) -> GateLineConfig:
        order = ("low", "normal", "high")
        if order.index(self.priority) > order.index(self.max_priority):
            raise ValueError(f"priority {self.priority!r} is above max_priority {self.max_priority!r}")
        return self


#: An engine's own priority order as a preset: the value of the request body's ``priority`` for each of
#: the gate's classes. vLLM (``--scheduling-policy priority``) serves lower values first; SGLang
#: (``--enable-priority-scheduling``) higher ones, unless started with
#: ``--schedule-low-priority-values-first``, when the ``vllm`` order is its order too. Normal is 0, the
#: engines' default, so a request the gate sends without a class is ranked as normal.
PRIORITY_PRESETS: dict[str, dict[str, int]] = {
    "vllm": {"high": -1, "normal": 0, "low": 1},
    "sglang": {"high": 1, "normal": 0, "low": -1},
}
_INT64 = 2**63


class EnginePriorityValues(Section):
    """The ``priority`` value an engine is sent for each of the gate's classes (an engine not preset)."""

    high: int = Field(ge=-_INT64, lt=_INT64, description="value for a request admitted as high")
    normal: int = Field(ge=-_INT64, lt=_INT64, description="value for a request admitted as normal")
    low: int = Field(ge=-_INT64, lt=_INT64, description="value for a request admitted as low")


class GateConfig(Section):
    """The admission gate: a reverse proxy in front of the engine's OpenAI API. Off unless configured."""

    enabled: bool = Field(False, description="run the admission gate")
    listen_host: str = Field(
        "127.0.0.1", description="gate address (0.0.0.0 when the pod's service points at it)"
    )
    listen_port: Port = Field(8080, description="gate port")
    upstreams: dict[str, ServerUrl] = Field(
        default_factory=lambda: {"primary": "http://127.0.0.1:8000"},
        description="upstream name -> base URL (the server's, without /v1)",
    )
    split: dict[str, float] = Field(
        default_factory=lambda: {"primary": 1.0}, description="initial traffic share per upstream"
    )
    upstream_tls_ca_file: str | None = Field(
        None, description="PEM CA certificates to verify https upstreams with, besides the system's"
    )
    upstream_tls_cert_file: str | None = Field(
        None, description="PEM client certificate for upstreams that ask for one (mutual TLS)"
    )
    upstream_tls_key_file: str | None = Field(None, description="PEM private key of upstream_tls_cert_file")
    upstream_models: dict[str, str] = Field(
        default_factory=dict,
        description="upstream name -> model name sent to it, for one serving another model (e.g. small)",
    )
    engine_priority: dict[str, EnginePriorityValues] = Field(
        default_factory=dict,
        description="upstream name -> the engine's own priority order (vllm, sglang, or a map of high, "
        "normal and low to values): each request sent there carries its class as admitted in the body's "
        "priority field, so the engine's queue and its preemption rank it too; only for an engine running "
        "priority scheduling (docs/gate.md)",
    )
    max_in_flight: int = Field(
        64,
        ge=1,
        le=65536,
        description="effective batch: sequences sent upstream at once (a request for n takes n)",
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
    require_api_key: bool = Field(
        False,
        description="answer 401 to a request without one of api_keys as its Authorization: Bearer key, on "
        "every path: the gate is the clients' door; off, a request without a known key goes to its "
        "line_header's line or default_line",
    )
    upstream_api_key_file: str | None = Field(
        None,
        description="file holding the key the upstreams want (the engine's --api-key): sent to them as "
        "Authorization: Bearer in place of the client's, by the gate, servepilot check and the canary; "
        "read at start",
    )
    default_line: str = Field("default", description="line of requests that name none (or an unknown one)")
    lines: dict[str, GateLineConfig] = Field(default_factory=dict, description="per-line limits")
    default_requests_per_min: float = Field(1000.0, gt=0, le=1e7, description="rate of lines not listed")
    peers_dns: str = Field(
        "",
        max_length=253,
        pattern=r"^([A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)?$",
        description="a headless Service's name resolving to every gate of the deployment (one address per "
        "ready pod): the lines' rates and bursts are then the deployment's, each of N gates enforcing 1/N "
        "of them; empty: each gate's own (N replicas let a line through at N times its rate)",
    )
    peers_refresh_s: float = Field(
        15.0,
        ge=1,
        le=3600,
        description="how often peers_dns is looked up again (a failed lookup keeps the last count)",
    )
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
    shutdown_delay_s: float = Field(
        0.0,
        ge=0,
        le=300,
        description="on shutdown, new requests are still accepted this long (readiness 503 'draining') "
        "before the listener closes: the seconds a Kubernetes Service takes to stop sending the pod new "
        "connections, which would be refused otherwise (the manifests set 5)",
    )
    drain_s: float = Field(
        10.0,
        ge=0.1,
        le=3600,
        description="on shutdown, once the listener closes, in-flight requests get this long to finish",
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
    access_log: str | None = Field(
        None,
        description="one JSON line per request (arrival, path, status, line, priority, upstream, outcome, "
        "queue wait, TTFT, tokens): stdout, or a file path; none when unset",
    )
    access_log_max_mb: float = Field(
        100.0, gt=0, le=1 << 20, description="the access log file is rotated at this size"
    )
    access_log_backups: int = Field(5, ge=0, le=1000, description="rotated access log files kept")
    rate_limit_headers: bool = Field(
        True,
        description="answer with OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} headers of "
        "the request's business line, for clients that pace themselves by them",
    )
    stream_usage: bool = Field(
        True,
        description="ask the engine for a completion or chat stream's usage (stream_options.include_usage) "
        "where the client did not, for exact token counts, and take that event out of the client's answer",
    )
    request_ids: bool = Field(
        True,
        description="give a request without an X-Request-Id one: sent to the engine (vLLM names the request "
        "by it in its log), returned to the client and written in the access log",
    )
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
        return value

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
    def _no_upstream_is_the_gate(self) -> GateConfig:
        """An upstream at the gate's own port on this host sends every request back to the gate (the
        engine's port and the gate's mixed up: 8080 for 8000). The gate answers such a loop 508 at its
        first return (agent/gate/forward.py); here it is the one line that names the field."""
        local = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", self.listen_host}
        for name, url in self.upstreams.items():
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            if parts.hostname in local and port == self.listen_port:
                raise ValueError(
                    f"upstreams.{name} is the gate's own address (port {self.listen_port}): every request "
                    "would come back to the gate; the engine listens elsewhere (vLLM 8000, SGLang 30000)"
                )
        return self

    @model_validator(mode="after")
    def _keys_for_require_api_key(self) -> GateConfig:
        if self.require_api_key and not self.api_keys and self.api_keys_file is None:
            # (an api_keys_file with no keys in it is allowed: every key revoked, everyone refused)
            raise ValueError("require_api_key needs api_keys or api_keys_file: no client could pass")
        return self

    @model_validator(mode="after")
    def _upstream_client_certificate_whole(self) -> GateConfig:
        if (self.upstream_tls_cert_file is None) != (self.upstream_tls_key_file is None):
            raise ValueError("upstream_tls_cert_file and upstream_tls_key_file must be set together")
        return self

    @model_validator(mode="after")
    def _engine_priority_known(self) -> GateConfig:
        for name in self.engine_priority:
            if name not in self.upstreams:
                known = ", ".join(self.upstreams)
                raise ValueError(f"engine_priority names {name!r}, not one of the upstreams ({known})")
        return self

    @field_validator("engine_priority", mode="before")
    @classmethod
    def _priority_presets(cls, value: Any) -> Any:
        """A preset's name stands for its values (:data:`PRIORITY_PRESETS`)."""
        if not isinstance(value, Mapping):
            return value  # the field's own check says what is wrong with it
        out = {}
        for name, order in value.items():
            if isinstance(order, str):
                if order not in PRIORITY_PRESETS:
                    presets = " or ".join(PRIORITY_PRESETS)
                    raise ValueError(
                        f"entry {name!r} must be {presets}, or a map of high, normal and low to values"
                    )
                order = PRIORITY_PRESETS[order]
            out[name] = order
        return out

    def priority_value(self, upstream: str, priority: str) -> int | None:
        """The body's ``priority`` for a request of class ``priority`` sent to ``upstream``; None when
        that upstream is not sent one (``engine_priority``)."""
        values = self.engine_priority.get(upstream)
        return None if values is None else int(getattr(values, priority))

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
