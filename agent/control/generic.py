"""The generic control API (DESIGN.md section 4; served by the simulator, spec in the repo).

``GET /v1/control/state`` publishes ``settings``, ``safe_defaults``, ``capabilities`` (bounds per knob) and
the ``lease``; ``POST /v1/control/apply`` takes ``{"settings": {...}, "idempotency_key": k, "lease_s": s}``
with absolute values, all or nothing; ``POST /v1/control/lease`` with ``{"lease_s": s}`` renews, and
``DELETE /v1/control/lease`` ends the lease at once (the engine returns to its safe defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

from agent.control.base import Capabilities, ControlError, KnobSpec, Value
from agent.control.transport import call


def parse_capabilities(doc: Any) -> dict[str, KnobSpec]:
    """Knob specs from the ``capabilities`` object of ``/v1/control/state`` (``lease_s`` is not a knob)."""
    caps = doc.get("capabilities") if isinstance(doc, dict) else None
    if not isinstance(caps, dict):
        raise ControlError("control state has no 'capabilities' object", temporary=False)
    knobs = {}
    for name, spec in caps.items():
        if name == "lease_s" or not isinstance(spec, dict):
            continue
        knobs[name] = KnobSpec(
            name, str(spec.get("type", "number")), spec.get("minimum"), spec.get("maximum"),
            tuple(spec.get("enum", ())),
        )  # fmt: skip
    return knobs


class GenericAdapter:
    name = "generic"

    def __init__(self, session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0) -> None:
        self.session, self.url, self.timeout_s = session, url.rstrip("/"), timeout_s

    async def _state(self) -> dict[str, Any]:
        doc = await call(self.session, "GET", self.url + "/v1/control/state", timeout_s=self.timeout_s)
        if not isinstance(doc, dict) or not isinstance(doc.get("settings"), dict):
            raise ControlError("control state has no 'settings' object", temporary=False)
        return doc

    async def discover(self) -> Capabilities:
        doc = await self._state()
        detail = {"safe_defaults": doc.get("safe_defaults", {}), "engine": doc.get("engine", {})}
        return Capabilities(self.name, parse_capabilities(doc), leases=True, detail=detail)

    async def read(self) -> dict[str, Value]:
        return dict((await self._state())["settings"])

    async def apply(self, values: Mapping[str, Value], key: str, lease_s: float) -> dict[str, Value]:
        body = {"settings": dict(values), "idempotency_key": key, "lease_s": lease_s}
        answer = await call(self.session, "POST", self.url + "/v1/control/apply", body, self.timeout_s)
        if not isinstance(answer, dict) or not isinstance(answer.get("settings"), dict):
            raise ControlError("apply answer has no 'settings' object", temporary=False)
        return dict(answer["settings"])

    async def renew(self, lease_s: float) -> None:
        await call(self.session, "POST", self.url + "/v1/control/lease", {"lease_s": lease_s}, self.timeout_s)

    async def release(self) -> bool:
        answer = await call(self.session, "DELETE", self.url + "/v1/control/lease", timeout_s=self.timeout_s)
        return isinstance(answer, dict) and answer.get("released") is True
