"""The probe's HTTP face: allocator statistics as Prometheus text, served from inside the engine process.

It uses prometheus_client's own threaded server with a *private* :class:`CollectorRegistry`, so nothing
the engine registers globally (vLLM's own metrics) leaks in or collides. Every scrape calls the stats
source afresh; the probe keeps no state and costs nothing between scrapes. Answers are never compressed:
gzip would run in the engine's process (holding its GIL) to save bytes on loopback.

Families (one series per CUDA device this process uses, labelled ``device``)::

    servepilot_probe_up                      1, or 0 when reading the allocator failed
    servepilot_probe_cuda_available          1 when CUDA is initialised in this process
    servepilot_probe_allocated_bytes         live tensors            (allocated_bytes.all.current)
    servepilot_probe_reserved_bytes          held from the driver    (reserved_bytes.all.current)
    servepilot_probe_active_bytes            blocks in use or awaiting stream sync
    servepilot_probe_inactive_split_bytes    free pieces of split blocks (fragmentation)
    servepilot_probe_peak_allocated_bytes    high-water marks since start or reset
    servepilot_probe_peak_reserved_bytes
    servepilot_probe_fragmentation_ratio     1 - allocated / reserved (0 when nothing is reserved)
    servepilot_probe_alloc_retries_total     cudaMalloc failures that forced a cache flush and retry
    servepilot_probe_ooms_total              out-of-memory errors raised by the allocator
    servepilot_probe_info{pid, torch_version} 1
    servepilot_probe_device_info{device, uuid} 1   which physical GPU each device is (``GPU-…``, as NVML
                                                   names it), so the sidecar can watch and drive only the
                                                   engine's GPUs on a node it shares (docs/probe.md)
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.probe.stats import (
    DeviceStats,
    StatsSource,
    UuidSource,
    device_stats,
    torch_device_uuids,
    torch_stats,
    torch_version,
)

log = logging.getLogger("servepilot.probe")

DEFAULT_PORT = 9401
PORT_ENV = "SERVEPILOT_PROBE_PORT"

#: (family suffix, help, attribute of DeviceStats) for the per-device gauges, in exposition order.
_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("allocated_bytes", "Bytes held by live tensors (allocated_bytes.all.current).", "allocated_bytes"),
    ("reserved_bytes", "Bytes the caching allocator holds from the driver.", "reserved_bytes"),
    ("active_bytes", "Bytes in active blocks (in use or awaiting stream sync).", "active_bytes"),
    ("inactive_split_bytes", "Free bytes inside split blocks (non-releasable).", "inactive_split_bytes"),
    ("peak_allocated_bytes", "High-water mark of allocated bytes.", "peak_allocated_bytes"),
    ("peak_reserved_bytes", "High-water mark of reserved bytes.", "peak_reserved_bytes"),
    ("fragmentation_ratio", "1 - allocated/reserved; 0 when nothing is reserved.", "fragmentation_ratio"),
)
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("alloc_retries", "cudaMalloc failures that flushed the cache and retried.", "alloc_retries"),
    ("ooms", "Out-of-memory errors raised by the caching allocator.", "ooms"),
)


class AllocatorCollector(Collector):
    """A prometheus_client custom collector that reads the stats source on every scrape."""

    def __init__(self, source: StatsSource, uuids: UuidSource = torch_device_uuids) -> None:
        self._source = source
        self._uuids = uuids
        self._pid = str(os.getpid())
        self._failed_before = False

    def _read(self) -> tuple[bool, list[DeviceStats] | None]:
        """(source healthy, devices or None when CUDA is not in use). A failing source never raises."""
        try:
            raw = self._source()
            devices = None if raw is None else [device_stats(int(i), s) for i, s in sorted(raw.items())]
        except Exception as error:
            if not self._failed_before:  # one line per failure streak, not one per scrape
                log.warning("servepilot probe: reading allocator stats failed: %s", error)
            self._failed_before = True
            return False, None
        self._failed_before = False
        return True, devices

    def collect(self) -> Iterator[Metric]:
        healthy, devices = self._read()
        yield GaugeMetricFamily("servepilot_probe_up", "1 when the allocator was read.", value=int(healthy))
        yield GaugeMetricFamily(
            "servepilot_probe_cuda_available",
            "1 when CUDA is initialised in this process (so allocator stats exist).",
            value=int(devices is not None),
        )
        for suffix, text, attr in _GAUGES:
            gauge = GaugeMetricFamily(f"servepilot_probe_{suffix}", text, labels=["device"])
            for dev in devices or ():
                gauge.add_metric([str(dev.device)], getattr(dev, attr))
            yield gauge
        for suffix, text, attr in _COUNTERS:
            counter = CounterMetricFamily(f"servepilot_probe_{suffix}", text, labels=["device"])
            for dev in devices or ():
                counter.add_metric([str(dev.device)], getattr(dev, attr))
            yield counter
        info = InfoMetricFamily("servepilot_probe", "The probed process.", labels=["pid", "torch_version"])
        info.add_metric([self._pid, torch_version()], {})
        yield info
        yield self._device_info(devices or [])

    def _device_info(self, devices: list[DeviceStats]) -> InfoMetricFamily:
        """``servepilot_probe_device_info{device, uuid}``; a failing UUID read leaves the family empty."""
        family = InfoMetricFamily(
            "servepilot_probe_device",
            "Which GPU (UUID, as NVML names it) each CUDA device is.",
            labels=["device"],
        )
        try:
            uuids = self._uuids([dev.device for dev in devices]) if devices else {}
        except Exception as error:  # never fail the scrape for want of a label
            log.debug("servepilot probe: reading device UUIDs failed: %s", error)
            uuids = {}
        for device, uuid in sorted(uuids.items()):
            family.add_metric([str(device)], {"uuid": uuid})
        return family


@dataclass
class ProbeServer:
    """A running probe endpoint. ``port`` is the bound port (useful when started with port 0)."""

    host: str
    port: int
    registry: CollectorRegistry
    _httpd: WSGIServer = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port.

        ``shutdown`` waits for the serve loop's next 0.5 s poll; connecting to ourselves wakes it at once.
        """
        stopper = threading.Thread(target=self._httpd.shutdown, name="servepilot-probe-stop")
        stopper.start()
        while stopper.is_alive():
            with contextlib.suppress(OSError):
                socket.create_connection((self.host, self.port), timeout=0.2).close()
            stopper.join(0.05)
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """One thread per request, so a slow scrape never blocks an evidence request (or the reverse)."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No access log into the engine's stderr."""


