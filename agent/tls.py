"""TLS for the agent API, and mutual TLS: who may call it.

With ``agent.tls_cert_file`` and ``agent.tls_key_file`` the API is served over TLS 1.2 or later. With
``agent.tls_client_ca_file`` as well, the server asks every client for a certificate and the handshake
fails for one that CA did not sign. A client that presents none still connects, because the kubelet's
HTTPS probes cannot present one. So :func:`client_certificate_required` answers 403 to such a client on
every path except the probes', which say only whether the process and its loop are alive. Prometheus,
``kubectl port-forward`` users and any other caller of ``/metrics`` or ``/api/*`` need a certificate.
The admin listener is separate, plain HTTP on loopback, behind its bearer token; admin routes mounted on
the API listener are covered like the rest.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable

from aiohttp import web

from agent.config import ConfigError

#: Paths the kubelet probes (no client certificate there): the only ones mutual TLS leaves open.
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/engine/livez"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def server_context(
    cert_file: str | None, key_file: str | None, client_ca_file: str | None = None
) -> ssl.SSLContext | None:
    """The agent API's TLS context: None without a certificate; with ``client_ca_file``, one that asks
    for a client certificate and verifies any it gets against that CA. A file that cannot be loaded is a
    :class:`ConfigError` naming its field."""
    if cert_file is None or key_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as error:
        raise ConfigError("agent.tls_cert_file", f"cannot load the certificate/key: {error}") from None
    if client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=client_ca_file)
        except (OSError, ssl.SSLError) as error:
            why = f"cannot load the CA certificates: {error}"
            raise ConfigError("agent.tls_client_ca_file", why) from None
        context.verify_mode = ssl.CERT_OPTIONAL  # the probes come without one: see the module docstring
    return context


@web.middleware
async def client_certificate_required(request: web.Request, handler: Handler) -> web.StreamResponse:
    """403 for a request without a verified client certificate, except on :data:`PROBE_PATHS`."""
    if request.path in PROBE_PATHS:
        return await handler(request)
    transport = request.transport
    if transport is None or not transport.get_extra_info("peercert"):
        return web.json_response(
            {"error": "a client certificate signed by the CA in agent.tls_client_ca_file is required"},
            status=403,
        )
    return await handler(request)
