"""``engine``, ``nvml`` and ``probe``: where the sidecar reads the engine and the GPUs from."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from agent.config.base import GpuIndices, OffMeansOff, Section, ServerUrl


class EngineConfig(Section):
    """The inference engine's Prometheus endpoint."""

    kind: Literal["auto", "vllm", "sglang", "llamacpp", "tgi"] = Field(
        "auto", description="metric-name table to use; auto detects from the scrape"
    )
    url: ServerUrl = Field("http://127.0.0.1:8000", description="engine base URL: the server's, without /v1")
    metrics_path: str = Field("/metrics", description="path of the Prometheus endpoint")
    timeout_s: float = Field(2.0, gt=0, le=60, description="HTTP timeout of one scrape")
    quantile_window_s: float = Field(
        60.0,
        ge=1,
        le=3600,
        description="window of histogram quantiles and window means; older scrape baselines count as stale",
    )
    tls_ca_file: str | None = Field(
        None,
        description="PEM CA certificates to verify an https engine with, besides the system's (its /metrics, "
        "/slots and control API)",
    )
    tls_cert_file: str | None = Field(
        None, description="PEM client certificate for an engine that asks for one (vLLM's --ssl-cert-reqs 2)"
    )
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file")

    @field_validator("metrics_path")
    @classmethod
    def _absolute_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with /")
        return value

    @model_validator(mode="after")
    def _client_certificate_whole(self) -> EngineConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be set together")
        return self


class NvmlConfig(Section):
    """GPU telemetry. ``backend`` is chosen explicitly: there is no silent fallback to a fake."""

    backend: Annotated[Literal["nvml", "simulated", "off"], OffMeansOff] = Field(
        "nvml", description="real NVML, simulator, or off"
    )
    sample_interval_s: float = Field(0.1, ge=0.01, le=10, description="NVML sampling period")
    process_interval_s: float = Field(
        1.0, ge=1.0, le=60, description="per-process memory period (>= 1 s: takes the driver lock)"
    )
    energy_interval_s: float = Field(
        1.0, ge=0.1, le=60, description="energy counter and power limit period (the counter is slow to read)"
    )
    simulated_url: ServerUrl = Field("http://127.0.0.1:8000", description="simulator serving simulated NVML")
    simulated_timeout_s: float = Field(0.5, gt=0, le=10, description="HTTP timeout of one simulated read")
    gpus: GpuIndices = Field(
        (), description="GPU indices to watch; empty = all, or the engine's once the probe names them"
    )


class ProbeConfig(Section):
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
