"""Streaming completion clients for the real-engine tests: raw bytes plus client-side timings.

:func:`stream` sends one OpenAI ``/v1/completions`` request with ``stream: true`` and keeps everything a
test may compare: the status, the exact body bytes, the SSE ``data:`` payloads, time to first chunk and
the gaps between chunks. :func:`normalised` blanks the fields a server fills per request (``id``,
``created`` and llama.cpp's ``timings``), so two runs of a deterministic request compare equal.
:func:`gate_for` runs a gate in front of an upstream for the test's duration (the fake engines' tests use
it too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from agent.config import GateConfig
from agent.engines.launcher import SERVED_MODEL
from agent.gate.proxy import Gate

ONE_AT_A_TIME: dict[str, Any] = {"max_in_flight": 1, "high_reserved_ratio": 0.0, "health_interval_s": 600}
"""Gate settings under which a second request must wait for the first (no share kept for high priority,
and no health check in the middle of a test)."""


@dataclass
class StreamResult:
    status: int
    body: bytes = b""
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    arrivals: list[tuple[float, bytes]] = field(default_factory=list)
    """Each chunk as it came, with its ``time.monotonic()``."""

    def sequence_gaps(self) -> list[float]:
        """The gaps between consecutive events of each sequence (``choices[].index``, or a top-level
        ``index`` in llama.cpp's native stream), an event timed by the chunk that ended it: what the
        gate's ITL of a multi-sequence stream should be, taken on the client's side."""
        last: dict[int, float] = {}
        gaps: list[float] = []
        pending = b""
        for t, chunk in self.arrivals:
            *events, pending = (pending + chunk).split(b"\n\n")
            for event in events:
                data = event.strip().removeprefix(b"data:").strip()
                if not data or data in (b"[DONE]", b"null"):
                    continue
                doc = json.loads(data)
                indices = [c["index"] for c in doc.get("choices", [])] if "choices" in doc else [doc["index"]]
                for index in indices:
                    if index in last:
                        gaps.append(t - last[index])
                    last[index] = t
        return gaps

    @property
    def events(self) -> list[str]:
        """The SSE ``data:`` payloads in order, ``[DONE]`` included."""
        return [line[5:].strip() for line in self.body.decode().splitlines() if line.startswith("data:")]

    @property
    def text(self) -> str:
        parts = []
        for event in self.events:
            if event != "[DONE]":
                parts.extend(c.get("text", "") for c in json.loads(event).get("choices", []))
        return "".join(parts)

    @property
    def usage(self) -> dict[str, Any]:
        for event in reversed(self.events):
            if event != "[DONE]" and (usage := json.loads(event).get("usage")):
                return dict(usage)
        return {}


def completion(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A deterministic streaming completion body: greedy, seeded, run to ``max_tokens``."""
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.0,
        "seed": 1234,
        "ignore_eos": True,
    }
    body.update(extra)
    return body


async def stream(
    session: aiohttp.ClientSession,
    base_url: str,
    body: dict[str, Any],
    path: str = "/v1/completions",
    headers: dict[str, str] | None = None,
) -> StreamResult:
    started = time.monotonic()
    async with session.post(base_url + path, json=body, headers=headers) as resp:
        result = StreamResult(resp.status)
        raw = bytearray()
        last: float | None = None
        async for chunk in resp.content.iter_any():
            now = time.monotonic()
            if last is None:
                result.ttft_s = now - started
            else:
                result.gaps_s.append(now - last)
            last = now
            raw.extend(chunk)
            result.arrivals.append((now, chunk))
    result.body = bytes(raw)
    result.e2e_s = time.monotonic() - started
    return result


async def stream_many(
    session: aiohttp.ClientSession, base_url: str, bodies: list[dict[str, Any]]
) -> list[StreamResult]:
    return list(await asyncio.gather(*(stream(session, base_url, b) for b in bodies)))


_PER_REQUEST = (
    (re.compile(rb'"id":"[^"]*"'), b'"id":"-"'),
    (re.compile(rb'"created":\d+'), b'"created":0'),
    (re.compile(rb',"timings":\{[^{}]*\}'), b""),
)


def normalised(body: bytes) -> bytes:
    """``body`` with the per-request fields blanked; every other byte is kept as the server sent it."""
    for pattern, replacement in _PER_REQUEST:
        body = pattern.sub(replacement, body)
    return body


def gate_tokens(registry: Any, line: str = "default") -> dict[str, float | None]:
    """A gate's ``servepilot_gate_tokens_total`` for ``line``, by kind (prompt, output)."""
    name = "servepilot_gate_tokens_total"
    return {k: registry.get_sample_value(name, {"line": line, "kind": k}) for k in ("prompt", "output")}


@contextlib.asynccontextmanager
async def gate_for(upstream: str, **settings: Any) -> AsyncIterator[tuple[Gate, str, CollectorRegistry]]:
    """A started gate in front of ``upstream`` with ``settings`` (GateConfig fields), its base URL and its
    own registry; stopped on exit."""
    registry = CollectorRegistry()
    gate = Gate(GateConfig(enabled=True, upstreams={"primary": upstream}, **settings), registry)
    port = await gate.start("127.0.0.1", 0)
    try:
        yield gate, f"http://127.0.0.1:{port}", registry
    finally:
        await gate.stop()


@contextlib.asynccontextmanager
async def sampled(read: Callable[[], Awaitable[float]], every_s: float) -> AsyncIterator[list[float]]:
    """What ``read`` returns every ``every_s`` while the ``async with`` body runs (a queue depth, the
    engine's busy slots), so a test can assert on the most it ever was."""
    seen: list[float] = []

    async def watch() -> None:
        while True:
            seen.append(await read())
            await asyncio.sleep(every_s)

    watcher = asyncio.ensure_future(watch())
    try:
        yield seen
    finally:
        watcher.cancel()
