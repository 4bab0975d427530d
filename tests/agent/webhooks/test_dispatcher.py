from __future__ import annotations

import json
import random
import ssl
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import REGISTRY, CollectorRegistry

from agent.config import ConfigError, WebhookConfig
from agent.engines.launcher import free_port as _free_port
from agent.state import AgentState
from agent.webhooks.dispatcher import WebhookDispatcher, sinks_from_config
from agent.webhooks.outbox import Outbox
from agent.webhooks.receiver import build_receiver_app
from agent.webhooks.sinks import AlertmanagerSink, GenericSink
from detectors.base import Finding, Severity
from detectors.snapshot import Reading, Snapshot, SourceStatus

SECRET = b"k" * 32
LEAK = Finding("memory_leak", "probe.reserved_bytes", Severity.CRITICAL, 0.9, "reserved grows", 0.0)


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _state(now: float, *findings: Finding) -> AgentState:
    reading = Reading("engine", now, SourceStatus.OK, {"engine.requests_running": 1.0})
    return AgentState(snapshot=Snapshot.from_readings(now, {"engine": reading}), findings=findings)


def _dispatcher(
    tmp_path: Path, url: str, clock: Clock, registry: CollectorRegistry | None = None, **cfg: Any
) -> WebhookDispatcher:
    config = WebhookConfig(
        **{"enabled": True, "queue_path": str(tmp_path / "outbox.sqlite"), "resolve_after_s": 0, **cfg}
    )
    return WebhookDispatcher(
        config,
        registry or CollectorRegistry(),
        sinks=[GenericSink(url, SECRET)],
        clock=clock,
        rng=random.Random(0),
    )


async def _serve(app: web.Application, port: int = 0) -> TestServer:
    server = TestServer(app, host="127.0.0.1", port=port)
    await server.start_server()
    return server


async def test_a_finding_reaches_a_verifying_receiver(tmp_path: Path) -> None:
    clock = Clock()
    app, log = build_receiver_app(SECRET, clock=clock)
    server = await _serve(app)
    disp = _dispatcher(tmp_path, str(server.make_url("/hook")), clock)
    try:
        disp.observe(_state(clock.now, LEAK))
        assert await disp.deliver_due() == 1
    finally:
        await disp.stop()
        await server.close()
    [msg] = log.messages
    assert msg["status"] == "firing" and msg["alerts"][0]["labels"]["detector"] == "memory_leak"
    assert log.rejected == []


async def test_a_second_start_keeps_one_delivery_task(tmp_path: Path) -> None:
    """Two delivery tasks would post each message twice, and stop() would wait for only one."""
    disp = _dispatcher(tmp_path, "http://127.0.0.1:9/hook", Clock())
    try:
        disp.start()
        first = disp._task
        disp.start()
        assert disp._task is first and first is not None and not first.done()
    finally:
        await disp.stop()
    assert first.done()


async def test_a_resolution_follows_the_firing_message(tmp_path: Path) -> None:
    clock = Clock()
    app, log = build_receiver_app(SECRET, clock=clock)
    server = await _serve(app)
    disp = _dispatcher(tmp_path, str(server.make_url("/hook")), clock)
    try:
        disp.observe(_state(clock.now, LEAK))
        clock.now += 10
        disp.observe(_state(clock.now))
        assert await disp.deliver_due() == 2
    finally:
        await disp.stop()
        await server.close()
    assert [m["status"] for m in log.messages] == ["firing", "resolved"]


async def test_nothing_is_lost_across_a_15_minute_outage_and_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    port = _free_port()  # nothing listens: connection refused, as when the receiver's pod is gone
    url = f"http://127.0.0.1:{port}/hook"
    disp = _dispatcher(tmp_path, url, clock, backoff_max_s=60.0)
    disp.observe(_state(clock.now, LEAK))
    for _ in range(15):  # 15 minutes of failing attempts, one pass per simulated minute
        clock.now += 60
        assert await disp.deliver_due() == 0
    disp.observe(_state(clock.now))  # resolved while the receiver is still down
    await disp.stop()  # the agent restarts

    app, log = build_receiver_app(SECRET, clock=clock)
    server = await _serve(app, port)
    registry = CollectorRegistry()
    restarted = _dispatcher(tmp_path, url, clock, registry)
    try:
        clock.now += 61  # past the longest backoff
        assert await restarted.deliver_due() == 2
    finally:
        await restarted.stop()
        await server.close()
    assert [m["status"] for m in log.messages] == ["firing", "resolved"]  # in order, signatures fresh
    assert log.rejected == []
    assert registry.get_sample_value("servepilot_webhook_queue_depth", {"sink": "generic"}) == 0.0


