"""One frozen, typed, validated configuration object, built once at start-up.

Loaded from YAML, with overrides from an environment *passed in as a mapping* (never read from
``os.environ`` here): ``SERVEPILOT_AGENT__INTERVAL_S=2`` sets ``agent.interval_s``. Validation is
pydantic's; :class:`ConfigError` turns its first error into one line that names the field, the allowed
range and the value, e.g. ``agent.interval_s must be in [0.05, 60], got 0``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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


class EngineConfig(_Section):
    """The inference engine's Prometheus endpoint."""

    kind: Literal["auto", "vllm", "sglang", "llamacpp", "tgi"] = Field(
        "auto", description="metric-name table to use; auto detects from the scrape"
    )
    url: str = Field("http://127.0.0.1:8000", description="engine base URL")
    metrics_path: str = Field("/metrics", description="path of the Prometheus endpoint")
    timeout_s: float = Field(2.0, gt=0, le=60, description="HTTP timeout of one scrape")
    quantile_window_s: float = Field(60.0, ge=1, le=3600, description="window of histogram quantiles")

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")


class NvmlConfig(_Section):
    """GPU telemetry. ``backend`` is chosen explicitly: there is no silent fallback to a fake."""

    backend: Literal["nvml", "simulated", "off"] = Field("nvml", description="real NVML, simulator, or off")
    sample_interval_s: float = Field(0.1, ge=0.01, le=10, description="NVML sampling period")
    process_interval_s: float = Field(
        1.0, ge=1.0, le=60, description="per-process memory period (>= 1 s: takes the driver lock)"
    )
    simulated_url: str = Field("http://127.0.0.1:8000", description="simulator serving simulated NVML")
    gpus: tuple[int, ...] = Field((), description="GPU indices to watch; empty = all")


class ProbeConfig(_Section):
    """The allocator probe loaded inside the engine process."""

    enabled: bool = Field(True, description="scrape the allocator probe")
    url: str = Field("http://127.0.0.1:9401/metrics", description="probe endpoint")
    timeout_s: float = Field(1.0, gt=0, le=60, description="HTTP timeout of one probe scrape")


class Config(_Section):
    """The whole configuration. Every field has a default that is safe on a GPU node."""

    agent: AgentConfig = AgentConfig()
    engine: EngineConfig = EngineConfig()
    nvml: NvmlConfig = NvmlConfig()
    probe: ProbeConfig = ProbeConfig()


class ConfigError(ValueError):
    """A configuration problem, as one line that names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}" if field else message)
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
    except OSError as error:
        raise ConfigError("", f"cannot read config {str(path)!r}: {error.strerror or error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError("", f"config {str(path)!r} is not valid YAML{where}") from None
    return build(data, environ)
