r"""Scheduler efficiency: is the engine producing the tokens its batch size says it should?

The model, learned online from the engine's own history. A decode step over a batch of :math:`B`
sequences takes roughly :math:`\tau(B) = a + bB` seconds (:math:`a`: reading the weights once per step,
:math:`b`: per-sequence attention and KV traffic), and emits :math:`B` tokens, so

.. math:: \hat T(B) = \frac{B}{a + bB}.

:math:`a, b` are fitted by recursive least squares with forgetting on :math:`y = B / T` (observed seconds
per step) against :math:`x = (1, B)`, with :math:`B` = ``engine.batch_size_mean`` (or
``engine.requests_running``) and :math:`T` = ``engine.generation_tokens_per_second``, both averaged over
the last ``smooth`` busy ticks: a per-tick rate of a small engine swings by half between ticks, and
:math:`B/T` of a noisy :math:`T` is biased upward (Jensen), which fitted a model far below the engine's
real throughput. While the batch has hardly varied the slope is unidentifiable and the expectation is
the mean step time alone (:meth:`expected_throughput`). Each tick is scored first,
:math:`d = (T - \hat T)/\hat T`, then learned unless
:math:`d` is below the threshold: a degraded period must not teach the model that degraded is normal
(guarded learning), while an engine faster than the model says is news the model must take (guarding
both sides froze a poor warm-up fit for good). During ``warmup`` ticks everything is learned and nothing
is reported.

A finding is raised when :math:`d < -\max(\text{threshold}, z\sigma)` in ``k`` of the last ``n`` ticks:
the threshold (15%) or ``noise_z`` (4) times the healthy spread of :math:`d`, whichever is larger.
:math:`\sigma^2` is a running mean of :math:`d^2` over the ticks faster than the model (those are always
learned; the slower ones are guarded, so their spread would be cut off at the threshold). A big engine's
smoothed rate sits within a few percent of the model and the 15% rule stands. A small one does not: at
~1.5 requests/s (``bench/soak.py``: batch 1-6, the running count a sample at the scrape, prompts of
50-3500 tokens arriving mid-tick) the smoothed rate strays 22% below the fit one tick in twenty, and the
fixed 15% raised 371 findings in 6 healthy hours, 64 of them critical; with the noise floor (sigma 0.19
there, so a shortfall must pass 78%), none. Guarded learning follows the same limit, so the model learns
the whole healthy spread rather than its upper edge.

**Speculative decoding.** A drafting engine emits, per sequence and step, one token of its own and the
draft tokens the step accepted, so its token rate follows the acceptance, which the traffic sets, not the
scheduler: on vLLM drafting 3 tokens by n-gram lookup, greedy traffic made 3.0 tokens per step and
sampled traffic 1.06 (``tests/fixtures/expo/vllm-0.32-cpu/*ngram3*``), a 65% "shortfall" of a healthy
scheduler. So :math:`T` here is the rate the batch makes without the accepted draft tokens,
``generation_tokens_per_second - spec_accepted_tokens_per_second`` (vLLM), or the rate over
``spec_accept_length`` (SGLang: tokens per verify step), which is :math:`B` tokens per step at any
acceptance. The acceptance itself is the ``spec_decode`` detector's to judge (one signal, one judge).

The diagnosis checks, in this order, and names the first that holds (all are kept as evidence):

1. **request-length mix shift** — mean prompt length (``gate.prompt_tokens_mean``, else prompt tokens per
   finished request) differs from its healthy baseline by more than ``mix_shift`` (30%): prefill steals
   decode steps, so fewer tokens per batch is expected, not a fault;
2. **fragmentation** — allocator (``probe.fragmentation_ratio`` or 1 - allocated/reserved) or KV-cache
   fragmentation above ``fragmentation_threshold`` (15%), or preemptions: memory is there but unusable;
3. **batch timeout / queueing** — requests wait (``engine.requests_waiting`` plus, behind the admission
   gate, ``gate.queue_depth``: there the engine's own queue stays near empty) while the KV cache has
   room (usage below 90%), or queue time p95 is over twice its baseline: the scheduler is not filling
   the batch it could run;
4. **engine restarted** — its process started within ``restart_window_s`` (300 s; its start time moved,
   :class:`~detectors.domain_util.RestartWatch`): a cold engine (caches, compiled graphs, the allocator
   finding its pools) runs below its old rate for minutes. Beside a vLLM killed and restarted under load
   its rate stayed about 40% under the rate before for two minutes, a critical finding for a cause
   already known; it is a warning at most;
5. otherwise **unexplained** — look at clocks and thermal throttling.
"""