async def test_a_resolution_never_overtakes_the_firing_message_still_backing_off(tmp_path: Path) -> None:
    """Seen live: the receiver came back while the firing message waited out its backoff, and the
    resolution, queued later but due at once, reached it first; a receiver that keeps the last status
    per alert then showed it firing for good."""
    clock = Clock()
    port = _free_port()  # the receiver is down when the alert fires
    url = f"http://127.0.0.1:{port}/hook"
    disp = _dispatcher(tmp_path, url, clock, backoff_base_s=30.0, backoff_max_s=60.0)
    disp.observe(_state(clock.now, LEAK))
    assert await disp.deliver_due() == 0  # refused: the firing message retries in ~30 s
    retry_at = disp.outbox.next_due_at()
    assert retry_at is not None and retry_at > clock.now + 10

    app, log = build_receiver_app(SECRET, clock=clock)
    server = await _serve(app, port)  # the receiver is back
    try:
        clock.now += 5
        disp.observe(_state(clock.now))  # resolved while the firing message still waits
        assert disp.outbox.next_due_at() == retry_at  # the queue's head sets the next attempt
        assert await disp.deliver_due() == 0  # the resolution waits behind it
        assert log.messages == []
        clock.now = retry_at
        assert await disp.deliver_due() == 2
    finally:
        await disp.stop()
        await server.close()
    assert [m["status"] for m in log.messages] == ["firing", "resolved"]


async def test_5xx_is_retried_with_backoff_until_it_succeeds(tmp_path: Path) -> None:
    clock = Clock()
    answers = [503, 502, 200]
    seen: list[str] = []

    async def flaky(request: web.Request) -> web.Response:
        seen.append(request.headers["webhook-id"])
        return web.Response(status=answers.pop(0))

    app = web.Application()
    app.router.add_post("/hook", flaky)
    server = await _serve(app)
    registry = CollectorRegistry()
    disp = _dispatcher(tmp_path, str(server.make_url("/hook")), clock, registry, backoff_base_s=1.0)
    try:
        disp.observe(_state(clock.now, LEAK))
        assert await disp.deliver_due() == 0
        assert await disp.deliver_due() == 0  # not due yet: backoff holds it
        clock.now += 1.0
        assert await disp.deliver_due() == 0
        clock.now += 2.0
        assert await disp.deliver_due() == 1
    finally:
        await disp.stop()
        await server.close()
    assert len(seen) == 3 and len(set(seen)) == 1  # the same id every attempt: receivers can dedup
    assert (
        registry.get_sample_value(
            "servepilot_webhook_deliveries_total", {"sink": "generic", "outcome": "retry"}
        )
        == 2
    )


async def test_4xx_is_dropped_without_retry(tmp_path: Path) -> None:
    clock = Clock()
    calls: list[int] = []

    async def reject(request: web.Request) -> web.Response:
        calls.append(1)
        return web.Response(status=400)

    app = web.Application()
    app.router.add_post("/hook", reject)
    server = await _serve(app)
    registry = CollectorRegistry()
    disp = _dispatcher(tmp_path, str(server.make_url("/hook")), clock, registry)
    try:
        disp.observe(_state(clock.now, LEAK))
        await disp.deliver_due()
        clock.now += 3600
        await disp.deliver_due()
    finally:
        await disp.stop()
        await server.close()
    assert calls == [1]
    assert (
        registry.get_sample_value(
            "servepilot_webhook_deliveries_total", {"sink": "generic", "outcome": "dropped"}
        )
        == 1
    )


async def test_messages_older_than_max_age_expire(tmp_path: Path) -> None:
    clock = Clock()
    registry = CollectorRegistry()
    disp = _dispatcher(tmp_path, f"http://127.0.0.1:{_free_port()}/hook", clock, registry, max_age_s=60)
    try:
        disp.observe(_state(clock.now, LEAK))
        clock.now += 61
        await disp.deliver_due()
    finally:
        await disp.stop()
    assert (
        registry.get_sample_value(
            "servepilot_webhook_deliveries_total", {"sink": "generic", "outcome": "expired"}
        )
        == 1
    )
    assert Outbox(tmp_path / "outbox.sqlite").pending("generic") == 0


