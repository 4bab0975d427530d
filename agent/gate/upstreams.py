"""Named upstreams, the traffic split the policies set, and health-based failover.

The split is a weight per upstream (``{"primary": 0.9, "fp8": 0.1}`` for a canary; ``{"fp8": 1}`` when
the breaker degrades). :meth:`UpstreamPool.candidates` turns one uniform draw ``u`` into an ordered list:
the weighted pick among healthy upstreams first, then the other healthy ones with weight > 0, then
healthy ones with weight 0 (failover may use any healthy deployment), and finally, when nothing is
healthy, every upstream anyway (a health check can be wrong; a refused request is certainly wrong).
Health is passive (a connection error marks the upstream down) and active (:func:`health_loop`
re-checks every ``interval_s`` and brings it back). An upstream the gate finds hung (its requests get no
byte while its health endpoint still answers) is kept down by the health loop instead of being probed,
until it sends again. The choice is pure; only :func:`health_loop` does I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from yarl import URL

if TYPE_CHECKING:
    from agent.config import Config, GateConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Upstream:
    name: str
    url: str
    healthy: bool = True
    last_error: str = ""
    checked_at: float = 0.0


class UpstreamPool:
    """Upstreams by name, their split weights and health."""

    def __init__(self, urls: Mapping[str, str], split: Mapping[str, float]) -> None:
        if not urls:
            raise ValueError("at least one upstream is required")
        self.upstreams = {name: Upstream(name, url.rstrip("/")) for name, url in urls.items()}
        self.weights: dict[str, float] = {}
        self.set_split(split)

    def set_split(self, split: Mapping[str, float]) -> None:
        """Set the traffic split (absolute weights, normalised here). Unknown names or weights that are
        negative, non-finite or all zero raise ``ValueError`` and leave the old split in place."""
        unknown = sorted(set(split) - set(self.upstreams))
        if unknown:
            raise ValueError(f"unknown upstream(s) {', '.join(unknown)}; known: {', '.join(self.upstreams)}")
        if any(not math.isfinite(w) or w < 0 for w in split.values()):
            raise ValueError("split weights must be finite and >= 0")
        total = sum(split.values())
        if total <= 0:
            raise ValueError("split weights must not all be zero")
        self.weights = {name: split.get(name, 0.0) / total for name in self.upstreams}

    def mark(self, name: str, healthy: bool, now: float, error: str = "") -> bool:
        """Record a health observation; True when it changed the upstream's state."""
        upstream = self.upstreams[name]
        changed = upstream.healthy != healthy
        upstream.healthy, upstream.checked_at = healthy, now
        upstream.last_error = "" if healthy else error
        if healthy and changed:  # good news: info, so a log alert on warnings is not raised by a recovery
            log.info("upstream %s is up", name)
        elif changed:
            log.warning("upstream %s is down%s", name, f": {error}" if error else "")
        return changed

    def describe(self) -> dict[str, dict[str, object]]:
        """Each upstream as an operator asks about it (``GET /api/upstreams``): its URL (without any
        user and password in it), its share of the split, whether it is in, and why not."""
        return {
            up.name: {
                "url": str(URL(up.url).with_user(None)),
                "weight": round(self.weights[up.name], 6),
                "healthy": up.healthy,
                "reason": up.last_error,
                "checked_at": up.checked_at,
            }
            for up in self.upstreams.values()
        }

    def candidates(self, u: float) -> list[Upstream]:
        """Upstreams to try in order for one request, given a uniform draw ``u`` in [0, 1)."""
        healthy = [up for up in self.upstreams.values() if up.healthy]
        weighted = [up for up in healthy if self.weights[up.name] > 0]
        first: Upstream | None = None
        total = sum(self.weights[up.name] for up in weighted)
        if weighted:
            acc, target = 0.0, u * total
            for up in weighted:
                acc += self.weights[up.name]
                if target < acc:
                    first = up
                    break
            first = first or weighted[-1]
        rest = sorted((up for up in healthy if up is not first), key=lambda up: -self.weights[up.name])
        ordered = ([first] if first else []) + rest
        if not ordered:
            ordered = sorted(self.upstreams.values(), key=lambda up: -self.weights[up.name])
        return ordered