from __future__ import annotations

import math
from collections import deque
from functools import partial

from detectors.base import Finding, Severity
from detectors.domain_util import KOfN, LastHit, RecursiveLeastSquares, RestartWatch
from detectors.snapshot import Snapshot


class _Ewma:
    """Exponentially weighted mean, for baselines learned only while the engine is healthy."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def learn(self, x: float | None) -> None:
        if x is not None:
            self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


class _RunningMean:
    """Mean with exponential forgetting that is exact while young (weight ``max(1/n, 1 - forgetting)``):
    no first sample dominates the way an EWMA seeded with it would."""

    def __init__(self, forgetting: float) -> None:
        self.floor = 1.0 - forgetting
        self.n = 0
        self.value = 0.0

    def learn(self, x: float) -> None:
        self.n += 1
        self.value += max(1.0 / self.n, self.floor) * (x - self.value)


class SchedulerEfficiencyDetector:
    """Observed generation throughput against what the batch size predicts; diagnoses shortfalls."""

    name = "scheduler_efficiency"

    def __init__(
        self,
        threshold: float = 0.15,
        warmup: int = 120,
        forgetting: float = 0.999,
        min_batch: float = 1.0,
        mix_shift: float = 0.3,
        fragmentation_threshold: float = 0.15,
        baseline_alpha: float = 0.01,
        k: int = 3,
        n: int = 5,
        smooth: int = 8,
        min_batch_spread: float = 0.1,
        noise_z: float = 4.0,
        noise_forgetting: float = 0.99,
        restart_window_s: float = 300.0,
    ) -> None:
        self.threshold = threshold
        self.warmup = warmup
        self.forgetting = forgetting
        self.min_batch = min_batch
        self.mix_shift = mix_shift
        self.fragmentation_threshold = fragmentation_threshold
        self.baseline_alpha = baseline_alpha
        self.k = k
        self.n = n
        self.model_ = RecursiveLeastSquares(2, forgetting=forgetting, delta=1.0)
        self.gate_ = KOfN(k, n)
        self.shown_ = LastHit()
        self.prompt_len_ = _Ewma(baseline_alpha)
        self.queue_p95_ = _Ewma(baseline_alpha)
        self.recent_: deque[tuple[float, float]] = deque(maxlen=smooth)  # (throughput, batch), busy ticks
        # seconds per step, and the batch's mean and square: for the batch's spread (see expected_throughput)
        self.step_ = _RunningMean(forgetting)
        self.batch_ = _RunningMean(forgetting)
        self.batch_sq_ = _RunningMean(forgetting)
        self.min_batch_spread = min_batch_spread
        self.noise_z = noise_z
        #: mean of d^2 over the ticks faster than the model: the healthy spread of the deviation
        self.noise_ = _RunningMean(noise_forgetting)
        self.restart_window_s = restart_window_s
        self.restarts_ = RestartWatch()

    def expected_throughput(self, batch: float) -> float | None:
        """:math:`\\hat T(B)` under the current model, or ``None`` before it is usable.

        While the batch has hardly varied (its coefficient of variation under ``min_batch_spread``) the
        slope :math:`b` is not identifiable: the fit's split between :math:`a` and :math:`b` is noise, and
        a batch 10% off the usual one extrapolated to several times the real throughput (a llama.cpp at a
        steady batch of ~1 flagged itself healthy). Then the expectation is the mean step time alone."""
        mean = self.batch_.value
        spread = max(0.0, self.batch_sq_.value - mean * mean) ** 0.5 / mean if mean > 0 else 0.0
        step = self.model_.predict((1.0, batch)) if spread >= self.min_batch_spread else self.step_.value
        return batch / step if step > 0 else None

    def limit(self) -> float:
        """How far below the model the smoothed throughput must fall to count: the threshold, or
        ``noise_z`` healthy spreads of the deviation when the engine's rate is noisier than that."""
        if self.noise_.n == 0:
            return self.threshold
        return max(self.threshold, self.noise_z * math.sqrt(self.noise_.value))

    def update(self, snapshot: Snapshot) -> list[Finding]:
        """Score this tick's throughput against the learned relation, diagnose a shortfall, then learn."""
        self.restarts_.feed(snapshot)  # every tick, idle ones too: an engine restarts while down
        throughput = _one_token_per_step(snapshot, snapshot.get("engine.generation_tokens_per_second"))
        batch = snapshot.get("engine.batch_size_mean")
        if batch is None:
            batch = snapshot.get("engine.requests_running")
        if throughput is None or batch is None or batch < self.min_batch or throughput <= 0:
            # idle or unobservable: efficiency has no meaning. Not a stall either: llama.cpp counts a
            # request's tokens when it finishes, so a short tick of a healthy engine can show none
            return []
        self.recent_.append((throughput, batch))
        throughput = sum(t for t, _ in self.recent_) / len(self.recent_)
        batch = sum(b for _, b in self.recent_) / len(self.recent_)
        prompt_len = _prompt_length(snapshot)
        queue_p95 = snapshot.get("engine.queue_seconds.p95")
        expected = self.expected_throughput(batch)
        warm = self.model_.n_ >= self.warmup and expected is not None
        deviation = (throughput - expected) / expected if warm and expected else 0.0
        limit = self.limit()
        hit = deviation < -limit
        active = self.gate_.push(hit, snapshot.now) if warm else False
        findings: list[Finding] = []
        if active and expected is not None:
            build = partial(
                self._finding, snapshot, throughput, expected, batch, deviation, prompt_len, limit
            )
            now = f"{throughput:.0f} tok/s, {deviation:+.0%} against expected"
            findings.append(self.shown_.show(self.gate_, hit, build, now))
        else:
            self.shown_.clear()
        if expected is not None and self.model_.n_ >= self.warmup // 2 and throughput > expected:
            self.noise_.learn(((throughput - expected) / expected) ** 2)
        if not warm or deviation >= -limit:
            self.model_.learn((1.0, batch), batch / throughput)
            self.step_.learn(batch / throughput)
            self.batch_.learn(batch)
            self.batch_sq_.learn(batch * batch)
            self.prompt_len_.learn(prompt_len)
            self.queue_p95_.learn(queue_p95)
        return findings

    def _finding(
        self,
        snapshot: Snapshot,
        throughput: float,
        expected: float,
        batch: float,
        deviation: float,
        prompt_len: float | None,
        limit: float,
    ) -> Finding:
        evidence: dict[str, float | str] = {
            "throughput_tokens_per_second": throughput,
            "expected_tokens_per_second": expected,
            "batch_size": batch,
            "deviation": deviation,
            "deviation_limit": limit,
        }
        drafting = _drafting(snapshot)
        if drafting:
            evidence["spec_decode"] = drafting
        causes = [
            ("request-length mix shift", self._mix_shift(prompt_len, evidence)),
            ("fragmentation", self._fragmentation(snapshot, evidence)),
            ("batch timeout / queueing", self._queueing(snapshot, evidence)),
            ("engine restarted", self._restarted(snapshot.now, evidence)),
        ]
        cause = next((name for name, holds in causes if holds), "unexplained")
        evidence["cause"] = cause
        critical = deviation < -2 * self.threshold and cause != "engine restarted"
        hints = {
            "request-length mix shift": "Longer prompts cost prefill time per step; expected, not a fault. "
            "Consider chunked prefill or routing long prompts to a separate pool.",
            "fragmentation": "Memory is held but unusable: see the fragmentation finding; expandable "
            "segments or a smaller KV block size help.",
            "batch timeout / queueing": "Requests wait while the cache has room: the batch limit or the "
            "scheduler's batching delay is too tight; raise the effective batch.",
            "engine restarted": "A restarted engine runs cold for minutes (caches, compiled graphs, the "
            "allocator's pools): wait; a shortfall that outlasts the warm-up is the engine's to explain.",
            "unexplained": "No load or memory cause found: check SM clocks, thermal and power throttling.",
        }
        return Finding(
            detector=self.name,
            signal="engine.generation_tokens_per_second",
            severity=Severity.CRITICAL if critical else Severity.WARNING,
            score=-deviation / (2 * self.threshold),
            summary=(
                f"throughput {throughput:.0f} tok/s{' (without accepted draft tokens)' if drafting else ''} "
                f"is {-deviation:.0%} below the {expected:.0f} tok/s a batch of {batch:.1f} should give; "
                f"most likely cause: {cause}"
            ),
            since=self.gate_.since(snapshot.now),
            evidence=evidence,
            hint=hints[cause],
        )

    def _restarted(self, now: float, evidence: dict[str, float | str]) -> bool:
        ago = self.restarts_.within(now, self.restart_window_s)
        if ago is not None:
            evidence["engine_restarted_s_ago"] = ago
        return ago is not None

    def _mix_shift(self, prompt_len: float | None, evidence: dict[str, float | str]) -> bool:
        base = self.prompt_len_.value
        if prompt_len is None or base is None or base <= 0:
            return False
        evidence |= {"prompt_tokens_mean": prompt_len, "prompt_tokens_mean_baseline": base}
        return abs(prompt_len / base - 1.0) > self.mix_shift

    def _fragmentation(self, snapshot: Snapshot, evidence: dict[str, float | str]) -> bool:
        ratio = snapshot.get("probe.fragmentation_ratio")
        reserved, allocated = snapshot.get("probe.reserved_bytes"), snapshot.get("probe.allocated_bytes")
        if ratio is None and reserved and allocated is not None:
            ratio = 1.0 - allocated / reserved
        preempt = snapshot.get("engine.preemptions_per_second") or 0.0
        if ratio is not None:
            evidence["allocator_fragmentation_ratio"] = ratio
        evidence["preemptions_per_second"] = preempt
        return (ratio is not None and ratio > self.fragmentation_threshold) or preempt > 0

    def _queueing(self, snapshot: Snapshot, evidence: dict[str, float | str]) -> bool:
        engine_waiting, gate_queue = snapshot.get("engine.requests_waiting"), snapshot.get("gate.queue_depth")
        waiting = (
            None
            if engine_waiting is None and gate_queue is None
            else (engine_waiting or 0.0) + (gate_queue or 0.0)
        )
        usage = snapshot.get("engine.kv_cache_usage_ratio")
        queue_p95, base = snapshot.get("engine.queue_seconds.p95"), self.queue_p95_.value
        for key, value in (
            ("requests_waiting", engine_waiting),
            ("gate_queue_depth", gate_queue),
            ("kv_cache_usage_ratio", usage),
            ("queue_seconds_p95", queue_p95),
            ("queue_seconds_p95_baseline", base),
        ):
            if value is not None:
                evidence[key] = value
        starved = waiting is not None and waiting > 0 and (usage is None or usage < 0.9)
        slow_queue = queue_p95 is not None and base is not None and base > 0 and queue_p95 > 2 * base
        return starved or slow_queue


