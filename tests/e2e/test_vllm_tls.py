"""End to end: a real vLLM 0.32 served only over https and asking for a client certificate
(``--ssl-certfile --ssl-keyfile --ssl-ca-certs --ssl-cert-reqs 2``), as a pod that encrypts every hop
without a mesh runs it. servepilot reaches it with ``engine.tls_*`` (the scrape, the control API,
``servepilot check``) and the gate with ``gate.upstream_tls_*``; without the client certificate each
says why it cannot, in one line.

Its own module, so its engine never runs beside another test module's on these 2 cores. Skipped
locally when vLLM is not installed; CI installs it.
"""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest
import trustme

from agent.config import build
from agent.engines.launcher import LaunchOptions, RunningEngine, ServedTls
from agent.preflight import run_checks
from tests.agent.https_sim import write_client_cert
from tests.engines.client import completion, gate_for, stream
from tests.engines.fixture import running


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The engine's certificate (a private CA) and the sidecar's client certificate (another CA)."""
    folder = tmp_path_factory.mktemp("tls")
    server_ca, clients = trustme.CA(), trustme.CA()
    served = server_ca.issue_cert("127.0.0.1")
    served.cert_chain_pems[0].write_to_path(str(folder / "engine.pem"))
    served.private_key_pem.write_to_path(str(folder / "engine.key"))
    server_ca.cert_pem.write_to_path(str(folder / "engine-ca.pem"))
    clients.cert_pem.write_to_path(str(folder / "clients-ca.pem"))
    write_client_cert(clients, "servepilot.example", folder / "sidecar.pem", folder / "sidecar.key")
    return {
        name: str(folder / name)
        for name in (
            "engine.pem",
            "engine.key",
            "engine-ca.pem",
            "clients-ca.pem",
            "sidecar.pem",
            "sidecar.key",
        )
    }


def _client(files: dict[str, str]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=files["engine-ca.pem"])
    context.load_cert_chain(files["sidecar.pem"], files["sidecar.key"])
    return context


@pytest.fixture(scope="module")
def engine(files: dict[str, str]) -> Iterator[RunningEngine]:
    tls = ServedTls(files["engine.pem"], files["engine.key"], client_ca_file=files["clients-ca.pem"])

    def healthy(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2.0, context=_client(files)) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    with running("vllm", LaunchOptions(tls=tls), poll=healthy) as server:
        yield server


def _settings(engine: RunningEngine, files: dict[str, str], *, client_certificate: bool) -> dict[str, object]:
    mine = {"cert_file": files["sidecar.pem"], "key_file": files["sidecar.key"]} if client_certificate else {}
    engine_tls = {"tls_ca_file": files["engine-ca.pem"], **{f"tls_{k}": v for k, v in mine.items()}}
    upstream_tls = {
        "upstream_tls_ca_file": files["engine-ca.pem"],
        **{f"upstream_tls_{k}": v for k, v in mine.items()},
    }
    return {
        "engine": {"url": engine.url, **engine_tls},
        "control": {"enabled": True, "url": engine.url, "adapter": "vllm"},
        "gate": {"enabled": True, "upstreams": {"primary": engine.url}, **upstream_tls},
        "nvml": {"backend": "off"},
        "probe": {"enabled": False},
    }


async def test_servepilot_check_reads_an_https_vllm_that_asks_for_a_client_certificate(
    engine: RunningEngine, files: dict[str, str]
) -> None:
    assert engine.url.startswith("https://")
    results = {r.name: r for r in await run_checks(build(_settings(engine, files, client_certificate=True)))}
    failed = {name: r.detail for name, r in results.items() if r.failed}
    assert failed == {}
    assert "engine vllm" in results["engine"].detail
    assert results["control"].detail.startswith("vllm API")
    assert results["upstream primary"].detail.startswith("healthy")
    results = {r.name: r for r in await run_checks(build(_settings(engine, files, client_certificate=False)))}
    assert {name for name, r in results.items() if r.failed} >= {"engine", "control", "upstream primary"}


async def test_the_gate_streams_from_an_https_vllm_with_its_client_certificate(
    engine: RunningEngine, files: dict[str, str]
) -> None:
    tls = _settings(engine, files, client_certificate=True)["gate"]
    assert isinstance(tls, dict)
    settings = {k: v for k, v in tls.items() if k.startswith("upstream_tls_")}
    async with gate_for(engine.url, **settings) as (_, base, _registry), aiohttp.ClientSession() as session:
        body = completion("count on", 16, stream_options={"include_usage": True})
        result = await stream(session, base, body)
    assert result.status == 200 and len(result.arrivals) >= 2, result.body[-300:]
    assert result.usage["completion_tokens"] == 16
    settings.pop("upstream_tls_cert_file"), settings.pop("upstream_tls_key_file")
    async with gate_for(engine.url, **settings) as (_, base, _registry), aiohttp.ClientSession() as session:
        refused = await stream(session, base, completion("count on", 16))
    assert refused.status == 502
