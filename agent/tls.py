"""TLS for the agent API (and mutual TLS: who may call it), and for servepilot as a client of the
engine, the gate's upstreams and the alert receivers.

With ``agent.tls_cert_file`` and ``agent.tls_key_file`` the API is served over TLS 1.2 or later. With
``agent.tls_client_ca_file`` as well, the server asks every client for a certificate and the handshake
fails for one that CA did not sign. A client that presents none still connects, because the kubelet's
HTTPS probes cannot present one. So :func:`client_certificate_required` answers 403 to such a client on
every path except the probes', which say only whether the process and its loop are alive. Prometheus,
``kubectl port-forward`` users and any other caller of ``/metrics`` or ``/api/*`` need a certificate.
The admin listener is separate, plain HTTP on loopback, behind its bearer token; admin routes mounted on
the API listener are covered like the rest.

Certificates are renewed while the sidecar runs (cert-manager re-issues before expiry and the kubelet
swaps the Secret's files in place), the client certificates it presents as well as the one it serves: a
:class:`WatchedTls` re-reads its files every ``agent.tls_watch_s`` and loads new content into the live
context, which every later handshake uses, so no restart (and, with the gate in the sidecar, no dropped
data path) is needed, and no expired client certificate cuts the sidecar off from its engine. New files
are first loaded into a scratch context: a certificate that does not match its key (the files caught
between two writes) is refused, logged, and tried again at the next check, while the old pair keeps
serving. A CA added to a CA file is trusted from then on; one removed stays trusted until a restart
(OpenSSL adds CAs to a context, it never drops them).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.config import ConfigError, EngineConfig, GateConfig, WebhookConfig

#: Paths the kubelet probes (no client certificate there): the only ones mutual TLS leaves open.
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/engine/livez"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = logging.getLogger(__name__)


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


ClientTls = ssl.SSLContext | bool
"""What aiohttp's ``ssl`` argument takes: a context, or True for its default verification."""


def client_context(
    fields: str, ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
) -> ClientTls:
    """TLS for servepilot as a client, from the settings ``<fields>ca_file``, ``<fields>cert_file`` and
    ``<fields>key_file`` (``fields`` e.g. ``webhooks.tls_``): servers verified against the system's CAs and
    ``ca_file``'s, and ``cert_file``/``key_file`` presented to a server that asks (mutual TLS); True when
    nothing is configured (aiohttp's default verification). A file that cannot be loaded is a
    :class:`ConfigError` naming its field.

    One context per set of files in the process, kept in :func:`client_contexts` so the sidecar's watch
    loads renewed files into it (a client certificate expires like a server's); the files are looked at
    again when it is asked for, so a caller never gets content older than what is on disk."""
    if ca_file is None and cert_file is None:
        return True
    files = (cert_file, key_file, ca_file)
    watched = _CLIENTS.get(files)
    if watched is not None:
        watched.reload_if_changed()
        return watched.context

    def load(cert: str | None, key: str | None, ca: str | None) -> ssl.SSLContext:
        context = ssl.create_default_context()
        field = "ca_file"
        try:
            if ca is not None:
                context.load_verify_locations(cafile=ca)
            field = "cert_file"
            if cert is not None:
                context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as error:
            raise ConfigError(fields + field, f"cannot load: {error}") from None
        return context

    watched = _CLIENTS[files] = WatchedTls(files, load)
    return watched.context


class WatchedTls:
    """A TLS context and the PEM files it was loaded from (certificate, key, CA; any may be unset), re-read
    when their content changes (module docstring). ``context`` is the one its users hold (a listener, a
    client session's connector): it is updated in place, never replaced, and every later handshake uses
    the new content. ``load(cert, key, ca)`` builds a context from files, raising :class:`ConfigError`."""

    def __init__(
        self, files: tuple[str | None, str | None, str | None], load: Callable[..., ssl.SSLContext]
    ) -> None:
        self.files = files
        self._load = load
        self.context = load(*files)
        self._digest = self._read_digest()
        #: reloads applied, and the last refusal (empty when the last try loaded or nothing changed)
        self.reloads = 0
        self.last_error = ""

    def _read(self) -> list[bytes | None]:
        """The files' content, None for an unset one. Raises OSError when one cannot be read."""
        return [Path(name).read_bytes() if name is not None else None for name in self.files]

    @property
    def label(self) -> str:
        """The file that names this context in metrics and logs: the certificate, else the CA file."""
        return next(name for name in (self.files[0], self.files[2]) if name is not None)

    def _refuse(self, problem: str) -> bool:
        """Keep the old content live and say why, once per distinct problem."""
        if problem != self.last_error:
            log.error("TLS files %s not loaded, the old ones serve on: %s", self.label, problem)
        self.last_error = problem
        return False

    @staticmethod
    def _digest_of(contents: list[bytes | None]) -> bytes:
        digest = hashlib.sha256()
        for content in contents:
            digest.update(content or b"")
            digest.update(b"\0")
        return digest.digest()

    def _read_digest(self) -> bytes | None:
        try:
            return self._digest_of(self._read())
        except OSError:  # loaded a moment ago: the next look reads them again
            return None

    def reload_if_changed(self) -> bool:
        """Load the files into the live context when their content changed since the last load; True
        when it did. The content read once is what is checked and what goes live (copied to private
        files for OpenSSL), so a write between the two cannot put a certificate beside another's key. A
        pair or CA file that does not load, or a file that cannot be read, is logged and kept out, and
        :attr:`last_error` says why until new files load (``servepilot_tls_files_current``); the old
        ones serve."""
        try:
            contents = self._read()
        except OSError as error:
            return self._refuse(f"cannot read: {error}")
        digest = self._digest_of(contents)
        if digest == self._digest:
            self.last_error = ""  # back to what is live (a bad write undone, a file readable again)
            return False
        with tempfile.TemporaryDirectory(prefix="servepilot-tls-") as folder:  # mode 0700
            copies: list[str | None] = []
            for name, content in zip(("cert.pem", "key.pem", "ca.pem"), contents, strict=True):
                if content is None:
                    copies.append(None)
                    continue
                path = Path(folder) / name
                path.write_bytes(content)
                copies.append(str(path))
            cert_file, key_file, ca_file = copies
            try:
                self._load(cert_file, key_file, ca_file)  # scratch: nothing half-loaded goes live
            except ConfigError as error:
                return self._refuse(f"changed but do not load: {error}")
            if cert_file is not None:
                self.context.load_cert_chain(cert_file, key_file)
            if ca_file is not None:
                self.context.load_verify_locations(cafile=ca_file)
        self._digest, self.last_error = digest, ""
        self.reloads += 1
        log.info("TLS files %s reloaded", self.label)
        return True


