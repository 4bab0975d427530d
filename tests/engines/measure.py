"""The gate's added latency over direct on a real engine: 4 concurrent streams, direct and gated rounds
interleaved so machine noise hits both alike. Prints p50/p99 of TTFT and end-to-end time for each path
and their differences (gate minus direct), plus the engine's setup time.

    .venv/bin/python -m tests.engines.measure llamacpp [--rounds 100] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry

from agent.config import GateConfig
from agent.engines.launcher import start
from agent.gate.proxy import Gate
from tests.engines.client import completion, stream_many


async def measure(url: str, rounds: int, tokens: int, streams: int = 4) -> dict[str, dict[str, float]]:
    gate = Gate(GateConfig(enabled=True, upstreams={"primary": url}, max_in_flight=64), CollectorRegistry())
    port = await gate.start("127.0.0.1", 0)
    gated = f"http://127.0.0.1:{port}"
    samples: dict[str, dict[str, list[float]]] = {p: {"ttft": [], "e2e": []} for p in ("direct", "gate")}
    try:
        # a new connection per request on both paths: llama.cpp closes kept-alive ones after 100 requests
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            await stream_many(session, url, [completion("warm up", tokens) for _ in range(streams)])
            for i in range(rounds):
                order = (("direct", url), ("gate", gated)) if i % 2 else (("gate", gated), ("direct", url))
                for path, base in order:
                    bodies = [completion(f"round {i} stream {k}", tokens) for k in range(streams)]
                    for result in await stream_many(session, base, bodies):
                        if result.status == 200 and result.ttft_s is not None:
                            samples[path]["ttft"].append(result.ttft_s)
                            samples[path]["e2e"].append(result.e2e_s)
    finally:
        await gate.stop()
    out: dict[str, dict[str, float]] = {}
    for path, kinds in samples.items():
        for kind, values in kinds.items():
            p50, p99 = np.percentile(values, [50, 99])
            out[f"{path} {kind}"] = {"p50_ms": 1000 * p50, "p99_ms": 1000 * p99, "n": float(len(values))}
    for kind in ("ttft", "e2e"):
        d, g = out[f"direct {kind}"], out[f"gate {kind}"]
        out[f"added {kind}"] = {
            "p50_ms": g["p50_ms"] - d["p50_ms"],
            "p99_ms": g["p99_ms"] - d["p99_ms"],
            "n": 0,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=["llamacpp", "vllm"])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    began = time.monotonic()
    with start(a.engine) as engine:
        ready = engine.wait_ready(900)
        print(f"{a.engine}: ready in {ready:.1f} s ({time.monotonic() - began:.1f} s with the model check)")
        result = asyncio.run(measure(engine.url, a.rounds, a.tokens))
    print("| path | p50 ms | p99 ms | requests |\n|---|---|---|---|")
    for name, row in result.items():
        print(f"| {name} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {int(row['n']) or ''} |")


if __name__ == "__main__":
    main()
