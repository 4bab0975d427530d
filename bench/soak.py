"""Soak: 24 hours of virtual time through the full agent brain, printing memory, open files and tasks.

What runs: the replay driver (:class:`agent.replay.driver.Replay`) plays a 24-hour diurnal workload on the
calibrated simulator core; every tick's snapshot goes through the agent's own parts, exactly as in the
live sidecar: the :class:`~agent.store.Store` at production size, every default detector and the ``auto``
policy set through :class:`~agent.replay.brain.Brain` (``Loop.think`` + the arbiter), the
:class:`~agent.exporter.Exporter` (rendered to text each sampled minute, as a scrape would), the webhook
dispatcher's alert tracking into its SQLite outbox, and the audit log (JSONL, rotating) for every decision.

What is measured, once per virtual hour: resident memory (``VmRSS``), open file descriptors, and asyncio
tasks of the loop hosting the run. The verdict compares the last RSS with the RSS at the end of warm-up
(detectors fill their windows, the store fills its rings, the allocator settles): growth under 5% passes.
Warm-up is 7 hours: the multivariate detector learns a row every 10 s into a window of 2,048, full after
5.7 hours (RSS climbs ~9 MiB until then, then stays within 1 MiB for the next day).
The replay's own per-tick record (its timeline, kept for reports) is harness, not agent, and is trimmed.
Also, over the whole run, the findings the detectors raised, per detector and severity: the day has no
fault, so each is a false alarm; warning and critical ones are what the webhooks would have sent.

    .venv/bin/python bench/soak.py                 # 24 h, ~1.5 req/s mean (prints a table and a verdict)
    .venv/bin/python bench/soak.py --hours 2 --warmup-hours 0.5 --json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.assembly import build_detectors
from agent.audit import Action, AuditLog
from agent.config import AuditConfig, EngineConfig, WebhookConfig
from agent.exporter import Exporter
from agent.replay.brain import Brain
from agent.replay.driver import Replay
from agent.replay.runner import vllm_defaults
from agent.replay.slo import Slo
from agent.replay.workload import Workload
from agent.state import AgentState
from agent.store import Store
from agent.webhooks.dispatcher import WebhookDispatcher
from agent.webhooks.sinks import AlertmanagerSink
from detectors.snapshot import Snapshot
from policies.arbiter import Decision
from policies.registry import build_set, default_arbiter
from simulator.engine import make_core

GROWTH_LIMIT = 0.05


def rss_bytes() -> int:
    """Resident set size from /proc (Linux); what the kubelet's memory limit counts."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def diurnal_workload(hours: float, mean_rps: float, seed: int) -> Workload:
    """Poisson arrivals whose rate follows a day (trough at 04:00, peak at 16:00), lognormal lengths."""
    rng = np.random.default_rng(seed)
    minutes = int(hours * 60)
    t = np.arange(minutes) / 60.0
    rate = mean_rps * (1.0 + 0.6 * np.sin(2 * np.pi * (t - 10.0) / 24.0))
    counts = rng.poisson(rate * 60.0)
    arrivals = np.sort(np.repeat(np.arange(minutes) * 60.0, counts) + rng.uniform(0, 60.0, counts.sum()))
    n = arrivals.size
    prompts = np.clip(rng.lognormal(6.0, 0.8, n), 16, 3500).astype(np.int64)
    outputs = np.clip(rng.lognormal(4.8, 0.7, n), 8, 512).astype(np.int64)
    return Workload("diurnal", arrivals, prompts, outputs)


@dataclass
class Sample:
    hour: float
    wall_s: float
    rss_mib: float
    open_files: int
    tasks: int
    series: int
    findings: int


class Agent:
    """The agent's stateful parts around the brain, fed one snapshot per tick."""

    def __init__(self, workdir: Path, brain: Brain) -> None:
        self.brain = brain
        self.store = Store(3600, 4096)
        self.exporter = Exporter()
        self.audit = AuditLog(
            AuditConfig(path=str(workdir / "audit.jsonl"), max_bytes=1 << 20), CollectorRegistry()
        )
        cfg = WebhookConfig(enabled=True, queue_path=str(workdir / "outbox.sqlite"), max_pending=1000)
        sink = AlertmanagerSink("http://127.0.0.1:9")  # never delivered: the outbox must stay bounded
        self.webhook_registry = CollectorRegistry()
        self.webhooks = WebhookDispatcher(cfg, self.webhook_registry, sinks=[sink], clock=time.time)
        self.audited_count = 0
        self.ticks = 0
        self.findings = 0
        #: per (detector, signal), when its standing finding began; a new ``since`` is a new finding
        self.since: dict[tuple[str, str], float] = {}
        #: findings raised, per (detector, severity): on this fault-free day, every one is a false alarm
        self.raised: Counter[tuple[str, str]] = Counter()

    def on_tick(self, snapshot: Snapshot) -> None:
        self.store.append(snapshot)
        findings, proposals = self.brain.loop.think(snapshot)
        self.ticks += 1
        self.findings = len(findings)
        for finding in findings:
            key = (finding.detector, finding.signal)
            if self.since.get(key) != finding.since:
                self.since[key] = finding.since
                self.raised[(finding.detector, finding.severity.value)] += 1
        state = AgentState(snapshot=snapshot, findings=findings, proposals=proposals)
        self.exporter.publish(state)
        self.webhooks.observe(state)
        if self.ticks % 60 == 0:
            generate_latest(self.exporter.registry)  # a scrape a minute

    def audited(self, decisions: list[Decision]) -> None:
        for d in decisions:
            self.audit.record(Action(d.at, d.knob, d.previous, d.value, d.reason, d.policy, "act", "ok"))
            self.audited_count += 1


