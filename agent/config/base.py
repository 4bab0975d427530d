"""What every config section shares: frozen, unknown keys refused, and the small checks several use."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Port = Annotated[int, Field(ge=1, le=65535)]


def check_http_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://")
    return value.rstrip("/")


HttpUrl = Annotated[str, AfterValidator(check_http_url)]
"""A base URL the sidecar calls: http(s), kept without its trailing slash (paths are appended to it)."""


def check_server_url(value: str) -> str:
    """An engine's (or upstream's) base URL is the server's, not its OpenAI API base: the sidecar adds
    ``/metrics``, ``/health`` and the request's own ``/v1/...`` path. The ``.../v1`` an OpenAI client is
    given, pasted here, scraped ``/v1/metrics`` and sent ``/v1/v1/chat/completions``: 404s all round."""
    if value.lower().endswith("/v1"):
        raise ValueError(
            "must be the server's base URL, without /v1 (the sidecar adds /metrics, /health and the "
            "requests' /v1/... paths to it)"
        )
    return value


ServerUrl = Annotated[str, AfterValidator(check_http_url), AfterValidator(check_server_url)]
"""An engine's or upstream's base URL: :data:`HttpUrl`, and not an OpenAI API base ending in ``/v1``."""


def off_from_false(value: object) -> object:
    """YAML 1.1 reads an unquoted ``off`` as false (PyYAML's ``safe_load`` does, in a file and in an
    environment override alike), so ``backend: off`` reached a choice field as ``False`` and was refused
    as "got False". A field whose choices include ``off`` takes that false as ``off``."""
    return "off" if value is False else value


OffMeansOff = BeforeValidator(off_from_false)
"""For a ``Literal[..., "off", ...]`` field: ``Annotated[Literal[...], OffMeansOff]``."""


def check_gpu_indices(value: tuple[int, ...]) -> tuple[int, ...]:
    if any(index < 0 for index in value) or len(set(value)) != len(value):
        raise ValueError("must be distinct GPU indices >= 0")
    return value


GpuIndices = Annotated[tuple[int, ...], AfterValidator(check_gpu_indices)]
"""NVML indices of GPUs (as this container numbers them); empty means every GPU it sees."""


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
