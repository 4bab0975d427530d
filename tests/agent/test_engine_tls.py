"""An engine served over https (vLLM's --ssl-certfile, with --ssl-cert-reqs 2 asking for a client
certificate): the sidecar scrapes it and drives its control API with ``engine.tls_*``, and says why it
cannot without them. The simulator over TLS stands in for the engine."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import trustme

from agent.collectors.engine_metrics import EngineMetricsCollector
from agent.config import ConfigError, ControlConfig, EngineConfig, build, load
from agent.control.base import ControlError
from agent.control.client import ControlClient
from agent.preflight import run_checks
from agent.tls import client_context, client_contexts, engine_context, watch
from detectors.snapshot import SourceStatus
from tests.agent.https_sim import https_sim, write_client_cert


@pytest.fixture
async def mtls_engine(tmp_path: Path) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """An engine that asks for a client certificate, and the ``engine.tls_*`` settings that reach it."""
    server_ca, clients = trustme.CA(), trustme.CA()
    server_ca.cert_pem.write_to_path(str(tmp_path / "engine-ca.pem"))
    write_client_cert(clients, "servepilot.example", tmp_path / "sidecar.pem", tmp_path / "sidecar.key")
    runner, url = await https_sim(server_ca, client_ca=clients)
    tls = {
        "tls_ca_file": str(tmp_path / "engine-ca.pem"),
        "tls_cert_file": str(tmp_path / "sidecar.pem"),
        "tls_key_file": str(tmp_path / "sidecar.key"),
    }
    yield url, tls
    await runner.cleanup()


async def _scrape(url: str, **tls: str) -> tuple[SourceStatus, str, str | None]:
    collector = EngineMetricsCollector(EngineConfig(url=url, **tls))  # type: ignore[arg-type]
    try:
        reading = await collector.collect(0.0)
    finally:
        await collector.close()
    return reading.status, reading.error or "", reading.info.get("engine")


async def test_the_scrape_of_an_https_engine_needs_its_ca_and_the_client_certificate_it_asks_for(
    mtls_engine: tuple[str, dict[str, str]],
) -> None:
    url, tls = mtls_engine
    status, error, _ = await _scrape(url)
    assert status is SourceStatus.ERROR and "certificate verify failed" in error  # a private CA
    status, error, _ = await _scrape(url, tls_ca_file=tls["tls_ca_file"])
    assert status is SourceStatus.ERROR  # verified, but the engine wants a client certificate
    status, error, engine = await _scrape(url, **tls)
    assert (status, error, engine) == (SourceStatus.OK, "", "vllm")


async def test_the_control_api_of_an_https_engine_is_driven_with_the_engines_tls(
    mtls_engine: tuple[str, dict[str, str]],
) -> None:
    url, tls = mtls_engine
    control = ControlConfig(enabled=True, url=url, lease_s=30)  # type: ignore[arg-type]
    engine_tls = engine_context(EngineConfig(url=url, **tls))  # type: ignore[arg-type]
    assert isinstance(engine_tls, ssl.SSLContext)
    client = ControlClient(control, retries=0, tls=engine_tls)
    try:
        caps = await client.start()
        assert caps.adapter == "generic" and "max_num_seqs" in caps.knobs
        before = (await client.read())["max_num_seqs"]
        result = await client.apply({"max_num_seqs": 16})
        assert result.ok and result.read_back["max_num_seqs"] == 16 != before
        assert await client.release()  # the lease is ended over TLS too: the engine is on its defaults
        assert (await client.read())["max_num_seqs"] == before
    finally:
        await client.close()
    untrusted = ControlClient(control, retries=0)
    try:
        with pytest.raises(ControlError, match="certificate verify failed") as caught:
            await untrusted.start()
        assert caught.value.temporary  # as for an engine still loading: discovery is tried again
    finally:
        await untrusted.close()


def test_engine_tls_settings_are_checked_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"^engine\.tls_ca_file cannot load"):
        EngineMetricsCollector(EngineConfig(tls_ca_file=str(tmp_path / "bad.pem")))
    (tmp_path / "sp.yaml").write_text("engine:\n  tls_cert_file: /etc/sidecar.pem\n")
    with pytest.raises(ConfigError, match=r"^engine\.tls_cert_file and tls_key_file must be set together"):
        load(tmp_path / "sp.yaml")


async def test_servepilot_check_reaches_an_https_engine_as_the_sidecar_does(
    mtls_engine: tuple[str, dict[str, str]],
) -> None:
    url, tls = mtls_engine
    raw = {
        "engine": {"url": url, **tls},
        "control": {"enabled": True, "url": url},
        "nvml": {"backend": "off"},
        "probe": {"enabled": False},
    }
    results = {r.name: r for r in await run_checks(build(raw))}
    assert results["engine"].status == "ok" and "engine vllm" in results["engine"].detail
    assert results["control"].detail.startswith("generic API, knobs max_num_seqs=")
    raw["engine"] = {"url": url}  # the same engine, its CA and the client certificate not configured
    results = {r.name: r for r in await run_checks(build(raw))}
    assert results["engine"].status == results["control"].status == "error"
    assert "certificate verify failed" in results["control"].detail


async def test_a_renewed_client_certificate_reaches_the_engine_without_a_restart(tmp_path: Path) -> None:
    """The sidecar's client certificate expired (cert-manager renews it before that; here it was not yet):
    the engine refuses the handshake. The renewed files, swapped in by the kubelet, are loaded into the
    live context by the watch (``agent.tls_watch_s``), and the same collector reads the engine again."""
    server_ca, clients = trustme.CA(), trustme.CA()
    server_ca.cert_pem.write_to_path(str(tmp_path / "engine-ca.pem"))
    cert_file, key_file = tmp_path / "sidecar.pem", tmp_path / "sidecar.key"
    expired = datetime.now(UTC) - timedelta(hours=1)
    write_client_cert(clients, "servepilot.example", cert_file, key_file, not_after=expired)
    runner, url = await https_sim(server_ca, client_ca=clients)
    engine = EngineConfig(
        url=url,  # type: ignore[arg-type]
        tls_ca_file=str(tmp_path / "engine-ca.pem"),
        tls_cert_file=str(cert_file),
        tls_key_file=str(key_file),
    )
    collector = EngineMetricsCollector(engine)
    stop = asyncio.Event()
    watching = asyncio.create_task(watch(0.02, stop))
    try:
        reading = await collector.collect(0.0)
        assert reading.status is SourceStatus.ERROR
        (watched,) = [tls for tls in client_contexts() if tls.files[0] == str(cert_file)]
        write_client_cert(clients, "servepilot.example", cert_file, key_file)  # renewed
        async with asyncio.timeout(10):  # the watch's next look, 20 ms away
            while watched.reloads == 0:
                await asyncio.sleep(0.01)
        await collector.close()  # the pooled connection closed: the next one shakes hands anew
        reading = await collector.collect(1.0)
        assert reading.status is SourceStatus.OK, reading.error
    finally:
        stop.set()
        await watching
        await collector.close()
        await runner.cleanup()


def test_a_client_context_asked_for_again_has_what_is_on_disk_now(tmp_path: Path) -> None:
    """One context per set of files, shared by the engine's scrape and control client; asked for after
    its files changed (before the watch looked), it carries the new content."""
    first, second = trustme.CA(), trustme.CA()
    ca_file = tmp_path / "engine-ca.pem"
    first.cert_pem.write_to_path(str(ca_file))
    engine = EngineConfig(tls_ca_file=str(ca_file))
    context = engine_context(engine)
    assert engine_context(engine) is context
    second.cert_pem.write_to_path(str(ca_file))
    assert engine_context(engine) is context
    (watched,) = [tls for tls in client_contexts() if tls.files[2] == str(ca_file)]
    assert watched.reloads == 1
    assert isinstance(context, ssl.SSLContext)
    trusted = context.get_ca_certs(binary_form=True)
    for ca in (first, second):  # OpenSSL adds CAs to a context, never drops one
        assert ssl.PEM_cert_to_DER_cert(ca.cert_pem.bytes().decode()) in trusted


def test_a_file_that_cannot_be_read_keeps_the_old_content_and_says_so(tmp_path: Path) -> None:
    """A CA file gone (a Secret unmounted, a mode that keeps the sidecar's uid out): the context keeps what
    it had, and says why until the file is back (``servepilot_tls_files_current`` 0, then 1)."""
    ca_file = tmp_path / "receiver-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(ca_file))
    context = client_context("webhooks.tls_", str(ca_file))
    (watched,) = [tls for tls in client_contexts() if tls.files[2] == str(ca_file)]
    content = ca_file.read_bytes()
    ca_file.unlink()
    assert not watched.reload_if_changed()
    assert watched.last_error.startswith("cannot read: ") and watched.label == str(ca_file)
    ca_file.write_bytes(content)  # back as it was: nothing to load, and nothing wrong any more
    assert not watched.reload_if_changed() and watched.last_error == "" and watched.reloads == 0
    assert client_context("webhooks.tls_", str(ca_file)) is context
