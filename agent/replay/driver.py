"""Closed-loop replay: the simulator's :class:`EngineCore` and servepilot's brain, in virtual time.

The loop is event-driven: submit arrivals when they are due, step the core (fast-forwarding pure-decode
stretches up to the next event), and at every tick boundary build the snapshot the live collectors would
see (:class:`CoreSignals`), let the brain decide, and apply its decisions to the core the way the
actuators would (absolute values: ``max_num_seqs`` for the batch, ``max_num_batched_tokens`` for the
token budget, SM clock, power limit, precision for the fp8 / small upstreams). Nothing reads a clock;
the same trace and seed give the same result.

Requests are judged against the SLO one by one: good when it finished, got no 5xx, its TTFT is within
``slo.ttft_s`` and its mean inter-token latency (TPOT) within ``slo.itl_s`` (DistServe's goodput).

The gate stands in front of the engine as it does live: its queue is the engine's waiting queue (the
batch knob is the engine's ``max_num_seqs``), and a request that has waited ``queue_timeout_s`` without
being scheduled is answered 503, as the gate's ``max_queue_wait_s`` does. It counts as a miss, and, as
live, not as an engine error (the breaker does not see it).

With priority classes (:mod:`agent.replay.classes`) the gate is the live one: the very
:class:`~agent.gate.admission.AdmissionQueue` the gate serves traffic with, in virtual time, in front of
the engine. Its in-flight limit is the batch knob (the engine keeps its ``max_num_seqs``, as live), with
its high reserve, aging, per-class deadlines (503) and queue bound (429, shedding the lowest class
first); a request's TTFT counts its wait in it. Each request is judged by its class's targets, goes to
the engine with its own class (the engine schedules by priority, as with ``gate.engine_priority``; a
promotion in the gate does not travel), and the classes' last arrivals are kept in ``last_seen`` for the
policies' ITL steering, as the live gate keeps them. Each tick gives the policies the gate's in-flight
count and high reserve, as the live gate's snapshot does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from agent.gate.admission import AdmissionQueue, Priority, Ticket, TicketState
from agent.itl_steering import AUDIT_KNOB
from agent.replay.classes import CLASSES
from agent.replay.signals import CoreSignals
from agent.replay.slo import Slo
from agent.replay.workload import Workload
from detectors.snapshot import Snapshot
from policies import knobs
from policies.arbiter import Decision
from simulator.engine import EngineCore
from simulator.faults import FaultSwitches
from simulator.scheduler import Request

#: Longest run of pure-decode steps one core call may fast-forward.
MAX_STEPS = 4096


@dataclass(frozen=True)
class FaultEvent:
    """At ``at_s`` (seconds into the replay), switch the simulator's faults to ``faults``."""

    at_s: float
    faults: FaultSwitches


class Controller(Protocol):
    """Whatever turns a snapshot into knob decisions (the brain, or nothing for a static setting)."""

    def control(self, snapshot: Snapshot, actual: dict[str, float | str]) -> list[Decision]: ...


@dataclass
class TickRow:
    """One tick of the timeline (what the report plots)."""

    t: float
    arrivals: int
    limit: float
    running: float
    waiting: float
    ttft_p99: float
    itl_p99: float
    clock_mhz: float
    power_w: float
    upstream: str
    token_budget: float = 0.0


