"""SLO-aware batch sizing: a gradient controller on latency against the SLO, guarded by KV-cache signals.

After Netflix's Gradient2 and Envoy's adaptive concurrency: the limit follows the ratio of a latency
target to the measured latency, and grows by a queue allowance only when there is work waiting. What
differs is the target: not a learned no-load latency but the operator's SLO, with headroom ``h``::

    g_itl   = h * itl_slo / itl_mean            (window mean of inter-token latency)
    g_ttft  = h * ttft_slo / ttft_p99
    p       = preemptions/s, smoothed: p <- p * a + preemptions * (1 - a), a = exp(-dt / preempt_tau_s)
    thrash  = p > preempt_max and preemptions > 0    (sustained, and still going on this tick)

    thrash                       ->  L = min(L, running) * md             KV cache thrashes: back off
    g_itl < 1, decode share >= 5%
                                 ->  L = L * max(md, g_itl)              ITL over target: shrink
    behind the gate, the engine queues > s of its admits for engine_queue_ticks, KV below kv_target
                                 ->  L = running + R + s                 its own cap binds: queue here
                                     (s = max(2, ceil(sqrt(running))), only when it cuts >= max(2, 10%))
    L binds and
      (g_itl > ai_margin or decode share < 5%) and kv_usage < kv_target and no preemption this tick
      (and behind the gate, the engine's queue smoothed over engine_queue_tau_s <= its own slack)
                                 ->  L = max(L + max(1, sqrt(L)),        room to grow: additive increase,
                                             L * min(2, sqrt(g_itl / ai_margin)))  or faster far below target;
                                 at most max(L + 1, running * kv_target / kv + R)    as far as the cache holds
    L above what the engine's slots take, behind the gate
                                 ->  L = (slots + s) / (1 - r)           the rest would queue in the engine
                                     (r: the gate's high reserve, a share of L; llama.cpp says its slots)
    L outside [lower, upper]     ->  L                                    brought back inside (below)
    otherwise                    ->  hold
    L = min(upper, max(lower, L)), and no growth past what the slots take

A full KV cache is not thrash: when the cache is what bounds concurrency (long chat histories), the
engine admits what fits and preempts now and then; a limit cut below that only idles capacity. Measured
on Mooncake at x0.5 with 512-token chunks: ``max_num_seqs`` 64 (the cache binds, 446 preemptions in
2 h) serves 99.25% of requests within the SLO, 32 (none) 98.7%; a limit that backed off at every tick
with usage above 95% or any preemption settled near 32, and one that backed off at a smoothed 0.5/s
still lost 0.3 points. So usage near full or a preemption only stops growth; the limit backs off when
preemptions keep coming: the rate smoothed over ``preempt_tau_s`` above ``preempt_max`` (2/s, 60 in
30 s) and still preempting this tick, the recompute storm that sinks an engine default (1.6/s on
average over the whole trace, in bursts, at ``max_num_seqs`` 64 with 1024-token chunks: 52%).

**Prefill-bound steps.** When the decode share of a step's tokens (``policies/steps.py``: generated over
prompt plus generated tokens/s) is under 5%, the steps' length is the prompt chunks', and a smaller batch
cannot shorten them: it only queues requests. Then the ITL rule does not cut, and a binding limit grows on
its queue though ITL is over target (a few more decodes per step add little to a step that carries a
2,048-token chunk). On the Azure 2024 coding week's weekday peak (code prompts, 1% decode), the ITL rule had
cut the limit from 256 to 8-20 and the queue grew to 895 requests, while no batch from 32 to 256 changed
the share of requests meeting the ITL target (40-44%): that is the token budget's to fix.

When ITL and TTFT are both at risk the engine is overloaded and shrinking would only move the violation
from ITL to TTFT (prefill-bound steps do not get faster with fewer sequences): the controller holds.
The queue wait is estimated by Little's law, ``queue / finish rate``.

The limit binds when requests wait and ``running >= L - R - 1``, ``R`` being the slots the gate reserves
for high priority (0 without a gate: in the replay the limit is the engine's ``max_num_seqs``). Normal
traffic can fill only ``L - R`` slots, so with the gate's default 20% reserve a test against ``L - 1``
never saw a normal-priority queue bind, and the limit never grew for one. Behind the gate the engine's
``running`` gauge is not trusted alone either: it is a sample of the engine's last step, and a real vLLM
serving a fast model read 0 running, tick after tick, while the gate had 2 in flight and 19 queued (the
controller held at 2). The gate's own in-flight count minus what the engine says it queues is exact;
the larger of the two is used, also as the base the limit shrinks from (a sampled 0 would otherwise cut
the limit to its floor in one step). An engine whose own cap binds below the gate's limit queues the
gate's excess itself, so ``running`` stays below ``L - R - 1`` and the gate's limit does not grow for it.
Nor should it stay there: requests queued inside the engine wait FIFO, where the gate's priorities, the
promotion of old requests and the queue deadline (503 with ``Retry-After``) cannot reach them. So when
the engine keeps more than a slack ``s`` of the gate's requests queued, tick after tick, with room in its
cache, the limit comes down to ``running + R + s``: the engine keeps ``s`` to admit from when a slot
frees, the rest wait in the gate. Seen on llama.cpp (4 slots) in ``servepilot demo --mode act``: the
gate's limit stayed at its initial 64 for a minute while 47 requests waited in the engine. A full cache
is left out: there the engine admits as blocks free, and a limit pinned to what ran before would keep
it from admitting more when shorter requests come (the growth rule stops above ``kv_target``).
Growth waits too while the engine's queue, smoothed over ``engine_queue_tau_s``, is above the slack of
what the engine itself says it runs: on that llama.cpp a scrape now and then read 0 running and 0
waiting with 7 in flight, which made the limit look bound, and the limit went 9 -> 14 -> 21 -> 32 -> 48
-> 64 within seconds after being brought down.

That guard alone holds the limit where the cut leaves it only while the engine's queue stays above its
slack, and the cut is made to leave it the slack: at that equilibrium the guard passes now and then, the
more so as requests in transit to vLLM's scheduler are in neither of its gauges. Beside vLLM's CPU backend
(``--max-num-seqs 4``) slowed by a CPU hog, the limit went 8 -> 12 -> 8 -> 12 within two minutes: each
growth put four more of the gate's requests in the engine's FIFO queue, until the queueing rule cut them
back. So the controller keeps the most the engine ran on a tick it queued more than the slack (its cap,
as far as seen), and grows no further than that cap, the reserve and the slack take (as with llama.cpp's
slots, below), until the engine runs more than the cap: then the cap is higher (shorter requests in a
KV-bound engine, or a restart with a larger ``max_num_seqs``) and is forgotten.

Growth stops short of what the cache holds at ``kv_target`` with the sequences' footprint now (``running x
kv_target / kv``, plus the reserve, one step at least). A cache-bound engine runs few sequences, so its ITL
sits far below target, and the gradient's x1.3 step from 84% usage (39 -> 51 with 31 running) put more in
the engine than its cache holds: they queued inside it, where the gate's classes do not reach, and the
cache filled to preemptions. Replaying the Mooncake hour with a tenth of its traffic interactive (TTFT 2 s)
the high class met 84.52% with the cap and 73.71% without (docs/policies.md, "Priority classes in replay").

**An engine that says how many it runs at once.** llama.cpp has a fixed number of slots (its
``--parallel``, in ``/slots``: ``engine.slots_total``) and queues the rest FIFO. Behind the gate a limit
above the slots, the gate's high reserve and the slack only moves the queue into the engine, so the limit
is brought down to that at once, and never grows past it. The reserve is a share of the limit itself
(``gate.high_reserved_ratio``), hence the division. Before 2026-12-06 the limit stayed at its initial
64 on a 4-slot llama.cpp until the engine's queue had held more than the slack for five ticks: in
``servepilot demo --engine llamacpp --mode act`` a burst at 45 s put 32 requests in llama.cpp's queue,
and the high class's TTFT p99 went to 4.7 s. vLLM and SGLang publish no such cap (``max_num_seqs`` is
not in their metrics): for them the queueing rule above finds it.

A limit that does not bind (fewer running than allowed and no queue) never grows: the controller only
probes upward when the queue asks for it, so an idle period cannot leave a huge limit behind. TTFT enters
through the queue: a long queue with ITL headroom grows the limit; a TTFT at risk with ITL at target holds
(more concurrency would only trade one violation for another).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from detectors.base import Finding
from detectors.snapshot import Snapshot
from policies import knobs
from policies.arbiter import PRIORITY
from policies.base import Proposal
from policies.steps import DECODE_SHARE_MIN, TokenMix
from policies.windows import smoothed


@dataclass(frozen=True)
class AutoState:
    limit: float
    #: Smoothed preemptions/s and the time it was last updated.
    preempt_rate: float = 0.0
    at: float | None = None
    #: Consecutive ticks the engine has queued more of the gate's requests than the slack it is left.
    engine_queued: int = 0
    #: The engine's own queue, smoothed over ``engine_queue_tau_s``.
    engine_queue: float = 0.0
    #: The engine's prompt and generated tokens/s, smoothed: the decode share of a step's tokens.
    mix: TokenMix = field(default_factory=TokenMix)
    #: Behind the gate, the most the engine ran (its own count) on a tick it queued more than the slack of
    #: the gate's requests: its own cap, as far as seen; 0 before any, or once it ran more than that.
    engine_cap: float = 0.0


@dataclass(frozen=True)
class AutoBatch:
    """The SLO-aware batch controller (see module docstring for the update rule)."""

    ttft_slo_s: float
    itl_slo_s: float
    lower: float = 8.0
    upper: float = 512.0
    initial: float = 64.0
    headroom: float = 0.8
    kv_target: float = 0.85
    md: float = 0.95
    ai_margin: float = 1.1
    preempt_tau_s: float = 30.0
    preempt_max: float = 2.0
    engine_queue_ticks: int = 5
    engine_queue_tau_s: float = 10.0
    decode_share_min: float = DECODE_SHARE_MIN
    name: str = "batch_auto"

    def __post_init__(self) -> None:
        if not (self.ttft_slo_s > 0 and self.itl_slo_s > 0):
            raise ValueError("SLO targets must be > 0")
        if not 0 < self.lower <= self.initial <= self.upper:
            raise ValueError("bounds must satisfy 0 < lower <= initial <= upper")

    def decide(
        self, snapshot: Snapshot, findings: Sequence[Finding], state: AutoState | None, now: float
    ) -> tuple[AutoState | None, list[Proposal]]:
        engine_running = snapshot.get(knobs.RUNNING)
        if engine_running is None:
            return state, []  # the engine did not answer this tick: hold
        current = snapshot.get(knobs.GATE_LIMIT)
        limit = current if current is not None else (state.limit if state is not None else self.initial)
        engine_waiting = snapshot.get(knobs.WAITING) or 0.0
        gate_queue = snapshot.get(knobs.GATE_QUEUE) or 0.0
        in_flight = snapshot.get(knobs.GATE_IN_FLIGHT)
        # the engine's gauge is a sample of its last step; behind the gate its own count is exact
        running = engine_running if in_flight is None else max(engine_running, in_flight - engine_waiting)
        # behind the gate the queue is the gate's; the engine's own queue adds to it
        waiting = engine_waiting + gate_queue
        kv = snapshot.get(knobs.KV_USAGE) or 0.0
        preempt = snapshot.get(knobs.PREEMPTIONS) or 0.0
        previous, at = (state.preempt_rate, state.at) if state is not None else (0.0, None)
        rate = smoothed(previous, at, now, preempt, self.preempt_tau_s)
        itl = snapshot.get(knobs.ITL_MEAN)
        g_itl = self.headroom * self.itl_slo_s / itl if itl else math.inf
        # the decode share of a step's tokens is what a smaller batch can take off it (policies/steps.py)
        mix = (state.mix if state is not None else TokenMix()).update(snapshot, now)
        prefill_bound = mix.prefill_bound(self.decode_share_min)
        reserved = snapshot.get(knobs.GATE_RESERVED) or 0.0
        binds = waiting > 0 and running >= limit - reserved - 1
        ttft = snapshot.get(knobs.TTFT_P99) or 0.0
        finished = snapshot.get(knobs.FINISHED) or 0.0
        wait = waiting / finished if finished > 0 else (math.inf if waiting > 0 else 0.0)
        ttft_risk = ttft > self.headroom * self.ttft_slo_s or wait > 0.5 * self.ttft_slo_s
        # behind the gate, the engine queueing the gate's admits tick after tick with room in its cache means
        # its own cap (slots, max_num_seqs, token budget) binds below the limit: there the requests wait
        # FIFO, out of reach of the gate's priorities, promotion and deadlines. Leave it a slack, no more.
        slack = _slack(running)
        queued = ((state.engine_queued if state is not None else 0) + 1) if engine_waiting > slack else 0
        engine_queue = smoothed(
            state.engine_queue if state is not None else 0.0, at, now, engine_waiting, self.engine_queue_tau_s
        )
        capped = running + reserved + slack
        slots_take = _slots_take(snapshot, limit, reserved, in_flight)
        cap = state.engine_cap if state is not None else 0.0
        if in_flight is not None and engine_waiting > slack:
            cap = max(cap, engine_running)
        elif engine_running > cap:
            cap = 0.0  # it runs more than it did when it queued: its cap is higher now
        # growth stops at what that cap takes, as at what slots take
        cap_takes = cap + reserved + _slack(cap) if cap > 0 else math.inf
        engine_binds = (
            in_flight is not None
            and queued >= self.engine_queue_ticks
            and kv < self.kv_target  # a full cache binding is the engine's to pace (see above)
            and limit - capped >= max(2.0, 0.1 * limit)
        )
        if rate > self.preempt_max and preempt > 0:
            new = min(limit, running) * self.md
            why = (
                f"KV cache thrashing ({rate:.2g} preemptions/s over {self.preempt_tau_s:g} s, usage {kv:.0%})"
            )
        elif g_itl < 1.0 and not ttft_risk and not prefill_bound:
            new = min(limit, max(running, 1.0)) * max(self.md, g_itl)
            why = f"ITL {itl:.4g}s above target {self.headroom * self.itl_slo_s:.4g}s"
        elif limit - max(self.lower, slots_take) >= 1.0:
            new = slots_take
            why = (
                f"the engine runs {snapshot.get(knobs.ENGINE_SLOTS):.0f} at once (its slots): past "
                f"{slots_take:.0f} requests wait in its own queue, not in the gate's where priorities apply"
            )
        elif engine_binds:
            new = capped
            why = (
                f"the engine queues {engine_waiting:.0f} of the gate's requests itself ({running:.0f} "
                f"running, {queued} ticks): they wait in the gate instead, where priorities apply"
            )
        elif (
            binds
            and (g_itl > self.ai_margin or prefill_bound)
            and kv < self.kv_target
            and preempt <= 0
            # behind the gate, not while the engine holds more than a slack queued (by its own count of
            # running: a sampled 0 + 0 reading with the gate's in-flight would hide its cap for a tick)
            and (in_flight is None or engine_queue <= _slack(engine_running))
            and limit < min(slots_take, cap_takes)  # no growth past what the slots, or the cap seen, take
        ):
            # far below the ITL target (a cold start at a small limit) the gradient's square root
            # outgrows the additive step: the operating point is reached in a few ticks, not dozens
            new = max(limit + max(1.0, math.sqrt(limit)), limit * min(2.0, math.sqrt(g_itl / self.ai_margin)))
            why = f"{waiting:.0f} queued, ITL {itl or 0:.3f}s and KV {kv:.0%} leave room"
            if g_itl <= self.ai_margin:
                why = (
                    f"{waiting:.0f} queued, KV {kv:.0%}: ITL {itl or 0:.3f}s is the prompt chunks' "
                    f"({mix.decode_share:.1%} of a step's tokens are decodes), not the batch's"
                )
            holds = running * self.kv_target / kv + reserved if kv > 0 else math.inf
            if holds < new:  # no further than the cache holds at kv_target with the sequences' footprint now
                new = max(limit + 1.0, holds)
                why += f", up to what the cache holds at {self.kv_target:.0%}"
            if slots_take < new:
                new = slots_take
                why += ", up to what the engine's slots take"
            elif cap_takes < new:
                new = max(limit + 1.0, cap_takes)
                why += f", up to what the engine's cap takes (it queued at {cap:.0f} running)"
        elif not self.lower <= limit <= self.upper:
            # set outside the bounds (the gate's configured start, or bounds narrowed by a config reload):
            # holding would keep it there for as long as no other branch fires
            new = limit
            why = f"limit {limit:g} outside the policy's bounds [{self.lower:g}, {self.upper:g}]"
        else:
            return AutoState(limit, rate, now, queued, engine_queue, mix, cap), []
        new = min(self.upper, max(self.lower, new))
        proposal = Proposal(self.name, knobs.BATCH, round(new), why, PRIORITY["throughput"])
        return AutoState(new, rate, now, queued, engine_queue, mix, cap), [proposal]


def _slots_take(snapshot: Snapshot, limit: float, reserved: float, in_flight: float | None) -> float:
    """Behind the gate, the limit at which an engine that says its slots (llama.cpp) runs them all and keeps
    a slack to admit from: ``slots + slack`` for the other classes, plus the high reserve, which is a share
    of the limit. Infinite without the gate or a slot count."""
    slots = snapshot.get(knobs.ENGINE_SLOTS)
    if in_flight is None or not slots or slots <= 0:
        return math.inf
    return slots_take(slots, reserved / limit if limit > 0 else 0.0)


def slots_take(slots: float, reserve_share: float) -> float:
    """The gate's limit at which an engine with ``slots`` runs them all with a slack to admit from, the
    high class's reserve (``reserve_share`` of the limit, at most half) on top."""
    return math.ceil((slots + _slack(slots)) / (1.0 - min(0.5, reserve_share)))


def _slack(running: float) -> float:
    """Of the gate's requests, how many the engine may keep queued to admit from: max(2, ceil(sqrt))."""
    return max(2.0, math.ceil(math.sqrt(running)))