def server_tls(cert_file: str, key_file: str, client_ca_file: str | None = None) -> WatchedTls:
    """The agent API's context (:func:`server_context`), watched for renewed files."""

    def load(cert: str, key: str, ca: str | None) -> ssl.SSLContext:
        context = server_context(cert, key, ca)
        assert context is not None  # a certificate and its key are always given here
        return context

    return WatchedTls((cert_file, key_file, client_ca_file), load)


_CLIENTS: dict[tuple[str | None, str | None, str | None], WatchedTls] = {}


def client_contexts() -> list[WatchedTls]:
    """Every client context :func:`client_context` has loaded in this process (the engine's, the gate's
    upstreams', the alert receivers'), for the watch to keep current."""
    return list(_CLIENTS.values())


def watched(server: WatchedTls | None = None) -> list[WatchedTls]:
    """``server`` (a listener's context, if any) and every client context."""
    return ([server] if server is not None else []) + client_contexts()


async def watch(every_s: float, stop: asyncio.Event, server: WatchedTls | None = None) -> None:
    """Until ``stop``, every ``every_s`` (``agent.tls_watch_s``) load renewed files into ``server`` (a
    listener's context) and every client context, those made after the watch began included."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_s)
        if stop.is_set():
            return
        for tls in watched(server):
            try:
                tls.reload_if_changed()
            except Exception:  # a bug here must not end the watch: the next renewal is tried
                log.exception("TLS certificate reload failed")


class TlsFilesCollector:
    """``servepilot_tls_files_current{file}``: 0 while a context's files on disk could not be loaded (new
    content that does not load, or a file that cannot be read) and the old content serves on, which ends
    the day the old certificate expires (the ``ServepilotTlsFilesNotLoaded`` alert); and
    ``servepilot_tls_reloads_total{file}``, renewals loaded. One series per context, named by
    :attr:`WatchedTls.label`; read at scrape time from :func:`watched`."""

    def __init__(self, server: Callable[[], WatchedTls | None]) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        current = GaugeMetricFamily(
            "servepilot_tls_files_current",
            "1 when a TLS context holds what its files on disk say; 0 while new or unreadable files could "
            "not be loaded and the old certificate serves on",
            labels=["file"],
        )
        reloads = CounterMetricFamily(
            "servepilot_tls_reloads", "renewed TLS files loaded without a restart", labels=["file"]
        )
        for tls in watched(self._server()):
            current.add_metric([tls.label], 0.0 if tls.last_error else 1.0)
            reloads.add_metric([tls.label], float(tls.reloads))
        yield current
        yield reloads


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


def gate_upstream_context(cfg: GateConfig) -> ClientTls:
    """TLS towards the gate's upstreams (``gate.upstream_tls_*``): the forwarding, the health checks,
    the canary's perplexity and ``servepilot check`` all reach them alike."""
    return client_context(
        "gate.upstream_tls_", cfg.upstream_tls_ca_file, cfg.upstream_tls_cert_file, cfg.upstream_tls_key_file
    )


def engine_context(cfg: EngineConfig) -> ClientTls:
    """TLS towards the engine (``engine.tls_*``): the scrape of its /metrics and /slots, its control API
    (lease renewals and restores included) and ``servepilot check``. The gate reaches it as an upstream,
    with ``gate.upstream_tls_*``."""
    return client_context("engine.tls_", cfg.tls_ca_file, cfg.tls_cert_file, cfg.tls_key_file)


def webhook_context(cfg: WebhookConfig) -> ClientTls:
    """TLS towards the alert receivers (``webhooks.tls_*``): the dispatcher and ``servepilot check``."""
    return client_context("webhooks.tls_", cfg.tls_ca_file, cfg.tls_cert_file, cfg.tls_key_file)
