"""End to end: a real vLLM 0.32 served only over https and asking for a client certificate
(``--ssl-certfile --ssl-keyfile --ssl-ca-certs --ssl-cert-reqs 2``), and guarding its API with a key
(``VLLM_API_KEY``, its ``--api-key``), as a pod that encrypts every hop without a mesh runs it.
servepilot reaches it with ``engine.tls_*`` (the scrape, the control API, ``servepilot check``) and the
gate with ``gate.upstream_tls_*`` and ``gate.upstream_api_key_file``; without the client certificate
each says why it cannot, in one line. The gate asks its own clients for their keys
(``gate.require_api_key``), which are not the engine's.

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

ENGINE_KEY = "engine-key-0123456789"
"""The engine's own API key; the gate's clients hold others."""


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
    (folder / "engine-api-key").write_text(ENGINE_KEY + "\n")
    return {
        name: str(folder / name)
        for name in (
            "engine.pem",
            "engine.key",
            "engine-ca.pem",
            "clients-ca.pem",
            "sidecar.pem",
            "sidecar.key",
            "engine-api-key",
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

    opts = LaunchOptions(tls=tls, extra_env={"VLLM_API_KEY": ENGINE_KEY})
    with running("vllm", opts, poll=healthy) as server:
        yield server


def _settings(engine: RunningEngine, files: dict[str, str], *, client_certificate: bool) -> dict[str, object]:
    mine = {"cert_file": files["sidecar.pem"], "key_file": files["sidecar.key"]} if client_certificate else {}
    engine_tls = {"tls_ca_file": files["engine-ca.pem"], **{f"tls_{k}": v for k, v in mine.items()}}
    upstream_tls = {
        "upstream_tls_ca_file": files["engine-ca.pem"],
        "upstream_api_key_file": files["engine-api-key"],
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
    assert results["upstream primary"].detail == "healthy, serves tiny-random-llama"  # asked with its key
    results = {r.name: r for r in await run_checks(build(_settings(engine, files, client_certificate=False)))}
    assert {name for name, r in results.items() if r.failed} >= {"engine", "control", "upstream primary"}


async def test_the_gate_streams_from_an_https_vllm_with_its_client_certificate(
    engine: RunningEngine, files: dict[str, str]
) -> None:
    tls = _settings(engine, files, client_certificate=True)["gate"]
    assert isinstance(tls, dict)
    settings = {k: v for k, v in tls.items() if k.startswith("upstream_")}
    clients = {"api_keys": {"client-key-1": "default"}, "require_api_key": True}
    mine = {"Authorization": "Bearer client-key-1"}
    async with (
        gate_for(engine.url, **settings, **clients) as (_, base, _registry),
        aiohttp.ClientSession() as session,
    ):
        body = completion("count on", 16, stream_options={"include_usage": True})
        result = await stream(session, base, body, headers=mine)
        keyless = await stream(session, base, body)
        engines_key = await stream(session, base, body, headers={"Authorization": f"Bearer {ENGINE_KEY}"})
    assert result.status == 200 and len(result.arrivals) >= 2, result.body[-300:]
    assert result.usage["completion_tokens"] == 16
    assert keyless.status == engines_key.status == 401  # the gate's door: the engine's key is not a client's
    async with aiohttp.ClientSession() as session:  # without the engine's key, vLLM refuses the gate
        unkeyed = {k: v for k, v in settings.items() if k != "upstream_api_key_file"}
        async with gate_for(engine.url, **unkeyed) as (_, base, _registry):
            assert (await stream(session, base, body, headers=mine)).status == 401
        settings.pop("upstream_tls_cert_file"), settings.pop("upstream_tls_key_file")
        async with gate_for(engine.url, **settings) as (_, base, _registry):
            refused = await stream(session, base, completion("count on", 16))
    assert refused.status == 502
