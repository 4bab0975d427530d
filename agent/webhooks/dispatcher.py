"""The webhook dispatcher: alert transitions in, durable deliveries out, with metrics.

``observe(state)`` is a loop listener (synchronous, cheap): it asks :class:`AlertTracker` what changed,
renders one message per sink (per group for the generic sink) and writes them to the :class:`Outbox`
before returning — from then on the message survives restarts. ``run(stop)`` is the delivery task: it
sends what is due, oldest first, and reschedules failures with backoff (:mod:`.retry`). Each sink's queue
is first in, first out: a message waits behind an older one that is backing off, so a resolution never
reaches a receiver before its firing message. A receiver that is down for 15 minutes only delays
messages; when it answers again the queue drains in order.
``deliver_due(now)`` is one pass of that task, which is what tests drive (no sleeping).

Metrics live in the registry passed in (the agent's own, never the global one)::

    servepilot_webhook_deliveries_total{sink,outcome}    ok | retry | dropped | expired | evicted
    servepilot_webhook_queue_depth{sink}                 messages waiting
    servepilot_webhook_oldest_pending_age_seconds{sink}  0 when the queue is empty
    servepilot_webhook_delivery_duration_seconds{sink}   one HTTP attempt
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agent.config import WebhookConfig
from agent.state import AgentState
from agent.tls import webhook_context
from agent.webhooks.alerts import Alert, AlertTracker
from agent.webhooks.outbox import Message, Outbox
from agent.webhooks.retry import Outcome, backoff_s, classify, retry_after_s
from agent.webhooks.signing import SignatureError, decode_secrets
from agent.webhooks.sinks import AlertmanagerSink, GenericSink, Sink, message_id

log = logging.getLogger(__name__)


class WebhookMetrics:
    """Delivery metrics, registered in the registry given (tests pass a fresh one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.deliveries = Counter(
            "servepilot_webhook_deliveries",
            "Webhook delivery attempts by outcome (ok, retry, dropped, expired, evicted).",
            ["sink", "outcome"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            "servepilot_webhook_queue_depth",
            "Webhook messages waiting in the outbox.",
            ["sink"],
            registry=registry,
        )
        self.oldest_age = Gauge(
            "servepilot_webhook_oldest_pending_age_seconds",
            "Age of the oldest undelivered webhook message (0 when none).",
            ["sink"],
            registry=registry,
        )
        self.duration = Histogram(
            "servepilot_webhook_delivery_duration_seconds",
            "Duration of one webhook HTTP attempt.",
            ["sink"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry,
        )


def sinks_from_config(cfg: WebhookConfig) -> list[Sink]:
    """The sinks ``cfg`` names. A generic URL without a readable secret is a one-line ValueError."""
    sinks: list[Sink] = []
    if cfg.alertmanager_url:
        sinks.append(AlertmanagerSink(cfg.alertmanager_url, cfg.generator_url, cfg.resend_s))
    if cfg.generic_url:
        if not cfg.secret_file:
            raise ValueError("webhooks.secret_file is required when webhooks.generic_url is set")
        try:
            text = Path(cfg.secret_file).read_text(encoding="utf-8")
            secrets = decode_secrets(text)
        except OSError as error:
            raise ValueError(f"webhooks.secret_file {cfg.secret_file!r}: {error.strerror or error}") from None
        except (SignatureError, UnicodeDecodeError) as error:
            raise ValueError(f"webhooks.secret_file {cfg.secret_file!r}: {error}") from None
        sinks.append(GenericSink(cfg.generic_url, secrets if len(secrets) > 1 else secrets[0], cfg.group_by))
    return sinks


class WebhookDispatcher:
    """Tracks alerts, queues them durably and delivers them with retries."""

    def __init__(
        self,
        cfg: WebhookConfig,
        registry: CollectorRegistry,
        *,
        sinks: Sequence[Sink] | None = None,
        outbox: Outbox | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        session: aiohttp.ClientSession | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.cfg = cfg
        self.sinks: dict[str, Sink] = {
            s.name: s for s in (sinks if sinks is not None else sinks_from_config(cfg))
        }
        self.outbox = outbox if outbox is not None else Outbox(cfg.queue_path, max_pending=cfg.max_pending)
        self.metrics = WebhookMetrics(registry)
        self.clock = clock
        self.rng = rng or random.Random()
        self.poll_s = poll_s
        self.tracker = AlertTracker(
            cfg.min_severity, cfg.source_down_after_s, dict(cfg.labels), resolve_after_s=cfg.resolve_after_s
        )
        self.tracker.restore(self.outbox.load_active())
        #: receivers' TLS (webhooks.tls_*)
        self._ssl = webhook_context(cfg)
        self._session = session
        self._own_session = session is None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._last_resend = 0.0
        self._unsaved: deque[Message] = deque(maxlen=max(10, cfg.max_pending))
        for name in self.sinks:
            self.metrics.deliveries.labels(name, Outcome.OK.value)
        self._refresh_gauges(clock())

    # -- producing -------------------------------------------------------------------------------

    def observe(self, state: AgentState) -> None:
        """Loop listener: queue the alert transitions of this tick (and periodic Alertmanager resends)."""
        now = state.snapshot.now if state.snapshot is not None else self.clock()
        changes = self.tracker.update(state, now)
        if changes:
            try:
                self.outbox.save_active(self.tracker.active.values())
            except sqlite3.Error as error:  # disk full: firing alerts are still in memory and re-posted
                log.error("webhook outbox: cannot save firing alerts: %s", error)
            self.submit(changes, now)
        self._resend(now)
        self._refresh_gauges(now)

    def submit(self, alerts: Sequence[Alert], now: float, *, only: str | None = None) -> int:
        """Render ``alerts`` for every sink (or only sink ``only``) and store the messages; returns stored."""
        self._store_unsaved()
        stored = 0
        for name, sink in self.sinks.items():
            if only is not None and name != only:
                continue
            for body in sink.render(alerts, now):
                stored += self._store(Message(message_id(name, body), name, now, now, 0, body))
        if stored:
            self._wake.set()
        return stored

    def _store(self, msg: Message) -> int:
        """Put ``msg`` in the outbox; when the disk refuses, hold it in memory (bounded) and retry later."""
        try:
            ok, evicted = self.outbox.put(msg)
        except sqlite3.Error as error:
            if len(self._unsaved) == self._unsaved.maxlen:
                self.metrics.deliveries.labels(self._unsaved[0].sink, "evicted").inc()
            self._unsaved.append(msg)
            self.metrics.deliveries.labels(msg.sink, "unsaved").inc()
            log.error(
                "webhook outbox: cannot store a message (%s); holding %d in memory", error, len(self._unsaved)
            )
            return 0
        if evicted:
            self.metrics.deliveries.labels(msg.sink, "evicted").inc(evicted)
            log.warning("webhook outbox for %s full: dropped %d oldest message(s)", msg.sink, evicted)
        return int(ok)

    def _store_unsaved(self) -> None:
        """Move messages held in memory during a disk outage into the outbox, oldest first."""
        while self._unsaved:
            msg = self._unsaved.popleft()
            try:
                self.outbox.put(msg)
            except sqlite3.Error:
                self._unsaved.appendleft(msg)
                return
            self._wake.set()

    def _resend(self, now: float) -> None:
        """Alertmanager forgets alerts that are not re-posted; Prometheus re-sends every minute, so do we."""
        if "alertmanager" not in self.sinks or now - self._last_resend < self.cfg.resend_s:
            return
        self._last_resend = now
        firing = list(self.tracker.active.values())
        if firing and self.outbox.pending("alertmanager") == 0:  # an outage must not pile up resends
            self.submit(firing, now, only="alertmanager")

    # -- reconfiguring (a config reload) ----------------------------------------------------------

    def prepare(self, cfg: WebhookConfig) -> Callable[[], None]:
        """Check ``cfg`` (a reload's webhooks section) and return what applies it; raises ValueError, in one
        line, having changed nothing, when a sink cannot be built (the secret file unreadable or empty).

        Applying it swaps the sinks and settings in place, keeping the outbox and the firing alerts:
        * queued messages go to a sink's new URL, signed at send time with its new secret(s);
        * a sink added (say ``alertmanager_url`` set) is sent every alert firing now, so it starts in step;
        * a sink removed has its queued messages discarded (counted as ``expired``), as it was asked;
        * a raised ``min_severity`` or new ``labels`` send their transitions at once
          (:meth:`AlertTracker.reconfigure`).
        ``enabled`` and ``queue_path`` need a restart (agent/reload.py).
        """
        sinks = {sink.name: sink for sink in sinks_from_config(cfg)}

        def apply() -> None:
            self._apply(cfg, sinks)

        return apply

    def _apply(self, cfg: WebhookConfig, sinks: dict[str, Sink]) -> None:
        now = self.clock()
        removed = [name for name in self.sinks if name not in sinks]
        added = [name for name in sinks if name not in self.sinks]
        moved = [name for name in sinks if name in self.sinks and sinks[name].url != self.sinks[name].url]
        for name in removed:
            try:
                discarded = self.outbox.discard(name)
            except sqlite3.Error as error:  # they expire at delivery instead (no sink to send them to)
                log.error("webhook outbox: cannot discard the messages of %s: %s", name, error)
                discarded = 0
            self.metrics.deliveries.labels(name, "expired").inc(discarded)
            self.metrics.queue_depth.labels(name).set(0)
            self.metrics.oldest_age.labels(name).set(0)
            log.warning("webhook %s removed: %d queued message(s) discarded", name, discarded)
        for name in moved:
            log.info(
                "webhook %s now posts to %s: %d queued message(s) go there",
                name,
                sinks[name].url,
                self.outbox.pending(name),
            )
        self.cfg = cfg
        self.sinks = sinks
        self.outbox.max_pending = cfg.max_pending
        for name in added:
            self.metrics.deliveries.labels(name, Outcome.OK.value)
        changes = self.tracker.reconfigure(
            now,
            min_severity=cfg.min_severity,
            source_down_after_s=cfg.source_down_after_s,
            resolve_after_s=cfg.resolve_after_s,
            static_labels=dict(cfg.labels),
        )
        if changes:
            try:
                self.outbox.save_active(self.tracker.active.values())
            except sqlite3.Error as error:
                log.error("webhook outbox: cannot save firing alerts: %s", error)
            for name in sinks:
                if name not in added:
                    self.submit(changes, now, only=name)
        firing = list(self.tracker.active.values())
        for name in added:
            url = sinks[name].url
            log.info("webhook %s added (%s): sending the %d alert(s) firing now", name, url, len(firing))
            if firing:
                self.submit(firing, now, only=name)
        self._refresh_gauges(now)

    # -- delivering ------------------------------------------------------------------------------

    async def _post(self, sink: Sink, msg: Message, now: float) -> tuple[int | None, str, float | None]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        started = time.perf_counter()
        try:
            async with self._session.post(
                sink.url,
                data=msg.body,
                headers=sink.headers(msg.id, msg.body, now),
                allow_redirects=False,
                ssl=self._ssl,
                timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s),  # per attempt: reloads change it
            ) as response:
                await response.read()
                later = retry_after_s(response.headers.get("retry-after"))
                return response.status, f"HTTP {response.status}", later
        except (TimeoutError, aiohttp.ClientError, OSError) as error:
            return None, f"{type(error).__name__}: {error}".strip().rstrip(":"), None
        finally:
            self.metrics.duration.labels(sink.name).observe(time.perf_counter() - started)

    async def deliver_due(self, now: float | None = None) -> int:
        """Attempt every message due at ``now``; returns how many were delivered."""
        now = self.clock() if now is None else now
        self._store_unsaved()
        delivered = 0
        blocked: set[str] = set()  # one failure per sink per pass: keep order, do not hammer a dead receiver
        for msg in self.outbox.due(now):
            sink = self.sinks.get(msg.sink)
            if sink is None or now - msg.created_at > self.cfg.max_age_s:
                self.outbox.remove(msg.id)
                self.metrics.deliveries.labels(msg.sink, "expired").inc()
                continue
            if msg.sink in blocked:
                continue
            status, detail, later = await self._post(sink, msg, now)
            outcome = classify(status)
            self.metrics.deliveries.labels(sink.name, outcome.value).inc()
            if outcome is Outcome.OK:
                self.outbox.remove(msg.id)
                delivered += 1
            elif outcome is Outcome.DROP:
                self.outbox.remove(msg.id)
                log.error("webhook %s rejected message %s for good: %s", sink.name, msg.id, detail)
            else:
                wait = backoff_s(msg.attempts + 1, self.cfg.backoff_base_s, self.cfg.backoff_max_s, self.rng)
                if later is not None:
                    wait = max(wait, min(later, self.cfg.backoff_max_s))
                self.outbox.retry_at(msg.id, now + wait, detail)
                blocked.add(msg.sink)
                log.warning("webhook %s: %s; retry %d in %.1f s", sink.name, detail, msg.attempts + 1, wait)
        self._refresh_gauges(now)
        return delivered

    def _refresh_gauges(self, now: float) -> None:
        for name in self.sinks:
            self.metrics.queue_depth.labels(name).set(self.outbox.pending(name))
            oldest = self.outbox.oldest_created_at(name)
            self.metrics.oldest_age.labels(name).set(0.0 if oldest is None else max(0.0, now - oldest))

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver until ``stop`` is set, waking when a message is queued or the next retry is due."""
        while not stop.is_set():
            try:
                await self.deliver_due()
            except Exception:  # a bug here must not end delivery for good
                log.exception("webhook delivery pass failed")
            next_at = self.outbox.next_due_at()
            wait = self.poll_s if next_at is None else min(self.poll_s, max(0.0, next_at - self.clock()))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_first(stop, self._wake), timeout=wait)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the delivery task on the running event loop; a second call while it runs does nothing
        (two tasks would deliver each message twice and only one would be stopped)."""
        if self._task is not None and not self._task.done():
            return
        self._stop.clear()
        self._task = asyncio.create_task(self.run(self._stop), name="servepilot-webhooks")

    async def stop(self) -> None:
        """Stop delivering; queued messages stay in the outbox for the next start."""
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout=self.cfg.timeout_s + 1.0)
        if self._session is not None and self._own_session:
            await self._session.close()
        self.outbox.close()

    def status(self) -> Mapping[str, int]:
        return {name: self.outbox.pending(name) for name in self.sinks}


async def _first(*events: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
