"""Per-request records, request-length buckets, the gate's Prometheus histograms and its signals.

Each finished request becomes a :class:`RequestRecord`. :class:`GateStats` turns records into

* Prometheus series in the registry it is given (the agent's own, never the global one), labelled by
  request-length bucket: ``servepilot_gate_{ttft,itl,e2e}_seconds{bucket}``, queue wait by priority,
  ``servepilot_gate_requests_total{line,priority,outcome}``, ``servepilot_gate_tokens_total{line,kind}`` and
  the SLO verdict on answers, ``servepilot_gate_{answered,slo_bad}_total``;
* flat signals for the brain (:meth:`GateStats.values`): ``gate.<bucket>.ttft_seconds.p50`` and friends,
  computed over a sliding window of ``window_s`` with numpy, so a detector sees recent behaviour rather
  than the life-long histogram.

Buckets are named by their upper edge in tokens: edges ``(256, 1024, 4096)`` give ``le256``, ``le1k``,
``le4k`` and ``gt4k``. A quantile is absent when its bucket had no request in the window (absence, never
NaN, is "no data").
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram

from agent.gate.admission import Priority

#: Latency buckets (seconds) from 1 ms to 2 min: TTFT spans both ends, ITL sits in the low tens of ms.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
#: Finer at the low end than LATENCY_BUCKETS: the gate's own work is tens of microseconds to a few ms.
HELD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
QUANTILES = (("p50", 50.0), ("p95", 95.0), ("p99", 99.0))
#: Characters of a request id an exemplar carries (OpenMetrics allows 128 for its labels' names and
#: values together)
EXEMPLAR_ID = 64
#: Refusal reasons (``RequestRecord.refused``) that are a business line's rate limit, not capacity.
QUOTA_REASONS = frozenset({"request_rate", "token_rate"})
OUTCOMES = ("ok", "upstream_error", "rejected", "expired", "disconnected", "client_error")


def _edge_name(edge: int) -> str:
    return f"{edge // 1024}k" if edge >= 1024 and edge % 1024 == 0 else str(edge)


class LengthBuckets:
    """Maps a prompt length in tokens to a bucket name (``le256``, ``le1k``, ``le4k``, ``gt4k``)."""

    def __init__(self, edges: Sequence[int] = (256, 1024, 4096)) -> None:
        self.edges = tuple(edges)
        last = f"gt{_edge_name(self.edges[-1])}"
        self.names = (*(f"le{_edge_name(e)}" for e in self.edges), last)

    def name(self, prompt_tokens: float) -> str:
        return self.names[bisect.bisect_left(self.edges, prompt_tokens)]


@dataclass(slots=True)
class RequestRecord:
    """What the gate saw of one request. Times in seconds; ``ttft_s`` is None when no token came back, or
    when the answer came in one piece with more than one token (see :attr:`whole`)."""

    line: str
    priority: str
    path: str
    prompt_tokens: float
    arrived: float
    engine_class: str = ""
    """The class an engine with priority scheduling is told (``gate.engine_priority``): the one the request
    arrived in, set when the gate admits it (empty before). Not the class a promotion ranked it in: the
    promotion got it out of the gate's queue; in the engine's queue, and among the engine's preemption
    victims, a promoted normal request ranked as high put fresh high requests behind it."""
    upstream: str = ""
    output_tokens: float = 0.0
    queue_wait_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    max_tokens: float = 0.0
    """The most tokens its answer can have: ``max_tokens`` x choices (0 when it names no ``max_tokens``)."""
    choices: int = 1
    """Sequences generated for it side by side (``n``, a batch's prompts or conversations): its tokens
    are shared among them, so its latency is judged per sequence."""
    prompts: int = 1
    """Prompts in it (a batch): ``prompt_tokens`` is their sum, and its length bucket is one prompt's."""
    sent_at: float = 0.0
    """When the gate sent it upstream (stall ejection)."""
    refused: str = ""
    """Why the gate turned it away (``servepilot_gate_refused_total``'s reason); empty when it did not."""
    held_s: float | None = None
    """From its arrival to its first send upstream, less its queue wait: what the gate itself added
    before the engine saw it (reading and parsing its body, the buckets, admission). None: never sent."""
    heard_at: float | None = None
    """When the upstream last sent a byte of its answer (each chunk); None before the first."""
    abandoned: str = ""
    """Why the gate ended this stream itself (its upstream hung mid-stream); empty otherwise."""
    e2e_s: float = 0.0
    whole: bool = False
    """Answered in one piece (a JSON body, not a stream): its first token reached the client with its
    last, so it has no TTFT of its own to record and is judged by when the whole answer came."""
    outcome: str = "ok"
    status: int = 0
    rate_limit: tuple[tuple[str, str], ...] = ()
    """Its line's rate-limit headers as it was admitted or refused (``gate.rate_limit_headers``)."""
    charged_tokens: float = 0.0
    """What its line's token budget was charged when it was admitted (estimated prompt + ``max_tokens``
    for each sequence); 0 when the line has none, or the charge was given back."""
    counted: bool = False
    """Its token counts are its answer's: the usage it reported, or a finished stream's token events (a
    JSON answer without usage says none)."""
    usage_asked: bool = False
    """The gate asked the upstream for this stream's usage event, which its client did not
    (``gate.stream_usage``): the event is taken out of the answer."""
    unanswered: bool = False
    """No upstream answered it: each one it was sent to refused the connection or answered a retriable
    error before any of its answer, and the gate answered 502. No engine worked on it."""
    request_id: str = ""
    """The client's ``X-Request-Id``, or one the gate gave it (``gate.request_ids``): sent to the engine
    (vLLM names the request by it in its log), returned to the client and written in the access log."""

    @property
    def admitted(self) -> bool:
        """Past the gate's queues, on its way to an upstream (its engine class is set then)."""
        return bool(self.engine_class)

    @property
    def unprocessed(self) -> bool:
        """No engine worked on it: it left while queued in the gate, no upstream answered it (the gate's
        502), or the engine refused it before its first token (4xx: a prompt too long, a model it does not
        serve). Its prompt was never processed, so it uses none of its line's token budget and adds none
        to ``servepilot_gate_tokens_total``. (A stream that ends in a 4xx error event after tokens is a
        failed answer: the engine did work.)"""
        return (
            not self.admitted
            or self.unanswered
            or (self.outcome == "client_error" and not self.output_tokens)
        )


def whole_answer_budget(slo: tuple[float, float], tokens: float) -> float:
    """The latest an answer of ``tokens`` tokens in one piece may come within ``slo`` (TTFT, mean ITL):
    when a stream that met both targets would have ended."""
    ttft_slo, itl_slo = slo
    return ttft_slo + itl_slo * max(0.0, tokens - 1)


def tokens_per_gap(rec: RequestRecord) -> float:
    """The tokens each of ``rec``'s gaps brought on average, where its answer's usage says more tokens
    came than gaps (1 otherwise): ``(output tokens - one first token per sequence) / gaps``.

    Under speculative decoding an engine sends a step's tokens in one event, 1 + the accepted drafts
    (2.8 on average for vLLM's n-gram drafts of greedy text), and a gate reading chunks late takes
    several events in one. Either way the gap is several tokens' time: recorded as one token's, it
    overstated the ITL that the target (a mean per token) and the tail detector judge by as many times.
    So each gap is divided by this, as SGLang counts its own ITL (a step's interval over its tokens). A
    stream without usage is counted by the engine's decode tokens per step where the sidecar knows them
    (:meth:`agent.gate.proxy.Gate.set_tokens_per_event`), else one token per event, which leaves this
    at 1."""
    gaps = len(rec.itl_s)
    if gaps == 0:
        return 1.0
    return max(1.0, (rec.output_tokens - max(1, rec.choices)) / gaps)


class _Window:
    """(time, values) pairs of the last ``window_s`` seconds, bounded in count as well as in time."""

    def __init__(self, window_s: float, max_items: int = 20_000) -> None:
        self.window_s = window_s
        self.items: deque[tuple[float, float]] = deque(maxlen=max_items)

    def add(self, t: float, value: float) -> None:
        self.items.append((t, value))

    def trim(self, now: float) -> None:
        cutoff = now - self.window_s
        while self.items and self.items[0][0] < cutoff:
            self.items.popleft()

    def values(self) -> np.ndarray:
        return np.fromiter((v for _, v in self.items), dtype=float, count=len(self.items))


class GateStats:
    """Records -> Prometheus histograms + windowed signals. ``now`` comes from the caller's clock."""

    def __init__(
        self, registry: CollectorRegistry, buckets: LengthBuckets, window_s: float = 60.0, start: float = 0.0
    ) -> None:
        self.buckets = buckets
        self.window_s = window_s
        self._start = start

        def hist(name: str, doc: str, label: str) -> Histogram:
            return Histogram(name, doc, [label], registry=registry, buckets=LATENCY_BUCKETS)

        self.ttft = hist("servepilot_gate_ttft_seconds", "Time to first token, queue included.", "bucket")
        self.itl = hist(
            "servepilot_gate_itl_seconds",
            "Time per streamed token: the gap between chunks over the tokens they brought (several under "
            "speculative decoding), where the answer's usage tells.",
            "bucket",
        )
        self.e2e = hist("servepilot_gate_e2e_seconds", "Request time end to end.", "bucket")
        self.queue_wait = hist("servepilot_gate_queue_wait_seconds", "Wait for admission.", "priority")
        self.held = Histogram(
            "servepilot_gate_held_seconds",
            "Time the gate held a request before sending it upstream, its queue wait aside: reading and "
            "parsing its body, the line's buckets, admission. What the gate adds before the engine sees "
            "a request (a slow client's upload included).",
            registry=registry,
            buckets=HELD_BUCKETS,
        )
        self.requests = Counter(
            "servepilot_gate_requests",
            "Requests by outcome.",
            ["line", "priority", "outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "servepilot_gate_tokens", "Tokens relayed.", ["line", "kind"], registry=registry
        )
        self.answered_total = Counter(
            "servepilot_gate_answered",
            "Answers from upstreams (refused, expired and abandoned requests are not answers; an error "
            "answer the gate retried elsewhere is one): the denominator of the SLO-bad share; by the class "
            "the request arrived in.",
            ["priority"],
            registry=registry,
        )
        self.slo_bad_total = Counter(
            "servepilot_gate_slo_bad",
            "Answers that failed (5xx) or missed the latency SLO (policies.ttft_slo_s, itl_slo_s; an "
            "answer in one piece by ttft_slo_s + itl_slo_s x (tokens - 1); a class of "
            "policies.slo_by_priority by its own): what the breaker's burn rate and the canary count; by "
            "the class the request arrived in.",
            ["priority"],
            registry=registry,
        )
        for priority in Priority:  # every class's series from the start, at 0
            self.answered_total.labels(priority.name.lower())
            self.slo_bad_total.labels(priority.name.lower())
        self._win = {
            (b, kind): _Window(window_s) for b in buckets.names for kind in ("ttft", "itl", "e2e", "done")
        }
        self._rejected = _Window(window_s)
        #: the refusals for want of capacity (queue full, shed for a higher class, a deadline passed), not
        #: a line's rate limit: demand the forecaster counts, which more replicas would have served
        self._shed = _Window(window_s)
        #: (TTFT, mean ITL) targets for :attr:`slo_bad`; None judges only failures
        self.slo: tuple[float, float] | None = None
        #: a class's own targets (``policies.slo_by_priority``), for the requests that arrived in it
        self.slo_by_priority: dict[str, tuple[float, float]] = {}
        #: class -> when a request last arrived in it (``policies.itl_steering``: which classes are served)
        self.last_seen: dict[str, float] = {}
        #: running totals the breaker and the canary read as per-tick deltas (``gate.requests`` etc.):
        #: answered requests (refused, expired and abandoned ones are not answers), their 5xx, and the
        #: answers that missed the SLO (5xx included, as replay counts them)
        self.answered = 0
        self.errors = 0
        self.slo_bad = 0
        #: the same three totals per upstream that gave the answer (after failover), for the canary's
        #: checks on its candidate
        self.by_upstream: dict[str, tuple[int, int, int]] = {}
        #: answers and SLO misses per class the request arrived in (judged by its class's targets), for
        #: the energy policy's per-class verdicts
        self.by_priority: dict[str, tuple[int, int]] = {}

    def targets(self, priority: str) -> tuple[float, float] | None:
        """The (TTFT, mean ITL) targets a request that arrived in class ``priority`` is judged by: its
        class's own where configured, else the SLO; None without an SLO."""
        if self.slo is None:
            return None
        return self.slo_by_priority.get(priority, self.slo)

    def missed_slo(self, rec: RequestRecord) -> bool:
        """A failed answer, or a successful one whose TTFT or mean inter-token time (TPOT: the time after
        the first token over the tokens after it, DistServe's definition) is over the SLO. With several
        sequences (``n`` > 1, a batch) the tokens are each sequence's share.

        An answer in one piece (:attr:`RequestRecord.whole`) is judged by the time a stream meeting both
        targets would have ended, ``ttft_slo + itl_slo x (tokens - 1)``: its client sees nothing before
        that. Judged by the TTFT SLO alone, every healthy non-streamed answer longer than a few dozen
        tokens was a miss, and a pod whose clients do not stream (batch jobs, agents) burnt its error
        budget, escalated the breaker and failed canaries on a healthy engine."""
        if rec.outcome == "upstream_error":
            return True
        slo = self.targets(rec.priority)
        if rec.outcome != "ok" or slo is None:
            return False
        ttft_slo, itl_slo = slo
        tokens = rec.output_tokens / max(1, rec.choices)  # each sequence's: they decode side by side
        if rec.whole:
            return rec.e2e_s > whole_answer_budget(slo, tokens)
        if rec.ttft_s is None or rec.ttft_s > ttft_slo:
            return True
        return tokens > 1 and (rec.e2e_s - rec.ttft_s) / (tokens - 1) > itl_slo

    def attempt_failed(self, upstream: str, priority: str) -> None:
        """An upstream's error answer that the gate did not pass on (it asked the next upstream): one
        more answer and one more 5xx for the breaker's and the canary's error shares, but no SLO miss,
        as the client's request may still be answered in time."""
        self.answered += 1
        self.errors += 1
        self.answered_total.labels(priority).inc()
        answered, errors, slo_bad = self.by_upstream.get(upstream, (0, 0, 0))
        self.by_upstream[upstream] = (answered + 1, errors + 1, slo_bad)
        answered, slo_bad = self.by_priority.get(priority, (0, 0))
        self.by_priority[priority] = (answered + 1, slo_bad)

    def bucket_of(self, rec: RequestRecord) -> str:
        """``rec``'s request-length bucket: by one prompt's length, not a batch's."""
        return self.buckets.name(rec.prompt_tokens / max(1, rec.prompts))

    def record(self, rec: RequestRecord, now: float) -> None:
        """Account one finished (or refused) request."""
        self.requests.labels(rec.line, rec.priority, rec.outcome).inc()
        if rec.outcome in ("rejected", "expired"):
            self._rejected.add(now, 1.0)
            if rec.refused not in QUOTA_REASONS:
                self._shed.add(now, 1.0)
            return
        if rec.outcome != "disconnected":
            error, missed = rec.outcome == "upstream_error", self.missed_slo(rec)
            self.answered += 1
            self.errors += error
            self.slo_bad += missed
            self.answered_total.labels(rec.priority).inc()
            if missed:
                self.slo_bad_total.labels(rec.priority).inc()
            answered, slo_bad = self.by_priority.get(rec.priority, (0, 0))
            self.by_priority[rec.priority] = (answered + 1, slo_bad + missed)
            if rec.upstream:
                answered, errors, slo_bad = self.by_upstream.get(rec.upstream, (0, 0, 0))
                self.by_upstream[rec.upstream] = (answered + 1, errors + error, slo_bad + missed)
        bucket = self.bucket_of(rec)
        # a request id on the latency series: from a slow bucket in Grafana to that request's access line
        exemplar = {"request_id": rec.request_id[:EXEMPLAR_ID]} if rec.request_id else None
        self.queue_wait.labels(rec.priority).observe(rec.queue_wait_s, exemplar)
        if rec.held_s is not None:
            self.held.observe(rec.held_s, exemplar)
        if not rec.unprocessed:  # an estimate of a prompt no engine read is no token relayed
            self.tokens.labels(rec.line, "prompt").inc(rec.prompt_tokens)
            self.tokens.labels(rec.line, "output").inc(rec.output_tokens)
        self._win[(bucket, "done")].add(now, 1.0)
        if rec.outcome != "ok":
            return
        self.e2e.labels(bucket).observe(rec.e2e_s, exemplar)
        self._win[(bucket, "e2e")].add(now, rec.e2e_s)
        if rec.ttft_s is not None:
            self.ttft.labels(bucket).observe(rec.ttft_s, exemplar)
            self._win[(bucket, "ttft")].add(now, rec.ttft_s)
        if rec.itl_s:  # with several sequences, each one's own gaps (agent.gate.sequences)
            itl_hist = self.itl.labels(bucket)
            itl_win = self._win[(bucket, "itl")]
            per_gap = tokens_per_gap(rec)
            for gap in rec.itl_s:
                itl_hist.observe(gap / per_gap)
                itl_win.add(now, gap / per_gap)

    def values(self, now: float) -> dict[str, float]:
        """``gate.<bucket>.{ttft,itl,e2e}_seconds.{p50,p95,p99}``, ``gate.<bucket>.itl_seconds.mean``,
        ``gate.<bucket>.requests_per_second``
        ``gate.rejected_per_second`` and ``gate.shed_per_second`` (the refusals that were not a line's
        rate limit) over the window (shorter while the gate is young)."""
        span = max(1e-9, min(self.window_s, now - self._start)) if now > self._start else self.window_s
        out: dict[str, float] = {}
        for (bucket, kind), win in self._win.items():
            win.trim(now)
            if kind == "done":
                out[f"gate.{bucket}.requests_per_second"] = len(win.items) / span
                continue
            if win.items:
                pct = np.percentile(win.values(), [q for _, q in QUANTILES])
                for (qname, _), value in zip(QUANTILES, pct, strict=True):
                    out[f"gate.{bucket}.{kind}_seconds.{qname}"] = float(value)
                if kind == "itl":  # the statistic the ITL target is of (the tail detector judges by it)
                    out[f"gate.{bucket}.itl_seconds.mean"] = float(np.mean(win.values()))
        self._rejected.trim(now)
        out["gate.rejected_per_second"] = len(self._rejected.items) / span
        self._shed.trim(now)
        out["gate.shed_per_second"] = len(self._shed.items) / span
        return out
