"""The precision canary, live: the policy, its perplexity meter and the operator's start/abort.

:class:`LiveCanary` owns three parts, each in its usual place in the loop:

* the :class:`~policies.canary.Canary` policy (pure; added to the loop's policy set);
* :class:`PerplexityMeter`, a collector named ``canary``: while the policy's phase is ``gate`` it starts
  (as its own asyncio task, never inside the tick) one measurement of both upstreams over the
  validation set (agent/perplexity.py) and publishes ``canary.ppl_primary`` and ``canary.ppl_fp8`` once
  both are known. A failed measurement is an error reading (visible in ``collector_success``) and is
  retried after ``canary.retry_s``; the policy rolls back if no perplexity arrives within
  ``canary.gate_timeout_s``;
* :meth:`LiveCanary.start` / :meth:`LiveCanary.abort` / :meth:`LiveCanary.status`, which the admin
  routes call (``POST``/``DELETE``/``GET /api/admin/canary``).

The policy proposes ``route.fp8_share``; agent/knobs.py binds that knob to the gate's split. Its health
checks read ``gate.requests``, ``gate.slo_bad`` and ``gate.errors`` per tick, from the gate's collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from agent.config import CanaryConfig, Config, ConfigError
from agent.gate.upstreams import upstream_auth
from agent.perplexity import Measurement, PerplexityError, load_validation_set, measure
from agent.tls import ClientTls, gate_upstream_context
from detectors.snapshot import Reading, SourceStatus
from policies.canary import PPL_FP8, PPL_PRIMARY, Canary, CanaryState

if TYPE_CHECKING:
    import aiohttp

    from agent.loop import Loop

log = logging.getLogger(__name__)

NAME = "canary"


class PerplexityMeter:
    """A collector: measures both upstreams while the canary is in its gate (see the module doc)."""

    name = NAME

    def __init__(
        self,
        cfg: CanaryConfig,
        upstreams: dict[str, str],
        texts: tuple[str, ...],
        phase: Callable[[], CanaryState | None],
        clock: Callable[[], float] = time.monotonic,
        models: dict[str, str] | None = None,
        tls: ClientTls = True,
        auth: dict[str, str] | None = None,
    ) -> None:
        self.cfg = cfg
        #: TLS towards https upstreams (``gate.upstream_tls_*``), as the gate reaches them
        self.tls = tls
        #: the upstreams' own key (``gate.upstream_api_key_file``), as the gate sends it
        self.auth = auth or {}
        self.urls = {cfg.primary: upstreams[cfg.primary], cfg.candidate: upstreams[cfg.candidate]}
        #: the model name each upstream is asked for: ``gate.upstream_models``, else ``canary.model`` (else
        #: the first it lists), as the gate sends it that upstream's traffic
        self.models = {name: (models or {}).get(name, cfg.model) for name in self.urls}
        self.texts = texts
        self.phase = phase
        self.clock = clock
        self.generation: float | None = None  # entered_at of the gate being measured
        self.result: tuple[Measurement, Measurement] | None = None
        self.error: str | None = None
        self._failed_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def collect(self, now: float) -> Reading:
        state = self.phase()
        if state is None or state.phase != "gate":
            self._cancel()  # aborted or decided: a measurement still running is no longer wanted
            return Reading.empty(self.name, now, "no perplexity gate in progress")
        if state.entered_at != self.generation:  # a new gate: forget the last one's numbers
            self._cancel()
            self.generation, self.result, self.error, self._failed_at = state.entered_at, None, None, None
        if self.result is not None:
            primary, fp8 = self.result
            return Reading(self.name, now, SourceStatus.OK, {PPL_PRIMARY: primary.ppl, PPL_FP8: fp8.ppl})
        retry_due = self._failed_at is None or self.clock() - self._failed_at >= self.cfg.retry_s
        if self._task is None and retry_due:
            self._task = asyncio.create_task(self._measure(state.entered_at), name="servepilot-canary-ppl")
        if self.error is not None:
            return Reading.failed(self.name, now, self.error)
        return Reading.empty(self.name, now, "measuring perplexity")

    async def _measure(self, generation: float) -> None:
        import aiohttp

        try:
            if self._session is None:
                connector = aiohttp.TCPConnector(ssl=self.tls)
                self._session = aiohttp.ClientSession(connector=connector, headers=self.auth)
            measured = []
            for upstream in (self.cfg.primary, self.cfg.candidate):  # one at a time: half the load
                measured.append(
                    await measure(
                        self._session,
                        upstream,
                        self.urls[upstream],
                        self.texts,
                        model=self.models[upstream],
                        timeout_s=self.cfg.timeout_s,
                        concurrency=self.cfg.concurrency,
                    )
                )
        except PerplexityError as error:
            if generation == self.generation:
                self.error, self._failed_at = str(error), self.clock()
            log.warning("%s", error)
        else:
            if generation == self.generation:
                self.result, self.error = (measured[0], measured[1]), None
                log.info(
                    "canary perplexity: %s %.4f, %s %.4f over %d tokens",
                    self.cfg.primary,
                    measured[0].ppl,
                    self.cfg.candidate,
                    measured[1].ppl,
                    measured[0].tokens,
                )
        finally:
            if generation == self.generation:
                self._task = None

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"measuring": self._task is not None, "error": self.error}
        if self.result is not None:
            primary, fp8 = self.result
            out.update(
                ppl_primary=primary.ppl,
                ppl_fp8=fp8.ppl,
                ppl_delta=fp8.ppl / primary.ppl - 1.0,
                tokens=primary.tokens,
            )
        return out

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None


class LiveCanary:
    """The canary's policy, meter and operator controls, bound to one loop (see the module doc)."""

    def __init__(self, cfg: Config) -> None:
        c = cfg.canary
        assert c.validation_file is not None  # config validation requires it when enabled
        try:
            texts = load_validation_set(c.validation_file)
        except ValueError as error:
            raise ConfigError("canary.validation_file", str(error)) from None
        self.policy = Canary(
            steps=c.steps,
            max_ppl_delta=c.max_ppl_delta,
            step_s=c.step_s,
            gate_timeout_s=c.gate_timeout_s,
            failure_limit=c.failure_limit,
            candidate=c.candidate,
            name=NAME,
        )
        self.meter = PerplexityMeter(
            c,
            dict(cfg.gate.upstreams),
            texts,
            self.state,
            models=dict(cfg.gate.upstream_models),
            tls=gate_upstream_context(cfg.gate),
            auth=upstream_auth(cfg.gate),
        )
        self.loop: Loop | None = None

    def collectors(self) -> list[Any]:
        """The perplexity meter (the rollout checks read the gate's own collector)."""
        return [self.meter]

    def attach(self, loop: Loop) -> None:
        self.loop = loop

    def state(self) -> CanaryState | None:
        return None if self.loop is None else self.loop.policy_state(NAME)

    def start(self, now: float) -> dict[str, Any]:
        """Begin (or restart) a rollout; the next tick starts measuring perplexity."""
        assert self.loop is not None
        self.loop.set_policy_state(NAME, self.policy.start(self.state(), now))
        return self.status()

    def abort(self, now: float) -> dict[str, Any]:
        """Roll back now: the policy proposes an fp8 share of 0 from the next tick on."""
        assert self.loop is not None
        state = self.state() or CanaryState()
        if state.phase in ("gate", "rolling", "promoted"):
            self.loop.set_policy_state(
                NAME, replace(state, phase="rolled_back", entered_at=now, reason="aborted by operator")
            )
        return self.status()

    def status(self) -> dict[str, Any]:
        state = self.state() or CanaryState()
        return {
            "phase": state.phase,
            "step": state.step,
            "fp8_share": self.policy.share(state),
            "failures": state.failures,
            "reason": state.reason,
            "entered_at": state.entered_at,
            "steps": list(self.policy.steps),
            "perplexity": self.meter.status(),
        }