def soak(
    hours: float, warmup_hours: float, mean_rps: float, seed: int, gpu: str, model: str
) -> dict[str, Any]:
    batch, tokens = vllm_defaults(gpu)
    core = make_core(gpu, model, max_num_seqs=batch, max_num_batched_tokens=tokens)
    policies = build_set("auto", ttft_slo_s=10.0, itl_slo_s=0.1, initial_batch=float(batch),
                         batch_bounds=(8.0, float(max(512, batch))))  # fmt: skip
    slo = Slo(10.0, 0.1)
    detectors = build_detectors(slo_s={"ttft": slo.ttft_s, "itl": slo.itl_s})
    brain = Brain(policies, default_arbiter(), detectors=detectors)
    samples: list[Sample] = []
    started = time.perf_counter()
    workload = diurnal_workload(hours, mean_rps, seed)
    agent_stats: dict[str, int] = {}
    findings: Counter[tuple[str, str]] = Counter()

    async def host() -> None:
        with tempfile.TemporaryDirectory(prefix="servepilot-soak-") as workdir:
            agent = Agent(Path(workdir), brain)
            replay: Replay

            def on_tick(snapshot: Snapshot) -> None:
                agent.on_tick(snapshot)
                if agent.ticks % 600 == 0:  # trim the harness's own records (not the agent's)
                    agent.audited(replay.actions)
                    del replay.timeline[:], replay.actions[:]
                if agent.ticks % 3600 == 0:
                    gc.collect()
                    samples.append(Sample(snapshot.now / 3600.0, time.perf_counter() - started,
                                          rss_bytes() / 2**20, open_files(), len(asyncio.all_tasks()),
                                          len(agent.store), agent.findings))  # fmt: skip
                    s = samples[-1]
                    print(f"{s.hour:6.1f} h  wall {s.wall_s:7.1f} s  rss {s.rss_mib:7.1f} MiB  "
                          f"fds {s.open_files:3d}  tasks {s.tasks}  series {s.series}",
                          flush=True)  # fmt: skip

            # the engine's quantiles over the live sidecar's window (engine.quantile_window_s), so the
            # detectors see the tails they would see live
            window_s = EngineConfig().quantile_window_s
            replay = Replay(core, workload, slo, controller=brain, on_tick=on_tick, window_s=window_s)
            replay.run()
            agent.audited(replay.actions)
            evicted = agent.webhook_registry.get_sample_value(
                "servepilot_webhook_deliveries_total", {"sink": "alertmanager", "outcome": "evicted"}
            )
            agent_stats["evicted"] = int(evicted or 0)
            agent_stats["audited"] = agent.audited_count
            findings.update(agent.raised)
            agent.audit.close()
            await agent.webhooks.stop()
            agent.webhooks.outbox.close()

    asyncio.run(host())
    warm = [s for s in samples if s.hour >= warmup_hours]
    if len(warm) < 2:
        raise SystemExit("soak too short for a verdict: need two samples after warm-up")
    base, last = warm[0], warm[-1]
    growth = (last.rss_mib - base.rss_mib) / base.rss_mib
    return {
        "virtual_hours": hours,
        "requests": len(workload),
        "wall_s": round(time.perf_counter() - started, 1),
        "speedup": round(hours * 3600 / (time.perf_counter() - started)),
        "rss_after_warmup_mib": round(base.rss_mib, 1),
        "rss_end_mib": round(last.rss_mib, 1),
        "rss_peak_mib": round(max(s.rss_mib for s in samples), 1),
        "rss_growth_after_warmup": round(growth, 4),
        "open_files_after_warmup": base.open_files,
        "open_files_end": last.open_files,
        "tasks_after_warmup": base.tasks,
        "tasks_end": last.tasks,
        "alert_messages_evicted": agent_stats["evicted"],
        "audit_records": agent_stats["audited"],
        # a fault-free day: every finding is a false alarm; info findings stay off the webhooks by default
        "findings_raised": {f"{d}/{sev}": n for (d, sev), n in sorted(findings.items())},
        "passed": growth < GROWTH_LIMIT and last.open_files <= base.open_files and last.tasks <= base.tasks,
        "samples": [s.__dict__ for s in samples],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0, help="virtual hours to run")
    parser.add_argument("--warmup-hours", type=float, default=7.0, help="hours before the RSS baseline")
    parser.add_argument("--rate", type=float, default=1.5, help="mean requests per second")
    parser.add_argument("--gpu", default="a100-80g")
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    # the outbox's "full: dropped oldest" warnings are expected here (no receiver) and counted in its metric
    logging.getLogger("agent.webhooks").setLevel(logging.ERROR)
    result = soak(args.hours, args.warmup_hours, args.rate, args.seed, args.gpu, args.model)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    else:
        print(f"\n{result['requests']} requests in {args.hours:g} virtual h, {result['wall_s']} s wall "
              f"({result['speedup']}x); RSS {result['rss_after_warmup_mib']} -> {result['rss_end_mib']} MiB "
              f"after warm-up ({100 * result['rss_growth_after_warmup']:+.2f}%, limit +5%); "
              f"open files {result['open_files_after_warmup']} -> {result['open_files_end']}; "
              f"tasks {result['tasks_after_warmup']} -> {result['tasks_end']}; "
              f"{'PASS' if result['passed'] else 'FAIL'}")  # fmt: skip
        raised = ", ".join(f"{name} {n}" for name, n in result["findings_raised"].items()) or "none"
        print(f"findings raised on this fault-free day (detector/severity): {raised}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
