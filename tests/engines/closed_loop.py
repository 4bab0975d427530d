"""The batch policy against a real engine: a replayed trace through the gate, static limits vs ``auto``.

* :func:`scaled_trace` takes the bundled Azure LLM 2023 conversation trace (real arrival gaps and token
  lengths) and scales it to the engine under test: token lengths into the tiny model's range, arrivals
  compressed so the offered load is ``load`` times the measured capacity.
* :func:`replay` sends it through a :class:`~agent.gate.proxy.Gate` (open loop: each request at its
  arrival time) and measures each request client-side. With ``policy`` set it runs the control loop
  once per ``tick_s``: engine ``/metrics`` + gate -> :class:`Snapshot` -> ``policy.decide`` ->
  ``gate.set_limit``, the live sidecar's path without its process around it.
* Goodput is output tokens per second of the requests that met their SLO deadline, ``e2e <= ttft_slo +
  tokens * itl_slo`` (vLLM's API server groups a fast tiny model's tokens into few SSE chunks, so a
  client-side per-chunk ITL would measure the chunking, not the engine), counted for the requests that
  arrive inside the measured window.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry

from agent.collectors.engine_metrics import EngineMetricsCollector
from agent.config import EngineConfig, GateConfig
from agent.gate.collector import GateCollector
from agent.gate.proxy import Gate
from agent.traces import read_requests
from detectors.snapshot import Reading, Snapshot
from policies import knobs
from policies.base import Policy
from tests.engines.client import completion, stream


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float


@dataclass
class RunResult:
    name: str
    goodput_tps: float
    throughput_tps: float
    attainment: float
    requests: int
    limits: list[int] = field(default_factory=list)
    ticks: list[str] = field(default_factory=list)
    """Per control tick (auto only): what the policy saw and did, so a failed run says why it held."""
    engine_itl_s: float | None = None
    """The engine's own mean inter-token latency over the whole run (its ITL histogram): how fast the
    shared machine let it run, so two runs of one setting that differ can be told apart by it."""

    def row(self) -> str:
        itl = "-" if self.engine_itl_s is None else f"{self.engine_itl_s * 1000:.1f}"
        return (
            f"| {self.name} | {self.goodput_tps:.0f} | {self.throughput_tps:.0f} | {self.attainment:.0%} | "
            f"{self.requests} | {self.limits[-1] if self.limits else '-'} | {itl} |"
        )


def scaled_trace(
    capacity_tps: float, load: float, seconds: float, max_prompt: int = 120, max_output: int = 48
) -> np.ndarray:
    """Rows of (arrival_s, prompt_tokens, output_tokens) offering ``load`` x ``capacity_tps`` tokens/s
    (call it with ``capacity_tps=1, load=1`` for the shape alone, then measure :func:`capacity`)."""
    with resources.as_file(resources.files("agent.data").joinpath("azure_llm_2023_conv.csv.gz")) as path:
        rows = read_requests(path)
    prompt = np.clip(rows[:, 1] * max_prompt / np.percentile(rows[:, 1], 95), 8, max_prompt)
    output = np.clip(rows[:, 2] * max_output / np.percentile(rows[:, 2], 95), 8, max_output)
    arrivals = rows[:, 0] - rows[0, 0]
    rate = load * capacity_tps / float(np.mean(output))  # requests per second wanted
    arrivals = arrivals * (len(rows) / max(arrivals[-1], 1e-9)) / rate
    keep = arrivals < seconds
    return np.column_stack([arrivals[keep], np.round(prompt[keep]), np.round(output[keep])])


@dataclass
class _Done:
    arrival: float
    output: int
    status: int
    ttft_s: float | None
    e2e_s: float


async def _one(
    session: aiohttp.ClientSession, url: str, row: Sequence[float], start: float, out: list[_Done]
) -> None:
    arrival, prompt_tokens, output_tokens = float(row[0]), int(row[1]), int(row[2])
    await asyncio.sleep(max(0.0, start + arrival - time.monotonic()))
    prompt = " ".join(["token"] * max(1, prompt_tokens - 1))
    body = completion(prompt, output_tokens, seed=int(arrival * 1000) % 65536)
    try:
        result = await stream(session, url, body)
        out.append(_Done(arrival, output_tokens, result.status, result.ttft_s, result.e2e_s))
    except (aiohttp.ClientError, TimeoutError):
        out.append(_Done(arrival, output_tokens, 599, None, 0.0))
    except asyncio.CancelledError:  # still unanswered when the run's drain time ran out
        out.append(_Done(arrival, output_tokens, 0, None, 0.0))
        raise


async def capacity(engine_url: str, shape: np.ndarray, concurrency: int = 8, requests: int = 48) -> float:
    """Output tokens/s the engine sustains on requests shaped like ``shape``'s rows, closed loop at
    ``concurrency`` (prefill-heavy trace requests sustain far less than a burst of long outputs)."""
    rows = [shape[i % len(shape)] for i in range(requests)]
    done: list[_Done] = []
    queue: asyncio.Queue[Sequence[float]] = asyncio.Queue()
    for row in rows:
        queue.put_nowait((0.0, row[1], row[2]))

    async def worker(session: aiohttp.ClientSession, start: float) -> None:
        while not queue.empty():
            await _one(session, engine_url, queue.get_nowait(), start, done)

    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        await asyncio.gather(*(worker(session, start) for _ in range(concurrency)))
        elapsed = time.monotonic() - start
    return sum(d.output for d in done if d.status == 200) / elapsed


def met_slo(d: _Done, slo: Slo) -> bool:
    """The request's deadline: ``e2e <= ttft_slo + tokens * itl_slo`` (independent of SSE chunking)."""
    return d.status == 200 and d.ttft_s is not None and d.e2e_s <= slo.ttft_s + d.output * slo.itl_s


