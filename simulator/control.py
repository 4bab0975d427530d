"""The engine control API's logic: capabilities, absolute-value apply, idempotency keys and leases.

Pure (``now`` is passed in, in seconds of the lease clock): the HTTP face maps :class:`ControlError` to a
status code. Semantics the generic adapter relies on:

* ``apply`` takes absolute values for any subset of the knobs, validates every one against the bounds
  ``capabilities`` publishes (422 on violation) and applies all or nothing.
* The same ``idempotency_key`` with the same body returns the first answer again and applies nothing; with
  a different body it is a 409.
* Every apply carries a lease (``lease_s``). ``renew`` extends it. When it lapses the engine returns to its
  safe defaults by itself, so an engine whose sidecar disappeared does not keep a risky setting.
* ``release`` ends the lease now (a sidecar stopping cleanly): the safe defaults at once, not ``lease_s``
  later. Idempotent: with no lease active it changes nothing and says so.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from simulator.engine import EngineCore, EngineSettings
from simulator.hardware import PRECISIONS

LEASE_BOUNDS = (1.0, 3600.0)
DEFAULT_LEASE_S = 30.0
MAX_NUM_SEQS_BOUNDS = (1, 1024)
#: The step token budget: one KV block's worth at least (16 tokens), and vLLM's largest V1 default x8.
MAX_NUM_BATCHED_TOKENS_BOUNDS = (16, 65536)
IDEMPOTENCY_MEMORY = 1024


class ControlError(Exception):
    """A rejected control request: HTTP ``status`` and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ControlPlane:
    """Owns the lease and the idempotency memory for one :class:`EngineCore`."""

    def __init__(self, core: EngineCore, defaults: EngineSettings) -> None:
        self.core = core
        self.defaults = defaults
        self.generation = 0
        self.lease_expires_at: float | None = None
        self.last_revert_at: float | None = None
        self._seen: OrderedDict[str, tuple[str, dict[str, Any]]] = OrderedDict()

    def capabilities(self) -> dict[str, Any]:
        """Knobs and their bounds, as published in ``/v1/control/state``."""
        gpu = self.core.gpu
        return {
            "max_num_seqs": {
                "type": "integer",
                "minimum": MAX_NUM_SEQS_BOUNDS[0],
                "maximum": MAX_NUM_SEQS_BOUNDS[1],
            },
            "max_num_batched_tokens": {
                "type": "integer",
                "minimum": MAX_NUM_BATCHED_TOKENS_BOUNDS[0],
                "maximum": MAX_NUM_BATCHED_TOKENS_BOUNDS[1],
            },
            "precision": {"type": "string", "enum": list(PRECISIONS)},
            "sm_clock_mhz": {"type": "number", "minimum": gpu.clock_min_mhz, "maximum": gpu.clock_max_mhz},
            "power_limit_w": {"type": "number", "minimum": gpu.min_power_limit_w, "maximum": gpu.tdp_w},
            "lease_s": {"type": "number", "minimum": LEASE_BOUNDS[0], "maximum": LEASE_BOUNDS[1]},
        }

    def state(self, now: float) -> dict[str, Any]:
        self.expire(now)
        expires = self.lease_expires_at
        return {
            "settings": asdict(self.core.settings),
            "safe_defaults": asdict(self.defaults),
            "lease": {
                "active": expires is not None,
                "expires_at": expires,
                "remaining_s": None if expires is None else max(0.0, expires - now),
            },
            "capabilities": self.capabilities(),
            "generation": self.generation,
            "last_revert_at": self.last_revert_at,
            "engine": {
                "model": self.core.model.served_name,
                "gpu": self.core.gpu.name,
                "tp": self.core.gpu.tp,
            },
        }

    def expire(self, now: float) -> bool:
        """Return to the safe defaults if the lease lapsed; True when that happened now."""
        if self.lease_expires_at is None or now < self.lease_expires_at:
            return False
        self._revert(now)
        return True

    def release(self, body: Any, now: float) -> dict[str, Any]:
        """End the active lease now and return to the safe defaults; ``released`` is false when no lease
        was active (it had lapsed, or was never taken), so a second release is harmless."""
        if body not in (None, {}):
            raise ControlError(422, "release takes no body")
        self.expire(now)
        released = self.lease_expires_at is not None
        if released:
            self._revert(now)
        return {"released": released, "settings": asdict(self.core.settings), "generation": self.generation}

    def _revert(self, now: float) -> None:
        self.core.apply_settings(self.defaults, self.core.time)
        self.lease_expires_at = None
        self.last_revert_at = now
        self.generation += 1

    def apply(self, body: Any, now: float) -> dict[str, Any]:
        """Validate and apply ``body`` (the parsed JSON); raises ControlError."""
        self.expire(now)
        if not isinstance(body, Mapping):
            raise ControlError(400, "body must be a JSON object")
        key = body.get("idempotency_key")
        if not isinstance(key, str) or not 1 <= len(key) <= 200:
            raise ControlError(422, "idempotency_key must be a string of 1-200 characters")
        fingerprint = json.dumps(body, sort_keys=True, default=str)
        if key in self._seen:
            seen_fingerprint, answer = self._seen[key]
            if seen_fingerprint != fingerprint:
                raise ControlError(409, f"idempotency_key {key!r} was already used with a different body")
            return answer
        unknown = set(body) - {"settings", "idempotency_key", "lease_s"}
        if unknown:
            raise ControlError(422, f"unknown field(s): {', '.join(sorted(unknown))}")
        lease_s = self._lease(body.get("lease_s", DEFAULT_LEASE_S))
        changes = self._validate(body.get("settings"))
        previous = self.core.settings
        target = self.core.with_settings(**changes)
        try:
            self.core.apply_settings(target, self.core.time)
        except ValueError as error:
            raise ControlError(422, f"settings.precision: {error}") from None
        self.generation += 1
        self.lease_expires_at = now + lease_s
        answer = {
            "applied": True,
            "idempotency_key": key,
            "generation": self.generation,
            "settings": asdict(target),
            "previous": asdict(previous),
            "lease_s": lease_s,
            "lease_expires_at": self.lease_expires_at,
        }
        self._seen[key] = (fingerprint, answer)
        while len(self._seen) > IDEMPOTENCY_MEMORY:
            self._seen.popitem(last=False)
        return answer

    def renew(self, body: Any, now: float) -> dict[str, Any]:
        """Extend the active lease by ``lease_s`` from ``now``; 409 when there is none to renew."""
        self.expire(now)
        if body is None:
            body = {}
        if not isinstance(body, Mapping):
            raise ControlError(400, "body must be a JSON object")
        unknown = set(body) - {"lease_s"}
        if unknown:
            raise ControlError(422, f"unknown field(s): {', '.join(sorted(unknown))}")
        lease_s = self._lease(body.get("lease_s", DEFAULT_LEASE_S))
        if self.lease_expires_at is None:
            raise ControlError(409, "no active lease to renew: the engine runs its safe defaults")
        self.lease_expires_at = now + lease_s
        return {"lease_s": lease_s, "lease_expires_at": self.lease_expires_at, "generation": self.generation}

    @staticmethod
    def _lease(raw: Any) -> float:
        lo, hi = LEASE_BOUNDS
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
            raise ControlError(422, f"lease_s must be a number, got {raw!r}")
        if not lo <= raw <= hi:
            raise ControlError(422, f"lease_s must be in [{lo:g}, {hi:g}], got {raw!r}")
        return float(raw)

    def _validate(self, settings: Any) -> dict[str, Any]:
        if not isinstance(settings, Mapping) or not settings:
            raise ControlError(422, "settings must be a non-empty object of knob: absolute value")
        caps = self.capabilities()
        out: dict[str, Any] = {}
        for name, value in settings.items():
            spec = caps.get(name)
            if spec is None or name == "lease_s":
                raise ControlError(
                    422,
                    f"settings.{name} is not a knob; known: max_num_seqs, max_num_batched_tokens, "
                    "precision, sm_clock_mhz, power_limit_w",
                )
            if "enum" in spec:
                if value not in spec["enum"]:
                    raise ControlError(422, f"settings.{name} must be one of {spec['enum']}, got {value!r}")
                out[name] = value
                continue
            integer = spec["type"] == "integer"
            valid_type = isinstance(value, int) if integer else isinstance(value, int | float)
            if isinstance(value, bool) or not valid_type or not math.isfinite(value):
                raise ControlError(
                    422, f"settings.{name} must be {'an integer' if integer else 'a number'}, got {value!r}"
                )
            if not spec["minimum"] <= value <= spec["maximum"]:
                raise ControlError(
                    422,
                    f"settings.{name} must be in [{spec['minimum']:g}, {spec['maximum']:g}], got {value!r}",
                )
            out[name] = int(value) if integer else float(value)
        return out
