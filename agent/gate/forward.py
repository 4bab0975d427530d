"""Sending a request upstream, and what to do when the upstream fails it.

The split (:class:`UpstreamPool`) orders the candidates; the first one answering gets the request, and
its answer is relayed (agent/gate/relay.py). The next candidate gets the request when:

* the connection is refused or breaks before any response (the upstream is marked down);
* the upstream answers one of ``gate.retry_statuses`` (it did not take the request), within the retry
  budget (:meth:`Forwarder.may_retry`);
* the upstream hung before sending any of its answer and the gate took the request back
  (agent/gate/held.py, :class:`~agent.gate.relay.Unanswered`): the client has had nothing yet.

A kept-alive connection the upstream closed meanwhile is retried once on a new connection instead
(:meth:`Forwarder.send`). When no candidate is left the client gets 502, or 504 when one hung.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import uuid
from collections.abc import Callable, Mapping

import aiohttp
from aiohttp import web

from agent.config import GateConfig
from agent.gate.cache import Fill
from agent.gate.held import HeldRequests
from agent.gate.metrics import GateMetrics
from agent.gate.openai import REQUEST_ID, RequestInfo
from agent.gate.records import GateStats, RequestRecord
from agent.gate.relay import VIA, Relay, Unanswered, closing, json_error, upstream_headers
from agent.gate.stream_usage import (
    MAX_REFUSAL_BYTES,
    REASK_AFTER_S,
    REFUSAL_STATUSES,
    UsageRefusals,
    refuses_stream_usage,
    unask_stream_usage,
)
from agent.gate.upstreams import Upstream, UpstreamPool, upstream_auth
from agent.tls import gate_upstream_context

log = logging.getLogger(__name__)

_JSON_OBJECT = re.compile(rb"\s*\{")
"""How a JSON object body starts; anything else is passed on as it came."""
#: The longest ``Retry-After`` of a 502 while every upstream is down: a long health-check interval is no
#: reason for a client to wait that long (OpenAI's Python SDK disregards one over 120 s anyway).
DOWN_RETRY_AFTER_MAX_S = 30.0


class Forwarder:
    """Sends the gate's requests to its upstreams, with failover, retries and the stale-socket retry.

    ``cfg`` is read at each request (a reload changes the retry rule); ``clock`` likewise (tests replace
    the gate's clock after the start). :meth:`open` before the first request, :meth:`close` at the end.
    """

    def __init__(
        self,
        cfg: Callable[[], GateConfig],
        pool: UpstreamPool,
        held: HeldRequests,
        stats: GateStats,
        metrics: GateMetrics,
        relay: Relay,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self._cfg = cfg
        self.pool = pool
        self.held = held
        self.stats = stats
        self.metrics = metrics
        self.relay = relay
        self.clock = clock
        self.rng = rng
        #: the upstream session (pooled connections); None before :meth:`open`
        self.session: aiohttp.ClientSession | None = None
        #: opened on the first stale-connection retry: never reuses a connection
        self.fresh: aiohttp.ClientSession | None = None
        #: requests on a retry now, held to the budget
        self.retrying = 0
        #: TLS towards https upstreams (``gate.upstream_tls_*``; a restart applies a change)
        self.tls = gate_upstream_context(cfg())
        #: the upstreams' own key, in place of the client's (``gate.upstream_api_key_file``, read at start)
        self.auth = upstream_auth(cfg())
        #: the upstreams that refused the ``stream_options`` the gate asks streams' usage with
        self.usage_refusals = UsageRefusals()
        #: this gate's entry in the ``Via`` header of what it sends upstream (RFC 9110 section 7.6.3),
        #: by which it knows a request that came back to it (:meth:`came_back`)
        self.via = f"1.1 servepilot-{uuid.uuid4().hex[:12]}"

    def came_back(self, headers: Mapping[str, str]) -> bool:
        """Whether a request has been through this gate already: an upstream that leads back to the gate
        (``gate.upstreams`` naming the gate's own port, or a Service in front of the gates). Each hop
        was admitted and held a slot until the queue gave up, and only X-Forwarded-For outgrowing 8 kB
        (about 740 hops) ended the loop: one request took every slot of the gate for its queue timeout."""
        via = headers.get(VIA)
        return via is not None and self.via in via

    def open(self) -> aiohttp.ClientSession:
        """Open the upstream session (the health checks use it too) and return it."""
        self.session = self._new_session()
        return self.session

    async def close(self) -> None:
        for session in (self.session, self.fresh):
            if session is not None:
                await session.close()

    def _new_session(self, *, fresh: bool = False) -> aiohttp.ClientSession:
        """An upstream session; ``fresh``: one that never reuses a connection (the stale-socket retry)."""
        cfg = self._cfg()
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=0,
            ttl_dns_cache=300,
            force_close=fresh,
            ssl=self.tls,
        )
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s
        )
        # no cookie jar: an upstream's Set-Cookie is its client's, relayed to it; kept here, it went with
        # every later client's requests (a load balancer's sticky session, a login)
        return aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )

    async def forward(
        self,
        request: web.Request,
        body: bytes,
        record: RequestRecord | None,
        info: RequestInfo,
        prefer: str | None = None,
        fill: Fill | None = None,
    ) -> web.StreamResponse:
        """Send upstream: the split's pick first, or ``prefer`` (the long pool) first when given. The next
        candidate gets it when an upstream refuses the connection, or when it hung before sending any of
        its answer (the gate's ``stalled_upstreams``): the client has had nothing yet."""
        assert self.session is not None, "Gate.start() was not called"
        headers = upstream_headers(request, self.auth, self.via)
        if record is not None:
            # the gate reads the answer (its usage, its events): uncompressed, as the engines send anyway
            headers["Accept-Encoding"] = "identity"
            if record.request_id and REQUEST_ID not in headers:
                headers[REQUEST_ID] = record.request_id  # one the gate gave it
        candidates = self.pool.candidates(self.rng.random())
        if prefer is not None:
            candidates.sort(key=lambda up: up.name != prefer)  # stable: the rest keep their order
        asked = record is not None and record.usage_asked  # the gate asked for the stream's usage
        errors: list[str] = []
        stalled: list[str] = []
        tried: set[str] = set()
        retried = 0
        try:
            while candidates:
                upstream = candidates.pop(0)
                tried.add(upstream.name)
                url = upstream.url + request.rel_url.path_qs
                key = id(record)
                if record is not None:
                    self.held.sent(record, upstream.name, info.stream, self.clock())
                sent = body
                if asked and record is not None:
                    sent = self._usage_body(upstream.name, body, record)
                try:
                    engine_class = "" if record is None else record.engine_class
                    body_for = self.body_for(upstream.name, sent, info, engine_class)
                    if record is None:
                        up = await self.send(request.method, url, body_for, headers)
                    else:  # a hang before the response headers is taken back by expiring this at once
                        async with asyncio.timeout(None) as taken_back:
                            self.held.sending[key] = taken_back
                            try:
                                up = await self.send(request.method, url, body_for, headers)
                            finally:
                                del self.held.sending[key]
                except (aiohttp.ClientConnectionError, TimeoutError, OSError) as error:
                    if record is None or not record.abandoned:  # not taken back: the upstream failed
                        self.pool.mark(upstream.name, False, self.clock(), f"{type(error).__name__}: {error}")
                        errors.append(f"{upstream.name}: {type(error).__name__}")
                        continue
                    up = None
                if record is not None and record.abandoned:  # taken back before or as its headers came
                    if up is not None:
                        up.close()
                    stalled.append(self._resent(upstream.name, record))
                    candidates = self._others(tried)
                    continue
                assert up is not None
                if record is not None and record.usage_asked and await self._refuses_usage(upstream.name, up):
                    candidates.insert(0, upstream)  # again, without the field (it did no work)
                    continue
                if up.status in self._cfg().retry_statuses and candidates and self.may_retry(retried):
                    self._retry(upstream.name, up, record)
                    retried += 1
                    continue
                if record is not None:
                    record.upstream = upstream.name
                    self.held.relaying[key] = up  # so a hang can take its answer back (stalled_upstreams)
                try:
                    return await self.relay(request, up, record, fill, info.token_event)
                except Unanswered:
                    assert record is not None
                    stalled.append(self._resent(upstream.name, record))
                    candidates = self._others(tried)
                finally:
                    up.release()
        finally:
            self.retrying -= min(retried, 1)
            if record is not None:
                self.held.done(record)
        if stalled:  # it hung before answering, and no other upstream was left to ask
            return self._failed(record, 504, "; ".join(stalled + errors), "upstream_stalled")
        message = "no upstream reachable (" + "; ".join(errors) + ")" if errors else "no upstream configured"
        # every upstream down (an engine restarting): a client retrying at once meets the same refusal,
        # so it is told to wait until the next health check, which may find one back
        down = errors and not any(up.healthy for up in self.pool.upstreams.values())
        wait = min(self._cfg().health_interval_s, DOWN_RETRY_AFTER_MAX_S) if down else None
        return self._failed(record, 502, message, "bad_gateway", wait)

    def _failed(
        self,
        record: RequestRecord | None,
        status: int,
        message: str,
        code: str,
        retry_after_s: float | None = None,
    ) -> web.Response:
        """No upstream answered: count the request as the upstreams' failure and tell the client why. A
        502 (none could be reached) gives its line back the tokens it was charged: during an engine's
        outage, clients' retries drained their lines' token budgets for answers nobody gave, and the
        lines met 429 ``token_rate`` once the engine was back. A 504 (one hung, perhaps busy with it)
        keeps its charge, as a failed answer does.

        A 502 while every upstream is down says ``Retry-After``: the health-check interval, at most
        :data:`DOWN_RETRY_AFTER_MAX_S`.

        Either answer closes the client's connection (``Connection: close``): a client retries a 502 or
        504 at once (OpenAI's SDK does, twice), and on the kept-alive connection it came on, which a
        Kubernetes Service pinned to this pod, whose engine cannot answer: the same error again. On a new
        connection the Service may send the retry to a replica that can."""
        if record is not None:
            record.outcome, record.status = "upstream_error", status
            record.unanswered = status == 502
            record.e2e_s = self.clock() - record.arrived
            self.relay.finish(record)
        return closing(json_error(status, message, "upstream_error", code, retry_after_s))

    def may_retry(self, retried: int) -> bool:
        """Whether a request that met a retriable error may try the next upstream: a request already on
        a retry may go on (it holds its place in the budget); a new one only while the requests on a
        retry stay within ``retry_budget_ratio`` of those at upstreams, or fewer than 3 (Envoy's retry
        budget: an upstream failing every request cannot double the load on the others)."""
        if retried:
            return True
        budget = max(3.0, self._cfg().retry_budget_ratio * len(self.held))
        if self.retrying + 1 > budget:
            self.metrics.retry_denied.inc()
            return False
        self.retrying += 1
        return True

    def _usage_body(self, upstream: str, asked: bytes, record: RequestRecord) -> bytes:
        """The body asking for the stream's usage, or as the client sent it to an upstream that refused
        the field lately (agent/gate/stream_usage.py); the record says which it got."""
        record.usage_asked = not self.usage_refusals.refused(upstream, self.clock())
        return asked if record.usage_asked else unask_stream_usage(asked)

    async def _refuses_usage(self, upstream: str, up: aiohttp.ClientResponse) -> bool:
        """Whether ``up`` refused the ``stream_options`` the gate put in the request; if so it is dropped
        and the upstream noted, to be sent the request again without the field. Any other answer is left
        for the relay (a body read here is kept by aiohttp for it)."""
        length = up.content_length
        if up.status not in REFUSAL_STATUSES or length is None or length > MAX_REFUSAL_BYTES:
            return False
        try:
            payload = await up.read()
        except (aiohttp.ClientError, TimeoutError):
            return False  # the relay meets the same error and fails the request as it would have
        if not refuses_stream_usage(up.status, payload):
            return False
        if not self.usage_refusals.refused(upstream, self.clock()):
            log.warning(
                "upstream %s refused stream_options (%d): its streams go without it for %g s, counted "
                "per event",
                upstream,
                up.status,
                REASK_AFTER_S,
            )
        self.usage_refusals.note(upstream, self.clock())
        self.metrics.usage_refused.labels(upstream).inc()
        up.release()
        return True

    def _retry(self, upstream: str, up: aiohttp.ClientResponse, record: RequestRecord | None) -> None:
        """Drop ``upstream``'s error answer (nothing of it reached the client) and count it: as a retry,
        and in the gate's answers as that upstream's 5xx, so the breaker and the canary still see an
        engine failing half its requests while the clients get the next upstream's answers."""
        self.metrics.retried.labels(upstream, str(up.status)).inc()
        log.debug("upstream %s answered %d: asking the next upstream", upstream, up.status)
        up.release()
        if record is not None:
            self.stats.attempt_failed(upstream, record.priority)

    def _resent(self, upstream: str, record: RequestRecord) -> str:
        """Note a request taken back from a hung ``upstream`` before any of its answer; returns why."""
        log.warning("took a request back, before any of its answer, from upstream %s", record.abandoned)
        self.metrics.resent.labels(upstream).inc()
        return f"upstream {record.abandoned}"

    def _others(self, tried: set[str]) -> list[Upstream]:
        """The upstreams still to try for a request taken back from a hung one, in the split's order."""
        return [up for up in self.pool.candidates(self.rng.random()) if up.name not in tried]

    def body_for(self, upstream: str, body: bytes, info: RequestInfo, engine_class: str = "") -> bytes:
        """The body as ``upstream`` should get it.

        * Its own model name (``gate.upstream_models``) in place of the one the client named. An upstream
          serving a smaller model (the breaker's L3) answers 404 to the primary's model name; the rewrite
          keeps a degraded level serving. The answer keeps the model that really answered. Only bodies
          the gate parsed (``info.model`` set) are rewritten.
        * Its class (the one it arrived in, :attr:`RequestRecord.engine_class`) as the engine's own
          ``priority`` (``gate.engine_priority``), in place of any the client sent: the gate's class is
          what the operator granted, and a client's own value would let it pass the others in the
          engine's queue. Only a JSON object is rewritten (not an audio upload's form), and only an
          admitted request (``engine_class`` set).
        """
        cfg = self._cfg()
        model = cfg.upstream_models.get(upstream)
        if model is not None and (not info.model or info.model == model):
            model = None
        priority = cfg.priority_value(upstream, engine_class) if engine_class and body else None
        if (model is None and priority is None) or not _JSON_OBJECT.match(body):
            return body  # nothing to change, or a form (an audio upload): not parsed, however large
        try:
            doc = json.loads(body)  # parsed once already (parse_request, parse_any)
        except (ValueError, UnicodeDecodeError):
            return body  # a body of an operator-admitted path that is not JSON: the engine judges it
        if model is not None:
            doc["model"] = model
        if priority is not None:
            doc["priority"] = priority
        return json.dumps(doc).encode()

    async def send(
        self, method: str, url: str, body: bytes, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        """One upstream request. A kept-alive connection the upstream closed meanwhile (llama.cpp closes
        after 100 requests or 5 s idle) fails before any response byte: either the write fails or the read
        sees the disconnect at once. That is retried once on a new connection instead of marking a healthy
        upstream down (as Go's HTTP transport does for reused connections). The retry goes through a
        session that never reuses connections: the pool may hold several sockets the upstream closed at
        the same moment, and a retry that picked another of them would fail the same way. A refused
        connection is not retried. The cost of the rare case where an upstream died mid-request: one
        duplicate attempt. A redirect is the client's to follow, not the gate's: it is relayed as it came
        (followed, a POST turned into a GET elsewhere, and the client got another page's answer as this
        one's)."""
        assert self.session is not None
        try:
            return await self.session.request(
                method, url, data=body or None, headers=headers, allow_redirects=False
            )
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as error:
            if isinstance(error, aiohttp.ClientConnectorError):  # refused / unreachable: not a stale socket
                raise
            log.info("upstream connection went stale (%s); retrying once on a new one", error)
            if self.fresh is None:
                self.fresh = self._new_session(fresh=True)
            return await self.fresh.request(
                method, url, data=body or None, headers=headers, allow_redirects=False
            )
