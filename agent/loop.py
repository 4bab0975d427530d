"""The control loop: collect, snapshot, store, detect, decide, publish — once per ``agent.interval_s``.

Each tick is level-based and self-contained. Collectors run concurrently under one deadline
(``agent.source_timeout_s``): a source that misses it is cancelled and recorded as an error for that tick,
so a slow or dead engine never stalls the loop. Detector and policy failures are counted per unit and
never stop the tick. Time comes from an injected clock; :meth:`Loop.tick` takes ``now`` so tests and
replay drive it by hand.

Sources read over the network (a collector with ``ahead_of_tick = True``: the engine's ``/metrics``, the
allocator probe, llama.cpp's slots) are collected ``lead_s`` before each tick by :meth:`Loop.run`, the way
the NVML sampler reads the GPU between ticks: the tick then finds their reading ready instead of waiting
for the engine to render its page (it does so in the process that serves its API) and for the text to be
parsed. Each such reading keeps the time it was taken (``observed_at``, ``lead_s`` before the snapshot:
``servepilot_collector_data_age_seconds`` shows it) and rates are computed on those times, so nothing is
skewed; a source still not in at the tick is waited for under the same deadline, counted from when it
started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from agent.collectors.base import Collector
from agent.state import AgentState, TickStats
from agent.store import Store
from agent.tally import FindingTally, suppressed_by_detector
from detectors.base import Detector, Finding
from detectors.snapshot import Reading, Snapshot, SourceStatus
from policies.base import Policy, Proposal

log = logging.getLogger(__name__)

Listener = Callable[[AgentState], object]
Derive = Callable[[Mapping[str, float], float], Mapping[str, float]]
"""Signals computed from the tick's own values (e.g. cost per token), merged in as source ``derived``."""
Enrich = Callable[[tuple[Finding, ...], Snapshot], Awaitable[tuple[Finding, ...]]]
"""Adds evidence to the tick's findings (e.g. a link to a memory snapshot); must not block the tick."""
Act = Callable[[Sequence[Proposal], Snapshot], Awaitable[Mapping[str, float | str]]]
"""Carries out (or advises) the tick's proposals; returns the knob values after acting."""