async def test_alertmanager_gets_v2_alerts_and_periodic_resends(tmp_path: Path) -> None:
    clock = Clock()
    posts: list[list[dict[str, Any]]] = []

    async def alerts(request: web.Request) -> web.Response:
        posts.append(json.loads(await request.read()))
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/api/v2/alerts", alerts)
    server = await _serve(app)
    config = WebhookConfig(
        enabled=True, queue_path=str(tmp_path / "q.sqlite"), resend_s=60, resolve_after_s=0
    )
    base = str(server.make_url("/")).rstrip("/")
    disp = WebhookDispatcher(config, CollectorRegistry(), sinks=[AlertmanagerSink(base)], clock=clock)
    try:
        disp.observe(_state(clock.now, LEAK))
        await disp.deliver_due()
        clock.now += 30
        disp.observe(_state(clock.now, LEAK))  # too early to resend
        clock.now += 31
        disp.observe(_state(clock.now, LEAK))
        await disp.deliver_due()
        clock.now += 1
        disp.observe(_state(clock.now))
        await disp.deliver_due()
    finally:
        await disp.stop()
        await server.close()
    assert len(posts) == 3
    assert [p[0]["labels"]["alertname"] for p in posts] == ["ServepilotFinding"] * 3
    assert posts[2][0]["endsAt"] < posts[1][0]["endsAt"]  # the resolve carries the real end time


