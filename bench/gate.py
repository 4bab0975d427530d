"""What the admission gate costs: added latency over going direct, and chunk relay rate; nginx for scale.

One run, three routes to the same simulator (``servepilot sim``, its own process): direct, through the
gate (``python -m agent.commands.gate``, its own process, in-flight limit above the concurrency so it
only relays), and through nginx (Debian package, one worker, a plain streaming reverse proxy with a
config written to a temp dir). For 64 and 256 concurrent streaming requests each route runs
``--rounds`` times for ``--duration`` seconds after a warm-up, the routes interleaved in a rotated order
per round and the rounds pooled; the load generator (this process; each client pauses 0-20 ms
at random between requests) measures per-request TTFT and counts SSE chunks. Added latency = TTFT
quantile through the proxy minus the same quantile direct.

Targets from the issue: added p50 <= 1 ms, p99 <= 5 ms, >= 20,000 chunks/s on 2 cores. Everything here
(simulator, proxy, load generator) shares the same cores, so the chunk rate is a lower bound on what
the gate can relay. Run it once, not in a loop, on a shared machine::

    python bench/gate.py [--rounds 3] [--duration 4] [--speed 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

NGINX_CONF = """
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
    upstream engine {{ server 127.0.0.1:{upstream}; keepalive 512; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, deadline_s: float = 30.0) -> None:
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up within {deadline_s:g} s")


async def one_route(
    url: str, model: str, concurrency: int, duration_s: float, warmup_s: float, max_tokens: int
) -> dict[str, float]:
    """``concurrency`` closed-loop streaming clients for warm-up + duration; stats of the measured part."""
    body = {"model": model, "prompt": "x " * 64, "max_tokens": max_tokens, "stream": True}
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    ttfts: list[float] = []
    chunks = 0
    t_start = time.perf_counter()
    measure_from, stop_at = t_start + warmup_s, t_start + warmup_s + duration_s
    errors = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal chunks, errors
        rng = random.Random(len(ttfts))
        while time.perf_counter() < stop_at:
            # A random pause breaks the phase lock between closed-loop clients and the simulator's steps:
            # without it a request sent right after the previous one finishes lands just before the next
            # step direct, and just after it through any proxy, which would charge the proxy a whole step.
            await asyncio.sleep(rng.uniform(0, 0.02))
            sent = time.perf_counter()
            try:
                async with session.post(url + "/v1/completions", data=payload, headers=headers) as resp:
                    if resp.status != 200:
                        errors += 1
                        await resp.read()
                        continue
                    first = True
                    async for chunk in resp.content.iter_any():
                        now = time.perf_counter()
                        if first:
                            if sent >= measure_from:
                                ttfts.append(now - sent)
                            first = False
                        if measure_from <= now < stop_at:
                            chunks += chunk.count(b"data:")
            except aiohttp.ClientError:
                errors += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return {"ttfts": ttfts, "chunks": chunks, "seconds": duration_s, "errors": errors}


def summarise(slots: list[dict[str, Any]]) -> dict[str, float]:
    """One route's slots pooled: TTFT quantiles over every measured request, chunks/s over all seconds."""
    ttft = np.concatenate([np.asarray(slot["ttfts"]) for slot in slots])
    seconds = sum(slot["seconds"] for slot in slots)
    return {
        "requests": float(len(ttft)),
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1000) if len(ttft) else float("nan"),
        "ttft_p99_ms": float(np.percentile(ttft, 99) * 1000) if len(ttft) else float("nan"),
        "chunks_per_s": sum(slot["chunks"] for slot in slots) / seconds,
        "errors": float(sum(slot["errors"] for slot in slots)),
    }


