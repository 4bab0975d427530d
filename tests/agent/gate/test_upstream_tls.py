"""The gate in front of https upstreams: a private CA (gate.upstream_tls_ca_file) and upstreams that ask
for a client certificate (gate.upstream_tls_cert_file/key_file), against the simulator served over TLS."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from prometheus_client import CollectorRegistry

from agent.config import ConfigError, GateConfig
from agent.gate.proxy import Gate
from tests.agent.https_sim import https_sim, write_client_cert

ONE = {"prompt": "hello", "max_tokens": 4}


@pytest.fixture
def server_ca(tmp_path: Path) -> trustme.CA:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "upstream-ca.pem"))
    return ca


async def _status_through_gate(upstream: str, **tls: Any) -> int:
    gate = Gate(
        GateConfig(enabled=True, upstreams={"primary": upstream}, health_interval_s=600, **tls),
        CollectorRegistry(),
    )
    port = await gate.start("127.0.0.1", 0)
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"http://127.0.0.1:{port}/v1/completions", json=ONE) as response,
        ):
            await response.read()
            return response.status
    finally:
        await gate.stop()


@pytest.fixture
async def https_upstream(server_ca: trustme.CA) -> AsyncIterator[str]:
    runner, url = await https_sim(server_ca)
    yield url
    await runner.cleanup()


async def test_an_https_upstream_with_a_private_ca_needs_upstream_tls_ca_file(
    https_upstream: str, tmp_path: Path
) -> None:
    assert await _status_through_gate(https_upstream) == 502  # the CA is not among the system's
    ca = str(tmp_path / "upstream-ca.pem")
    assert await _status_through_gate(https_upstream, upstream_tls_ca_file=ca) == 200


async def test_an_upstream_that_asks_for_a_client_certificate_gets_upstream_tls_cert_file(
    server_ca: trustme.CA, tmp_path: Path
) -> None:
    clients = trustme.CA()
    runner, url = await https_sim(server_ca, client_ca=clients)
    ca = str(tmp_path / "upstream-ca.pem")
    write_client_cert(clients, "servepilot-gate.example", tmp_path / "gate.pem", tmp_path / "gate.key")
    try:
        assert await _status_through_gate(url, upstream_tls_ca_file=ca) == 502
        mine = {
            "upstream_tls_cert_file": str(tmp_path / "gate.pem"),
            "upstream_tls_key_file": str(tmp_path / "gate.key"),
        }
        assert await _status_through_gate(url, upstream_tls_ca_file=ca, **mine) == 200
    finally:
        await runner.cleanup()


def test_upstream_tls_settings_are_checked_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="upstream_tls_cert_file and upstream_tls_key_file must be set together"
    ):
        GateConfig(upstream_tls_key_file="/etc/gate.key")
    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"^gate\.upstream_tls_ca_file cannot load"):
        Gate(GateConfig(enabled=True, upstream_tls_ca_file=str(tmp_path / "bad.pem")), CollectorRegistry())


async def test_servepilot_check_reaches_https_upstreams_as_the_gate_does(
    https_upstream: str, tmp_path: Path
) -> None:
    from agent import config
    from agent.preflight import check_upstreams

    gate = {"enabled": True, "upstreams": {"primary": https_upstream}}
    rows = await check_upstreams(config.build({"gate": gate}))
    assert rows[0].failed and "certificate verify failed" in rows[0].detail, rows
    trusted = {**gate, "upstream_tls_ca_file": str(tmp_path / "upstream-ca.pem")}
    rows = await check_upstreams(config.build({"gate": trusted}))
    assert rows[0].status == "ok" and rows[0].detail.startswith("healthy"), rows