@dataclass
class ReplayRun:
    """Everything a replay measured: per-request outcomes, the tick timeline and the decisions."""

    workload: Workload
    slo: Slo
    ttft: NDArray[np.float64]
    tpot: NDArray[np.float64]
    done: NDArray[np.bool_]
    error: NDArray[np.bool_]
    energy_j: float
    end_s: float
    timeline: list[TickRow] = field(default_factory=list)
    actions: list[Decision] = field(default_factory=list)
    preemptions: int = 0
    itl_p99_s: float = 0.0
    #: requests the gate's queue timeout answered 503 (also set in ``error``: never served)
    expired: int = 0
    #: each request's priority class (index into :data:`~agent.replay.classes.CLASSES`); None: no classes
    classes: NDArray[np.int64] | None = None
    #: each class's targets, by index (with ``classes``)
    targets: tuple[Slo, ...] = ()
    #: which requests the queue timeout answered 503 (``expired`` counts them)
    refused: NDArray[np.bool_] | None = None
    #: which requests a full gate queue answered 429 (with classes; also set in ``error``)
    rejected: NDArray[np.bool_] | None = None
    #: what speculative decoding did over the run (drafts, draft tokens, accepted tokens); None without
    spec_decode: dict[str, float] | None = None

    @property
    def good(self) -> NDArray[np.bool_]:
        """Served, and within its targets: the SLO's, or its class's own."""
        ok = self.done & ~self.error
        if self.classes is None:
            return ok & (self.ttft <= self.slo.ttft_s) & (self.tpot <= self.slo.itl_s)
        ttft = np.array([t.ttft_s for t in self.targets])[self.classes]
        itl = np.array([t.itl_s for t in self.targets])[self.classes]
        return ok & (self.ttft <= ttft) & (self.tpot <= itl)


