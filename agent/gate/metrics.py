"""The admission gate's own Prometheus series, apart from the proxy that moves them.

Gauges of state the gate already holds (in flight, queue depth, limit, per-upstream health, split and
late requests) are read when scraped, through the callables given here, so they can never disagree with
the admission queue or the pool. Per-upstream children exist from the start at 0: ``increase()`` needs a
sample before the first event, and the dashboards' queries need a series to show "none" rather than "no
data" (a counter with no child until its first retry made the e2e dashboard test fail once).

Per-request histograms are :class:`agent.gate.records.GateStats`'; the response cache and the long
request lane register their own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.gate.admission import Priority

Reader = Callable[[], float]
PerUpstream = Callable[[str], float]


class GateMetrics:
    """The gate's series in one registry: what the proxy counts and the state it exposes."""

    def __init__(
        self,
        registry: CollectorRegistry,
        upstreams: Iterable[str],
        retry_statuses: Iterable[int],
        *,
        in_flight: Reader,
        queue_depth: Reader,
        limit: Reader,
        up: PerUpstream,
        split: PerUpstream,
        late: PerUpstream,
        deadline: Callable[[Priority], float],
    ) -> None:
        """``deadline``: a priority class's queue deadline, read at scrape."""
        self.upstreams = tuple(upstreams)
        in_flight_g = Gauge(
            "servepilot_gate_in_flight",
            "Sequences upstream now (a request for n takes n).",
            registry=registry,
        )
        queue_g = Gauge("servepilot_gate_queue_depth", "Requests waiting for admission.", registry=registry)
        limit_g = Gauge("servepilot_gate_limit", "In-flight limit (effective batch).", registry=registry)
        up_g = Gauge(
            "servepilot_gate_upstream_up", "Upstream health (1 up).", ["upstream"], registry=registry
        )
        split_g = Gauge("servepilot_gate_split_ratio", "Traffic share.", ["upstream"], registry=registry)
        self.role = Gauge(
            "servepilot_gate_upstream_role",
            "1 for each upstream, labelled role=engine for this pod's own engine (its URL is engine.url) "
            "and role=other for another deployment (fp8, small, a long-context pool): what the alert rules "
            "and Alertmanager's inhibition tell apart, whatever the upstreams are named.",
            ["upstream", "role"],
            registry=registry,
        )
        self.ejected = Counter(
            "servepilot_gate_upstream_ejections_total",
            "Times an upstream was taken out of the split for holding requests with no byte for "
            "gate.eject_stalled_s (a hung engine whose health check still passes).",
            ["upstream"],
            registry=registry,
        )
        self.blind = Counter(
            "servepilot_gate_blind_seconds",
            "Seconds the gate went unscheduled, a second or more at a time (its event loop blocked, or the "
            "node stalled). An upstream's silence across them is not taken as a hang.",
            registry=registry,
        )
        self.resent = Counter(
            "servepilot_gate_resent_total",
            "Requests taken back from a hung upstream before any byte of their answer and sent to the next "
            "upstream (gate.cut_stalled_streams), by the upstream that hung.",
            ["upstream"],
            registry=registry,
        )
        self.retried = Counter(
            "servepilot_gate_retried",
            "Requests an upstream answered with one of gate.retry_statuses, sent to the next upstream "
            "instead of passing the error on, by that upstream and its status.",
            ["upstream", "status"],
            registry=registry,
        )
        self.peers = Gauge(
            "servepilot_gate_peers",
            "Gates sharing the business lines' rates (gate.peers_dns: the addresses its headless Service "
            "resolves to); each enforces 1/this of every line's rates and bursts. 1 without peers_dns.",
            registry=registry,
        )
        self.websockets_open = Gauge(
            "servepilot_gate_websockets",
            "WebSocket sessions the gate relays now (the engines' realtime APIs, e.g. vLLM's /v1/realtime).",
            registry=registry,
        )
        self.websocket_sessions = Counter(
            "servepilot_gate_websocket_sessions",
            "WebSocket sessions relayed, by the upstream that took them.",
            ["upstream"],
            registry=registry,
        )
        self.usage_refused = Counter(
            "servepilot_gate_stream_usage_refused",
            "Streams an upstream refused for the stream_options the gate put in to count their tokens "
            "(gate.stream_usage), each sent again without it; the upstream goes unasked for 10 minutes.",
            ["upstream"],
            registry=registry,
        )
        self.refused = Counter(
            "servepilot_gate_refused",
            "Requests the gate refused, by business line and why: request_rate or token_rate (429, the "
            "line's buckets), queue_full (429, no room in the gate's queue), shed (429, pushed out of the "
            "queue by a higher class), queue_timeout (503, no slot within the deadline), line_share_full "
            "(503, the line held its share of the gate); and requests it could not read: request_too_large "
            "(413), unsupported_content_encoding (415), bad_request (400: not JSON, a bad field or header).",
            ["line", "reason"],
            registry=registry,
        )
        self.unauthorized = Counter(
            "servepilot_gate_unauthorized",
            "Requests answered 401 for want of a valid API key (gate.require_api_key).",
            registry=registry,
        )
        self.retry_denied = Counter(
            "servepilot_gate_retry_budget_exceeded",
            "Errors passed on that a retry could have hidden, had the retry budget allowed it "
            "(gate.retry_budget_ratio).",
            registry=registry,
        )
        self.late = Gauge(
            "servepilot_gate_late_requests",
            "Requests an upstream holds now that will miss the latency SLO whatever comes next: no first "
            "token past the TTFT SLO, or decoding past what the ITL SLO allows for max_tokens.",
            ["upstream"],
            registry=registry,
        )
        self.line_waiting = Gauge(
            "servepilot_gate_line_waiting",
            "Requests of a business line waiting in its own queue for a slot of its share of the gate "
            "(gate.lines.<name>.max_in_flight_share), by line; only lines with a share.",
            ["line"],
            registry=registry,
        )
        deadline_g = Gauge(
            "servepilot_gate_queue_deadline_seconds",
            "How long a request of this priority class may wait for a slot before its 503: "
            "gate.max_queue_wait_s scaled by the class's TTFT target (policies.slo_by_priority).",
            ["priority"],
            registry=registry,
        )
        for priority in Priority:
            deadline_g.labels(priority.name.lower()).set_function(functools.partial(deadline, priority))
        in_flight_g.set_function(in_flight)
        queue_g.set_function(queue_depth)
        limit_g.set_function(limit)
        statuses = [str(status) for status in retry_statuses]
        for name in self.upstreams:
            up_g.labels(name).set_function(functools.partial(up, name))
            split_g.labels(name).set_function(functools.partial(split, name))
            self.late.labels(name).set_function(functools.partial(late, name))
            self.role.labels(name, "other").set(1)
            self.ejected.labels(name)
            self.resent.labels(name)
            self.usage_refused.labels(name)  # 0 from the start: a panel or rule sees no gap
            self.websocket_sessions.labels(name)
            for status in statuses:  # at 0 from the start, so increase() sees the first retry
                self.retried.labels(name, status)

    def mark_engine(self, upstream: str | None) -> None:
        """``role="engine"`` for ``upstream`` (None: no upstream is this pod's engine), ``other`` for the
        rest; a role an upstream no longer has is removed, not left at 1 beside the new one."""
        for name in self.upstreams:
            role, stale = ("engine", "other") if name == upstream else ("other", "engine")
            with contextlib.suppress(KeyError):  # the role it did not have
                self.role.remove(name, stale)
            self.role.labels(name, role).set(1)