def run_loop(coro: Any) -> Any:
    """uvloop when installed (as the gate command uses it), so the load generator costs less CPU."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` from /proc, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def print_table(results: dict[tuple[int, str], dict[str, float]], args: argparse.Namespace) -> None:
    print(
        f"\nservepilot gate bench: simulator speed {args.speed:g}, {args.max_tokens} tokens/request, "
        f"{args.rounds} interleaved rounds x {args.duration:g} s measured per row, "
        f"gate event loop {args.event_loop}, "
        f"{os.cpu_count()} CPUs shared by every process"
    )
    cols = (
        "conc",
        "route",
        "reqs",
        "TTFT p50",
        "TTFT p99",
        "added p50",
        "added p99",
        "chunks/s",
        "errors",
        "CPU",
    )
    widths = (5, 7, 6, 10, 10, 10, 10, 9, 6, 5)
    print(" ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for (conc, name), row in results.items():
        base = results[(conc, "direct")]
        cells = [str(conc), name, f"{row['requests']:.0f}"]
        cells += [f"{row['ttft_p50_ms']:.2f} ms", f"{row['ttft_p99_ms']:.2f} ms"]
        for q in ("p50", "p99"):
            delta = row[f"ttft_{q}_ms"] - base[f"ttft_{q}_ms"]
            cells.append("" if name == "direct" else f"{delta:+.2f} ms")
        cells += [f"{row['chunks_per_s']:.0f}", f"{row['errors']:.0f}"]
        cells.append(f"{row['proxy_cpu_share']:.0%}" if "proxy_cpu_share" in row else "")
        print(" ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duration", type=float, default=4.0, help="measured seconds per route, load and round"
    )
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per load (pooled)")
    parser.add_argument("--speed", type=float, default=4.0, help="simulator time scale")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument(
        "--event-loop",
        choices=("auto", "uvloop", "asyncio"),
        default="auto",
        help="the gate's agent.event_loop (auto: uvloop if installed, as `servepilot run` and `gate` do)",
    )
    args = parser.parse_args()

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen[bytes]] = []
    tmp = Path(tempfile.mkdtemp(prefix="servepilot-bench-gate-"))
    try:
        sim_port, gate_port, nginx_port = free_port(), free_port(), free_port()
        sim = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "sim", "--port", str(sim_port), "--speed", str(args.speed),
             "--max-num-seqs", "512"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(sim)
        # Relay only: no line rate limit (the default, 1000/min, would refuse most of the load) and an
        # in-flight limit above the concurrency, so every request goes straight upstream.
        (tmp / "gate.yaml").write_text(
            f"agent:\n  event_loop: {args.event_loop}\n"
            "gate:\n  default_requests_per_min: 10000000\n  max_in_flight: 4096\n"
        )
        gate = subprocess.Popen(
            [sys.executable, "-m", "agent.commands.gate", "--config", str(tmp / "gate.yaml"),
             "--upstream", f"http://127.0.0.1:{sim_port}", "--port", str(gate_port), "--no-metrics"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(gate)
        routes = {"direct": f"http://127.0.0.1:{sim_port}", "gate": f"http://127.0.0.1:{gate_port}"}
        nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
        if nginx:
            (tmp / "nginx.conf").write_text(NGINX_CONF.format(tmp=tmp, upstream=sim_port, port=nginx_port))
            procs.append(subprocess.Popen([nginx, "-c", str(tmp / "nginx.conf"), "-p", str(tmp)], cwd=tmp))
            routes["nginx"] = f"http://127.0.0.1:{nginx_port}"
        else:
            print("nginx not found (apt-get install -y nginx): skipping its rows", file=sys.stderr)
        for url in routes.values():
            wait_http(url + "/v1/models")
        with urllib.request.urlopen(routes["direct"] + "/v1/models", timeout=5) as resp:
            model = json.load(resp)["data"][0]["id"]
        results: dict[tuple[int, str], dict[str, float]] = {}
        names = list(routes)
        for conc in args.concurrency:
            slots: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            gate_cpu = 0.0
            for round_ in range(args.rounds):
                # interleaved, each round in a rotated order: drift (the simulator's state, the other
                # processes on the cores) lands on every route alike instead of on whichever ran last
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    gate_cpu0 = cpu_seconds(gate.pid)
                    slots[name].append(
                        run_loop(
                            one_route(routes[name], model, conc, args.duration, args.warmup, args.max_tokens)
                        )
                    )
                    if name == "gate":
                        gate_cpu += cpu_seconds(gate.pid) - gate_cpu0
            for name in names:
                results[(conc, name)] = summarise(slots[name])
            results[(conc, "gate")]["proxy_cpu_share"] = gate_cpu / (
                args.rounds * (args.duration + args.warmup)
            )
        print_table(results, args)
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
