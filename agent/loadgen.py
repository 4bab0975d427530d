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
from dataclasses import dataclass, field

import aiohttp
import numpy as np

#: Statuses a server sheds load with (together with a ``Retry-After`` header).
SHED_STATUSES = frozenset((429, 503))


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

    def ttft_quantile(self, q: float) -> float | None:
        return float(np.quantile(np.fromiter(self.ttft_s, float), q)) if self.ttft_s else None


class LoadGenerator:
    """Replays ``requests`` (rows of arrival_s, prompt_tokens, output_tokens) against ``base_url``.

    ``speed`` > 1 compresses time (2.0 = twice the trace's rate); ``rate_scale`` thins or thickens the
    trace by sending each request ``rate_scale`` times on average (Bernoulli thinning for < 1). The trace
    repeats when it ends, so a long demo keeps its shape.
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
            if self.stats.in_flight >= self.max_in_flight:
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
        self.stats.sent += 1
        self.stats.in_flight += 1
        started = time.monotonic()
        first = True
        try:
            async with session.post(f"{self.base_url}/v1/completions", json=body) as response:
                if response.status != 200:
                    if response.status in SHED_STATUSES and "Retry-After" in response.headers:
                        self.stats.shed += 1
                    else:
                        self.stats.failed += 1
                        self.stats.last_error = f"HTTP {response.status}"
                    return
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    if first:
                        self.stats.ttft_s.append(time.monotonic() - started)
                        first = False
                    with contextlib.suppress(ValueError):
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            self.stats.tokens += 1
                self.stats.ok += 1
        except (aiohttp.ClientError, TimeoutError) as error:
            self.stats.failed += 1
            self.stats.last_error = f"{type(error).__name__}: {error}"[:200]
        finally:
            self.stats.in_flight -= 1