async def test_metrics_use_the_registry_passed_in_not_the_global_one(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    disp = _dispatcher(tmp_path, "http://127.0.0.1:9/hook", Clock(), registry)
    await disp.stop()
    assert registry.get_sample_value("servepilot_webhook_queue_depth", {"sink": "generic"}) == 0.0
    assert REGISTRY.get_sample_value("servepilot_webhook_queue_depth", {"sink": "generic"}) is None


def test_generic_url_without_secret_is_a_one_line_error() -> None:
    # with enabled: true config validation refuses it first (tests/agent/test_config.py); the dispatcher
    # still refuses a config that reaches it without a secret
    with pytest.raises(
        ValueError, match=r"^webhooks.secret_file is required when webhooks.generic_url is set$"
    ):
        sinks_from_config(WebhookConfig(generic_url="http://127.0.0.1:1/hook"))


def test_secret_file_is_read_and_decoded(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("whsec_a2V5\n")
    [sink] = sinks_from_config(WebhookConfig(generic_url="http://127.0.0.1:1/hook", secret_file=str(secret)))
    assert isinstance(sink, GenericSink) and sink.secret == b"key"


def test_a_secret_file_with_two_secrets_signs_with_both(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("whsec_b2xk whsec_bmV3\n")  # "old", "new"
    [sink] = sinks_from_config(WebhookConfig(generic_url="http://127.0.0.1:1/hook", secret_file=str(secret)))
    assert isinstance(sink, GenericSink) and sink.secret == (b"old", b"new")


@pytest.mark.parametrize(("content", "why"), [("", "empty"), ("whsec_***", "not valid base64")])
def test_a_secret_file_that_holds_no_secret_is_a_one_line_error(
    tmp_path: Path, content: str, why: str
) -> None:
    secret = tmp_path / "secret"
    secret.write_text(content)
    with pytest.raises(ValueError, match=f"^webhooks.secret_file '.*secret': .*{why}"):
        sinks_from_config(WebhookConfig(generic_url="http://127.0.0.1:1/hook", secret_file=str(secret)))


def _generic_config(tmp_path: Path, url: str, secret: str, **cfg: Any) -> WebhookConfig:
    path = tmp_path / "secret"
    path.write_text(secret)
    return WebhookConfig(
        **{
            "enabled": True,
            "queue_path": str(tmp_path / "outbox.sqlite"),
            "resolve_after_s": 0,
            "generic_url": url,
            "secret_file": str(path),
            **cfg,
        }
    )


OLD_SECRET, NEW_SECRET = b"old-secret-0123456789", b"new-secret-0123456789"


def _whsec(*keys: bytes) -> str:
    import base64

    return " ".join("whsec_" + base64.b64encode(key).decode() for key in keys)


async def test_a_reload_sends_what_was_queued_for_a_dead_receiver_to_its_new_url_with_the_new_secret(
    tmp_path: Path,
) -> None:
    clock = Clock()
    dead = f"http://127.0.0.1:{_free_port()}/hook"  # nothing listens: the old receiver is gone
    registry = CollectorRegistry()
    disp = WebhookDispatcher(
        _generic_config(tmp_path, dead, _whsec(OLD_SECRET)), registry, clock=clock, rng=random.Random(0)
    )
    app, log = build_receiver_app(NEW_SECRET, clock=clock)  # knows only the new secret
    server = await _serve(app)
    try:
        disp.observe(_state(clock.now, LEAK))
        assert await disp.deliver_due() == 0  # refused: queued, backing off
        disp.prepare(_generic_config(tmp_path, str(server.make_url("/hook")), _whsec(NEW_SECRET)))()
        clock.now += 61
        assert await disp.deliver_due() == 1
    finally:
        await disp.stop()
        await server.close()
    [msg] = log.messages
    assert msg["status"] == "firing" and log.rejected == []
    assert registry.get_sample_value("servepilot_webhook_queue_depth", {"sink": "generic"}) == 0.0


async def test_during_a_rotation_receivers_with_the_old_or_the_new_secret_both_accept(tmp_path: Path) -> None:
    clock = Clock()
    apps = [build_receiver_app(key, clock=clock) for key in (OLD_SECRET, NEW_SECRET)]
    servers = [await _serve(app) for app, _ in apps]
    urls = [str(server.make_url("/hook")) for server in servers]
    disp = WebhookDispatcher(
        _generic_config(tmp_path, urls[0], _whsec(OLD_SECRET)), CollectorRegistry(), clock=clock
    )
    try:
        disp.prepare(_generic_config(tmp_path, urls[0], _whsec(OLD_SECRET, NEW_SECRET)))()
        disp.observe(_state(clock.now, LEAK))
        assert await disp.deliver_due() == 1
        disp.prepare(_generic_config(tmp_path, urls[1], _whsec(OLD_SECRET, NEW_SECRET)))()
        clock.now += 1
        disp.observe(_state(clock.now))  # resolved: to the receiver that has moved to the new secret
        assert await disp.deliver_due() == 1
    finally:
        await disp.stop()
        for server in servers:
            await server.close()
    assert [m["status"] for m in apps[0][1].messages] == ["firing"] and apps[0][1].rejected == []
    assert [m["status"] for m in apps[1][1].messages] == ["resolved"] and apps[1][1].rejected == []


async def test_a_secret_file_gone_bad_is_refused_and_the_running_sink_keeps_working(tmp_path: Path) -> None:
    clock = Clock()
    app, log = build_receiver_app(OLD_SECRET, clock=clock)
    server = await _serve(app)
    url = str(server.make_url("/hook"))
    disp = WebhookDispatcher(
        _generic_config(tmp_path, url, _whsec(OLD_SECRET)), CollectorRegistry(), clock=clock
    )
    try:
        with pytest.raises(ValueError, match=r"webhooks\.secret_file .*empty"):
            disp.prepare(_generic_config(tmp_path, url, ""))
        disp.observe(_state(clock.now, LEAK))
        assert await disp.deliver_due() == 1
    finally:
        await disp.stop()
        await server.close()
    assert len(log.messages) == 1 and log.rejected == []


async def test_a_removed_receiver_loses_its_queue_and_an_added_one_gets_what_fires(tmp_path: Path) -> None:
    clock = Clock()
    dead = f"http://127.0.0.1:{_free_port()}/hook"
    registry = CollectorRegistry()
    disp = WebhookDispatcher(
        _generic_config(tmp_path, dead, _whsec(OLD_SECRET)), registry, clock=clock, rng=random.Random(0)
    )
    alerts: list[Any] = []

    async def alertmanager(request: web.Request) -> web.Response:
        alerts.extend(await request.json())
        return web.json_response({})

    am = web.Application()
    am.router.add_post("/api/v2/alerts", alertmanager)
    server = await _serve(am)
    try:
        disp.observe(_state(clock.now, LEAK))
        assert await disp.deliver_due() == 0
        assert registry.get_sample_value("servepilot_webhook_queue_depth", {"sink": "generic"}) == 1.0
        disp.prepare(
            WebhookConfig(
                enabled=True,
                queue_path=str(tmp_path / "outbox.sqlite"),
                alertmanager_url=str(server.make_url("/")).rstrip("/"),
            )
        )()
        assert disp.outbox.pending("generic") == 0
        assert registry.get_sample_value("servepilot_webhook_queue_depth", {"sink": "generic"}) == 0.0
        sample = {"sink": "generic", "outcome": "expired"}
        assert registry.get_sample_value("servepilot_webhook_deliveries_total", sample) == 1.0
        clock.now += 61
        assert await disp.deliver_due() == 1
    finally:
        await disp.stop()
        await server.close()
    [alert] = alerts
    assert alert["labels"]["detector"] == "memory_leak"


async def test_a_raised_min_severity_sends_the_resolution_at_once(tmp_path: Path) -> None:
    clock = Clock()
    app, log = build_receiver_app(OLD_SECRET, clock=clock)
    server = await _serve(app)
    url = str(server.make_url("/hook"))
    warn = Finding("thermal", "nvml.gpu0.temperature_celsius", Severity.WARNING, 0.5, "warm", 0.0)
    disp = WebhookDispatcher(
        _generic_config(tmp_path, url, _whsec(OLD_SECRET), resolve_after_s=300),
        CollectorRegistry(),
        clock=clock,
    )
    try:
        disp.observe(_state(clock.now, LEAK, warn))
        assert await disp.deliver_due() == 1
        disp.prepare(_generic_config(tmp_path, url, _whsec(OLD_SECRET), min_severity="critical"))()
        assert await disp.deliver_due() == 1
        disp.observe(_state(clock.now + 1, LEAK, warn))
        assert await disp.deliver_due() == 0  # nothing more: the warning is no longer sent
    finally:
        await disp.stop()
        await server.close()
    first, second = log.messages
    assert first["status"] == "firing" and len(first["alerts"]) == 2
    assert second["status"] == "resolved"
    assert [a["labels"]["detector"] for a in second["alerts"]] == ["thermal"]


def _https_receiver_context(
    tmp_path: Path, client_ca: trustme.CA | None = None
) -> tuple[ssl.SSLContext, trustme.CA]:
    """A receiver's TLS: a certificate from a private CA (written to receiver-ca.pem), and with
    ``client_ca`` a client certificate that CA signed required (as Alertmanager's web.config can)."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "receiver-ca.pem"))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    if client_ca is not None:
        client_ca.configure_trust(context)
        context.verify_mode = ssl.CERT_REQUIRED
    return context, ca


async def _deliver_to_https(tmp_path: Path, server_ssl: ssl.SSLContext, **tls: Any) -> tuple[int, list[Any]]:
    """One finding sent to an https receiver with the ``webhooks.tls_*`` settings ``tls``: messages
    delivered, and what the receiver got."""
    clock = Clock()
    app, log = build_receiver_app(SECRET, clock=clock)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server(ssl=server_ssl)
    disp = _dispatcher(tmp_path, str(server.make_url("/hook")), clock, **tls)
    try:
        disp.observe(_state(clock.now, LEAK))
        delivered = await disp.deliver_due()
    finally:
        await disp.stop()
        await server.close()
    return delivered, log.messages


async def test_an_https_receiver_with_a_private_ca_is_reached_with_tls_ca_file(tmp_path: Path) -> None:
    """Without webhooks.tls_ca_file the private CA is unknown: nothing delivered, the message kept for a
    retry; with it, delivered."""
    server_ssl, _ = _https_receiver_context(tmp_path)
    delivered, got = await _deliver_to_https(tmp_path / "a", server_ssl)
    assert delivered == 0 and got == []
    assert Outbox(tmp_path / "a" / "outbox.sqlite").pending("generic") == 1
    ca_file = str(tmp_path / "receiver-ca.pem")
    delivered, got = await _deliver_to_https(tmp_path / "b", server_ssl, tls_ca_file=ca_file)
    assert delivered == 1 and got[0]["status"] == "firing"


async def test_a_receiver_that_asks_for_a_client_certificate_gets_tls_cert_file(tmp_path: Path) -> None:
    clients = trustme.CA()
    server_ssl, _ = _https_receiver_context(tmp_path, client_ca=clients)
    ca_file = str(tmp_path / "receiver-ca.pem")
    delivered, _ = await _deliver_to_https(tmp_path / "a", server_ssl, tls_ca_file=ca_file)
    assert delivered == 0  # the handshake fails without a client certificate
    sidecar = clients.issue_cert("servepilot.example")
    sidecar.cert_chain_pems[0].write_to_path(str(tmp_path / "client.pem"))
    sidecar.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    mine = {"tls_cert_file": str(tmp_path / "client.pem"), "tls_key_file": str(tmp_path / "client.key")}
    delivered, got = await _deliver_to_https(tmp_path / "b", server_ssl, tls_ca_file=ca_file, **mine)
    assert delivered == 1 and got[0]["status"] == "firing"


def test_webhook_tls_files_are_checked_with_one_line_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file must be set together"):
        WebhookConfig(tls_cert_file="/etc/client.pem")
    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"webhooks\.tls_ca_file cannot load"):
        _dispatcher(tmp_path, "https://127.0.0.1:9/hook", Clock(), tls_ca_file=str(tmp_path / "bad.pem"))
    with pytest.raises(ConfigError, match=r"webhooks\.tls_cert_file cannot load"):
        _dispatcher(
            tmp_path,
            "https://127.0.0.1:9/hook",
            Clock(),
            tls_cert_file=str(tmp_path / "bad.pem"),
            tls_key_file=str(tmp_path / "bad.pem"),
        )