class Replay:
    """One replay of ``workload`` on ``core`` under ``controller`` (``None`` keeps the settings).

    ``classes`` gives each request a priority class and ``targets`` each class's targets; ``gate`` (needed
    with classes) is the admission queue in front of the core, whose ``max_wait_s`` and ``wait_scale``
    are the queue timeout and each class's deadline scale (the core should schedule by priority).
    ``last_seen`` gets each class's latest arrival (shared with a steering controller)."""

    def __init__(
        self,
        core: EngineCore,
        workload: Workload,
        slo: Slo,
        *,
        controller: Controller | None = None,
        interval_s: float = 1.0,
        window_s: float = 10.0,
        faults: Sequence[FaultEvent] = (),
        seed: int = 0,
        on_tick: Callable[[Snapshot], None] | None = None,
        queue_timeout_s: float = float("inf"),
        classes: NDArray[np.int64] | None = None,
        targets: Sequence[Slo] = (),
        gate: AdmissionQueue | None = None,
        last_seen: dict[str, float] | None = None,
    ) -> None:
        if classes is not None and (
            classes.size != len(workload) or len(targets) != len(CLASSES) or gate is None
        ):
            raise ValueError("classes need one class per request, targets per class, and a gate")
        self.core = core
        self.workload = workload
        self.slo = slo
        self.controller = controller
        self.interval_s = interval_s
        self.signals = CoreSignals(core, window_s=window_s)
        self.faults = sorted(faults, key=lambda f: f.at_s)
        self.rng = np.random.default_rng(seed)
        self.on_tick = on_tick
        self.queue_timeout_s = queue_timeout_s
        self.expired = 0
        self.classes = classes
        self.targets = tuple(targets)
        self.gate = gate if classes is not None else None
        if self.gate is not None:
            self.gate.max_wait_s = queue_timeout_s
        self.last_seen = last_seen if last_seen is not None else {}
        self._tickets: dict[int, int] = {}  # a waiting ticket's seq -> its request
        self._admitted: dict[str, Ticket] = {}  # an admitted request's id -> its ticket
        #: no fresh waiting request is due to expire before this (a lower bound: scan when reached)
        self._next_expiry = float("inf")
        self.upstream = "primary"
        n = len(workload)
        self.ttft = np.full(n, np.inf)
        self.tpot = np.full(n, np.inf)
        self.done = np.zeros(n, dtype=np.bool_)
        self.error = np.zeros(n, dtype=np.bool_)
        self.refused = np.zeros(n, dtype=np.bool_)
        self.rejected = np.zeros(n, dtype=np.bool_)
        self.arrived = np.zeros(n)
        self._live: dict[str, tuple[int, Request]] = {}
        self._tick_requests = 0
        self._tick_bad = 0
        self._tick_class = np.zeros((len(CLASSES), 2))  # per class: this tick's answers and misses
        self._tick_errors = 0
        self._tick_arrivals = 0
        self._error_rate = 0.0
        self.timeline: list[TickRow] = []
        self.actions: list[Decision] = []

    # -- actuators ----------------------------------------------------------------------------------
    @property
    def batch_limit(self) -> float:
        """The batch knob: the gate's in-flight limit with classes, else the engine's ``max_num_seqs``."""
        return float(self.core.settings.max_num_seqs if self.gate is None else self.gate.limit)

    def actual(self) -> dict[str, float | str]:
        s = self.core.settings
        return {
            knobs.BATCH: self.batch_limit,
            knobs.TOKEN_BUDGET: float(s.max_num_batched_tokens),
            knobs.SM_CLOCK: s.sm_clock_mhz,
            knobs.POWER_LIMIT: s.power_limit_w,
            knobs.UPSTREAM: self.upstream,
            knobs.QUEUE_WAIT: self.queue_timeout_s,
        }

    def apply(self, decision: Decision, now: float) -> None:
        core = self.core
        s = core.settings
        value = decision.value
        if decision.knob == knobs.BATCH and self.gate is not None:  # the gate's limit, as live
            self._settle(self.gate.set_limit(max(1, int(float(value))), now), now)
            self.actions.append(decision)
            return
        if decision.knob == knobs.BATCH:
            settings = core.with_settings(max_num_seqs=max(1, int(float(value))))
        elif decision.knob == knobs.TOKEN_BUDGET:
            settings = core.with_settings(max_num_batched_tokens=max(16, int(float(value))))
        elif decision.knob == knobs.SM_CLOCK:
            settings = core.with_settings(sm_clock_mhz=float(value))
        elif decision.knob == knobs.POWER_LIMIT:
            settings = core.with_settings(power_limit_w=float(value))
        elif decision.knob == knobs.QUEUE_WAIT:
            self.queue_timeout_s = float(value)  # the gate's, not the engine's: settings unchanged
            self._next_expiry = -float("inf")  # every deadline moved: look again
            if self.gate is not None:
                self.gate.max_wait_s = self.queue_timeout_s
            self.actions.append(decision)
            return
        elif decision.knob == AUDIT_KNOB:  # the policies' ITL target moved: no actuator, only the record
            self.actions.append(decision)
            return
        elif decision.knob == knobs.UPSTREAM:
            # One simulated GPU: the fp8 upstream is this engine in fp8; the small model, too (the
            # simulator has no second deployment), so L3 differs from L2 only in the audit trail.
            self.upstream = str(value)
            settings = core.with_settings(precision="fp16" if value == "primary" else "fp8")
        else:
            return
        if settings != s:
            core.apply_settings(settings, now)
        self.actions.append(decision)

    # -- the loop -----------------------------------------------------------------------------------
    def _submit(self, index: int, at: float) -> None:
        self._tick_arrivals += 1
        if self._error_rate > 0 and self.rng.random() < self._error_rate:
            self.error[index] = True  # the engine answered 5xx: counted, never served
            self._tick_requests += 1
            self._tick_bad += 1
            self._tick_errors += 1
            if self.classes is not None:
                self._tick_class[self.classes[index]] += (1.0, 1.0)
            return
        self.arrived[index] = at
        if self.gate is None:
            self._engine(index, at)
            self._next_expiry = min(self._next_expiry, at + self.queue_timeout_s)
            return
        assert self.classes is not None
        name = CLASSES[int(self.classes[index])]
        self.last_seen[name] = at
        ticket, changed = self.gate.offer(Priority[name.upper()], at)
        self._tickets[ticket.seq] = index
        self._settle([ticket, *changed], at)

    def _engine(self, index: int, at: float, priority: int = 0) -> None:
        """Send request ``index`` to the engine at ``at`` (``priority``: lower first)."""
        w = self.workload
        rid = str(index)
        request = self.core.submit(rid, int(w.prompts[index]), int(w.outputs[index]), at, priority)
        self._live[rid] = (index, request)

    def _settle(self, tickets: Sequence[Ticket], now: float) -> None:
        """The gate may have changed these tickets' state: send the admitted to the engine, in the order
        the gate admitted them and with each one's own class; answer the shed 429 and the
        expired 503."""
        for ticket in tickets:
            index = self._tickets.pop(ticket.seq, None)
            if index is None:
                continue  # still waiting, or seen already
            if ticket.state is TicketState.ADMITTED:
                self._admitted[str(index)] = ticket
                self._engine(index, now, Priority.HIGH - ticket.priority)  # its own class, as the gate tells
            elif ticket.state is TicketState.WAITING:
                self._tickets[ticket.seq] = index
            else:  # not an answer: the live gate counts these as rejected, not as 5xx
                self.error[index] = True
                if ticket.state is TicketState.EXPIRED:
                    self.refused[index] = True
                    self.expired += 1
                else:
                    self.rejected[index] = True

    def _expire(self, now: float) -> None:
        """The gate's queue timeout: a request still waiting for its first schedule ``queue_timeout_s``
        after it arrived is answered 503 (never served). Requests put back by a preemption were admitted
        already and stay. The waiting queue is scanned only once the earliest deadline may have passed.
        With classes, the admission queue expires its own, each class at its deadline."""
        if self.gate is not None:
            self._settle(self.gate.expire(now), now)
            return
        if now < self._next_expiry:
            return
        live = self._live
        expired: list[Request] = []
        earliest = float("inf")
        for req in self.core.scheduler.waiting:
            if req.first_scheduled >= 0:
                continue
            due = req.arrival + self.queue_timeout_s
            if due <= now:
                expired.append(req)
            elif due < earliest:
                earliest = due
        self._next_expiry = earliest
        for req in expired:
            self.core.abort(req.rid, now)
            index, _ = live.pop(req.rid)
            self.error[index] = True
            self.refused[index] = True
            self.expired += 1  # not an answer: the live gate counts it as rejected, not as a 5xx

    def _finish(self, rid: str, now: float) -> None:
        index, req = self._live.pop(rid)
        if self.gate is not None:  # its slot frees: the gate admits who is next
            self._settle(self.gate.release(self._admitted.pop(rid), now), now)
        ttft = req.first_token - self.arrived[index]  # with a gate, its wait there too
        tpot = (req.last_token - req.first_token) / (req.output - 1) if req.output > 1 else 0.0
        self.ttft[index], self.tpot[index], self.done[index] = ttft, tpot, True
        self._tick_requests += 1
        slo = self.slo if self.classes is None else self.targets[self.classes[index]]
        missed = ttft > slo.ttft_s or tpot > slo.itl_s
        self._tick_bad += missed
        if self.classes is not None:
            self._tick_class[self.classes[index]] += (1.0, missed)

    def _tick(self, now: float) -> None:
        queue = self.gate
        gate = {
            # without classes the replay's batch limit is the engine's max_num_seqs, so its queue is the
            # engine's own (engine.requests_waiting): the gate holds nothing back there
            knobs.GATE_LIMIT: self.batch_limit,
            knobs.GATE_QUEUE: 0.0 if queue is None else float(queue.queue_depth),
            knobs.GATE_REQUESTS: float(self._tick_requests),
            knobs.GATE_SLO_BAD: float(self._tick_bad),
            knobs.GATE_ERRORS: float(self._tick_errors),
        }
        if self.queue_timeout_s < float("inf"):
            gate[knobs.QUEUE_WAIT] = self.queue_timeout_s
        if queue is not None:  # the live gate's admission state, as its snapshot_values gives it
            gate[knobs.GATE_IN_FLIGHT] = float(queue.in_flight)
            gate[knobs.GATE_RESERVED] = float(queue.reserved)
        if self.classes is not None:
            for name, (answers, missed) in zip(CLASSES, self._tick_class, strict=True):
                gate[knobs.class_signal(name, "requests")] = float(answers)
                gate[knobs.class_signal(name, "slo_bad")] = float(missed)
            self._tick_class[:] = 0.0
        snapshot = self.signals.snapshot(now, gate)
        if self.on_tick is not None:
            self.on_tick(snapshot)
        if self.controller is not None:
            for decision in self.controller.control(snapshot, self.actual()):
                self.apply(decision, now)
        get = snapshot.values.get
        s = self.core.settings
        self.timeline.append(
            TickRow(
                now,
                self._tick_arrivals,
                self.batch_limit,
                get(knobs.RUNNING, 0.0),
                get(knobs.WAITING, 0.0),
                get(knobs.TTFT_P99, 0.0),
                get(knobs.ITL_P99, 0.0),
                get(knobs.SM_CLOCK_HZ, 0.0) / 1e6,
                get("nvml.gpu0.power_watts.mean", 0.0),
                self.upstream,
                float(s.max_num_batched_tokens),
            )
        )
        self._tick_requests = self._tick_bad = self._tick_errors = self._tick_arrivals = 0

    def _switch_faults(self, event: FaultEvent, now: float) -> None:
        self.core.set_faults(event.faults, now)
        self._error_rate = event.faults.error_rate

    def run(self) -> ReplayRun:
        core = self.core
        times = self.workload.arrivals
        n = times.size
        start = core.time
        energy0 = core.gpu_counters.energy_j
        preempt0 = core.stats.preemptions
        itl0 = core.stats.itl.counts.copy()
        spec0 = _spec_counts(core)
        faults = list(self.faults)
        i = 0
        next_tick = start + self.interval_s
        inf = float("inf")
        ungated = self.gate is None
        while i < n or core.has_work():
            next_arrival = start + times[i] if i < n else inf
            next_fault = start + faults[0].at_s if faults else inf
            horizon = min(next_arrival, next_tick, next_fault)
            if core.has_work() and core.time < horizon:
                if self.gate is not None or self.queue_timeout_s < inf:
                    self._expire(core.time)
                # without a gate nothing here acts before the horizon: a finish frees nothing but the
                # engine's own waiting queue (the core watches it), and no queue of the gate's expires
                result = core.step(core.time, max_steps=MAX_STEPS, until=horizon, unattended=ungated)
                for finished in result.finished:
                    self._finish(finished.request_id, core.time)
                if result.steps == 0:  # nothing schedulable (cannot happen on a sane core): wait
                    if horizon == inf:
                        break
                    core.idle_until(horizon)
                continue
            now = core.time if core.has_work() else max(core.time, horizon)
            while faults and start + faults[0].at_s <= now:
                self._switch_faults(faults.pop(0), now)
            while i < n and start + times[i] <= now:
                self._submit(i, start + float(times[i]))
                i += 1
            while next_tick <= now:
                self._tick(next_tick)
                next_tick += self.interval_s
        itl = core.stats.itl
        delta = np.cumsum(itl.counts - itl0).astype(np.float64)
        from agent.collectors.derive import bucket_quantile

        p99 = bucket_quantile(0.99, np.append(itl.bounds, np.inf), delta) if delta[-1] > 0 else None
        return ReplayRun(
            self.workload,
            self.slo,
            self.ttft,
            self.tpot,
            self.done,
            self.error,
            core.gpu_counters.energy_j - energy0,
            core.time - start,
            self.timeline,
            self.actions,
            core.stats.preemptions - preempt0,
            p99 or 0.0,
            self.expired,
            self.classes,
            self.targets,
            self.refused,
            self.rejected,
            _spec_run(core, spec0),
        )


def _spec_counts(core: EngineCore) -> tuple[int, int, int]:
    """The core's drafts, draft tokens and accepted tokens so far (zeros without speculation)."""
    spec = core.spec
    return (spec.drafts, spec.draft_tokens, spec.accepted) if spec is not None else (0, 0, 0)


def _spec_run(core: EngineCore, before: tuple[int, int, int]) -> dict[str, float] | None:
    """What speculative decoding did since ``before``: its setting (``acceptance_per_token``: the chance a
    draft token is accepted once the one before it was) and counts, the share of draft tokens accepted
    (``acceptance``, vLLM's ratio) and the tokens a draft gave (1 + accepted per draft)."""
    if core.spec is None:
        return None
    drafts, drafted, accepted = (now - then for now, then in zip(_spec_counts(core), before, strict=True))
    config = core.spec.config
    return {
        "draft_tokens": config.draft_tokens,
        "acceptance_per_token": config.acceptance,
        "draft_cost": config.draft_cost,
        "drafts": drafts,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else 0.0,
        "tokens_per_draft": 1.0 + accepted / drafts if drafts else 1.0,
    }
