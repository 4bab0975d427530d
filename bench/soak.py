"""Soak: 24 hours of virtual time through the full agent brain, printing memory, open files and tasks.

What runs: the replay driver (:class:`agent.replay.driver.Replay`) plays a 24-hour diurnal workload on the
calibrated simulator core; every tick's snapshot goes through the agent's own parts, exactly as in the
live sidecar: the :class:`~agent.store.Store` at production size, every default detector and the ``auto``
policy set as the sidecar builds it beside the simulator (batch limit, token budget, breaker) through
:class:`~agent.replay.brain.Brain` (``Loop.think`` + the arbiter), the :class:`~agent.exporter.Exporter`
(rendered to text each sampled minute, as a scrape would), the webhook dispatcher's alert tracking into its
SQLite outbox, and the audit log (JSONL, rotating) for every decision.

What is measured, once per virtual hour: resident memory (``VmRSS``), open file descriptors, and asyncio
tasks of the loop hosting the run. The verdict compares the last RSS with the RSS at the end of warm-up
(detectors fill their windows, the store fills its rings, the allocator settles): growth under 5% passes,
with no more asyncio tasks and no descriptor leaked (:func:`leaked`: each one open at the end and not at
the end of warm-up is named; one per agent file, opened at its first write, is expected).
Warm-up is 7 hours: the multivariate detector learns a row every 10 s into a window of 2,048, full after
5.7 hours (RSS climbs ~9 MiB until then, then stays within 1 MiB for the next day).
The replay's own per-tick record (its timeline, kept for reports) is harness, not agent, and is trimmed.
Also, over the whole run, the findings the detectors raised, per detector and severity: the day has no
fault, so each is a false alarm; warning and critical ones are what the webhooks would have sent.

    .venv/bin/python bench/soak.py                 # 24 h, ~1.5 req/s mean (prints a table and a verdict)
    .venv/bin/python bench/soak.py --hours 2 --warmup-hours 0.5 --json
    .venv/bin/python bench/soak.py --week --hours 72   # the real Azure 2024 coding week's first 3 days
    .venv/bin/python bench/soak.py --week --hours 168 --no-token-budget   # as beside a released engine

``--week`` replays the Azure LLM 2024 coding week (10-s counts, from ``--traces``) instead of the synthetic
day, with the 2023 code trace's token lengths, at ``--rate-scale`` of its real rate: 0.1 by default, which
puts its busiest hour (11.7 req/s at 0.14) at 8.4 req/s, about the day-1 peak's load at 0.14, the busiest
at which the best static setting still meets the SLO (bench/goodput.py). A real week's traffic: bursts,
a weekend, the morning ramps, the peaks near what the engine serves within the SLO, and no fault.
``--findings FILE`` writes each raised finding as a JSON line as it comes (when, what, the evidence).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

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
from agent.replay.workload import Workload, load
from agent.state import AgentState
from agent.store import Store
from agent.tally import FindingTally
from agent.webhooks.dispatcher import WebhookDispatcher
from agent.webhooks.sinks import AlertmanagerSink
from detectors.base import Finding
from detectors.snapshot import Snapshot
from policies.arbiter import Decision
from policies.base import Proposal
from policies.registry import build_set, default_arbiter
from simulator.engine import make_core

GROWTH_LIMIT = 0.05
TRACES = Path("/work/shared/data/traces")
WEEK = "azure_llm_2024/azure2024_coding_counts_10s.csv"
WEEK_LENGTHS = "azure_llm_2023/AzureLLMInferenceTrace_code.csv"


def rss_bytes() -> int:
    """Resident set size from /proc (Linux); what the kubelet's memory limit counts."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def leaked(opened: list[str], workdir: str) -> list[str]:
    """Of the descriptors opened after warm-up and still open (``fd -> target``), those that are a leak.

    The agent opens some of its files at their first write (the audit log, at the first action, which on
    a quiet night can come hours in), and holds each open from then on: one descriptor per file of its
    working folder is expected. Anything else (a socket, a pipe, a second descriptor on the same file) is
    not."""
    targets = [name.split(" -> ", 1)[1] for name in opened]
    return [
        name
        for name, target in zip(opened, targets, strict=True)
        if not target.startswith(workdir + os.sep) or targets.count(target) > 1
    ]


def touch_arrays(harness: object) -> None:
    """Write every numpy array the harness holds, so its pages are resident from the start.

    The replay keeps a slot per request of the workload (arrival, done, error...), allocated zeroed; the
    kernel maps a zeroed page only when it is first written, so over a week (1.7 million requests) these
    arrays alone would add ~20 MiB of RSS as the replay reaches them, growth that is the harness's, not
    the agent's."""
    for value in vars(harness).values():
        if isinstance(value, np.ndarray):
            value[...] = value.copy()


