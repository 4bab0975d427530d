r"""Tail latency per request-length bucket: is a high P95/P99 explained by load, or anomalous?

Signals (each modelled on its own): ``gate.<bucket>.{ttft,itl,e2e}_seconds.{p95,p99}`` for the admission
gate's request-length buckets (``le256``, ``le1k``, ``le4k``, ``gt4k``) and the engine-wide
``engine.{ttft,itl,e2e}_seconds.{p95,p99}``.

The model. Queueing theory says a tail grows with utilisation and with the queue in front of it, and
multiplicatively, so for each signal an online linear model in log space,

.. math::
    \log L_t = w_0 + w_1 u_t + w_2 \log(1 + q_t) + w_3 \log(1 + n_t) + \varepsilon_t,

with :math:`u` the mean GPU utilisation (``nvml.gpu<i>.utilization_ratio.mean``), :math:`q` the requests
waiting and :math:`n` the requests running, is fitted by recursive least squares with forgetting. Each
tick is scored before it is learned:

* residual :math:`z = (\log L_t - \hat w^\top x_t) / \max(\hat\sigma, \sigma_\text{min})`, with
  :math:`\hat\sigma` the running RMS of one-step-ahead residuals;
* reference latency :math:`L_\text{ref} = \exp(\hat w^\top \bar x)` at the typical load :math:`\bar x`
  (an exponentially weighted mean of the features).

The queue is the one in front of what the signal times. The engine's tails start at the engine, so their
:math:`q` is ``engine.requests_waiting``; the gate's TTFT and e2e tails (``gate.<bucket>.*``) start when
the request reached the gate, so theirs adds the gate's own queue (``gate.queue_depth``). When the gate's
in-flight limit binds, requests wait in the gate and the engine's queue reads 0: with the engine's alone,
a gate TTFT tail that followed its queue read as "not explained by load".

A tail is a quantile of the requests of a window (``engine.quantile_window_s``, ``gate.stats_window_s``:
60 s, :meth:`TailLatencyDetector.set_windows`), and its slowest requests waited behind the deepest queue
of that window, not the queue of the tick: on the Azure coding week (``bench/soak.py --week``) a TTFT P95
of 7.1 s once the queue had drained to 0 read as "4 sigmas over what the load predicts" when :math:`q`
was the tick's. So for TTFT and e2e :math:`q` is the window's maximum
(:class:`~detectors.domain_util.WindowMax`); for ITL, which counts no wait and whose gaps follow what
runs with them, the tick's (with the window's, four of the week's ITL tails at the peaks read as
anomalous warnings). ``evidence.queue_modelled`` is the one the model used.

Verdicts, each needing ``k`` of the last ``n`` ticks:

* **anomalous tail** (warning; critical beyond twice ``z_threshold``): :math:`z > z_\text{thr}` and
  :math:`L_t > (1 + \text{min\_excess})\,\hat L_t` — the load does not explain it;
* **load-driven tail** (info): :math:`L_t > \text{elevated\_ratio} \cdot L_\text{ref}` while the model
  explains it — the remedy is capacity or admission, not debugging.

Anomalous ticks are not learned (the model must not adopt the fault); load-driven ones are.

**Against the SLO.** An anomalous TTFT or ITL tail is reported as info, verdict ``anomalous, within SLO``,
while the statistic its latency target (``slo_s``: ``{"ttft": policies.ttft_slo_s, "itl":
policies.itl_slo_s}``, which the agent sets and a config reload updates) is of stays under ``slo_share``
(half) of it: past half, it is on its way to a miss and worth a warning before it gets there. Info stays in
the findings and on ``/api/state``, below the webhooks' default severity. The statistic:

* TTFT: the tail itself. The target is a P99, the statistic the signal is.
* ITL: the mean gap over the same window (``engine.itl_seconds.mean``, ``gate.<bucket>.itl_seconds.mean``),
  in ``evidence.itl_mean_s``. The target is a per-request mean, and the tails of the per-token gaps say
  little about it. At low load an engine's ITL tail is bimodal: over a 60-s window most gaps are the decode
  step (10 ms for a 7B model on an A100), and a long prompt's chunked prefill now and then stalls a few
  decode steps to 100 ms or more, a step no load feature predicts (utilisation, queue, running, prompt
  tokens per second, each averaged over the window, were tried). With few requests in the window those few
  gaps are the P99. Judged by the tail against half the target, a fault-free replayed day
  (``bench/soak.py``, ~1.5 requests/s) raised 169 warning and critical findings for tails of 15-30 ms
  against a 100 ms target; judged by the tail against the whole target, the real Azure 2024 coding week
  with the 2023 code trace's long prompts (``bench/soak.py --week``) still raised 44 in a week, nearly all
  P99s of 101-130 ms on weekend nights with one or two requests running (both counted before f1405c6
  fed the soak's detectors each tick once). Without a mean in the snapshot, the tail is judged against
  the whole target: a tail under the target of the mean leaves nearly every request's mean under it too.

Past the share, the severity says what the tail does to the SLO, not how surprising it is: a warning while
the statistic is under the target, critical once it is past it (a miss is happening). On the coding week
(``bench/soak.py --week``, before f1405c6) the weekday peaks held TTFT P99s of 5-6.5 s, 8-19 residual
sigmas over what the load predicts: 18 of its 19 criticals by z were tails under the 10 s target; the two
P99s of 18-19 s (one a warning by z) are the criticals now.
An e2e tail (no target) and every tail without a known target keep the z-based warning and critical.
"""

