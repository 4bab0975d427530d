"""An engine served over https (vLLM's --ssl-certfile, with --ssl-cert-reqs 2 asking for a client
certificate): the sidecar scrapes it and drives its control API with ``engine.tls_*``, and says why it
cannot without them. The simulator over TLS stands in for the engine."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trustme

from agent.collectors.engine_metrics import EngineMetricsCollector
from agent.config import ConfigError, ControlConfig, EngineConfig, build, load
from agent.control.base import ControlError
from agent.control.client import ControlClient
from agent.preflight import run_checks
from agent.tls import engine_context
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
