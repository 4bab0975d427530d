"""The control client the agent calls: discovery, validated absolute applies with read-back, leases.

* ``start()`` discovers the API flavour (``adapter: auto`` tries generic, then vLLM, then SGLang) and
  records the settings it found, which are what ``restore()`` puts back on engines without leases.
* ``apply(values)`` checks each value against the published bounds (a bad value never leaves the agent),
  skips knobs already at their value (level-based), sends the rest under one idempotency key and retries
  temporary failures with bounded, jittered backoff under the same key, so a retry never applies twice;
  then compares the read-back with what was asked.
* While a lease is held, a task renews it every ``lease_s / 3``; if the agent dies or wedges, renewals
  stop and the engine returns to its safe defaults by itself. A clean stop ends the lease at once
  (``release_on_stop``), as the GPU actuator restores clocks on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

from agent.config import ControlConfig
from agent.control.base import Capabilities, ControlAdapter, ControlError, Value
from agent.control.generic import GenericAdapter
from agent.control.sglang import SglangAdapter
from agent.control.vllm import VllmAdapter
from agent.tls import ClientTls

log = logging.getLogger(__name__)

ADAPTERS: dict[str, type[GenericAdapter] | type[SglangAdapter] | type[VllmAdapter]] = {
    "generic": GenericAdapter,
    "vllm": VllmAdapter,
    "sglang": SglangAdapter,
}


@dataclass
class ApplyResult:
    """What an apply did: the values sent, what the engine reports back, and any mismatch."""

    requested: dict[str, Value]
    sent: dict[str, Value]
    read_back: dict[str, Value]
    key: str
    attempts: int = 1
    mismatched: dict[str, tuple[Value, Value | None]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.mismatched


def _same(a: Value | None, b: Value) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    return a == b


class ControlClient:
    """Engine control over HTTP. Build, ``await start()``, ``await apply({...})``, ``await close()``."""

    def __init__(
        self,
        cfg: ControlConfig,
        *,
        session: aiohttp.ClientSession | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        rng: random.Random | None = None,
        retries: int = 3,
        tls: ClientTls = True,
    ) -> None:
        self.cfg = cfg
        self.tls = tls  # the engine's (agent.tls.engine_context): the control API is the engine's
        self._own_session = session is None
        self.session = session
        self.sleep = sleep
        self.rng = rng or random.Random()
        self.retries = retries
        self.adapter: ControlAdapter | None = None
        self.capabilities: Capabilities | None = None
        self.initial: dict[str, Value] = {}
        self._renew_task: asyncio.Task[None] | None = None
        self.renew_failures = 0
        #: set when a renewal found the lease lapsed (the engine is on its safe defaults); the owner clears it
        self.lapsed = False

    async def start(self) -> Capabilities:
        """Discover the engine's control API; ControlError when none is served."""
        if self.session is None:
            headers = {}
            if self.cfg.token_file:
                from agent.admin import load_token

                headers["Authorization"] = f"Bearer {load_token(self.cfg.token_file)}"
            connector = aiohttp.TCPConnector(ssl=self.tls)
            self.session = aiohttp.ClientSession(headers=headers, connector=connector)
        names = list(ADAPTERS) if self.cfg.adapter == "auto" else [self.cfg.adapter]
        reasons = []
        unreachable = False
        for name in names:
            adapter = ADAPTERS[name](self.session, self.cfg.url, self.cfg.timeout_s)
            try:
                self.capabilities = await adapter.discover()
            except ControlError as error:
                reasons.append(f"{name}: {error}")
                if error.temporary and self.cfg.adapter != "auto":
                    raise
                unreachable = unreachable or error.temporary
                continue
            self.adapter = adapter
            self.initial = await adapter.read()
            log.info("engine control via %s: knobs %s", name, ", ".join(self.capabilities.knobs))
            return self.capabilities
        # temporary when some flavour could not be asked (refused, timed out, 5xx: an engine still loading),
        # so the caller tries again later; permanent when every flavour answered that it is not served
        raise ControlError("no engine control API found (" + "; ".join(reasons) + ")", temporary=unreachable)

    def _require(self) -> tuple[ControlAdapter, Capabilities]:
        if self.adapter is None or self.capabilities is None:
            raise ControlError("control client not started", temporary=False)
        return self.adapter, self.capabilities

    async def read(self) -> dict[str, Value]:
        adapter, _ = self._require()
        return await adapter.read()

    async def apply(self, values: Mapping[str, Value], *, key: str | None = None) -> ApplyResult:
        """Set ``values`` (absolute). Raises ControlError (permanent, or temporary after the retries)."""
        adapter, caps = self._require()
        unknown = [name for name in values if name not in caps.knobs]
        if unknown:
            raise ControlError(
                f"{unknown[0]} is not a knob of this engine ({', '.join(caps.knobs)})", temporary=False
            )
        values = {name: caps.knobs[name].coerce(value) for name, value in values.items()}  # the knob's type
        for name, value in values.items():
            problem = caps.knobs[name].check(value)
            if problem:
                raise ControlError(problem, temporary=False)
        current = await self._with_retries(adapter.read)
        sent = {k: v for k, v in values.items() if not _same(current.get(k), v)}
        key = key or uuid.uuid4().hex
        result = ApplyResult(dict(values), sent, current, key)
        if sent:
            result.read_back, result.attempts = await self._send(adapter, sent, key)
            if caps.leases:
                self._ensure_renewing(adapter)
        result.mismatched = {
            k: (v, result.read_back.get(k))
            for k, v in values.items()
            if not _same(result.read_back.get(k), v)
        }
        return result

    async def _send(
        self, adapter: ControlAdapter, sent: dict[str, Value], key: str
    ) -> tuple[dict[str, Value], int]:
        attempt = 0
        while True:
            attempt += 1
            try:
                await adapter.apply(sent, key, self.cfg.lease_s)
                return await adapter.read(), attempt
            except ControlError as error:
                if not error.temporary or attempt > self.retries:
                    raise
                await self.sleep(self._backoff(attempt))

    async def _with_retries(self, fn: Callable[[], Awaitable[dict[str, Value]]]) -> dict[str, Value]:
        attempt = 0
        while True:
            attempt += 1
            try:
                return await fn()
            except ControlError as error:
                if not error.temporary or attempt > self.retries:
                    raise
                await self.sleep(self._backoff(attempt))

    def _backoff(self, attempt: int) -> float:
        """Full jitter over an exponential cap: 0.1, 0.2, 0.4 ... s, at most 2 s."""
        return self.rng.uniform(0, min(2.0, 0.1 * 2 ** (attempt - 1)))

    def _ensure_renewing(self, adapter: ControlAdapter) -> None:
        if self._renew_task is None or self._renew_task.done():
            self._renew_task = asyncio.create_task(self._renew_loop(adapter), name="servepilot-control-lease")

    async def _renew_loop(self, adapter: ControlAdapter) -> None:
        period = self.cfg.lease_s / 3
        while True:
            await self.sleep(period)
            try:
                await adapter.renew(self.cfg.lease_s)
                self.renew_failures = 0
            except ControlError as error:
                self.renew_failures += 1
                if error.status == 409:  # the lease lapsed: the engine is on its defaults, nothing to hold
                    log.warning("control lease lapsed; the engine returned to its safe defaults")
                    self.lapsed = True
                    return
                log.warning("control lease renewal failed (%d in a row): %s", self.renew_failures, error)

    async def restore(self) -> bool:
        """Put back the settings found at start (engines without leases; True when sent); leased engines
        revert alone."""
        if self.adapter is None or self.capabilities is None or self.capabilities.leases or not self.initial:
            return False
        with contextlib.suppress(ControlError):
            await self.adapter.apply(self.initial, uuid.uuid4().hex, self.cfg.lease_s)
            return True
        return False

    async def release(self) -> bool:
        """End this client's lease now, so the engine runs its safe defaults at once rather than up to
        ``lease_s`` later; True when the engine confirmed. Only a lease this client took (it applied
        something); a failure is logged, and the lease then lapses on its own."""
        if self.adapter is None or self.capabilities is None or not self.capabilities.leases:
            return False
        if self._renew_task is None:  # never applied: no lease of ours to end
            return False
        try:
            released = await self.adapter.release()
        except ControlError as error:
            log.warning("control lease release failed (%s); the engine reverts when the lease lapses", error)
            return False
        if released:
            log.info("control lease released: the engine is back on its safe defaults")
        return released

    async def hand_back(self) -> bool:
        """Leave the engine on its defaults and stop holding it, but stay usable (the sidecar left act
        mode): a lease this client holds is ended at once and no longer renewed; an engine without leases
        gets the settings found at start back. A later apply takes a new lease. True when it held a lease
        or had settings to put back."""
        held = await self._stop_renewing(release=True)
        return await self.restore() or held

    async def _stop_renewing(self, *, release: bool) -> bool:
        """Stop renewing the lease; end it at once too when ``release``. True when one was held."""
        held = self._renew_task is not None
        if self._renew_task is not None:
            self._renew_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renew_task
        if release:
            await self.release()  # while _renew_task still says a lease of ours was taken
        self._renew_task = None
        return held

    async def close(self) -> None:
        """Stop renewing, then hand the engine back: a leased engine's lease is ended at once
        (``control.release_on_stop``, else it reverts when the lease lapses); an engine without leases
        gets the settings found at start back. Then release HTTP."""
        await self._stop_renewing(release=self.cfg.release_on_stop)
        await self.restore()
        if self._own_session and self.session is not None:
            await self.session.close()
