"""vLLM: runtime endpoints found through ``/openapi.json`` (they exist only in some builds and modes).

Released vLLM cannot change ``max_num_seqs`` or precision at run time; what some builds serve is
``/pause`` + ``/resume`` (+ ``/is_paused``) and, in dev mode, ``/sleep`` + ``/wake_up`` (+ ``/is_sleeping``).
The adapter offers each as a boolean knob only when all of its paths are in the OpenAPI document.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

from agent.control.base import Capabilities, ControlError, KnobSpec, Value
from agent.control.transport import call

#: knob -> (path to set true, path to set false, path that reads it back, JSON key of the read-back)
ENDPOINTS: dict[str, tuple[str, str, str, str]] = {
    "paused": ("/pause", "/resume", "/is_paused", "is_paused"),
    "sleeping": ("/sleep", "/wake_up", "/is_sleeping", "is_sleeping"),
}


def knobs_from_openapi(doc: Any) -> dict[str, KnobSpec]:
    paths = doc.get("paths") if isinstance(doc, dict) else None
    if not isinstance(paths, dict):
        raise ControlError("/openapi.json has no 'paths'", temporary=False)
    return {
        knob: KnobSpec(knob, "boolean")
        for knob, needed in ENDPOINTS.items()
        if all(path in paths for path in needed[:3])
    }


class VllmAdapter:
    name = "vllm"

    def __init__(self, session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0) -> None:
        self.session, self.url, self.timeout_s = session, url.rstrip("/"), timeout_s
        self._knobs: dict[str, KnobSpec] = {}

    async def discover(self) -> Capabilities:
        doc = await call(self.session, "GET", self.url + "/openapi.json", timeout_s=self.timeout_s)
        self._knobs = knobs_from_openapi(doc)
        if not self._knobs:
            raise ControlError("this vLLM serves no runtime control endpoint", temporary=False)
        return Capabilities(self.name, self._knobs, leases=False)

    async def read(self) -> dict[str, Value]:
        out: dict[str, Value] = {}
        for knob in self._knobs:
            _, _, path, key = ENDPOINTS[knob]
            answer = await call(self.session, "GET", self.url + path, timeout_s=self.timeout_s)
            out[knob] = bool(answer.get(key)) if isinstance(answer, dict) else bool(answer)
        return out

    async def apply(self, values: Mapping[str, Value], key: str, lease_s: float) -> dict[str, Value]:
        for knob, value in values.items():
            if knob not in self._knobs:
                raise ControlError(f"vLLM here does not serve a {knob!r} endpoint", temporary=False)
            on, off, _, _ = ENDPOINTS[knob]
            await call(self.session, "POST", self.url + (on if value else off), timeout_s=self.timeout_s)
        return await self.read()

    async def renew(self, lease_s: float) -> None:
        """vLLM has no leases."""

    async def release(self) -> bool:
        """vLLM has no leases: the client puts the start values back instead (``restore``)."""
        return False