from __future__ import annotations

import math
import re

from detectors.base import Finding, Severity
from detectors.domain_util import (
    KOfN,
    PerNameSet,
    RecursiveLeastSquares,
    WindowMax,
    gpu_indices,
    mean_of,
)
from detectors.snapshot import Snapshot

_SIGNAL = re.compile(
    r"^(?:gate\.(?P<bucket>le256|le1k|le4k|gt4k)|engine)\.(?P<kind>ttft|itl|e2e)_seconds\.(?P<q>p95|p99)$"
)


def _mean_of(tail: str) -> str:
    """``engine.itl_seconds.p99`` -> ``engine.itl_seconds.mean``: the same window's mean."""
    return tail.rsplit(".", 1)[0] + ".mean"


def _watched(snapshot: Snapshot) -> tuple[list[str], list[tuple[str, re.Match[str]]]]:
    """The utilisation signals of every GPU, and the tail signals with their name match."""
    util = [f"nvml.gpu{i}.utilization_ratio.mean" for i in gpu_indices(snapshot)]
    tails = [(name, m) for name in snapshot.values if (m := _SIGNAL.match(name)) is not None]
    return util, tails


_KIND = {"ttft": "time to first token", "itl": "inter-token latency", "e2e": "end-to-end latency"}

LOAD_DRIVEN_SIGNAL = "tails.load_driven"
"""The signal of the one finding that holds every load-driven tail (:func:`_grouped`)."""


def _ratio(finding: Finding) -> float:
    """A load-driven tail over its typical value."""
    return float(finding.evidence["latency_s"]) / float(finding.evidence["reference_s"])


def _grouped(load_driven: list[Finding]) -> Finding:
    """One finding for every load-driven tail of a tick. They share one cause and one remedy (capacity or
    admission), and under overload nearly every tail rises with it: an overloaded vLLM demo listed 16 of
    them, one per kind, quantile and bucket, and 16 findings read as 16 problems. Its evidence is the worst
    tail's, with ``tails`` (how many) and ``signals`` (each one with its ratio, worst first)."""
    ranked = sorted(load_driven, key=_ratio, reverse=True)
    worst = ranked[0]
    evidence = {
        **worst.evidence,
        "worst_signal": worst.signal,
        "tails": float(len(ranked)),
        "signals": ", ".join(f"{f.signal} {_ratio(f):.1f}x" for f in ranked),
    }
    many = f"{len(ranked)} latency tails are" if len(ranked) > 1 else "1 latency tail is"
    return Finding(
        detector=worst.detector,
        signal=LOAD_DRIVEN_SIGNAL,
        severity=Severity.INFO,
        score=worst.score,
        summary=f"{many} above typical, explained by load; the worst: {worst.summary}",
        since=min(f.since for f in ranked),
        evidence=evidence,
        hint=worst.hint,
    )


class _Model:
    def __init__(self, forgetting: float, k: int, n: int, alpha: float) -> None:
        self.rls = RecursiveLeastSquares(4, forgetting=forgetting, delta=10.0)
        self.gate = KOfN(k, n)
        self.x_ref: list[float] | None = None
        self.alpha = alpha
        #: the latest tick that was a hit: (anomalous, z, evidence), what the finding shows while the k-of-n
        #: gate holds it active through ticks that are not hits
        self.last_hit: tuple[bool, float, dict[str, float | str]] | None = None

    def learn(self, x: list[float], y: float) -> None:
        self.rls.learn(x, y)
        ref, alpha = self.x_ref, self.alpha
        self.x_ref = list(x) if ref is None else [r + alpha * (v - r) for r, v in zip(ref, x, strict=True)]


