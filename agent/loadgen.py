"""A trace-replaying load generator: real arrival times and token lengths, sent as streaming completions.

Used by ``servepilot demo`` (and by benchmarks) to give the engine a realistic shape of load. Requests
are open-loop — each one is sent at its (scaled) arrival time whether or not earlier ones finished — with
a hard cap on requests in flight so a stalled engine cannot make the generator grow without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
import numpy as np

#: Statuses a server sheds load with (together with a ``Retry-After`` header).
SHED_STATUSES = frozenset((429, 503))
#: The header that names a request's priority class at servepilot's gate (``gate.priority_header``).
PRIORITY_HEADER = "x-servepilot-priority"


@dataclass
class LoadStats:
    """Client-side view of the load: counts and recent first-token latencies."""

    sent: int = 0
    ok: int = 0
    #: Refused on purpose with ``Retry-After`` (429 or 503: the gate shedding load, a line over its rate):
    #: the admission control at work, not an error, so apart from ``failed``.
    shed: int = 0
    failed: int = 0
    dropped: int = 0
    in_flight: int = 0
    tokens: int = 0
    last_error: str = ""
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=512))
    #: The same counts per priority class, when the generator sends a mix of classes (else empty).
    classes: dict[str, LoadStats] = field(default_factory=dict)

    def ttft_quantile(self, q: float) -> float | None:
        return float(np.quantile(np.fromiter(self.ttft_s, float), q)) if self.ttft_s else None


class LoadGenerator:
    """Replays ``requests`` (rows of arrival_s, prompt_tokens, output_tokens) against ``base_url``.

    ``speed`` > 1 compresses time (2.0 = twice the trace's rate); ``rate_scale`` thins or thickens the
    trace by sending each request ``rate_scale`` times on average (Bernoulli thinning for < 1). The trace
    repeats when it ends, so a long demo keeps its shape. ``priority_mix`` (class -> share) gives each
    request a priority class at random in those shares, named in :data:`PRIORITY_HEADER`, and counts each
    class apart (``stats.classes``): what a gate's priority classes do for each is then seen client-side.
    """

    def __init__(
        self,
        base_url: str,
        requests: np.ndarray,
        *,
        model: str = "default",
        speed: float = 1.0,
        rate_scale: float = 1.0,
        max_output_tokens: int = 512,
        max_prompt_tokens: int = 8192,
        max_in_flight: int = 512,
        seed: int = 0,
        priority_mix: Mapping[str, float] | None = None,
    ) -> None:
        if requests.ndim != 2 or requests.shape[1] != 3 or len(requests) == 0:
            raise ValueError("requests must be a non-empty (n, 3) array of arrival_s, prompt, output tokens")
        self.base_url = base_url.rstrip("/")
        self.requests = requests
        self.model = model
        self.speed = speed
        self.rate_scale = rate_scale
        self.max_output_tokens = max_output_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.max_in_flight = max_in_flight
        self.rng = np.random.default_rng(seed)
        self.stats = LoadStats()
        self._classes = list(priority_mix or ())
        if priority_mix:
            shares = np.array([float(priority_mix[c]) for c in self._classes])
            if not np.all(np.isfinite(shares)) or np.any(shares < 0) or shares.sum() <= 0:
                raise ValueError(
                    f"priority_mix must give shares >= 0 with a total above 0, got {priority_mix}"
                )
            self._shares = shares / shares.sum()
            self.stats.classes = {c: LoadStats() for c in self._classes}
        self._tasks: set[asyncio.Task[None]] = set()

    def _schedule(self) -> list[tuple[float, int, int]]:
        """One pass of the trace as (offset_s, prompt, output), scaled and thinned."""
        arrivals = (self.requests[:, 0] - self.requests[0, 0]) / self.speed
        out: list[tuple[float, int, int]] = []
        for t, prompt, output in zip(arrivals, self.requests[:, 1], self.requests[:, 2], strict=True):
            copies = int(self.rate_scale) + (1 if self.rng.random() < self.rate_scale % 1 else 0)
            for _ in range(copies):
                out.append(
                    (
                        float(t),
                        int(min(max(prompt, 1), self.max_prompt_tokens)),
                        int(min(max(output, 1), self.max_output_tokens)),
                    )
                )
        return out

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60)
        connector = aiohttp.TCPConnector(limit=self.max_in_flight)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            try:
                while not stop.is_set():
                    await self._one_pass(session, stop)
            finally:
                for task in list(self._tasks):
                    task.cancel()
                with contextlib.suppress(Exception):
                    await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _one_pass(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        schedule = self._schedule()
        span = schedule[-1][0] if schedule else 0.0
        start = time.monotonic()
        for offset, prompt, output in schedule:
            delay = start + offset - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
            if stop.is_set():
                return
            if len(self._tasks) >= self.max_in_flight:  # tasks not yet started count too
                self.stats.dropped += 1
                continue
            task = asyncio.create_task(self._send(session, prompt, output))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        rest = start + span + 1.0 / max(self.speed, 1e-9) - time.monotonic()
        if rest > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=rest)

    async def _send(self, session: aiohttp.ClientSession, prompt: int, output: int) -> None:
        body = {
            "model": self.model,
            "prompt": [1] * prompt,
            "max_tokens": output,
            "stream": True,
            "ignore_eos": True,
        }
        headers = None
        counts = [self.stats]  # the totals, and the request's class when there is a mix
        if self._classes:
            cls = self._classes[int(self.rng.choice(len(self._classes), p=self._shares))]
            headers = {PRIORITY_HEADER: cls}
            counts.append(self.stats.classes[cls])
        for c in counts:
            c.sent += 1
            c.in_flight += 1
        started = time.monotonic()
        first = True
        try:
            url = f"{self.base_url}/v1/completions"
            async with session.post(url, json=body, headers=headers) as response:
                if response.status != 200:
                    shed = response.status in SHED_STATUSES and "Retry-After" in response.headers
                    for c in counts:
                        if shed:
                            c.shed += 1
                        else:
                            c.failed += 1
                            c.last_error = f"HTTP {response.status}"
                    return
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    if first:
                        for c in counts:
                            c.ttft_s.append(time.monotonic() - started)
                        first = False
                    with contextlib.suppress(ValueError):
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            for c in counts:
                                c.tokens += 1
                for c in counts:
                    c.ok += 1
        except (aiohttp.ClientError, TimeoutError) as error:
            for c in counts:
                c.failed += 1
                c.last_error = f"{type(error).__name__}: {error}"[:200]
        finally:
            for c in counts:
                c.in_flight -= 1