def open_file_names() -> set[str]:
    """What each open descriptor points at (a file, a socket, a pipe), to name the one that leaked."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # closed since listdir (the listing's own descriptor)
            continue
    return names


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


def week_workload(traces: Path, hours: float, rate_scale: float, seed: int, max_model_len: int) -> Workload:
    """The first ``hours`` of the Azure 2024 coding week at ``rate_scale``, with code-trace lengths."""
    week = load(traces / WEEK, rate_scale=rate_scale, max_model_len=max_model_len,
                lengths=traces / WEEK_LENGTHS, seed=seed)  # fmt: skip
    return week.until(hours * 3600.0)


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

    def __init__(self, workdir: Path, brain: Brain, findings_log: IO[str] | None = None) -> None:
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
        self.now = 0.0
        self.findings = 0
        #: findings raised, per (detector, severity), as the agent counts them for
        #: ``servepilot_findings_raised_total``: on this fault-free day, every one is a false alarm
        self.tally = FindingTally()
        #: each raised finding as a JSON line (``--findings``), to see when and why; written as it comes,
        #: so the harness holds none of them in memory
        self.log = findings_log
        #: the harness's own per-tick work (trimming, samples), after the agent's
        self.after_tick: Callable[[Snapshot], None] | None = None

    def control(self, snapshot: Snapshot, actual: dict[str, float | str]) -> list[Decision]:
        """The replay's controller: the brain thinks once (detectors, policies, arbiter), then the agent's
        other parts take what it found, as the live loop's listeners do. Until 2026-12-05 the harness
        thought a second time for its findings, so every detector saw each tick twice and each policy
        decided twice per tick; the token budget controller's first decision set its dwell, and the one
        that counted never acted."""
        decisions = self.brain.control(snapshot, actual)
        self.on_tick(snapshot, self.brain.findings, self.brain.proposals)
        if self.after_tick is not None:
            self.after_tick(snapshot)
        return decisions

    def on_tick(
        self, snapshot: Snapshot, findings: tuple[Finding, ...], proposals: tuple[Proposal, ...]
    ) -> None:
        self.store.append(snapshot)
        self.ticks += 1
        self.now = snapshot.now
        self.findings = len(findings)
        for finding in self.tally.observe(findings):
            if self.log is not None:
                self.log.write(
                    json.dumps({"hour": round(snapshot.now / 3600.0, 3), **finding.to_json()}) + "\n"
                )
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
    hours: float,
    warmup_hours: float,
    mean_rps: float,
    seed: int,
    gpu: str,
    model: str,
    week: tuple[Path, float] | None = None,
    findings_log: IO[str] | None = None,
    token_budget: bool = True,
) -> dict[str, Any]:
    """``week``: (traces folder, rate scale) to replay the real week instead of the synthetic day;
    ``findings_log``: where to write each raised finding (a JSON line each); ``token_budget``: whether the
    engine's token budget is a knob (the simulator's is; a released vLLM or SGLang cannot change it)."""
    batch, tokens = vllm_defaults(gpu)
    core = make_core(gpu, model, max_num_seqs=batch, max_num_batched_tokens=tokens)
    policies = build_set("auto", ttft_slo_s=10.0, itl_slo_s=0.1, initial_batch=float(batch),
                         batch_bounds=(8.0, float(max(512, batch))),
                         initial_token_budget=float(tokens) if token_budget else None)  # fmt: skip
    slo = Slo(10.0, 0.1)
    # the engine's quantiles over the live sidecar's window (engine.quantile_window_s), so the detectors
    # see the tails they would see live, and the tail detector's queue window is the same
    window_s = EngineConfig().quantile_window_s
    detectors = build_detectors(slo_s={"ttft": slo.ttft_s, "itl": slo.itl_s}, windows_s=(window_s, window_s))
    brain = Brain(policies, default_arbiter(), detectors=detectors)
    samples: list[Sample] = []
    started = time.perf_counter()
    if week is None:
        workload = diurnal_workload(hours, mean_rps, seed)
    else:
        workload = week_workload(week[0], hours, week[1], seed, core.model.max_model_len)
    agent_stats: dict[str, Any] = {}
    findings: Counter[tuple[str, str]] = Counter()
    fd_names: list[set[str]] = []  # per sample, to name a descriptor that stayed open

    async def host() -> None:
        with tempfile.TemporaryDirectory(prefix="servepilot-soak-") as workdir:
            agent_stats["workdir"] = workdir
            agent = Agent(Path(workdir), brain, findings_log)
            replay: Replay

            def after_tick(snapshot: Snapshot) -> None:
                if agent.ticks % 600 == 0:  # trim the harness's own records (not the agent's)
                    agent.audited(replay.actions)
                    del replay.timeline[:], replay.actions[:]
                if agent.ticks % 3600 == 0:
                    sample(snapshot.now)

            def sample(now: float) -> None:
                gc.collect()
                samples.append(Sample(now / 3600.0, time.perf_counter() - started,
                                      rss_bytes() / 2**20, open_files(), len(asyncio.all_tasks()),
                                      len(agent.store), agent.findings))  # fmt: skip
                fd_names.append(open_file_names())
                s = samples[-1]
                print(f"{s.hour:6.1f} h  wall {s.wall_s:7.1f} s  rss {s.rss_mib:7.1f} MiB  "
                      f"fds {s.open_files:3d}  tasks {s.tasks}  series {s.series}",
                      flush=True)  # fmt: skip

            agent.after_tick = after_tick
            replay = Replay(core, workload, slo, controller=agent, window_s=window_s)
            touch_arrays(replay)
            replay.run()
            agent.audited(replay.actions)
            if samples and agent.now - samples[-1].hour * 3600.0 >= 60.0:  # the end, past the last sample
                sample(agent.now)
            evicted = agent.webhook_registry.get_sample_value(
                "servepilot_webhook_deliveries_total", {"sink": "alertmanager", "outcome": "evicted"}
            )
            agent_stats["evicted"] = int(evicted or 0)
            agent_stats["audited"] = agent.audited_count
            findings.update(agent.tally.raised)
            agent.audit.close()
            await agent.webhooks.stop()
            agent.webhooks.outbox.close()

    asyncio.run(host())
    warm = [i for i, s in enumerate(samples) if s.hour >= warmup_hours]
    if len(warm) < 2:
        raise SystemExit("soak too short for a verdict: need two samples after warm-up")
    base, last = samples[warm[0]], samples[warm[-1]]
    growth = (last.rss_mib - base.rss_mib) / base.rss_mib
    opened = sorted(fd_names[warm[-1]] - fd_names[warm[0]])
    fds_leaked = leaked(opened, agent_stats["workdir"])
    return {
        "workload": workload.name,
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
        "opened_after_warmup": opened,
        "fds_leaked": fds_leaked,
        "tasks_after_warmup": base.tasks,
        "tasks_end": last.tasks,
        "alert_messages_evicted": agent_stats["evicted"],
        "audit_records": agent_stats["audited"],
        # a fault-free day: every finding is a false alarm; info findings stay off the webhooks by default
        "findings_raised": {f"{d}/{sev}": n for (d, sev), n in sorted(findings.items())},
        "passed": growth < GROWTH_LIMIT and not fds_leaked and last.tasks <= base.tasks,
        "samples": [s.__dict__ for s in samples],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0, help="virtual hours to run")
    parser.add_argument("--warmup-hours", type=float, default=7.0, help="hours before the RSS baseline")
    parser.add_argument("--rate", type=float, default=1.5, help="mean requests per second (synthetic day)")
    parser.add_argument("--week", action="store_true", help="replay the Azure 2024 coding week instead")
    parser.add_argument("--rate-scale", type=float, default=0.1, help="the week's rate scale (--week)")
    parser.add_argument("--traces", type=Path, default=TRACES, help="folder of the traces (--week)")
    parser.add_argument(
        "--no-token-budget", action="store_true", help="no token budget knob, as with a released engine"
    )
    parser.add_argument("--gpu", default="a100-80g")
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--findings", type=Path, help="write each raised finding to this file (JSON lines)")
    args = parser.parse_args(argv)
    # the outbox's "full: dropped oldest" warnings are expected here (no receiver) and counted in its metric
    logging.getLogger("agent.webhooks").setLevel(logging.ERROR)
    week = (args.traces, args.rate_scale) if args.week else None
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(args.findings.open("w", encoding="utf-8")) if args.findings else None
        run = (args.hours, args.warmup_hours, args.rate, args.seed, args.gpu, args.model)
        result = soak(*run, week=week, findings_log=log, token_budget=not args.no_token_budget)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    else:
        print(f"\n{result['requests']} requests in {args.hours:g} virtual h, {result['wall_s']} s wall "
              f"({result['speedup']}x); RSS {result['rss_after_warmup_mib']} -> {result['rss_end_mib']} MiB "
              f"after warm-up ({100 * result['rss_growth_after_warmup']:+.2f}%, limit +5%); "
              f"open files {result['open_files_after_warmup']} -> {result['open_files_end']}; "
              f"tasks {result['tasks_after_warmup']} -> {result['tasks_end']}; "
              f"{'PASS' if result['passed'] else 'FAIL'}")  # fmt: skip
        for name in result["opened_after_warmup"]:
            why = "LEAKED" if name in result["fds_leaked"] else "an agent file, opened at its first write"
            print(f"open after warm-up, not before: {name} ({why})")
        raised = ", ".join(f"{name} {n}" for name, n in result["findings_raised"].items()) or "none"
        print(f"findings raised on this fault-free {'week' if args.week else 'day'} "
              f"(detector/severity): {raised}")  # fmt: skip
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
