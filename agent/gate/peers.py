"""How many gates share a deployment's rate limits: the addresses a headless Service's name resolves to.

A business line's ``requests_per_min`` and ``tokens_per_min`` are what a tenant was sold for the whole
deployment, but each pod's gate keeps its own buckets: behind a Service spreading requests over N pods,
a line got N times its rate, and more with every replica the autoscaler added. With ``gate.peers_dns``
naming a headless Service (``clusterIP: None``) that selects the gates' pods, its name resolves to one
address per ready pod, and each gate enforces ``1/N`` of every line's rates and bursts
(:meth:`agent.gate.ratelimit.LineLimits.reconfigured`). The Service spreads a line's requests over the
pods about evenly, so the deployment as a whole holds the line to about its rate, with no shared store
on the request path (Envoy's local rate limit does the same per instance; a global one needs a
service every request waits on).

The count is read every ``gate.peers_refresh_s``. A lookup that fails or finds nobody (a DNS outage, the
Service not created yet) keeps the last count, and before the first answer it is 1: a gate that cannot
count its peers lets its lines have their whole rate rather than refuse a tenant's traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections import Counter
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

#: The longest a lookup may take; a slower one counts as failed (the last count stays).
RESOLVE_TIMEOUT_S = 5.0

Resolver = Callable[[str], Awaitable[set[str]]]
"""A name to the set of addresses it resolves to (:func:`resolve`; tests pass their own)."""


async def resolve(name: str) -> set[str]:
    """The distinct addresses ``name`` resolves to, through the system's resolver (the pod's
    resolv.conf: a Service's short name resolves in its own namespace). Raises OSError when it does
    not resolve."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return {str(info[4][0]) for info in infos}


def gates_in(addresses: set[str]) -> int:
    """The gates behind a headless Service's ``addresses``: in a dual-stack cluster each pod has an IPv4
    and an IPv6 address, so the larger of the two families' counts, not their sum."""
    families = Counter(ipaddress.ip_address(address.split("%")[0]).version for address in addresses)
    return max(families.values(), default=0)


class PeerCount:
    """The number of gates sharing the rates: the addresses of ``name``, kept from the last good lookup."""

    def __init__(self, name: str, resolver: Resolver | None = None) -> None:
        self.name = name
        self._resolve = resolver if resolver is not None else resolve
        #: gates counted at the last good lookup (1 before any)
        self.count = 1
        #: why the last lookup failed, empty after a good one
        self.error = ""

    async def refresh(self) -> int:
        """Look the name up again; returns the count now in force."""
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                found = await self._resolve(self.name)
        except (OSError, TimeoutError) as error:
            self._failed(f"{type(error).__name__}: {error}")
            return self.count
        count = gates_in(found)
        if not count:
            self._failed("no addresses")
            return self.count
        if self.error:
            log.info("gate peers: %s resolves again (%d)", self.name, count)
        if count != self.count:
            log.info("gate peers: %d gates share the lines' rates (%s)", count, self.name)
        self.count, self.error = count, ""
        return self.count

    def _failed(self, why: str) -> None:
        if not self.error:  # once per outage, not every refresh
            log.warning(
                "gate peers: %s does not resolve (%s); the lines' rates stay divided by %d",
                self.name,
                why,
                self.count,
            )
        self.error = why


async def peers_loop(
    peers: PeerCount, every_s: float, apply: Callable[[int], None], stop: asyncio.Event
) -> None:
    """Count the peers every ``every_s`` until ``stop``, calling ``apply`` with each count (the first at
    once)."""
    while not stop.is_set():
        apply(await peers.refresh())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_s)
