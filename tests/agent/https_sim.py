"""The simulator served over https, for the tests of servepilot as a TLS client (the gate's upstreams,
the engine's scrape and control API)."""

from __future__ import annotations

import ssl
from datetime import datetime
from pathlib import Path

import trustme
from aiohttp import web

from simulator.engine import make_core
from simulator.server import SimServer


async def https_sim(server_ca: trustme.CA, client_ca: trustme.CA | None = None) -> tuple[web.AppRunner, str]:
    """The simulator over https with a certificate from ``server_ca``, and its base URL; with
    ``client_ca``, a client certificate that CA signed is required (vLLM's --ssl-ca-certs with
    --ssl-cert-reqs 2)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ca.issue_cert("127.0.0.1").configure_cert(context)
    if client_ca is not None:
        client_ca.configure_trust(context)
        context.verify_mode = ssl.CERT_REQUIRED
    runner = web.AppRunner(SimServer(make_core("a100-80g", "llama-2-7b"), speed=50.0).app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
    return runner, f"https://127.0.0.1:{runner.addresses[0][1]}"


def write_client_cert(
    ca: trustme.CA, name: str, cert_file: Path, key_file: Path, not_after: datetime | None = None
) -> None:
    """A client certificate ``ca`` signed for ``name`` (valid until ``not_after``, by default trustme's),
    written as PEM to ``cert_file`` and ``key_file``."""
    cert = ca.issue_cert(name, not_after=not_after)
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