def evidence_dir(environ: dict[str, str] | None = None) -> str:
    """Where memory snapshots go: ``SERVEPILOT_PROBE_EVIDENCE_DIR``, else a folder in the temp dir."""
    env = os.environ if environ is None else environ
    return env.get("SERVEPILOT_PROBE_EVIDENCE_DIR") or os.path.join(
        tempfile.gettempdir(), f"servepilot-evidence-{os.getpid()}"
    )


def serve(
    port: int,
    host: str = "127.0.0.1",
    source: StatsSource = torch_stats,
    uuids: UuidSource = torch_device_uuids,
) -> ProbeServer:
    """Start a probe server (not the process-wide one). Raises :class:`OSError` when the port is taken.

    Serves ``/metrics`` (prometheus_client's WSGI app over the probe's own registry) and
    ``/evidence/memory`` (bounded torch memory-history recordings for leak evidence, docs/probe.md).
    """
    from agent.probe.evidence import MemoryRecorder, wsgi_app

    registry = CollectorRegistry(auto_describe=False)
    registry.register(AllocatorCollector(source, uuids))
    app = wsgi_app(MemoryRecorder(evidence_dir()), make_wsgi_app(registry, disable_compression=True))
    httpd = make_server(host, port, app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="servepilot-probe", daemon=True)
    thread.start()
    return ProbeServer(host, int(httpd.server_port), registry, httpd, thread)


def resolve_port(port: int | None, environ: dict[str, str] | None = None) -> int:
    """The port argument, else ``SERVEPILOT_PROBE_PORT``, else 9401. A bad env value is a ValueError."""
    if port is not None:
        return port
    raw = (environ if environ is not None else os.environ).get(PORT_ENV, "").strip()
    if not raw:
        return DEFAULT_PORT
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{PORT_ENV} must be an integer port, got {raw!r}") from None
    if not 0 <= value <= 65535:
        raise ValueError(f"{PORT_ENV} must be in [0, 65535], got {value}")
    return value


_lock = threading.Lock()
_running: ProbeServer | None = None


def start(
    port: int | None = None, host: str = "127.0.0.1", source: StatsSource = torch_stats
) -> ProbeServer | None:
    """Start the process-wide probe once; later calls return the running server.

    Never raises into the engine: a taken port or a bad ``SERVEPILOT_PROBE_PORT`` logs one warning and
    returns ``None`` (the engine serves on, only without the probe).
    """
    global _running
    with _lock:
        if _running is not None:
            return _running
        try:
            resolved = resolve_port(port)
        except ValueError as error:
            log.warning("servepilot probe not started: %s", error)
            return None
        try:
            _running = serve(resolved, host, source)
        except Exception as error:  # never crash the engine that loaded us
            reason = getattr(error, "strerror", None) or error
            log.warning("servepilot probe not started: cannot listen on %s:%d: %s", host, resolved, reason)
            return None
        log.info("servepilot probe serving allocator stats at %s", _running.url)
        return _running


def stop() -> None:
    """Stop the process-wide probe (tests, and engines that want to shut it down cleanly)."""
    global _running
    with _lock:
        if _running is not None:
            _running.close()
            _running = None


def forget_after_fork() -> None:
    """In a forked child: drop the parent's server (its thread is gone) and close our copy of its socket."""
    global _running, _lock
    _lock = threading.Lock()  # a parent thread may have held it at fork time
    if _running is not None:
        try:
            _running._httpd.server_close()
        finally:
            _running = None
