"""Webhook faults: the receiver down, the outbox's disk full, and a restart with alerts pending.

Deliveries are driven with ``deliver_due(now)`` (virtual time, no sleeping). The disk is filled for real:
SQLite's ``max_page_count`` makes the outbox file unable to grow, and SQLite answers exactly as on a full
disk (SQLITE_FULL, "database or disk is full").
"""

from __future__ import annotations

import json
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from agent.config import WebhookConfig
from agent.webhooks.alerts import Alert
from agent.webhooks.dispatcher import WebhookDispatcher
from agent.webhooks.outbox import Outbox
from agent.webhooks.sinks import AlertmanagerSink


class Receiver:
    """An Alertmanager stand-in on a fixed loopback port that can be stopped and started again."""

    def __init__(self) -> None:
        self.received: list[list[dict[str, object]]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _post(self, request: web.Request) -> web.Response:
        self.received.append(json.loads(await request.read()))
        return web.json_response({})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/api/v2/alerts", self._post)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def _dispatcher(url: str, path: Path, registry: CollectorRegistry | None = None) -> WebhookDispatcher:
    cfg = WebhookConfig(enabled=True, alertmanager_url=url, queue_path=str(path), timeout_s=2)
    sink = AlertmanagerSink(url)
    return WebhookDispatcher(cfg, registry or CollectorRegistry(), sinks=[sink], clock=lambda: 0.0)


def _alert(name: str, at: float) -> Alert:
    return Alert({"alertname": name, "severity": "warning"}, {"summary": name}, at)


async def test_receiver_down_keeps_alerts_queued_and_delivers_them_in_order(tmp_path: Path) -> None:
    receiver = Receiver()
    url = await receiver.start()
    await receiver.stop()  # the port is known and closed: connection refused
    dispatcher = _dispatcher(url, tmp_path / "outbox.sqlite")
    try:
        dispatcher.submit([_alert("First", 10.0)], 10.0)
        dispatcher.submit([_alert("Second", 11.0)], 11.0)
        assert await dispatcher.deliver_due(12.0) == 0
        assert dispatcher.outbox.pending("alertmanager") == 2
        await receiver.start()
        delivered = 0
        for now in range(13, 13 + 600, 30):  # virtual time past every backoff
            delivered += await dispatcher.deliver_due(float(now))
        assert delivered == 2 and dispatcher.outbox.pending("alertmanager") == 0
        names = [batch[0]["labels"]["alertname"] for batch in receiver.received]  # type: ignore[index]
        assert names == ["First", "Second"]
    finally:
        await dispatcher.stop()
        await receiver.stop()


async def test_a_full_disk_loses_no_alert(tmp_path: Path) -> None:
    receiver = Receiver()
    url = await receiver.start()
    dispatcher = _dispatcher(url, tmp_path / "outbox.sqlite")
    db = dispatcher.outbox._db  # the seam: SQLite's own size cap stands in for a full disk
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    try:
        db.execute(f"PRAGMA max_page_count = {pages}")
        dispatcher.submit([_alert("WhileFull" + "x" * 8000, 20.0)], 20.0)  # must not raise
        db.execute("PRAGMA max_page_count = 1073741823")  # space is back
        delivered = 0
        for now in range(21, 21 + 600, 30):
            delivered += await dispatcher.deliver_due(float(now))
        names = [str(batch[0]["labels"]["alertname"]) for batch in receiver.received]  # type: ignore[index]
        assert any(name.startswith("WhileFull") for name in names)
    finally:
        await dispatcher.stop()
        await receiver.stop()


async def test_pending_messages_and_firing_alerts_survive_a_restart(tmp_path: Path) -> None:
    receiver = Receiver()
    url = await receiver.start()
    await receiver.stop()
    path = tmp_path / "outbox.sqlite"
    first = _dispatcher(url, path)
    firing = _alert("Firing", 30.0)
    first.submit([firing], 30.0)
    first.outbox.save_active([firing])
    await first.deliver_due(31.0)
    await first.stop()
    first.outbox.close()

    await receiver.start()
    second = _dispatcher(url, path)
    try:
        assert [a.fingerprint for a in second.tracker.active.values()] == [firing.fingerprint]
        delivered = 0
        for now in range(32, 32 + 600, 30):
            delivered += await second.deliver_due(float(now))
        assert delivered == 1 and len(receiver.received) == 1
    finally:
        await second.stop()
        await receiver.stop()


def test_the_outbox_file_is_the_only_state_needed(tmp_path: Path) -> None:
    """Reopening the file alone (no dispatcher) shows the queued message: it was fsynced on put."""
    path = tmp_path / "outbox.sqlite"
    dispatcher = _dispatcher("http://127.0.0.1:9", path)
    dispatcher.submit([_alert("Durable", 40.0)], 40.0)
    dispatcher.outbox.close()
    assert Outbox(path).pending("alertmanager") == 1