async def probe_health(session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    """One health check of ``url``: ``(True, "")`` on a 2xx answer, else ``(False, why)`` in one line.
    The gate's health loop and ``servepilot check`` both judge an upstream with it."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            if 200 <= resp.status < 300:
                return True, ""
            return False, f"health check returned HTTP {resp.status}"
    except (TimeoutError, aiohttp.ClientError, OSError) as error:
        return False, f"health check failed: {type(error).__name__}: {error}"


async def health_loop(
    pool: UpstreamPool,
    session: aiohttp.ClientSession,
    path: str,
    interval_s: float,
    clock: Callable[[], float],
    stop: asyncio.Event,
    timeout_s: float = 2.0,
    stalled: Callable[[], Mapping[str, str]] | None = None,
    awake_since: Callable[[], float] | None = None,
) -> None:
    """Probe every upstream's ``path`` each ``interval_s`` until ``stop`` is set; 2xx means healthy.

    ``stalled`` names the upstreams to keep down this round, with why: a hung engine's health endpoint
    still answers 2xx, so probing it would bring it back into the split. ``awake_since`` gives when the
    gate last woke from a blind spot (agent/gate/ejection.py, :class:`BlindWatch`): a probe that failed
    across one marks nothing, as its timeout ran while the gate could not read the answer."""

    async def probe(up: Upstream) -> None:
        started = clock()
        ok, problem = await probe_health(session, up.url + path, timeout_s)
        if not ok and awake_since is not None and awake_since() > started:
            log.info("health check of upstream %s failed across the gate's blind spot: ignored", up.name)
            return
        pool.mark(up.name, ok, clock(), problem)

    while not stop.is_set():
        held = stalled() if stalled is not None else {}
        for name, why in held.items():
            pool.mark(name, False, clock(), why)
        await asyncio.gather(*(probe(up) for up in pool.upstreams.values() if up.name not in held))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)


def _endpoint(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of ``url``, every loopback name one host: ``localhost``, ``127.0.0.1`` and
    ``::1`` are the same engine in a pod, and a config may well use one for the engine and another for
    the gate's upstream."""
    import ipaddress

    parsed = URL(url)
    host = (parsed.host or "").lower()
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        loopback = False
    return parsed.scheme, "loopback" if loopback else host, parsed.port


def engine_upstream(cfg: Config) -> str | None:
    """The gate upstream that is this pod's engine (its URL is ``engine.url``: the same scheme, host and
    port, loopback names alike), or None: where the ``engine_stall`` detector's finding applies
    (:meth:`agent.gate.proxy.Gate.set_engine_stalled`)."""
    if not cfg.gate.enabled:
        return None
    engine = _endpoint(cfg.engine.url)
    return next((name for name, url in cfg.gate.upstreams.items() if _endpoint(url) == engine), None)


def upstream_auth(cfg: GateConfig) -> dict[str, str]:
    """The ``Authorization`` header the upstreams want (``upstream_api_key_file``), or none. ConfigError
    naming the field, never the key, when the file cannot be read or holds no key."""
    from agent.config import ConfigError

    if cfg.upstream_api_key_file is None:
        return {}
    field = "gate.upstream_api_key_file"
    try:
        key = Path(cfg.upstream_api_key_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        why = getattr(error, "strerror", None) or type(error).__name__
        raise ConfigError(field, f"{cfg.upstream_api_key_file!r}: cannot read it: {why}") from None
    if not key or any(c.isspace() for c in key):
        raise ConfigError(field, f"{cfg.upstream_api_key_file!r}: must hold one key, no spaces")
    return {"Authorization": f"Bearer {key}"}
