"""EngineCore: the discrete-time heart of the simulator, shared by the live server and replay.

No clock reads, no asyncio: callers pass ``now`` (seconds) and get back what one step did and how long it
took. Between calls the core integrates idle power and cooling up to ``now``. ``step(now, max_steps=N,
until=T)`` may fast-forward across up to ``N`` consecutive steps in which nobody is admitted or finishes
until the last of them: pure-decode steps in one vectorised call and, for a caller that does nothing
between steps (``unattended``), steps in which the newest request's prompt goes on in chunks beside the
decoding ones, priced one by one but applied to the requests once.
That is what lets a replay run thousands of times faster than real time; per-step results (every token,
every histogram observation) are identical to stepping one by one, except that power and temperature are
integrated per run of pure decode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from simulator.faults import FaultSwitches
from simulator.hardware import GpuProfile
from simulator.kvcache import BLOCK_SIZE, BlockPool, KvBudget, blocks_for, kv_budget
from simulator.models import ModelProfile
from simulator.power import (
    REASON_APPLICATIONS_CLOCKS,
    REASON_SW_POWER_CAP,
    REASON_SW_THERMAL,
    PowerModel,
    ThermalModel,
)
from simulator.scheduler import Policy, Request, Schedule, Scheduler
from simulator.specdec import SpecDecodeConfig, SpecDecoder
from simulator.stats import EngineStats
from simulator.steptime import StepCost, StepTimeModel

#: Longest stretch one fast-forwarded call may cover, so power and temperature stay fine-grained.
MAX_RUN_S = 2.0


@dataclass(frozen=True)
class EngineSettings:
    """The knobs the control API turns, in absolute values."""

    max_num_seqs: int
    precision: str
    sm_clock_mhz: float
    power_limit_w: float
    #: The chunked-prefill token budget of one step (vLLM's ``max_num_batched_tokens``).
    max_num_batched_tokens: int = 8192


@dataclass(frozen=True)
class Finished:
    """A request that completed (or was aborted) in a step."""

    request_id: str
    reason: str
    prompt_tokens: int
    output_tokens: int


@dataclass
class StepResult:
    """What a ``step`` call did. ``tokens``: tokens emitted per request id; ``duration`` 0 when idle."""

    start: float
    duration: float
    steps: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    finished: list[Finished] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    batch_tokens: int = 0

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass
class GpuCounters:
    """Cumulative GPU activity, read by the simulated NVML view (which differences it over windows)."""

    time_s: float = 0.0
    busy_s: float = 0.0
    energy_j: float = 0.0
    bytes_moved: float = 0.0
    mem_busy_s: float = 0.0
    clock_mhz: float = 0.0
    power_w: float = 0.0
    throttle_reasons: int = 0
    activation_bytes: float = 0.0


class EngineCore:
    """A vLLM-like engine on one GPU profile (or one tensor-parallel node)."""

    def __init__(
        self,
        gpu: GpuProfile,
        model: ModelProfile,
        settings: EngineSettings,
        *,
        max_num_batched_tokens: int | None = None,
        gpu_memory_utilization: float = 0.9,
        block_size: int = BLOCK_SIZE,
        start: float = 0.0,
        scheduling_policy: Policy = "fcfs",
        spec: SpecDecodeConfig | None = None,
    ) -> None:
        self.gpu = gpu
        #: speculative decoding (simulator/specdec.py); None drafts nothing
        self.spec = SpecDecoder(spec) if spec is not None and spec.draft_tokens > 0 else None
        self.model = model
        if max_num_batched_tokens is not None:
            settings = replace(settings, max_num_batched_tokens=max_num_batched_tokens)
        if settings.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {settings.max_num_batched_tokens}")
        #: The budget at start-up: the activation reserve (hence the KV pool) is sized for it once, as
        #: vLLM's memory profiling does; the runtime knob changes the step budget, not the pool.
        self.profiled_batched_tokens = settings.max_num_batched_tokens
        self.gpu_memory_utilization = gpu_memory_utilization
        self.block_size = block_size
        self.stats = EngineStats(max_model_len=model.max_model_len)
        self.faults = FaultSwitches()
        self.power = PowerModel(gpu)
        self.thermal = ThermalModel(gpu)
        self.gpu_counters = GpuCounters(time_s=start, clock_mhz=gpu.clock_min_mhz, power_w=gpu.idle_power_w)
        self.leak_base_bytes = 0.0
        self.leak_since = start
        self._t = start
        self._requests: dict[str, Request] = {}
        self.budget: KvBudget = self._budget(settings.precision)
        self.scheduler = Scheduler(
            BlockPool(self.budget.num_blocks),
            settings.max_num_seqs,
            settings.max_num_batched_tokens,
            block_size,
            scheduling_policy,
        )
        self.settings = settings
        self.steptime = StepTimeModel(gpu, model, settings.precision)

    @property
    def max_num_batched_tokens(self) -> int:
        """The current step token budget (a runtime setting)."""
        return self.settings.max_num_batched_tokens

    # -- settings and faults ------------------------------------------------------------------------
    def _budget(self, precision: str) -> KvBudget:
        budget = kv_budget(
            self.gpu,
            self.model,
            precision,
            self.gpu_memory_utilization,
            self.profiled_batched_tokens,
            self.block_size,
        )
        if budget.num_blocks < blocks_for(self.model.max_model_len, self.block_size):
            raise ValueError(
                f"KV cache holds {budget.num_blocks * self.block_size} tokens in {precision}, fewer than "
                f"max_model_len {self.model.max_model_len}; raise gpu_memory_utilization"
            )
        return budget

    def apply_settings(self, settings: EngineSettings, now: float) -> list[str]:
        """Switch to ``settings`` (validated by the caller against :meth:`capabilities`). A precision change
        re-sizes the KV pool; sequences that no longer fit are preempted. Returns preempted ids."""
        self._advance_idle(now)
        preempted: list[Request] = []
        if settings.precision != self.settings.precision:
            budget = self._budget(settings.precision)
            self.budget = budget
            self.scheduler.pool.resize(budget.num_blocks)
            self.steptime = StepTimeModel(self.gpu, self.model, settings.precision)
            preempted = self.scheduler.shrink_to_fit()
            self.stats.preemptions += len(preempted)
        self.scheduler.max_num_seqs = settings.max_num_seqs
        self.scheduler.max_num_batched_tokens = settings.max_num_batched_tokens
        self.settings = settings
        return [r.rid for r in preempted]

    def set_faults(self, faults: FaultSwitches, now: float) -> None:
        """Switch faults; a leak keeps what it leaked so far and restarts its staircase at ``now``."""
        self._advance_idle(now)
        self.leak_base_bytes = self.leaked_bytes(now)
        self.leak_since = now
        self.faults = faults

    def leaked_bytes(self, now: float) -> float:
        """Leaked memory at ``now``: whole stairs of ``leak_step_bytes`` at ``leak_bytes_per_hour``."""
        f = self.faults
        if f.leak_bytes_per_hour <= 0:
            return self.leak_base_bytes
        grown = f.leak_bytes_per_hour * max(0.0, now - self.leak_since) / 3600.0
        return self.leak_base_bytes + math.floor(grown / f.leak_step_bytes) * f.leak_step_bytes

    # -- requests -----------------------------------------------------------------------------------
    def submit(
        self, request_id: str, prompt_tokens: int, max_tokens: int, now: float, priority: int = 0
    ) -> Request:
        """Queue a request; raises ValueError (one line, vLLM's wording) when it can never run.
        ``priority`` (lower first) orders it only under the priority scheduling policy."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError(f"prompt and max_tokens must be >= 1, got {prompt_tokens} and {max_tokens}")
        limit = self.model.max_model_len
        if prompt_tokens + max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion)."
            )
        self._advance_idle(now)
        request = Request(request_id, prompt_tokens, max_tokens, now, priority)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str, now: float) -> bool:
        """Drop a request (client went away); counted as ``finished_reason="abort"``."""
        request = self.scheduler.remove(request_id)
        if request is None:
            return False
        del self._requests[request_id]
        self.stats.request_success["abort"] += 1
        return True

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.scheduler.pool.usage)

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    @property
    def time(self) -> float:
        """Simulated time up to which the core has accounted (end of the last step or idle stretch)."""
        return self._t

    # -- time ---------------------------------------------------------------------------------------
    def _advance_idle(self, now: float) -> None:
        dt = now - self._t
        if dt <= 0:
            return
        g = self.gpu_counters
        if self.faults.stalled and self.faults.stalled_gpu == "busy":
            # a hung collective: spin kernels on a few SMs keep the GPU busy at its clock, at low power
            clock = self.settings.sm_clock_mhz
            power = self.power.spin_power(clock)
            g.busy_s += dt
        else:
            clock, power = self.gpu.clock_min_mhz, self.power.idle_power
        g.energy_j += power * dt
        g.time_s = now
        g.power_w = power
        g.clock_mhz = clock
        g.activation_bytes = 0.0
        self.thermal.advance(power, dt, self.faults.ambient_c)
        self._t = now

    def idle_until(self, now: float) -> None:
        """Account idle time up to ``now`` (telemetry reads call this so energy keeps integrating)."""
        self._advance_idle(now)

    def _clock_for(self, cost_at: StepCost, clock: float) -> tuple[float, int]:
        """Apply the power limit to ``clock`` given the step's shares; returns (clock, extra reasons)."""
        new_clock, capped = self.power.capped_clock(
            clock, self.settings.power_limit_w, cost_at.compute_share, cost_at.mem_share
        )
        return new_clock, (REASON_SW_POWER_CAP if capped else 0)

    def _account_busy(self, cost: StepCost, duration: float, clock: float, reasons: int) -> None:
        factor = cost.duration_s / duration if duration > 0 else 1.0
        power = self.power.busy_power(clock, cost.compute_share * factor, cost.mem_share * factor)
        g = self.gpu_counters
        g.busy_s += duration
        g.energy_j += power * duration
        g.bytes_moved += cost.bytes_moved
        g.mem_busy_s += cost.mem_s
        g.power_w = power
        g.clock_mhz = clock
        g.throttle_reasons = reasons
        self.thermal.advance(power, duration, self.faults.ambient_c)
        self._t += duration
        g.time_s = self._t

    # -- the step -----------------------------------------------------------------------------------
    def step(
        self, now: float, *, max_steps: int = 1, until: float | None = None, unattended: bool = False
    ) -> StepResult:
        """Run one engine iteration starting at ``max(now, end of the previous one)``.

        With ``max_steps > 1`` the call also fast-forwards through following pure-decode steps that start
        before ``until`` (if given); the result then covers ``steps`` iterations. The fast-forward stops
        where a request ends, so that the caller can answer it and send what that frees.

        ``unattended``: the caller does nothing between steps before ``until`` (no finish to answer, no
        queue of its own to expire; a replay without a gate, which reads when each request ended from
        its timestamps). The call then also goes on past a request's end while nothing waits, and runs
        at once the steps in which the newest prompt is prefilled in chunks beside decoding sequences.
        A caller that acts between steps (a gate admitting on a finish, expiring its queue at each
        call) would act later than it does step by step.
        """
        self._advance_idle(now)
        start = self._t
        result = StepResult(start=start, duration=0.0)
        sched = self.scheduler.schedule(start)
        result.preempted = [r.rid for r in sched.preempted]
        self.stats.preemptions += len(sched.preempted)
        if not sched.items:
            return result
        clock, reasons, cost = self._price(sched)
        duration = cost.duration_s * self.faults.latency_factor
        self._account_busy(cost, duration, clock, reasons)
        self.gpu_counters.activation_bytes = sched.num_tokens * self.model.hidden * 16.0 / self.gpu.tp
        result.duration = duration
        result.steps = 1
        result.batch_tokens = sched.num_tokens
        self.stats.steps += 1
        self._apply(sched, start + duration, result)
        quiet = not sched.preempted and sched.waiting_blocked and not (result.finished and self.num_waiting)
        if max_steps > 1 and quiet and self.spec is None:  # drafts: every step draws its acceptances
            while True:
                ended = unattended and self._prefill_forward(result, max_steps - result.steps, until)
                if not ended:
                    ended = self._fast_forward(result, max_steps - result.steps, until)
                if not (ended and unattended and not self.num_waiting):
                    break
        return result

    def _base_clock(self) -> tuple[float, int]:
        """The clock before the power limit: the setting, capped by the thermal governor."""
        settings = self.settings
        thermal_cap = self.thermal.clock_cap_mhz()
        reasons = 0
        if settings.sm_clock_mhz < self.gpu.clock_max_mhz:
            reasons |= REASON_APPLICATIONS_CLOCKS
        if thermal_cap < settings.sm_clock_mhz:
            reasons |= REASON_SW_THERMAL
        return min(settings.sm_clock_mhz, thermal_cap), reasons

    def _price(self, sched: Schedule) -> tuple[float, int, StepCost]:
        context = 0
        pairs = 0.0
        for req, n in sched.items:
            context += req.computed
            pairs += n * (req.computed + (n + 1) * 0.5)
        new_tokens, seqs = sched.num_tokens, len(sched.items)
        spec = self.spec
        drafting = 0
        if spec is not None:  # each decoding sequence's draft tokens are verified in this forward pass
            for req, _ in sched.items:
                if _drafts(req):
                    drafting += 1
                    pairs += spec.k * (req.computed + (spec.k + 1) * 0.5)
            new_tokens += spec.k * drafting
        clock, reasons, cost = self._cost(new_tokens, seqs, context, pairs)
        if drafting and spec is not None and spec.cost_factor() != 1.0:
            cost = replace(cost, duration_s=cost.duration_s * spec.cost_factor())
        return clock, reasons, cost

    def _cost(self, new_tokens: int, seqs: int, context: int, pairs: float) -> tuple[float, int, StepCost]:
        """One step's clock (the setting, the thermal cap, the power limit), throttle reasons and cost."""
        clock, reasons = self._base_clock()
        cost = self.steptime.cost(new_tokens, seqs, context, pairs, clock)
        capped_clock, extra = self._clock_for(cost, clock)
        if extra:
            cost = self.steptime.cost(new_tokens, seqs, context, pairs, capped_clock)
        return capped_clock, reasons | extra, cost

    def _apply(self, sched: Schedule, end: float, result: StepResult) -> None:
        stats = self.stats
        done: list[Request] = []
        gaps: list[float] = []
        tokens = result.tokens
        accepted = self._accepted(sched) if self.spec is not None else None
        decoding = 0  # sequences whose one scheduled token is the one they generated the step before
        for req, n in sched.items:
            drafted = accepted is not None and _drafts(req)
            req.computed += n
            if req.computed < req.prompt + req.output:
                continue  # mid-prefill chunk: no token yet
            if req.output == 0:
                req.first_token = end
                stats.ttft.observe(end - req.arrival)
                stats.prompt_tokens += req.prompt
            else:
                gaps.append(end - req.last_token)  # one gap per step, as vLLM observes it
                decoding += n == 1
            emitted = 1
            if drafted and accepted:
                emitted += self._keep_drafts(req, accepted.pop())
            req.output += emitted
            req.last_token = end
            tokens[req.rid] = emitted  # the step's first iteration: each request appears once
            if req.output >= req.max_tokens:
                done.append(req)
        generated = sum(tokens.values()) if accepted is not None else len(tokens)
        stats.generation_tokens += generated
        # vLLM's iteration_tokens: prompt tokens computed in the step + the tokens it generated, accepted
        # drafts included (a decoding sequence's input token was counted when generated)
        stats.iteration_tokens.observe(sched.num_tokens - decoding + generated)
        if gaps:
            stats.itl.observe_list(gaps)
        if done:
            self._finish(done, end, result)

    def _accepted(self, sched: Schedule) -> list[int]:
        """This step's leading accepted draft tokens, one per decoding sequence (popped from the end)."""
        assert self.spec is not None
        acceptance = self.faults.spec_acceptance
        if acceptance is None:
            acceptance = self.spec.config.acceptance
        return self.spec.draw(sum(1 for req, _ in sched.items if _drafts(req)), acceptance)

    def _keep_drafts(self, req: Request, accepted: int) -> int:
        """Keep up to ``accepted`` verified draft tokens of ``req``: no more than its answer has left, and
        only as far as KV blocks hold them (its own, or free ones of the pool); counted as one draft."""
        assert self.spec is not None
        keep = min(accepted, req.max_tokens - req.output - 1)
        if keep > 0:
            pool, bs = self.scheduler.pool, self.block_size
            need = blocks_for(req.computed + keep, bs) - req.blocks
            if need > 0 and not pool.allocate(need):
                keep = max(0, min(keep, req.blocks * bs - req.computed))
            elif need > 0:
                req.blocks += need
        req.computed += keep
        self.spec.count(keep)
        return keep

    def _finish(self, done: list[Request], end: float, result: StepResult) -> None:
        stats = self.stats
        finished_ids = {id(r) for r in done}
        self.scheduler.running = [r for r in self.scheduler.running if id(r) not in finished_ids]
        for req in done:
            self.scheduler.pool.release(req.blocks)
            req.blocks = 0
            del self._requests[req.rid]
            stats.request_success["length"] += 1
            stats.e2e.observe(end - req.arrival)
            stats.queue.observe(req.first_scheduled - req.arrival)
            stats.inference.observe(end - req.first_scheduled)
            stats.prefill.observe(req.first_token - req.first_scheduled)
            stats.decode.observe(end - req.first_token)
            if req.output > 1:
                stats.tpot.observe((end - req.first_token) / (req.output - 1))
            stats.request_prompt_tokens.observe(req.prompt)
            stats.request_generation_tokens.observe(req.output)
            stats.request_max_tokens.observe(req.max_tokens)
            stats.request_preemptions.observe(req.preemptions)
            result.finished.append(Finished(req.rid, "length", req.prompt, req.output))

    def _fast_forward(self, result: StepResult, max_extra: int, until: float | None) -> bool:
        """Run up to ``max_extra`` pure-decode steps at once; true when it stopped because a request
        ended (the others could go on)."""
        running = self.scheduler.running
        n = len(running)
        if n == 0 or n > self.max_num_batched_tokens:
            return False
        k = max_extra
        context = 0
        for req in running:
            left = req.prompt + req.output - req.computed
            if left != 1 or req.output == 0:  # a prompt's last token too: its step gives the first token
                return False  # someone is still in prefill: the next step is not a pure decode
            if req.max_tokens - req.output < k:
                k = req.max_tokens - req.output
            context += req.computed
        if k < 1:
            return False
        start = self._t
        factor = self.faults.latency_factor
        clock, reasons = self._base_clock()
        arrays = self.steptime.decode_arrays(n, context, k, clock)
        first = self.steptime.summarise(arrays, 1)
        capped_clock, extra = self._clock_for(first, clock)
        if extra:
            clock, reasons = capped_clock, reasons | extra
            arrays = self.steptime.decode_arrays(n, context, k, clock)
        durations = arrays[0] * factor if factor != 1.0 else arrays[0]
        ends = start + durations.cumsum()
        limit = MAX_RUN_S if until is None else min(MAX_RUN_S, until - start)
        k = min(k, int(np.searchsorted(ends - durations - start, limit, side="left")))
        k = self._fit_blocks(running, k)  # 0 when k < 1
        if k < 1:
            return False
        durations, ends = durations[:k], ends[:k]
        run_cost = self.steptime.summarise(arrays, k)
        end = float(ends[-1])
        self._account_busy(run_cost, end - start, clock, reasons)
        stats = self.stats
        stats.steps += k
        stats.iteration_tokens.observe(n, k)
        stats.generation_tokens += n * k
        if k > 1:
            stats.itl.observe_many(durations[1:], n)
        done = self._advance_decoders(running, k, float(ends[0]), end, result)
        result.steps += k
        result.duration = end - result.start
        if done:
            self._finish(done, end, result)
        return bool(done)

    def _prefill_forward(self, result: StepResult, max_extra: int, until: float | None) -> bool:
        """Run the steps in which every running request decodes but the newest, whose prompt goes on in
        chunks of the token budget the others leave, up to the one that ends its prompt (and gives its
        first token). A long prompt under a small budget takes several such steps, which otherwise cost
        a call each, request by request. Each step is priced as :meth:`step` prices it (clock, power
        limit and temperature per step); the requests are updated once, at the end. True when it
        stopped because a request ended."""
        scheduler = self.scheduler
        running = scheduler.running
        n = len(running)
        if n == 0 or scheduler.waiting or running[-1].output:
            return False
        newest = running[-1]
        decoders = n - 1
        chunk = self.max_num_batched_tokens - decoders
        if chunk < 1:
            return False
        k = max_extra
        context = 0
        for req in running:
            if req is newest:
                break
            if req.prompt + req.output - req.computed != 1 or req.output == 0:
                return False  # not a decoding sequence: this step is not one of those
            if req.max_tokens - req.output < k:
                k = req.max_tokens - req.output
            context += req.computed
        steps = self._fit_prefill(running, min(k, -(-(newest.prompt - newest.computed) // chunk)), chunk)
        stats = self.stats
        factor = self.faults.latency_factor
        limit = self._t + MAX_RUN_S if until is None else min(self._t + MAX_RUN_S, until)
        computed = newest.computed
        ends: list[float] = []
        new_tokens = 0
        while len(ends) < steps and self._t < limit:  # a step starts before ``until``, as a call would
            now_new = min(chunk, newest.prompt - computed)
            new_tokens = decoders + now_new
            pairs = float(context + decoders) + now_new * (computed + (now_new + 1) * 0.5)
            clock, reasons, cost = self._cost(new_tokens, n, context + computed, pairs)
            self._account_busy(cost, cost.duration_s * factor, clock, reasons)
            ends.append(self._t)
            computed += now_new
            context += decoders
            first = computed == newest.prompt
            stats.steps += 1
            stats.generation_tokens += decoders + first
            stats.iteration_tokens.observe(new_tokens + first)
        if not ends:
            return False
        self.gpu_counters.activation_bytes = new_tokens * self.model.hidden * 16.0 / self.gpu.tp
        j, end = len(ends), ends[-1]
        result.steps += j
        result.duration = end - result.start
        if decoders and j > 1:
            stats.itl.observe_many(np.diff(np.asarray(ends)), decoders)
        done = self._advance_decoders(running[:-1], j, ends[0], end, result)
        used = blocks_for(computed, self.block_size) - newest.blocks
        newest.blocks += used
        scheduler.pool.used += used
        newest.computed = computed
        if computed == newest.prompt:
            newest.first_token = newest.last_token = end
            stats.ttft.observe(end - newest.arrival)
            stats.prompt_tokens += newest.prompt
            newest.output = 1
            result.tokens[newest.rid] = 1
            if newest.output >= newest.max_tokens:
                done.append(newest)
        if done:
            self._finish(done, end, result)
        return bool(done)

    def _advance_decoders(
        self, decoders: list[Request], j: int, first_end: float, end: float, result: StepResult
    ) -> list[Request]:
        """Give each of ``decoders`` the tokens of ``j`` steps, the first ending at ``first_end`` and the
        last at ``end``, with their blocks and their first inter-token gap (the caller counts the
        others: one step's length each); returns those whose answer is complete."""
        bs = self.block_size
        tokens = result.tokens
        firsts: list[float] = []
        done: list[Request] = []
        used = 0
        for req in decoders:
            firsts.append(first_end - req.last_token)
            req.computed += j
            req.output += j
            blocks = -(-req.computed // bs)
            used += blocks - req.blocks
            req.blocks = blocks
            req.last_token = end
            tokens[req.rid] = tokens.get(req.rid, 0) + j
            if req.output >= req.max_tokens:
                done.append(req)
        self.scheduler.pool.used += used
        self.stats.itl.observe_list(firsts)
        return done

    def _fit_prefill(self, running: list[Request], k: int, chunk: int) -> int:
        """Largest ``j <= k`` such that ``j`` more steps (the others decoding, the newest prefilling
        ``chunk`` tokens a step) fit the pool."""
        bs = self.block_size
        newest = running[-1]

        def need(j: int) -> int:
            mine = -(-min(newest.prompt, newest.computed + j * chunk) // bs) - newest.blocks
            return mine + sum(-(-(r.computed + j) // bs) - r.blocks for r in running if r is not newest)

        return self._largest_fitting(k, need)

    def _fit_blocks(self, running: list[Request], k: int) -> int:
        """Largest ``j <= k`` such that ``j`` more decode steps of every running request fit the pool."""
        bs = self.block_size
        return self._largest_fitting(k, lambda j: sum(-(-(r.computed + j) // bs) - r.blocks for r in running))

    def _largest_fitting(self, k: int, need: Callable[[int], int]) -> int:
        """Largest ``j`` in ``[0, k]`` whose ``need(j)`` blocks (rising with ``j``) the pool has free."""
        free = self.scheduler.pool.free
        if k < 1 or need(k) <= free:
            return max(k, 0)
        lo, hi = 0, k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if need(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def with_settings(self, **changes: object) -> EngineSettings:
        """The current settings with ``changes`` applied (a convenience for callers and tests)."""
        return replace(self.settings, **changes)  # type: ignore[arg-type]


def _drafts(req: Request) -> bool:
    """Whether ``req``'s next step carries draft tokens: a decode after its first token (a prefill, or
    the recompute of a preempted request, drafts nothing)."""
    return req.output > 0 and req.decoding


def make_core(
    gpu: str = "a100-80g",
    model: str = "llama-2-7b",
    precision: str = "fp16",
    max_num_seqs: int = 256,
    *,
    sm_clock_mhz: float | None = None,
    power_limit_w: float | None = None,
    **options: Any,
) -> EngineCore:
    """Build a core from profile keys, with the GPU's full clock and TDP unless given; ``options`` go to
    :class:`EngineCore` (``max_num_batched_tokens``, ``gpu_memory_utilization``, ``start``...)."""
    from simulator.hardware import PRECISIONS, gpu_profile
    from simulator.models import model_profile

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    g, m = gpu_profile(gpu), model_profile(model)
    settings = EngineSettings(
        max_num_seqs=max_num_seqs,
        precision=precision,
        sm_clock_mhz=g.clock_max_mhz if sm_clock_mhz is None else sm_clock_mhz,
        power_limit_w=g.tdp_w if power_limit_w is None else power_limit_w,
    )
    return EngineCore(g, m, settings, **options)
