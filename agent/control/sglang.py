"""SGLang: ``POST /set_internal_state`` with ``{"server_args": {...}}``, read back from ``/get_server_info``.

SGLang's scheduler accepts only an allowlist of keys (others fail the whole update), so the adapter
offers exactly those: ``max_micro_batch_size`` (pipeline parallel micro-batch) and the speculative
decoding thresholds. SGLang has no lease: a value stays after the sidecar dies, which the client
compensates for by restoring what it read at discovery when it stops.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

from agent.control.base import Capabilities, ControlError, KnobSpec, Value
from agent.control.transport import call

#: The keys SGLang's ``Scheduler.set_internal_state`` allows, with the bounds we enforce before sending.
ALLOWED: dict[str, KnobSpec] = {
    "max_micro_batch_size": KnobSpec("max_micro_batch_size", "integer", 1, None),
    "speculative_accept_threshold_single": KnobSpec(
        "speculative_accept_threshold_single", "number", 0.0, 1.0
    ),
    "speculative_accept_threshold_acc": KnobSpec("speculative_accept_threshold_acc", "number", 0.0, 1.0),
}


def _server_args(doc: Any) -> dict[str, Any]:
    """``/get_server_info`` is flat in most versions; some nest the scheduler's view under a list."""
    if not isinstance(doc, dict):
        raise ControlError("SGLang server info is not a JSON object", temporary=False)
    merged = dict(doc)
    for nested in doc.get("internal_states", []) or []:
        if isinstance(nested, dict):
            merged.update(nested)
    return merged


class SglangAdapter:
    name = "sglang"

    def __init__(self, session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0) -> None:
        self.session, self.url, self.timeout_s = session, url.rstrip("/"), timeout_s

    async def _info(self) -> dict[str, Any]:
        return _server_args(
            await call(self.session, "GET", self.url + "/get_server_info", timeout_s=self.timeout_s)
        )

    async def discover(self) -> Capabilities:
        info = await self._info()
        knobs = {name: spec for name, spec in ALLOWED.items() if name in info}
        if not knobs:
            raise ControlError("SGLang server info lists none of the settable keys", temporary=False)
        return Capabilities(self.name, knobs, leases=False, detail={"version": str(info.get("version", ""))})

    async def read(self) -> dict[str, Value]:
        info = await self._info()
        return {name: info[name] for name in ALLOWED if name in info}

    async def apply(self, values: Mapping[str, Value], key: str, lease_s: float) -> dict[str, Value]:
        unknown = sorted(set(values) - set(ALLOWED))
        if unknown:
            raise ControlError(f"SGLang does not allow setting {', '.join(unknown)}", temporary=False)
        answer = await call(
            self.session,
            "POST",
            self.url + "/set_internal_state",
            {"server_args": dict(values)},
            self.timeout_s,
        )
        if isinstance(answer, dict) and answer.get("updated") is False:
            raise ControlError(f"SGLang refused the update: {answer}", temporary=False)
        return await self.read()

    async def renew(self, lease_s: float) -> None:
        """SGLang has no leases."""

    async def release(self) -> bool:
        """SGLang has no leases: the client puts the start values back instead (``restore``)."""
        return False
