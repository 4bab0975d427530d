"""What the admission gate costs: added latency over going direct, and chunk relay rate; nginx for scale.

One run, four routes (five with ``--pipe``) to the same simulator (``servepilot sim --stamp-chunks``,
its own process): direct; through the gate (``python -m agent.commands.gate``, its own process,
in-flight limit above the concurrency so it only relays); through ``bench/aiohttp_floor.py`` (the least
an aiohttp proxy does: the floor under the gate's own work); through nginx (Debian package, one worker,
a plain streaming reverse proxy with a config written to a temp dir); and with ``--pipe`` through
``bench/pipe_floor.py`` (a TCP byte pipe on uvloop: the floor under any Python proxy). For 64 and 256
concurrent streaming requests each route runs ``--rounds`` times for ``--duration`` seconds after a
warm-up, the routes interleaved in a rotated order per round and the rounds pooled; the load generator
(this process; each client pauses 0-20 ms at random between requests) reads the simulator's stamps
(CLOCK_MONOTONIC, shared by every process on the host):

* outside: per request, send to the simulator's arrival stamp, plus the first event's write stamp to its
  read here. The TTFT less the time inside the engine, whose batching would otherwise drown what a
  proxy adds (a request waits for the next step boundary);
* event: per SSE event, its write stamp to its read here;
* added: the route's quantile minus direct's.

It also prints TTFT, chunks/s and the CPU share of the simulator, the proxy and itself. Targets from the
issue: added p50 <= 1 ms, p99 <= 5 ms, >= 20,000 chunks/s on 2 cores, judged for the gate and then, as
a reference, for each other proxy in the run. Everything here shares the same
cores unless ``--pin``, so the chunk rate is a lower bound on what the gate can relay. Run it once, not in
a loop, on a quiet machine::

    python bench/gate.py [--rounds 3] [--duration 4] [--speed 4] [--max-tokens 64] [--pin]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from agent import eventloop
from simulator.server import RECEIVED_HEADER, STAMP_PREFIX

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
) -> dict[str, Any]:
    """``concurrency`` closed-loop streaming clients for warm-up + duration; what the measured part saw.

    Per request: its TTFT, and its time *outside* the engine: from sending the request to the simulator
    receiving it (the ``X-Sim-Received-Ns`` header), plus from the simulator writing the first SSE event
    to this client reading it (the event's ``: sent_ns=`` comment line). Per SSE event: its transit from
    the simulator's write to this client's read. All on CLOCK_MONOTONIC, which every process shares."""
    body = {"model": model, "prompt": "x " * 64, "max_tokens": max_tokens, "stream": True}
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    ttfts: list[int] = []
    outside: list[int] = []  # request transit + first event's transit, ns
    transits: list[int] = []  # every measured event's transit, ns
    chunks = 0
    t_start = time.monotonic_ns()
    measure_from = t_start + int(warmup_s * 1e9)
    stop_at = measure_from + int(duration_s * 1e9)
    errors = 0
    stamp, skip = STAMP_PREFIX, len(STAMP_PREFIX)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal chunks, errors
        rng = random.Random(len(ttfts))
        while time.monotonic_ns() < stop_at:
            # A random pause breaks the phase lock between closed-loop clients and the simulator's steps:
            # without it a request sent right after the previous one finishes lands just before the next
            # step direct, and just after it through any proxy, which would charge the proxy a whole step.
            await asyncio.sleep(rng.uniform(0, 0.02))
            sent = time.monotonic_ns()
            try:
                async with session.post(url + "/v1/completions", data=payload, headers=headers) as resp:
                    if resp.status != 200:
                        errors += 1
                        await resp.read()
                        continue
                    arrived = int(resp.headers[RECEIVED_HEADER])
                    first = True
                    async for chunk in resp.content.iter_any():
                        now = time.monotonic_ns()
                        measured = measure_from <= now < stop_at
                        if first or measured:
                            pos = chunk.find(stamp)
                            while pos >= 0:  # an event split across two reads is not timed
                                end = chunk.find(b"\n", pos)
                                if end < 0:
                                    break
                                transit = now - int(chunk[pos + skip : end])
                                if first:
                                    if sent >= measure_from:
                                        ttfts.append(now - sent)
                                        outside.append(arrived - sent + transit)
                                    first = False
                                if measured:
                                    transits.append(transit)
                                pos = chunk.find(stamp, end)
                        if measured:
                            chunks += chunk.count(b"data:")
            except aiohttp.ClientError:
                errors += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return {
        "ttfts": ttfts,
        "outside": outside,
        "transits": transits,
        "chunks": chunks,
        "seconds": duration_s,
        "errors": errors,
    }


def _ms(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q) / 1e6) if len(values) else float("nan")


def summarise(slots: list[dict[str, Any]]) -> dict[str, float]:
    """One route's slots pooled: quantiles over every measured request and event, chunks/s over all
    seconds, and each process's CPU share of the wall time the route ran."""
    pooled = {
        key: np.concatenate([np.asarray(slot[key], dtype=np.float64) for slot in slots])
        for key in ("ttfts", "outside", "transits")
    }
    seconds = sum(slot["seconds"] for slot in slots)
    row = {"requests": float(len(pooled["ttfts"]))}
    for key, name in (("ttfts", "ttft"), ("outside", "outside"), ("transits", "chunk")):
        row[f"{name}_p50_ms"] = _ms(pooled[key], 50)
        row[f"{name}_p99_ms"] = _ms(pooled[key], 99)
    row["chunks_per_s"] = sum(slot["chunks"] for slot in slots) / seconds
    row["errors"] = float(sum(slot["errors"] for slot in slots))
    wall = sum(slot["wall_s"] for slot in slots)
    for proc in ("sim", "proxy", "loadgen"):
        if all(proc in slot["cpu_s"] for slot in slots):
            row[f"{proc}_cpu_share"] = sum(slot["cpu_s"][proc] for slot in slots) / wall
    return row


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` from /proc, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its direct children (nginx's master and its worker)."""
    total = cpu_seconds(pid)
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for child in children.read_text().split() if children.exists() else []:
        with contextlib.suppress(FileNotFoundError):  # gone since the list was read
            total += cpu_seconds(int(child))
    return total


def _cells(values: list[str], widths: tuple[int, ...]) -> str:
    return " ".join(c.rjust(w) for c, w in zip(values, widths, strict=True))


def print_table(results: dict[tuple[int, str], dict[str, float]], args: argparse.Namespace) -> None:
    print(
        f"\nservepilot gate bench: simulator speed {args.speed:g} ({args.sim_event_loop} loop), "
        f"{args.max_tokens} tokens/request, {args.rounds} interleaved rounds x {args.duration:g} s measured "
        f"per row, gate event loop {args.event_loop}, "
        + (
            f"proxies pinned to CPU {min(args.proxy_cpus)}, simulator and load generator to the other CPUs"
            if args.pin
            else f"{os.cpu_count()} CPUs shared by every process"
        )
    )
    print(
        "outside = the request's way to the simulator plus its first event's way back (TTFT less the time "
        "inside the engine);\nevent = each SSE event's transit from the simulator's write to the client's "
        "read; added = the route's quantile minus direct's"
    )
    widths = (5, 7, 6, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9)
    print(
        _cells(
            ["conc", "route", "reqs", "TTFT p50", "TTFT p99", "outs p50", "outs p99", "added50", "added99",
             "evt p50", "evt p99", "added50", "added99"],
            widths,
        )
    )  # fmt: skip
    for (conc, name), row in results.items():
        base = results[(conc, "direct")]
        cells = [str(conc), name, f"{row['requests']:.0f}"]
        cells += [f"{row[f'ttft_{q}_ms']:.2f}" for q in ("p50", "p99")]
        for key in ("outside", "chunk"):
            cells += [f"{row[f'{key}_{q}_ms']:.3f}" for q in ("p50", "p99")]
            for q in ("p50", "p99"):
                delta = row[f"{key}_{q}_ms"] - base[f"{key}_{q}_ms"]
                cells.append("" if name == "direct" else f"{delta:+.3f}")
        print(_cells(cells, widths))
    print("(milliseconds)\n")
    cpu_widths = (5, 7, 9, 6, 9, 9, 9)
    print(_cells(["conc", "route", "chunks/s", "errors", "sim CPU", "proxy CPU", "loadgen"], cpu_widths))
    for (conc, name), row in results.items():
        cells = [str(conc), name, f"{row['chunks_per_s']:.0f}", f"{row['errors']:.0f}"]
        cells += [
            f"{row[f'{proc}_cpu_share']:.0%}" if f"{proc}_cpu_share" in row else ""
            for proc in ("sim", "proxy", "loadgen")
        ]
        print(_cells(cells, cpu_widths))
    print("(CPU: share of one core over the route's wall time, warm-up included)\n")
    # the gate's verdict (its route comes first after direct), then the reference routes' for comparison
    for name in dict.fromkeys(name for _, name in results if name != "direct"):
        for conc in sorted({conc for conc, _ in results}):
            row, base = results[(conc, name)], results[(conc, "direct")]
            worst = {
                q: max(row[f"{key}_{q}_ms"] - base[f"{key}_{q}_ms"] for key in ("outside", "chunk"))
                for q in ("p50", "p99")
            }
            checks = (
                (f"added p50 {worst['p50']:+.3f} ms <= 1 ms", worst["p50"] <= 1.0),
                (f"added p99 {worst['p99']:+.3f} ms <= 5 ms", worst["p99"] <= 5.0),
                (f"{row['chunks_per_s']:,.0f} chunks/s >= 20,000", row["chunks_per_s"] >= 20_000),
            )
            verdicts = [f"{check}: {'yes' if ok else 'NO'}" for check, ok in checks]
            print(f"{name} at {conc} streams (worse of outside and event): " + "; ".join(verdicts))


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
        "--sim-event-loop",
        choices=eventloop.CHOICES,
        default="auto",
        help="the simulator's event loop (auto: uvloop if installed, as vLLM's API server runs)",
    )
    parser.add_argument(
        "--event-loop",
        choices=eventloop.CHOICES,
        default="auto",
        help="the gate's agent.event_loop (auto: uvloop if installed, as `servepilot run` and `gate` do)",
    )
    parser.add_argument(
        "--gate-python",
        default=sys.executable,
        help="the interpreter that runs the gate (default: this one), to compare Python versions",
    )
    parser.add_argument(
        "--pipe",
        action="store_true",
        help="also a TCP byte pipe on uvloop (bench/pipe_floor.py): the floor under any Python proxy",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="each proxy (gate, the floors, nginx) on the last CPU, the simulator and this load "
        "generator on the others: the system under test apart from what drives it (default: every "
        "process on every CPU)",
    )
    parser.add_argument(
        "--access-log", action="store_true", help="the gate writes its access log (gate.access_log) to a file"
    )
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) < 2:
        parser.error("--pin needs at least 2 CPUs")
    proxy_cpus, other_cpus = ({cpus[-1]}, set(cpus[:-1])) if args.pin else (set(cpus), set(cpus))
    args.proxy_cpus = proxy_cpus
    os.sched_setaffinity(0, other_cpus)  # this process: the load generator

    def on(cpus_: set[int]) -> Any:
        return lambda: os.sched_setaffinity(0, cpus_)

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen[bytes]] = []
    tmp = Path(tempfile.mkdtemp(prefix="servepilot-bench-gate-"))
    try:
        sim_port, gate_port, nginx_port = free_port(), free_port(), free_port()
        sim = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "sim", "--port", str(sim_port), "--speed", str(args.speed),
             "--max-num-seqs", "512", "--stamp-chunks", "--event-loop", args.sim_event_loop],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, preexec_fn=on(other_cpus),
        )  # fmt: skip
        procs.append(sim)
        # Relay only: no line rate limit (the default, 1000/min, would refuse most of the load) and an
        # in-flight limit above the concurrency, so every request goes straight upstream.
        access_log = f"  access_log: {tmp / 'access.jsonl'}\n" if args.access_log else ""
        (tmp / "gate.yaml").write_text(
            f"agent:\n  event_loop: {args.event_loop}\n"
            "gate:\n  default_requests_per_min: 10000000\n  max_in_flight: 4096\n" + access_log
        )
        gate = subprocess.Popen(
            [args.gate_python, "-m", "agent.commands.gate", "--config", str(tmp / "gate.yaml"),
             "--upstream", f"http://127.0.0.1:{sim_port}", "--port", str(gate_port), "--no-metrics"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, preexec_fn=on(proxy_cpus),
        )  # fmt: skip
        procs.append(gate)
        routes = {"direct": f"http://127.0.0.1:{sim_port}", "gate": f"http://127.0.0.1:{gate_port}"}
        proxies = {"gate": gate.pid}
        # the floors: the least an aiohttp proxy does, and (--pipe) the least any Python proxy does
        for name, script in (("aiohttp", "aiohttp_floor.py"), ("pipe", "pipe_floor.py")):
            if name == "pipe" and not args.pipe:
                continue
            port = free_port()
            procs.append(
                subprocess.Popen(
                    [args.gate_python, str(ROOT / "bench" / script), routes["direct"], str(port)],
                    cwd=ROOT, env=env, stdout=subprocess.DEVNULL, preexec_fn=on(proxy_cpus),
                )
            )  # fmt: skip
            proxies[name] = procs[-1].pid
            routes[name] = f"http://127.0.0.1:{port}"
        nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
        if nginx:
            (tmp / "nginx.conf").write_text(NGINX_CONF.format(tmp=tmp, upstream=sim_port, port=nginx_port))
            procs.append(
                subprocess.Popen(
                    [nginx, "-c", str(tmp / "nginx.conf"), "-p", str(tmp)], cwd=tmp, preexec_fn=on(proxy_cpus)
                )
            )
            proxies["nginx"] = procs[-1].pid
            routes["nginx"] = f"http://127.0.0.1:{nginx_port}"
        else:
            print("nginx not found (apt-get install -y nginx): skipping its rows", file=sys.stderr)
        for url in routes.values():
            wait_http(url + "/v1/models")
        with urllib.request.urlopen(routes["direct"] + "/v1/models", timeout=5) as resp:
            model = json.load(resp)["data"][0]["id"]
        results: dict[tuple[int, str], dict[str, float]] = {}
        names = list(routes)
        run_loop = eventloop.runner("auto")  # uvloop where installed: the load generator costs less CPU
        for conc in args.concurrency:
            slots: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            for round_ in range(args.rounds):
                # interleaved, each round in a rotated order: drift (the simulator's state, the other
                # processes on the cores) lands on every route alike instead of on whichever ran last
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    proxy = proxies.get(name)
                    before = (cpu_seconds(sim.pid), proc_cpu_seconds(proxy) if proxy else 0.0)
                    own0, wall0 = time.process_time(), time.monotonic()
                    slot = run_loop(
                        one_route(routes[name], model, conc, args.duration, args.warmup, args.max_tokens)
                    )
                    slot["wall_s"] = time.monotonic() - wall0
                    slot["cpu_s"] = {
                        "sim": cpu_seconds(sim.pid) - before[0],
                        "loadgen": time.process_time() - own0,
                    }
                    if proxy:
                        slot["cpu_s"]["proxy"] = proc_cpu_seconds(proxy) - before[1]
                    slots[name].append(slot)
            for name in names:
                results[(conc, name)] = summarise(slots[name])
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