def score(done: Sequence[_Done], slo: Slo, window: tuple[float, float], name: str) -> RunResult:
    span = window[1] - window[0]
    inside = [d for d in done if window[0] <= d.arrival < window[1]]
    served = [d for d in inside if d.status == 200 and d.ttft_s is not None]
    good = [d for d in served if met_slo(d, slo)]
    return RunResult(
        name,
        sum(d.output for d in good) / span,
        sum(d.output for d in served) / span,
        len(good) / max(1, len(served)),
        len(inside),
    )


def _policy_snapshot(readings: Sequence[Reading], now: float) -> Snapshot:
    """The tick's snapshot as the sidecar builds it (the policy adds the gate's queue to the engine's)."""
    return Snapshot.from_readings(now, {r.source: r for r in readings})


def _tick_line(now: float, snapshot: Snapshot, readings: Sequence[Reading], proposals: Sequence[Any]) -> str:
    """One control tick in a line: the batch policy's inputs, then its proposal or why it held."""

    def shown(key: str, scale: float = 1.0, unit: str = "") -> str:
        value = snapshot.get(key)
        return "-" if value is None else f"{value * scale:.3g}{unit}"

    failed = [f"{r.source}: {r.error}" for r in readings if r.error]
    inputs = (
        f"t={now:.0f}s running={shown(knobs.RUNNING)} engine_queue={shown(knobs.WAITING)} "
        f"gate_in_flight={shown(knobs.GATE_IN_FLIGHT)} gate_queue={shown(knobs.GATE_QUEUE)} "
        f"limit={shown(knobs.GATE_LIMIT)} "
        f"itl_mean={shown(knobs.ITL_MEAN, 1000, 'ms')} ttft_p99={shown(knobs.TTFT_P99, 1000, 'ms')} "
        f"kv={shown(knobs.KV_USAGE)} finished/s={shown(knobs.FINISHED)}"
    )
    action = "; ".join(f"-> {p.value} ({p.reason})" for p in proposals) or "hold"
    return f"{inputs} {action}" + (f" [{'; '.join(failed)}]" if failed else "")


async def replay(
    engine_url: str,
    trace: np.ndarray,
    slo: Slo,
    *,
    limit: int,
    window: tuple[float, float],
    policy: Policy | None = None,
    tick_s: float = 1.0,
    drain_s: float = 10.0,
    name: str = "",
) -> RunResult:
    """One run of ``trace`` through a gate starting at ``limit``; ``policy`` (if any) drives the limit.

    Requests still unanswered ``drain_s`` after the last arrival are cancelled and count as missed, so a
    limit far too low costs its goodput, not the test's time.
    """
    gate = Gate(
        GateConfig(
            enabled=True,
            upstreams={"primary": engine_url},
            max_in_flight=limit,
            high_reserved_ratio=0.0,
            max_queue_wait_s=120.0,
            stats_window_s=5.0,
        ),
        CollectorRegistry(),
    )
    port = await gate.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    metrics = EngineMetricsCollector(EngineConfig(url=engine_url, kind="vllm", quantile_window_s=5.0))
    whole = EngineMetricsCollector(EngineConfig(url=engine_url, kind="vllm", quantile_window_s=3600.0))
    sources = (metrics, GateCollector(gate))
    done: list[_Done] = []
    limits: list[int] = []
    ticks: list[str] = []
    state: Any = None
    try:
        await whole.collect(0.0)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            start = time.monotonic()
            load = asyncio.gather(*(_one(session, url, row, start, done) for row in trace))
            give_up = start + float(trace[-1, 0]) + drain_s
            while not load.done() and time.monotonic() < give_up:
                await asyncio.wait({load}, timeout=tick_s)
                now = time.monotonic() - start
                if policy is not None:
                    readings = await asyncio.gather(*(s.collect(now) for s in sources))
                    snapshot = _policy_snapshot(readings, now)
                    state, proposals = policy.decide(snapshot, [], state, now)
                    for proposal in proposals:
                        if proposal.knob == knobs.BATCH and isinstance(proposal.value, int | float):
                            gate.set_limit(int(proposal.value))
                    ticks.append(_tick_line(now, snapshot, readings, proposals))
                limits.append(gate.limit)
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
        engine_itl = (await whole.collect(time.monotonic() - start)).values.get("engine.itl_seconds.mean")
    finally:
        await whole.close()
        await metrics.close()
        await gate.stop()
    result = score(done, slo, window, name or (f"static {limit}" if policy is None else "auto"))
    result.limits = limits
    result.ticks = ticks
    result.engine_itl_s = engine_itl
    return result
