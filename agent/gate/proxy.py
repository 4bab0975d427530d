"""The admission gate's HTTP face: an aiohttp reverse proxy over :class:`AdmissionQueue`.

Request path: size limit (413) -> business line and priority -> the line's token buckets (429) ->
admission (queue; 429 when full, 503 after ``max_queue_wait_s``) -> an upstream chosen by the split,
failing over to the next on a connection error (502 when every one fails, 503 when none is usable) ->
the response relayed chunk by chunk (SSE stays streaming; agent/gate/relay.py) -> a :class:`RequestRecord`.
Sending and failing over is agent/gate/forward.py.

A client that disconnects cancels its handler (the runner is created with ``handler_cancellation``),
which closes the upstream connection, so the engine aborts the request instead of generating for nobody.
Every refusal is an OpenAI-style JSON error with ``Retry-After`` where waiting helps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import HttpVersion11, hdrs, web
from prometheus_client import CollectorRegistry

from agent.collectors.derive import MAX_TOKENS_PER_STEP
from agent.config import ConfigError, GateConfig
from agent.gate.access_log import AccessLog
from agent.gate.admission import MAX_WAIT_S, AdmissionQueue, Priority, Ticket, TicketState, class_wait_scales
from agent.gate.cache import Entry, Fill, ResponseCache, cache_key, response_identity
from agent.gate.ejection import BlindWatch, StallEjector
from agent.gate.forward import Forwarder
from agent.gate.held import HeldRequests
from agent.gate.isolation import IsolationLane
from agent.gate.line_slots import LineSlots, line_cap
from agent.gate.metrics import GateMetrics
from agent.gate.openai import (
    ADMITTED_PATHS,
    MAX_REQUEST_ID,
    MESSAGES_PATH,
    REQUEST_ID,
    BadRequest,
    RequestInfo,
    parse_any,
    parse_request,
)
from agent.gate.peers import PeerCount, peers_loop
from agent.gate.ratelimit import LineLimiter, LineLimits, LineResolver
from agent.gate.records import GateStats, LengthBuckets, RequestRecord
from agent.gate.relay import Relay, add_gate_headers, closing, for_messages_clients, json_error
from agent.gate.stream_usage import ask_stream_usage
from agent.gate.upstreams import UpstreamPool, health_loop
from agent.gate.websockets import WebSocketRelay, is_websocket
from agent.server_name import without_versions

log = logging.getLogger(__name__)


def client_max_wait_s(header: str | None) -> float | None:
    """The client's own queue deadline in seconds from the ``max_wait_header`` value in milliseconds.

    A client that gives up after 1.5 s gains nothing from a gate that keeps it queued for 10: it learns
    of the overload only from its own timeout, and the slot it was waiting for may go to a request
    nobody reads. ``0`` means "answer 503 rather than queue". ValueError (a 400) on anything but a finite
    number >= 0."""
    if header is None:
        return None
    try:
        milliseconds = float(header)
    except ValueError:
        raise ValueError(f"must be a number of milliseconds >= 0, got {header!r}") from None
    if not math.isfinite(milliseconds) or milliseconds < 0:
        raise ValueError(f"must be a number of milliseconds >= 0, got {header!r}")
    return milliseconds / 1000.0


#: a request's record, and whether the cache answered it, for its access line
RECORD = web.RequestKey("servepilot_record", RequestRecord)
CACHED = web.RequestKey("servepilot_cached", bool)


class Gate:
    """The gate: build with a config and the agent's registry, ``await start()``, turn its knobs.

    ``slo``: the (TTFT, mean ITL) targets answers are judged by (``policies.*_slo_s``); without it the gate
    counts no SLO-bad or late request. Knobs: :meth:`set_limit` (effective batch), :meth:`set_split`
    (traffic split). Signals: :meth:`snapshot_values`. Time for latencies and windows comes from ``clock``
    (monotonic).
    ``in_progress`` counts requests being served (queued or relaying); ``cut`` those a drain ended,
    at ``drain_s`` or sooner when hurried (:meth:`drain`).
    """

    def __init__(
        self,
        cfg: GateConfig,
        registry: CollectorRegistry,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        slo: tuple[float, float] | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        now = clock()
        #: the queue deadline (``cfg.max_queue_wait_s`` at start; the ``gate.max_queue_wait_s`` knob)
        self.max_queue_wait_s = cfg.max_queue_wait_s
        self.admission = AdmissionQueue(
            cfg.max_in_flight,
            cfg.queue_size,
            high_reserved_ratio=cfg.high_reserved_ratio,
            aging_s=cfg.aging_s,
            max_wait_s=cfg.max_queue_wait_s,
        )
        self.isolation = IsolationLane(cfg, registry) if cfg.isolation_threshold_tokens > 0 else None
        self.cache = ResponseCache(cfg, registry) if cfg.cache_enabled else None
        self.lines = LineLimits(cfg, now)
        self.resolver = LineResolver(cfg)
        self.pool = UpstreamPool(cfg.upstreams, cfg.split)
        self._sync_cache_version()
        self.stats = GateStats(registry, LengthBuckets(cfg.length_edges), cfg.stats_window_s, start=now)
        self.stats.slo = slo
        self._rng = rng or random.Random()
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}
        self._runner: web.AppRunner | None = None
        self._health_stop = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self._serving: set[asyncio.Task[Any]] = set()  # the handlers of requests in progress
        self.cut = 0
        self.shutting_down = False  # from the shutdown's start, its delay included: readiness says so
        self._loop_said = False
        self._draining = False
        self.metrics = GateMetrics(
            registry,
            self.pool.upstreams,
            cfg.retry_statuses,
            in_flight=lambda: self.admission.in_flight,
            queue_depth=lambda: self.admission.queue_depth,
            limit=lambda: self.admission.limit,
            up=self._upstream_up,
            split=self._split_of,
            late=self._late_at,
            deadline=self.admission.max_wait_for,
        )
        self.ejector = StallEjector(cfg.eject_stalled_s, on_eject=self._count_ejection)
        #: the requests at upstreams: which will miss the SLO, which a hung upstream must give back
        self.held = HeldRequests(self.ejector)
        #: the upstream that is this pod's own engine (:meth:`mark_engine`), None while none is named
        self.engine_upstream: str | None = None
        self.line_slots = LineSlots()
        self._watch_line_shares(cfg)
        self.blind = BlindWatch(on_blind=self._went_blind)
        self._blind_task: asyncio.Task[None] | None = None
        #: the gates sharing the lines' rates (``gate.peers_dns``, agent/gate/peers.py); None: off
        self.peers = PeerCount(cfg.peers_dns) if cfg.peers_dns else None
        self._peers_task: asyncio.Task[None] | None = None
        self.metrics.peers.set_function(lambda: round(1.0 / self.lines.share))
        self.access_log: AccessLog | None = None
        if cfg.access_log is not None:
            try:
                self.access_log = AccessLog(
                    cfg.access_log, registry, int(cfg.access_log_max_mb * (1 << 20)), cfg.access_log_backups
                )
            except OSError as error:
                raise ConfigError("gate.access_log", f"cannot open {cfg.access_log}: {error}") from None
        # the clock and the config are read through self: tests replace the clock after the start, and a
        # reload the config
        #: upstream -> decode tokens per event of its streams (:meth:`set_tokens_per_event`)
        self.tokens_per_event: dict[str, float] = {}
        relay = Relay(lambda: self.clock(), self._finish, self._fill_cache, self.tokens_per_event)
        self.forwarder = Forwarder(
            lambda: self.cfg,
            self.pool,
            self.held,
            self.stats,
            self.metrics,
            relay,
            lambda: self.clock(),
            self._rng,
        )
        self.websockets = WebSocketRelay(
            self.pool,
            self.metrics,
            lambda: self.forwarder.session,
            self.forwarder.auth,
            self.forwarder.via,
            self._rng.random,
            cfg.max_body_bytes,
            self._count_realtime,
        )
        self.app = without_versions(web.Application(client_max_size=cfg.max_body_bytes))
        self.app.router.add_route("*", "/{tail:.*}", self._handle, expect_handler=self._expect)
        self.app.on_response_prepare.append(self._close_when_shutting_down)

    async def _expect(self, request: web.Request) -> None:
        """``Expect: 100-continue``: the 100 that asks for the body, except for a body declared over
        ``max_body_bytes``, which then gets its 413 before it is sent. aiohttp's own handler sent the 100
        to every request, and a client (curl does for bodies over 1 MiB) began an upload the gate then
        refused unread. Any other expectation gets 417, as aiohttp answers it."""
        if request.version != HttpVersion11:  # HTTP/1.0 has no interim answers
            return
        expect = request.headers.get(hdrs.EXPECT, "")
        if expect.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"unknown Expect: {expect}")
        declared = request.content_length
        if declared is None or declared <= self.cfg.max_body_bytes:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the answer's own size starts after the interim one

    async def _close_when_shutting_down(self, _: web.Request, response: web.StreamResponse) -> None:
        """Once the shutdown began, each answer closes its connection (``Connection: close``). A Service's
        endpoint update moves new connections only: a client's pooled one (an ingress keeps them) would
        carry its next request here until the listener closes, and meet the close. Retired after its
        answer, it is opened again, to another pod. A WebSocket's handshake is left alone."""
        if self.shutting_down and not isinstance(response, web.WebSocketResponse):
            closing(response)

    def _upstream_up(self, name: str) -> float:
        return float(self.pool.upstreams[name].healthy)

    def _count_ejection(self, name: str) -> None:
        self.metrics.ejected.labels(name).inc()

    def _awake_since(self) -> float:
        return self.blind.awake_since(asyncio.get_running_loop().time(), self.clock())

    def _went_blind(self, seconds: float) -> None:
        self.metrics.blind.inc(seconds)
        log.warning(
            "the gate was not scheduled for %.1f s (its event loop blocked, or the node stalled): upstream "
            "silences count again from now",
            seconds,
        )

    def _late_at(self, name: str) -> float:
        return float(self.late_at_upstreams().get(name, 0))

    def _split_of(self, name: str) -> float:
        return self.pool.weights[name]

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Listen on ``host:port`` (config defaults; port 0 picks a free one) and return the port."""
        session = self.forwarder.open()
        if self.access_log is not None:
            self.access_log.start()
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=self.cfg.drain_s,
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, host or self.cfg.listen_host, self.cfg.listen_port if port is None else port
        )
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        cfg = self.cfg
        checker = health_loop(
            self.pool,
            session,
            cfg.health_path,
            cfg.health_interval_s,
            self.clock,
            self._health_stop,
            stalled=self.stalled_upstreams,
            awake_since=self._awake_since,
        )
        self._health_task = asyncio.create_task(checker, name="servepilot-gate-health")
        # self.clock read at each beat: tests replace it after the start
        self._blind_task = asyncio.create_task(
            self.blind.run(lambda: self.clock()), name="servepilot-gate-blind"
        )
        if self.peers is not None:
            counter = peers_loop(self.peers, cfg.peers_refresh_s, self.set_peers, self._health_stop)
            self._peers_task = asyncio.create_task(counter, name="servepilot-gate-peers")
        log.info(
            "gate on http://%s:%s -> %s", host or self.cfg.listen_host, self.port, dict(self.cfg.upstreams)
        )
        return self.port

    async def drain(self, hurry: asyncio.Event | None = None) -> None:
        """Stop accepting and let accepted requests finish, for at most ``drain_s``; idempotent.

        With ``shutdown_delay_s``, new requests are served that long first, while readiness answers 503:
        Kubernetes takes a pod out of its Service's endpoints when the pod is deleted, at the same time
        as the SIGTERM, and every node's kube-proxy and every ingress learns it a moment later. A
        listener closed at once refuses the connections sent meanwhile, and a client that is not
        retrying sees an error where the pod could have served it.

        Then aiohttp's runner does the work: the listener closes (new connections are refused, so a load
        balancer or client retries elsewhere), idle kept-alive connections close, and each connection
        with a request in progress (relaying upstream or still queued for admission) closes after its
        response, or has its handler cancelled at ``drain_s``, which drops the upstream request so the
        engine aborts it. The upstream session stays open meanwhile: the streams need it.

        ``hurry`` set (a second SIGTERM or Ctrl-C: an operator who will not wait) ends the delay, and
        the requests still in progress at once, as ``drain_s`` would have.
        """
        runner, self._runner = self._runner, None
        if runner is None:
            return
        hurry = hurry or asyncio.Event()
        self.shutting_down = True
        if self.cfg.shutdown_delay_s > 0:
            log.info(
                "gate shutting down: new requests accepted for %g s more (readiness 503) before the "
                "listener closes",
                self.cfg.shutdown_delay_s,
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(hurry.wait(), self.cfg.shutdown_delay_s)
        self._draining, busy = True, self.in_progress
        started = time.monotonic()
        if busy:
            log.info("gate draining: %d request(s) in progress, up to %g s", busy, self.cfg.drain_s)
        # realtime sessions last minutes: ended with 1001 a second before the drain's limit, while their
        # connections still stand (cut at the limit, their clients saw the connection drop, not a close)
        grace = self.cfg.drain_s - min(1.0, self.cfg.drain_s / 2)
        closer = asyncio.create_task(self._end_sessions_after(grace)) if self.websockets.sessions else None
        cutter = asyncio.create_task(self._cut_when(hurry))
        await runner.cleanup()
        cutter.cancel()
        if closer is not None:
            closer.cancel()
        if busy:
            how = "short" if hurry.is_set() else "at the limit"
            log.info("gate drained in %.2f s (%d cut %s)", time.monotonic() - started, self.cut, how)

    async def _cut_when(self, hurry: asyncio.Event) -> None:
        await hurry.wait()
        if self._serving:
            log.warning("gate: cutting %d request(s) in progress short", len(self._serving))
        for task in self._serving:  # each counts itself as cut (see _handle)
            task.cancel()
        if self.websockets.sessions:
            await self.websockets.going_away()

    async def _end_sessions_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await self.websockets.going_away()

    async def stop(self, hurry: asyncio.Event | None = None) -> None:
        """Drain (see :meth:`drain`), then close the upstream session and the cache; idempotent."""
        self._health_stop.set()
        if self._blind_task is not None:
            self._blind_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._blind_task
        for task in (self._health_task, self._peers_task):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await asyncio.wait_for(task, timeout=2.0)
        await self.drain(hurry)
        await self.forwarder.close()
        if self.cache is not None:
            self.cache.close()
        if self.access_log is not None:
            self.access_log.stop()

    # --- knobs and signals -------------------------------------------------------------------------
    @property
    def in_progress(self) -> int:
        return len(self._serving)

    @property
    def limit(self) -> int:
        return self.admission.limit

    def set_limit(self, limit: int) -> None:
        """Set the in-flight limit (absolute). Raising it admits waiters at once."""
        self._wake(self.admission.set_limit(int(limit), self.clock()))
        self.line_slots.refill()

    def set_isolation_limit(self, limit: int) -> None:
        """Set the long pool's in-flight limit (absolute); ValueError when isolation is off."""
        if self.isolation is None:
            raise ValueError("long-request isolation is off")
        self._wake(self.isolation.admission.set_limit(int(limit), self.clock()))
        self.line_slots.refill()

    def set_max_queue_wait(self, seconds: float) -> None:
        """Set the queue deadline (absolute seconds). Requests that start waiting afterwards get it; a
        lower one also expires, now, those already waiting longer than it (they answer 503)."""
        seconds = float(seconds)
        if not 0 < seconds <= MAX_WAIT_S:
            raise ValueError(f"max_queue_wait_s must be in (0, {MAX_WAIT_S:g}], got {seconds:g}")
        self.max_queue_wait_s = seconds
        for admission in self._lanes():
            admission.max_wait_s = seconds
        self._expire_overdue()

    def _lanes(self) -> list[AdmissionQueue]:
        return [self.admission] + ([self.isolation.admission] if self.isolation is not None else [])

    def _expire_overdue(self) -> None:
        """Answer 503, now, whoever has waited past a deadline just lowered."""
        now = self.clock()
        for admission in self._lanes():
            self._wake(admission.expire(now))

    def set_peers(self, count: int) -> None:
        """``count`` gates share the lines' rates now (``gate.peers_dns``): each line's buckets are made
        ``1/count`` of its configured ones, their levels carried over (capped at a smaller bucket)."""
        share = 1.0 / max(1, count)
        if share != self.lines.share:
            self.lines = self.lines.reconfigured(self.cfg, self.clock(), share)

    def set_admission_rules(self, cfg: GateConfig) -> None:
        """Take the business-line rules of ``cfg`` (lines and their rates, API keys, default line, the
        line and priority headers, the body size limit, the retry rule, the engine's priority order)
        without a restart (agent/reload.py: the caller has checked that nothing else differs). Each line
        keeps its bucket levels; requests already admitted or queued are not touched."""
        self.lines = self.lines.reconfigured(cfg, self.clock())
        self.resolver = LineResolver(cfg)
        self.cfg = cfg
        self._watch_line_shares(cfg)

    def _watch_line_shares(self, cfg: GateConfig) -> None:
        """``servepilot_gate_line_waiting`` for each line with a share (a line that loses it keeps its
        series until the restart, at 0 once its queue has drained)."""
        for name, line in cfg.lines.items():
            if line.max_in_flight_share is not None:
                self.metrics.line_waiting.labels(name).set_function(
                    functools.partial(self.line_slots.waiting, name)
                )

    def set_slo(
        self,
        ttft_slo_s: float,
        itl_slo_s: float,
        by_priority: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        """Judge answers by these (TTFT, mean ITL) targets from now on (at start and at a config reload),
        those of a request that arrived in a class of ``by_priority`` by its class's own. Answers already
        counted stay as they were judged: ``servepilot_gate_slo_bad_total`` is a counter.

        A class's TTFT target also scales its queue deadline: ``max_queue_wait_s`` x (its TTFT / the
        global TTFT). Batch traffic allowed 30 s against a 2 s SLO would otherwise be answered 503 after
        the 2 s only interactive traffic needs. A deadline lowered this way expires overdue waiters now."""
        self.stats.slo = (ttft_slo_s, itl_slo_s)
        self.stats.slo_by_priority = dict(by_priority or {})
        scales = class_wait_scales(self.stats.slo_by_priority, ttft_slo_s)
        for admission in self._lanes():
            admission.wait_scale.update(scales)
        self._expire_overdue()

    def set_split(self, split: Mapping[str, float]) -> None:
        """Set the traffic split (absolute weights per upstream name); ValueError on a bad split.

        The response cache serves what the upstream taking most of the traffic would answer: when that
        changes (the breaker routes everything to ``fp8`` or ``small``), entries made by the other model
        stop being served, and come back if the split returns before they expire. A canary's small share
        does not change it."""
        self.pool.set_split(split)
        self._sync_cache_version()

    def _sync_cache_version(self) -> None:
        if self.cache is not None:
            weights = self.pool.weights
            self.cache.set_model_version(max(weights, key=lambda name: (weights[name], name)))

    def late_at_upstreams(self) -> dict[str, int]:
        """Per upstream, the requests it holds whose answer will miss the latency SLO whatever comes next
        (:meth:`HeldRequests.late`); empty without a latency SLO."""
        if self.stats.slo is None:
            return {}
        return self.held.late(self.stats.slo, self.clock(), self.stats.slo_by_priority)

    def mark_engine(self, upstream: str | None) -> None:
        """Name the upstream that is this pod's own engine (None: none is), for
        ``servepilot_gate_upstream_role``; every other upstream is ``other``."""
        if upstream is not None and upstream not in self.pool.upstreams:
            raise ValueError(f"unknown upstream {upstream!r}; known: {', '.join(self.pool.upstreams)}")
        self.engine_upstream = upstream
        self.metrics.mark_engine(upstream)

    def set_engine_stalled(self, upstream: str, why: str | None) -> None:
        """What the sidecar's ``engine_stall`` detector says of the engine behind ``upstream`` (this pod's
        own): ``why``, its summary, while it finds the engine hung; None once it does not.

        Its finding is proof of a hang that needs no stream: the engine holds requests and no token,
        step or engine gauge has moved for 60 s while its HTTP server answers. The gate's own proof is a
        frozen stream, so an engine hung while holding only non-streamed requests, or only prompts, was
        left in the split and each of its requests waited ``read_timeout_s``. While the finding stands,
        the upstream is out of the split (``eject_stalled_s`` > 0) and, with ``cut_stalled_streams``,
        proven hung: see :meth:`stalled_upstreams`."""
        if upstream not in self.pool.upstreams:
            raise ValueError(f"unknown upstream {upstream!r}; known: {', '.join(self.pool.upstreams)}")
        self.held.set_engine_stalled(upstream, why)

    def set_tokens_per_event(self, upstream: str, tokens: float | None) -> None:
        """The decode tokens each stream event of ``upstream`` brings, from its engine's counts
        (``engine.decode_tokens_per_step``, the sidecar's for this pod's engine); None or 1 or less: one.

        Under speculative decoding an event carries a step's tokens, 1 + the accepted drafts, and a
        stream without usage was counted one token per event: beside real vLLM drafting 3 tokens by
        n-gram lookup, 595 of 1536 tokens (tests/e2e/test_vllm_specdec.py). Too few tokens made each
        answer's time per token look that much longer, an SLO miss the breaker could escalate on, and
        undercharged the line's token bucket. With this, such a stream counts
        ``first + (events - first) x tokens``, the engine's window mean (1530.7 of the 1536 there)."""
        if upstream not in self.pool.upstreams:
            raise ValueError(f"unknown upstream {upstream!r}; known: {', '.join(self.pool.upstreams)}")
        if tokens is None or not tokens > 1.0:
            self.tokens_per_event.pop(upstream, None)
        else:
            self.tokens_per_event[upstream] = min(tokens, MAX_TOKENS_PER_STEP)

    def stalled_upstreams(self) -> dict[str, str]:
        """Upstreams to keep out of the split as hung, with why (agent/gate/ejection.py); the health loop
        asks every round. With ``cut_stalled_streams``, their requests are taken back from them
        (:meth:`HeldRequests.stalled`)."""
        return self.held.stalled(self.clock(), self._awake_since(), cut=self.cfg.cut_stalled_streams)

    def snapshot_values(self) -> dict[str, float]:
        """The gate's signals for the Snapshot (see :meth:`GateStats.values`) plus the admission state."""
        values = self.stats.values(self.clock())
        values["gate.in_flight"] = float(self.admission.in_flight)
        values["gate.queue_depth"] = float(self.admission.queue_depth)
        values["gate.limit"] = float(self.admission.limit)
        values["gate.reserved"] = float(self.admission.reserved)
        values["gate.max_queue_wait_s"] = self.max_queue_wait_s
        values["gate.upstreams_healthy"] = float(sum(up.healthy for up in self.pool.upstreams.values()))
        if self.isolation is not None:
            values.update(self.isolation.values())
        if self.cache is not None:
            values.update(self.cache.values())
        return values

    # --- the request path --------------------------------------------------------------------------
    def _wake(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            future = self._waiters.pop(ticket, None)
            if future is not None and not future.done():
                future.set_result(None)

    async def _read_body(self, request: web.Request) -> bytes | None:
        """The body, or None when it exceeds ``max_body_bytes`` (declared or actual)."""
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return None
        chunks, size = [], 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        """Counts requests in progress, and those a drain cuts at ``drain_s`` (see :meth:`drain`); writes
        each one's access line (``gate.access_log``)."""
        task = asyncio.current_task()
        assert task is not None  # aiohttp runs each handler in a task
        self._serving.add(task)
        started = self.clock()
        response: web.StreamResponse | None = None
        try:
            response = await self._serve(request)
            return response
        except asyncio.CancelledError:
            record = request.get(RECORD)
            if self._draining:
                self.cut += 1
            elif record is not None and not record.status:  # its client left before any answer came
                record.outcome, record.status = "disconnected", 499
                record.e2e_s = self.clock() - record.arrived
                self._finish(record)
            raise
        finally:
            self._serving.discard(task)
            record = request.get(RECORD)
            if response is not None and not response.prepared and record is not None:
                add_gate_headers(response.headers, record)  # a JSON answer, a refusal or an error
            if response is not None and request.path == MESSAGES_PATH:
                for_messages_clients(response)
            if self.access_log is not None:
                self._log_access(request, response, started)

    def _log_access(self, request: web.Request, response: web.StreamResponse | None, started: float) -> None:
        record = request.get(RECORD)
        if response is not None:
            status = response.status
        elif record is not None and record.status:
            status = record.status  # the client left: 499, as the record says
        else:
            status = 499 if request.transport is None or request.transport.is_closing() else 500
        assert self.access_log is not None
        self.access_log.write(
            method=request.method,
            path=request.rel_url.path,
            status=status,
            held_s=max(0.0, self.clock() - started),
            headers=request.headers,
            remote=request.remote,
            record=record,
            bucket=self.stats.bucket_of(record) if record is not None else None,
            cached=request.get(CACHED, False),
        )

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        arrived = self.clock()
        if self.forwarder.came_back(request.headers):  # before anything is read, admitted or charged
            return self._loop_detected()
        keyed = self.resolver.key_line(request.headers)
        # before its body is read: nothing is done for it. Not a CORS preflight (OPTIONS), which browsers
        # send without credentials: the engine answers it (vLLM's --allowed-origins), and runs nothing
        if keyed is None and self.cfg.require_api_key and request.method != "OPTIONS":
            self.metrics.unauthorized.inc()
            message = "a valid API key is required: Authorization: Bearer <key>"
            refusal = json_error(401, message, "invalid_request_error", "invalid_api_key")
            refusal.headers["WWW-Authenticate"] = "Bearer"
            return refusal
        if is_websocket(request):  # a realtime session (agent/gate/websockets.py)
            return await self._websocket(request, keyed, arrived)
        body = await self._read_body(request)
        if body is None:
            message = f"request body exceeds the gate's limit of {self.cfg.max_body_bytes} bytes"
            return self._unreadable(request, keyed, 413, message, "request_too_large")
        path = request.rel_url.path
        known = path in ADMITTED_PATHS
        # generation is a POST: anything else on these paths (a browser's CORS preflight, an OPTIONS or
        # HEAD) runs nothing, and passes through. A preflight through llama.cpp was admitted as a request,
        # charged to its line's bucket and timed as a 0-token answer.
        if request.method != "POST" or (not known and path not in self.cfg.admit_paths):
            return await self.forwarder.forward(request, body, None, RequestInfo())
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # its body is read here: a clear refusal, not "not JSON"
            message = f"the gate reads request bodies and takes them uncompressed, not {encoding}"
            return self._unreadable(request, keyed, 415, message, "unsupported_content_encoding")
        try:
            info = parse_request(path, body) if known else parse_any(body)
        except BadRequest as error:
            return self._unreadable(request, keyed, 400, str(error), "bad_request")
        line = keyed or self.resolver.named_line(request.headers)
        limiter = self.lines.get(line, arrived)
        priority = limiter.class_of(request.headers.get(self.cfg.priority_header))
        try:
            own_wait_s = client_max_wait_s(request.headers.get(self.cfg.max_wait_header))
        except ValueError as error:
            message = f"{self.cfg.max_wait_header}: {error}"
            return self._unreadable(request, keyed, 400, message, "bad_request")
        record = RequestRecord(line, priority.name.lower(), path, info.prompt_tokens, arrived)
        record.request_id = request.headers.get(REQUEST_ID, "")[:MAX_REQUEST_ID]
        if not record.request_id and self.cfg.request_ids:
            record.request_id = uuid.uuid4().hex
        request[RECORD] = record
        self.stats.last_seen[record.priority] = arrived
        record.max_tokens, record.choices = info.max_tokens * info.choices, info.choices
        record.prompts = info.prompts
        est_tokens = info.prompt_tokens + record.max_tokens  # max_tokens for each of its sequences
        verdict = limiter.admit(est_tokens, arrived)
        if self.cfg.rate_limit_headers:
            record.rate_limit = limiter.headers(arrived)
        if not verdict.granted:
            return self._refuse(
                record, 429, verdict.reason, "rate_limit_exceeded", verdict.retry_after_s, why=verdict.limit
            )
        if limiter.tokens is not None:
            record.charged_tokens = est_tokens  # settled by the answer's counts (_finish)
        fill: Fill | None = None
        if self.cache is not None:
            key = cache_key(path, body, line, request.headers, self.cfg.cache_lines)
            if key is None:
                self.cache.bypass()
            else:
                entry = self.cache.get(key)
                if entry is not None:
                    request[CACHED] = True
                    return await self._serve_cached(request, entry)
                fill = Fill(key, self.cache.admit(key), self.cfg.cache_max_entry_bytes)
        isolation = self.isolation
        lane = isolation if isolation is not None and isolation.is_long(info.prompt_length) else None
        admission = self.admission if lane is None else lane.admission
        if lane is not None:
            lane.routed.inc()
        share = limiter.max_in_flight_share
        held = 0  # slots of the line's share
        if share is not None:  # first the line's share (agent/gate/line_slots.py), a slot per sequence
            deadline = self._deadline(own_wait_s, priority)
            held = await self.line_slots.acquire(
                line, lambda: line_cap(share, admission.limit), deadline, info.choices
            )
            if not held:
                self._refund(limiter, est_tokens, record)
                cap = line_cap(share, admission.limit)
                message = (
                    f"business line {line!r} holds its share of the gate ({cap} of {admission.limit} slots)"
                )
                message += f" and none freed within {deadline:g} s"
                return self._refuse(record, 503, message, "line_share_full", deadline, outcome="expired")
            record.queue_wait_s = max(0.0, self.clock() - arrived)  # in the line's own queue
            own_wait_s = max(0.0, deadline - record.queue_wait_s)  # what is left of it for the gate's queue
        try:
            return await self._admit(
                request, body, record, info, limiter, priority, admission, lane, fill, own_wait_s
            )
        finally:
            if held:
                self.line_slots.release(line, held)

    async def _websocket(self, request: web.Request, keyed: str | None, arrived: float) -> web.StreamResponse:
        """A WebSocket session: one request of its line (429 when the line is over its rate), then
        relayed to an upstream that takes its handshake."""
        line = keyed or self.resolver.named_line(request.headers)
        limiter = self.lines.get(line, arrived)
        verdict = limiter.admit(0.0, arrived)
        if not verdict.granted:
            self.metrics.refused.labels(limiter.name, verdict.limit).inc()
            reason, wait_s = verdict.reason, verdict.retry_after_s
            return json_error(429, reason, "rate_limit_error", "rate_limit_exceeded", wait_s)
        return await self.websockets(request, line)

    def _count_realtime(self, line: str, usage: tuple[float, float]) -> None:
        """An utterance of a realtime session: its tokens counted for its line, and taken from the line's
        token budget (into debt, as any answer's beyond its charge: its next requests wait)."""
        prompt, output = usage
        self.stats.tokens.labels(line, "prompt").inc(prompt)
        self.stats.tokens.labels(line, "output").inc(output)
        now = self.clock()
        self.lines.get(line, now).settle(0.0, prompt + output, now)

    def _refund(self, limiter: LineLimiter, est_tokens: float, record: RequestRecord) -> None:
        """Give back what the line's buckets were charged for a request the gate then did not serve, and
        say the refunded level in its answer's rate-limit headers."""
        limiter.refund(est_tokens)
        record.charged_tokens = 0.0
        if record.rate_limit:
            record.rate_limit = limiter.headers(self.clock())

    def _deadline(self, own_wait_s: float | None, priority: Priority) -> float:
        """How long a request may wait to be admitted: the gate's deadline for its original class, or the
        client's when shorter."""
        gate_s = self.admission.max_wait_for(priority)
        return gate_s if own_wait_s is None else min(own_wait_s, gate_s)

    async def _admit(
        self,
        request: web.Request,
        body: bytes,
        record: RequestRecord,
        info: RequestInfo,
        limiter: LineLimiter,
        priority: Priority,
        admission: AdmissionQueue,
        lane: IsolationLane | None,
        fill: Fill | None,
        own_wait_s: float | None,
    ) -> web.StreamResponse:
        """Through the admission queue (its deadline, or ``own_wait_s`` when shorter), then upstream.
        ``record.queue_wait_s`` holds the wait before it (in the line's own queue), if any."""
        est_tokens = info.prompt_tokens + record.max_tokens  # as admitted by the line's buckets
        ticket, changed = admission.offer(priority, record.arrived, info.choices)
        self._wake(changed)
        if ticket.state is TicketState.WAITING:
            refusal = await self._wait(ticket, record, admission, own_wait_s)
            if refusal is not None:
                self._refund(limiter, est_tokens, record)
                return refusal
        elif ticket.state is TicketState.REJECTED:
            self._refund(limiter, est_tokens, record)
            return self._refuse(record, 429, "the gate's queue is full", "queue_full", self.cfg.aging_s)
        record.queue_wait_s += ticket.queue_wait_s
        record.engine_class = record.priority  # admitted: an engine with priority scheduling is told it
        if info.stream and self.cfg.stream_usage:  # exact token counts (agent/gate/stream_usage.py)
            asked = ask_stream_usage(record.path, body)
            if asked is not None:
                body, record.usage_asked = asked, True
        try:
            prefer = None if lane is None else lane.upstream
            return await self.forwarder.forward(request, body, record, info, prefer, fill)
        finally:
            self._wake(admission.release(ticket, self.clock()))

    async def _wait(
        self, ticket: Ticket, record: RequestRecord, admission: AdmissionQueue, own_wait_s: float | None
    ) -> web.Response | None:
        """Wait for admission; a refusal response if the ticket was shed or expired instead. The deadline
        is the gate's, or the client's own (``max_wait_header``) when that is shorter."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = future
        deadline = self._deadline(own_wait_s, ticket.priority)
        try:
            await asyncio.wait_for(future, timeout=deadline)
        except TimeoutError:
            admission.expire_ticket(ticket)
        except asyncio.CancelledError:  # the client went away while queued
            self._waiters.pop(ticket, None)
            if not admission.cancel(ticket) and ticket.state is TicketState.ADMITTED:
                self._wake(admission.release(ticket, self.clock()))
            raise
        finally:
            self._waiters.pop(ticket, None)
        if ticket.state is TicketState.ADMITTED:
            return None
        if ticket.state is TicketState.REJECTED:
            message = f"the gate's queue is full ({ticket.reason})"
            return self._refuse(record, 429, message, "queue_full", 1.0, why="shed")
        message = f"no capacity within {deadline:g} s (in-flight limit {admission.limit})"
        retry_s = self._deadline(None, ticket.priority)  # when capacity may free, whatever the client's wait
        return self._refuse(record, 503, message, "queue_timeout", retry_s, outcome="expired")

    def _unreadable(
        self, request: web.Request, keyed: str | None, status: int, message: str, code: str
    ) -> web.Response:
        """Answer a request the gate cannot read (too large, compressed, not JSON, a bad header) ``status``;
        counted by its line and ``code`` in ``servepilot_gate_refused_total``, as no engine answer is."""
        line = keyed or self.resolver.named_line(request.headers)
        self.metrics.refused.labels(line, code).inc()
        return json_error(status, message, "invalid_request_error", code)

    def _refuse(
        self,
        record: RequestRecord,
        status: int,
        message: str,
        code: str,
        retry_s: float,
        outcome: str = "rejected",
        why: str = "",
    ) -> web.Response:
        """Answer ``status`` with an OpenAI-shaped ``code``; counted by its line and ``why`` (the code when
        not given) in ``servepilot_gate_refused_total``."""
        record.outcome, record.status, record.refused = outcome, status, why or code
        self.stats.record(record, self.clock())
        self.metrics.refused.labels(record.line, record.refused).inc()
        return json_error(
            status, message, "rate_limit_error" if status == 429 else "overloaded_error", code, retry_s
        )

    def _finish(self, record: RequestRecord) -> None:
        now = self.clock()
        if record.charged_tokens:
            self._settle(record, now)
        self.stats.record(record, now)

    def _settle(self, record: RequestRecord, now: float) -> None:
        """Replace the estimate its line's token budget was charged at admission by what the answer used:
        its prompt and output tokens as the engine counted them (or a stream's token events; for a client
        that left mid-stream, those relayed until then, as the engine aborts it), or nothing for a request
        no engine worked on (:attr:`RequestRecord.unprocessed`: left while queued, or refused before its
        first token). A line whose clients ask for ``max_tokens`` far above what they get was held to a
        fraction of its budget; a request without ``max_tokens`` was charged its prompt alone, whatever it
        generated. A failed answer, a JSON
        answer without usage, or one whose client left while the engine worked on it keeps its charge:
        what it used is not known."""
        if record.outcome in ("ok", "disconnected") and record.counted:
            used = record.prompt_tokens + record.output_tokens
        elif record.unprocessed:
            used = 0.0
        else:
            return
        self.lines.get(record.line, now).settle(record.charged_tokens, used, now)
        record.charged_tokens = 0.0

    # --- the response cache ------------------------------------------------------------------------
    def _fill_cache(
        self, fill: Fill, up: aiohttp.ClientResponse, streaming: bool, record: RequestRecord | None
    ) -> None:
        """A complete 200 response: note the model identity it shows, and store it if admitted."""
        assert self.cache is not None
        body = fill.body
        identity = response_identity(body if body else fill.head, streaming)
        self.cache.observe_identity(identity)
        if fill.store and body and up.headers.get("Content-Encoding", "identity") == "identity":
            gpu_s = 0.0 if record is None else max(0.0, record.e2e_s - record.queue_wait_s)
            content_type = up.headers.get("Content-Type", "application/json")
            self.cache.put(fill.key, body, content_type, streaming, gpu_s, identity)

    def _loop_detected(self) -> web.Response:
        """508 (RFC 5842) to a request that came back through an upstream leading to this gate, said
        once in the log: it is a wiring mistake, and every request meets it."""
        message = "request loop: the request came back to this gate through its upstream (gate.upstreams)"
        if not self._loop_said:
            self._loop_said = True
            log.error("%s; upstreams %s lead back to the gate", message, dict(self.cfg.upstreams))
        return json_error(508, message, "upstream_error", "loop_detected")

    async def _serve_cached(self, request: web.Request, entry: Entry) -> web.StreamResponse:
        """Answer from the cache: a JSON body as is, a stream replayed event by event."""
        headers = {"Content-Type": entry.content_type, "X-Servepilot-Cache": "hit"}
        if not entry.streaming:
            return web.Response(status=200, body=entry.body, headers=headers)
        resp = web.StreamResponse(status=200, headers=headers)
        record = request.get(RECORD)
        if record is not None:  # its headers leave now, before the gate's handler sees the response
            add_gate_headers(resp.headers, record)
        await resp.prepare(request)
        for event in entry.events():
            await resp.write(event)
        await resp.write_eof()
        return resp