def _drafting(snapshot: Snapshot) -> str:
    """How the token rate is corrected for speculative decoding (module docstring): "" when it is not."""
    accepted = snapshot.get("engine.spec_accepted_tokens_per_second")
    if accepted is not None and math.isfinite(accepted) and accepted > 0:
        return "accepted draft tokens subtracted"
    length = snapshot.get("engine.spec_accept_length")
    if length is not None and math.isfinite(length) and length > 1:
        return "divided by the accept length"
    return ""


def _one_token_per_step(snapshot: Snapshot, tokens: float | None) -> float | None:
    """The generation rate without accepted draft tokens: one token per sequence per step, whatever the
    acceptance (module docstring, "Speculative decoding"). ``None`` when nothing is left (a tick whose
    counters were read mid-step) or no rate."""
    if tokens is None:
        return None
    how = _drafting(snapshot)
    if how.startswith("accepted"):
        tokens -= snapshot.get("engine.spec_accepted_tokens_per_second") or 0.0
    elif how:
        tokens /= snapshot.get("engine.spec_accept_length") or 1.0
    return tokens if tokens > 0 else None


def _prompt_length(snapshot: Snapshot) -> float | None:
    """Mean prompt tokens per request: the gate's figure, else prompt tokens/s over finished requests/s."""
    mean = snapshot.get("gate.prompt_tokens_mean")
    if mean is not None:
        return mean
    prompt_tps, finished = (
        snapshot.get("engine.prompt_tokens_per_second"),
        snapshot.get("engine.requests_finished_per_second"),
    )
    if prompt_tps is not None and finished and finished > 0:
        return prompt_tps / finished
    return None
