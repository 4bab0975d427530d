"""What every control adapter offers, its value types and its errors.

Errors are classified the way the loop needs them (STYLE.md, "Classify errors"): a
:class:`ControlError` with ``temporary=True`` (connection refused, timeout, HTTP 5xx, 429) is retried with
bounded, jittered backoff under the *same* idempotency key; a permanent one (4xx: a value out of bounds,
an unknown knob) is reported and not retried.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

Value = int | float | str | bool


class ControlError(Exception):
    """A failed control call, as one readable line; ``temporary`` says whether retrying can help."""

    def __init__(self, message: str, *, temporary: bool, status: int | None = None) -> None:
        super().__init__(message)
        self.temporary = temporary
        self.status = status


@dataclass(frozen=True)
class KnobSpec:
    """One knob an engine exposes: type and bounds (JSON-schema-like, as the control API publishes)."""

    name: str
    type: str = "number"
    minimum: float | None = None
    maximum: float | None = None
    enum: tuple[Value, ...] = ()

    def coerce(self, value: Value) -> Value:
        """``value`` in this knob's JSON type. Policies speak continuous numbers: sleep_wake proposes 1/0
        for a boolean, and a 50% step or a halving gives 13.5 or 4096.0 for an integer knob, which an
        engine refuses (JSON ``4096.0`` is no integer: the generic API answers 422). Integers round to the
        nearest; anything else is left for :meth:`check` to judge."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return value
        if self.type == "boolean":
            return bool(value)
        if self.type == "integer" and math.isfinite(value):
            return round(value)
        return value

    def check(self, value: Value) -> str | None:
        """Why ``value`` is not acceptable, or None when it is."""
        if self.enum:
            return (
                None if value in self.enum else f"{self.name} must be one of {list(self.enum)}, got {value!r}"
            )
        if self.type == "boolean":
            return None if isinstance(value, bool) else f"{self.name} must be true or false, got {value!r}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{self.name} must be a number, got {value!r}"
        if self.type == "integer" and not float(value).is_integer():
            return f"{self.name} must be an integer, got {value!r}"
        lo = -float("inf") if self.minimum is None else self.minimum
        hi = float("inf") if self.maximum is None else self.maximum
        if not lo <= value <= hi:
            return f"{self.name} must be in [{lo:g}, {hi:g}], got {value!r}"
        return None


@dataclass(frozen=True)
class Capabilities:
    """What discovery found: the adapter in use, its knobs, and whether the engine enforces leases."""

    adapter: str
    knobs: Mapping[str, KnobSpec]
    leases: bool
    detail: Mapping[str, Any] = field(default_factory=dict)


class ControlAdapter(Protocol):
    """One engine API flavour. Values are absolute; ``apply`` returns the settings read back."""

    name: str

    async def discover(self) -> Capabilities:
        """Probe the engine; raise ControlError(temporary=False) when this flavour is not served."""
        ...

    async def read(self) -> dict[str, Value]:
        """The knobs' current values."""
        ...

    async def apply(self, values: Mapping[str, Value], key: str, lease_s: float) -> dict[str, Value]:
        """Set ``values`` (absolute) under idempotency ``key`` and a lease; return the applied settings."""
        ...

    async def renew(self, lease_s: float) -> None:
        """Extend the lease; a no-op where the engine has no leases."""
        ...

    async def release(self) -> bool:
        """End the lease now, so the engine returns to its safe defaults at once; True when a lease was
        ended. A no-op (False) where the engine has no leases."""
        ...
