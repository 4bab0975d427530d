"""How long a real engine takes to answer ``/metrics``: idle, and while it streams tokens.

Why it matters: the sidecar reads the engine's ``/metrics`` every tick. vLLM and llama.cpp render the
page in the process that serves the API, so a busy engine answers it later than an idle one. Read
inside the tick, that wait is the tick's; read ``agent.scrape_lead_s`` ahead of the tick (the default,
agent/loop.py), the tick finds the page ready unless the engine takes longer than the lead.

Starts the real engine with its tiny local model (``bash scripts/engines.sh vllm`` first; CPU backend, no
GPU), times ``--samples`` scrapes spaced 0.1 s apart with no load, then again while ``--streams`` streaming
completions run back to back, and prints the wall time of each scrape (request sent to last byte read)
with its size::

    python bench/engine_scrape.py [--engine vllm|llamacpp] [--samples 100] [--streams 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.collectors.base import SCRAPE_HEADERS  # noqa: E402
from agent.engines.launcher import SERVED_MODEL, EngineError, LaunchOptions, start  # noqa: E402

READY_TIMEOUT_S = 900.0
#: agent.scrape_lead_s's default, in ms: a scrape slower than this is still out when the tick begins
LEAD_MS = 100.0
#: a kept-alive connection the engine closed meanwhile (llama.cpp: after 100 requests or 5 s idle)
STALE = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)


async def _scrapes(session: aiohttp.ClientSession, url: str, samples: int) -> tuple[list[float], int]:
    walls: list[float] = []
    size = 0
    for _ in range(samples):
        started = time.perf_counter()
        try:
            body = await _get(session, url)
        except STALE:  # llama.cpp closes kept-alive connections; the sidecar retries once too
            body = await _get(session, url)
        walls.append(time.perf_counter() - started)  # a retry's time counts
        size = len(body)
        await asyncio.sleep(0.1)
    return walls, size


async def _get(session: aiohttp.ClientSession, url: str) -> bytes:
    async with session.get(url, headers=SCRAPE_HEADERS) as response:
        return await response.read()


async def _stream_forever(session: aiohttp.ClientSession, base: str, stop: asyncio.Event) -> int:
    """Back-to-back streaming completions until ``stop``; how many tokens' chunks arrived."""
    body = {"model": SERVED_MODEL, "prompt": "Once upon a time", "max_tokens": 128, "stream": True}
    body |= {"temperature": 0.0, "ignore_eos": True}
    chunks = 0
    while not stop.is_set():
        try:
            async with session.post(base + "/v1/completions", json=body) as response:
                async for _ in response.content:
                    chunks += 1
        except STALE:
            continue  # a connection the engine had closed: the next request takes a new one
    return chunks


def _row(label: str, walls: list[float], size: int) -> str:
    ms = np.array(walls) * 1000
    p50, p99 = np.percentile(ms, [50, 99])
    late = int((ms > LEAD_MS).sum())
    return f"| {label} | {len(ms)} | {size:,} | {p50:.2f} | {p99:.2f} | {ms.max():.2f} | {late} |"


async def _measure(base: str, samples: int, streams: int) -> list[str]:
    rows = [
        f"| engine state | scrapes | bytes | p50 ms | p99 ms | max ms | over {LEAD_MS:g} ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    async with aiohttp.ClientSession() as session:
        await _scrapes(session, base + "/metrics", 3)  # connection set up, first render
        walls, size = await _scrapes(session, base + "/metrics", samples)
        rows.append(_row("idle", walls, size))
        stop = asyncio.Event()
        load = [asyncio.create_task(_stream_forever(session, base, stop)) for _ in range(streams)]
        await asyncio.sleep(2.0)  # the streams reach their steady state
        walls, size = await _scrapes(session, base + "/metrics", samples)
        stop.set()
        chunks = sum(await asyncio.gather(*load))
        rows.append(_row(f"{streams} streams decoding ({chunks:,} chunks during the run)", walls, size))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("vllm", "llamacpp"), default="vllm")
    parser.add_argument("--samples", type=int, default=100, help="scrapes per state, 0.1 s apart")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streaming completions under load")
    args = parser.parse_args()
    try:
        engine = start(args.engine, opts=LaunchOptions(parallel=max(1, args.streams)))
    except EngineError as error:
        print(f"engine_scrape: {error}", file=sys.stderr)
        return 2
    with engine:
        try:
            ready_s = engine.wait_ready(READY_TIMEOUT_S)
        except EngineError as error:
            print(f"engine_scrape: {error}", file=sys.stderr)
            return 1
        with contextlib.suppress(KeyboardInterrupt):
            rows = asyncio.run(_measure(engine.url, args.samples, args.streams))
            print(f"{args.engine} /metrics wall time (ready in {ready_s:.0f} s), one scrape every 0.1 s:")
            print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