class TailLatencyDetector:
    """P95/P99 latency per request-length bucket, split into load-driven and anomalous tails."""

    name = "tail_latency"

    def __init__(
        self,
        z_threshold: float = 4.0,
        min_excess: float = 0.3,
        elevated_ratio: float = 2.0,
        min_sigma: float = 0.05,
        forgetting: float = 0.998,
        reference_alpha: float = 0.002,
        warmup: int = 60,
        k: int = 3,
        n: int = 5,
        slo_s: dict[str, float] | None = None,
        slo_share: float = 0.5,
        window_s: float = 60.0,
    ) -> None:
        #: latency targets by kind (``ttft``, ``itl``); an anomalous tail while the target's statistic is
        #: under ``slo_share`` of it is info (module docstring). The agent sets it from the config, and
        #: again on a reload.
        self.slo_s = dict(slo_s or {})
        self.slo_share = slo_share
        self.z_threshold = z_threshold
        self.min_excess = min_excess
        self.elevated_ratio = elevated_ratio
        self.min_sigma = min_sigma
        self.forgetting = forgetting
        self.reference_alpha = reference_alpha
        self.warmup = warmup
        self.k = k
        self.n = n
        self.models_: dict[str, _Model] = {}
        self._watched = PerNameSet(_watched)
        self.set_windows(window_s, window_s)

    def set_windows(self, engine_s: float, gate_s: float) -> None:
        """The windows the engine's and the gate's quantiles are of (``engine.quantile_window_s``,
        ``gate.stats_window_s``): a tail's queue feature is the deepest queue of its own window."""
        self.window_s, self.gate_window_s = engine_s, gate_s
        self._engine_queue = WindowMax(engine_s)
        self._gate_queue = WindowMax(gate_s)

    def update(self, snapshot: Snapshot) -> list[Finding]:
        """Score each tail signal against the load model, then learn it unless it is anomalous."""
        util_names, tails = self._watched(snapshot)
        util = mean_of(snapshot, util_names)
        waiting = snapshot.get("engine.requests_waiting")
        running = snapshot.get("engine.requests_running")
        gate_queue = snapshot.get("gate.queue_depth")
        # TTFT and e2e: the deepest queue of the tail's window, which its slowest requests waited behind.
        # ITL counts no wait: its gaps follow what runs with them now, so the tick's queue
        queue_now = max(0.0, waiting or 0.0)
        x_now = [1.0, util or 0.0, math.log1p(queue_now), math.log1p(max(0.0, running or 0.0))]
        deepest = self._engine_queue.push(snapshot.now, queue_now)
        x_engine = [*x_now]
        x_engine[2] = math.log1p(deepest)
        # the gate's clock starts at the gate: its requests wait in its queue, then in the engine's
        x_gate, deepest_at_gate = x_engine, deepest
        if gate_queue is not None:
            deepest_at_gate = self._gate_queue.push(snapshot.now, queue_now + max(0.0, gate_queue))
            x_gate = [*x_now]
            x_gate[2] = math.log1p(deepest_at_gate)
        findings: list[Finding] = []  # anomalous tails, each its own finding
        load_driven: list[Finding] = []  # load-driven ones, grouped into one (:func:`_grouped`)
        values = snapshot.values
        for name, match in tails:
            latency = values[name]
            if latency <= 0:
                continue
            if match.group("kind") == "itl":
                x, queue = x_now, queue_now
            elif match.group("bucket") is None:
                x, queue = x_engine, deepest
            else:
                x, queue = x_gate, deepest_at_gate
            model = self.models_.get(name)
            if model is None:
                model = self.models_[name] = _Model(self.forgetting, self.k, self.n, self.reference_alpha)
            y = math.log(latency)
            if model.rls.n_ < self.warmup or model.x_ref is None:
                model.learn(x, y)
                continue
            predicted = model.rls.predict(x)
            z = (y - predicted) / max(model.rls.residual_std, self.min_sigma)
            anomalous = z > self.z_threshold and latency > (1 + self.min_excess) * math.exp(predicted)
            reference = math.exp(model.rls.predict(model.x_ref))
            elevated = latency > self.elevated_ratio * reference
            hit = anomalous or elevated
            if hit:
                evidence: dict[str, float | str] = {
                    "latency_s": latency,
                    "predicted_s": math.exp(predicted),
                    "reference_s": reference,
                    "z": z,
                    "gpu_utilization_ratio": util if util is not None else "absent",
                    "requests_waiting": waiting if waiting is not None else "absent",
                    "gate_queue_depth": gate_queue if gate_queue is not None else "absent",
                    "queue_modelled": queue,
                    "requests_running": running if running is not None else "absent",
                    "bucket": match.group("bucket") or "all",
                    "at": snapshot.now,
                }
                if match.group("kind") == "itl" and (mean := values.get(_mean_of(name))) is not None:
                    evidence["itl_mean_s"] = mean
                model.last_hit = (anomalous, z, evidence)
            if model.gate.push(hit, snapshot.now) and model.last_hit is not None:
                # while the gate holds the finding through a tick that is no hit, the finding shows the
                # latest hit (its ``at``) and the value now: describing the value now as the finding
                # ("P95 ... is 0.078s, 0.8x its typical") reported a normal tail as the problem (seen live)
                was_anomalous, was_z, shown = model.last_hit
                shown = {**shown, "latest_s": latency}
                finding = self._finding(
                    name, match, was_anomalous, was_z, shown, model.gate.since(snapshot.now)
                )
                (findings if was_anomalous else load_driven).append(finding)
            if not anomalous:
                model.learn(x, y)
        if load_driven:
            findings.append(_grouped(load_driven))
        return findings

    def _finding(
        self,
        name: str,
        match: re.Match[str],
        anomalous: bool,
        z: float,
        evidence: dict[str, float | str],
        since: float,
    ) -> Finding:
        what = f"{match.group('q').upper()} {_KIND[match.group('kind')]}"
        bucket = match.group("bucket")
        where = f" for prompts {bucket}" if bucket else ""
        latency, predicted, reference = (
            float(evidence[k]) for k in ("latency_s", "predicted_s", "reference_s")
        )
        if anomalous:
            severity = Severity.CRITICAL if z > 2 * self.z_threshold else Severity.WARNING
            summary = (
                f"{what}{where} is {latency:.3g}s, {latency / predicted:.1f}x what the current load "
                f"predicts ({predicted:.3g}s): not explained by load"
            )
            evidence["verdict"] = "anomalous"
            target = self.slo_s.get(match.group("kind"))
            if target is not None:
                evidence["slo_s"] = target
                # judged by the statistic the target is of (module docstring)
                mean = evidence.get("itl_mean_s")
                if match.group("kind") == "ttft":
                    judged, share, judged_as = latency, self.slo_share, "it is"
                elif isinstance(mean, float):
                    judged, share, judged_as = mean, self.slo_share, f"the mean gap ({mean:.3g}s) is"
                else:
                    judged, share, judged_as = latency, 1.0, "it is"
                if judged < share * target:
                    severity, evidence["verdict"] = Severity.INFO, "anomalous, within SLO"
                    summary += f", but {judged_as} under {share:.0%} of the {target:.3g}s target"
                elif judged < target:  # on its way to a miss: a warning, whatever z says
                    severity = Severity.WARNING
                    summary += f"; {judged_as} {judged / target:.0%} of the {target:.3g}s target"
                else:  # the SLO is being missed
                    severity = Severity.CRITICAL
                    summary += f"; {judged_as} past the {target:.3g}s target"
            return Finding(
                detector=self.name,
                signal=name,
                severity=severity,
                score=z / (2 * self.z_threshold),
                summary=summary,
                since=since,
                evidence=evidence,
                hint="Not a load problem: check preemptions, throttling, a noisy neighbour or slow upstream.",
            )
        evidence["verdict"] = "load-driven"
        return Finding(
            detector=self.name,
            signal=name,
            severity=Severity.INFO,
            score=min(1.0, latency / reference / (2 * self.elevated_ratio)),
            summary=(
                f"{what}{where} is {latency:.3g}s, {latency / reference:.1f}x its typical {reference:.3g}s, "
                "explained by load (utilisation and queue)"
            ),
            since=since,
            evidence=evidence,
            hint="Load-driven tail: add capacity or tighten admission for this request-length bucket.",
        )