class Loop:
    """Runs the tick. Holds the only mutable agent state; publishes immutable :class:`AgentState`."""

    def __init__(
        self,
        collectors: Sequence[Collector],
        store: Store,
        *,
        interval_s: float,
        source_timeout_s: float,
        detectors: Sequence[Detector] = (),
        policies: Sequence[Policy] = (),
        clock: Callable[[], float] = time.time,
        act: Act | None = None,
        derive: Sequence[Derive] = (),
        enrich: Enrich | None = None,
        lead_s: float = 0.0,
    ) -> None:
        self.collectors = list(collectors)
        self.store = store
        self.interval_s = interval_s
        self.source_timeout_s = min(source_timeout_s, interval_s)
        self.detectors = list(detectors)
        self.policies = list(policies)
        self.clock = clock
        self.act = act
        self.derive = list(derive)
        self.enrich = enrich
        #: how long before each tick :meth:`run` starts the ``ahead_of_tick`` collectors (at most half a tick)
        self.lead_s = max(0.0, min(lead_s, interval_s / 2))
        self.state = AgentState()
        self._policy_state: dict[str, Any] = {}
        self._listeners: list[Listener] = []
        self._detector_errors: dict[str, int] = {}
        self._policy_errors: dict[str, int] = {}
        self._overruns = 0
        self._tally = FindingTally(d.name for d in self.detectors)

    def policy_state(self, name: str) -> Any:
        """The state the policy ``name`` returned on the last tick (``None`` before it ran)."""
        return self._policy_state.get(name)

    def set_policy_state(self, name: str, state: Any) -> None:
        """Seed the state the policy ``name`` gets on the next tick (restored after a restart)."""
        self._policy_state[name] = state

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(state)`` after every tick (the exporter and the demo view use this)."""
        self._listeners.append(listener)

    async def _collect_one(self, collector: Collector, now: float) -> Reading:
        started = time.perf_counter()
        try:
            # asyncio.timeout, not wait_for: the same deadline without a second task per collector
            async with asyncio.timeout(self.source_timeout_s):
                return await collector.collect(now)
        except TimeoutError:
            return Reading.failed(
                collector.name,
                now,
                f"no answer within {self.source_timeout_s:g} s",
                duration_s=time.perf_counter() - started,
            )
        except Exception as error:  # collect() must not raise; a bug there must not kill the loop
            log.exception("collector %s raised", collector.name)
            return Reading.failed(collector.name, now, f"collector raised {type(error).__name__}: {error}")

    async def collect(
        self, now: float, early: Mapping[int, asyncio.Task[Reading]] | None = None
    ) -> dict[str, Reading]:
        """Every source's reading for the tick at ``now``; ``early`` holds the ones already under way (by
        position in :attr:`collectors`), each bounded by its own deadline since it started."""
        early = early or {}
        readings = await asyncio.gather(
            *(early[i] if i in early else self._collect_one(c, now) for i, c in enumerate(self.collectors))
        )
        return {r.source: r for r in readings}

    def _start_ahead(self, positions: Sequence[int]) -> dict[int, asyncio.Task[Reading]]:
        """Start the collectors at ``positions`` now; the clock's time is their reading's ``observed_at``."""
        now = self.clock()
        tasks = {}
        for i in positions:
            collector = self.collectors[i]
            name = f"servepilot-collect-{collector.name}"
            tasks[i] = asyncio.create_task(self._collect_one(collector, now), name=name)
        return tasks

    def think(self, snapshot: Snapshot) -> tuple[tuple[Finding, ...], tuple[Proposal, ...]]:
        """The pure part of the tick: detectors, then policies. Shared by the live agent and replay."""
        findings: list[Finding] = []
        for detector in self.detectors:
            try:
                findings.extend(detector.update(snapshot))
            except Exception:
                log.exception("detector %s failed", detector.name)
                self._detector_errors[detector.name] = self._detector_errors.get(detector.name, 0) + 1
        proposals: list[Proposal] = []
        for policy in self.policies:
            try:
                state, proposed = policy.decide(
                    snapshot, findings, self._policy_state.get(policy.name), snapshot.now
                )
            except Exception:
                log.exception("policy %s failed", policy.name)
                self._policy_errors[policy.name] = self._policy_errors.get(policy.name, 0) + 1
                continue
            self._policy_state[policy.name] = state
            proposals.extend(proposed)
        return tuple(findings), tuple(proposals)

    def _with_derived(self, snapshot: Snapshot) -> Snapshot:
        derived: dict[str, float] = {}
        for derive in self.derive:
            try:
                derived.update(derive(snapshot.values, snapshot.now))
            except Exception:  # a deriver bug must not cost the tick its other signals
                log.exception("deriving signals failed")
        if not derived:
            return snapshot
        reading = Reading("derived", snapshot.now, SourceStatus.OK, derived)
        # merge only the derived values into the already-merged snapshot (not every source again)
        return Snapshot(
            snapshot.now,
            MappingProxyType({**snapshot.values, **reading.values}),
            MappingProxyType({**snapshot.readings, "derived": reading}),
        )

    async def tick(self, now: float, early: Mapping[int, asyncio.Task[Reading]] | None = None) -> AgentState:
        """One full tick at time ``now``; ``early``: readings :meth:`run` started ahead of it."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        readings = await self.collect(now, early)
        collected = time.perf_counter()
        snapshot = Snapshot.from_readings(now, readings)
        if self.derive:
            snapshot = self._with_derived(snapshot)
        self.store.append(snapshot)
        findings, proposals = self.think(snapshot)
        if self.enrich is not None:
            try:
                findings = await self.enrich(findings, snapshot)
            except Exception:
                log.exception("adding evidence to findings failed")
        self._tally.observe(findings)
        finished = time.perf_counter()
        knobs = self.state.knobs
        if self.act is not None:
            try:
                knobs = await self.act(proposals, snapshot)
            except Exception:  # actuation errors are audited by the actuator; a bug must not stop the loop
                log.exception("actuation failed")
        duration = finished - started
        self.state = AgentState(
            snapshot=snapshot,
            findings=findings,
            proposals=proposals,
            knobs=knobs,
            policy_states=MappingProxyType(dict(self._policy_state)),
            stats=TickStats(
                ticks=self.state.stats.ticks + 1,
                last_duration_s=duration,
                last_collect_s=collected - started,
                last_think_s=finished - collected,
                last_cpu_s=time.thread_time() - cpu_started,
                overruns=self._overruns,
                # every running one from 0: a counter series that first appears at 1 loses that error
                # to increase() (ServepilotBrainFailing), and a healthy pod would show no series at all
                detector_errors=dict.fromkeys((d.name for d in self.detectors), 0) | self._detector_errors,
                policy_errors=dict.fromkeys((p.name for p in self.policies), 0) | self._policy_errors,
                findings_raised=self._tally.counts(),
                findings_suppressed=suppressed_by_detector(self.detectors),
            ),
        )
        for listener in self._listeners:
            try:
                listener(self.state)
            except Exception:
                log.exception("state listener failed")
        return self.state

    async def run(self, stop: asyncio.Event) -> None:
        """Tick on a fixed grid until ``stop`` is set; a tick that overruns skips the missed slots.

        ``lead_s`` before each slot the ``ahead_of_tick`` collectors start, so the tick finds them done."""
        loop = asyncio.get_running_loop()
        ahead = [i for i, c in enumerate(self.collectors) if getattr(c, "ahead_of_tick", False)]
        ahead = ahead if self.lead_s > 0 else []
        next_at = loop.time()
        while not stop.is_set():
            early: dict[int, asyncio.Task[Reading]] = {}
            if ahead:
                if await _stopped_by(stop, next_at - self.lead_s):
                    break
                early = self._start_ahead(ahead)
            if await _stopped_by(stop, next_at):
                await _cancel(early.values())
                break
            await self.tick(self.clock(), early)
            next_at += self.interval_s
            lag = loop.time() - next_at
            if lag > 0:
                skipped = int(lag // self.interval_s) + 1
                self._overruns += skipped
                next_at += skipped * self.interval_s


async def _stopped_by(stop: asyncio.Event, deadline: float) -> bool:
    """Wait until the loop time ``deadline``; True when ``stop`` was set first (or already)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
    return stop.is_set()


async def _cancel(tasks: Iterable[asyncio.Task[Reading]]) -> None:
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
