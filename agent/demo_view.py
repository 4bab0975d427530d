"""The demo's live terminal view (rich): load, engine, GPU, allocator and findings, from one AgentState.

Pure rendering: it reads the state the loop published, the load generator's counters and (with the gate
on) the actuation mode and the latest audit entries, nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from agent.loadgen import LoadStats
from agent.state import AgentState
from detectors.base import Finding, Severity
from detectors.snapshot import SourceStatus

_GIB = 1024**3


def finding_counts(findings: Sequence[Finding]) -> str:
    """``16 (16 info)``, ``3 (1 critical, 2 info)`` or ``0``: how many, and how bad."""
    if not findings:
        return "0"
    by = [(severity, sum(f.severity == severity for f in findings)) for severity in reversed(Severity)]
    return f"{len(findings)} (" + ", ".join(f"{n} {severity.value}" for severity, n in by if n) + ")"


def _fmt(value: float | None, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
    if value is None:
        return "—"
    return f"{value * scale:.{digits}f}{unit}"


def _pair(
    get: Callable[[str], float | None], a: str, b: str, unit: str = "", scale: float = 1.0, digits: int = 1
) -> str:
    """Two related values as "a / b" (e.g. p50 / p99)."""
    return f"{_fmt(get(a), unit, scale, digits)} / {_fmt(get(b), unit, scale, digits)}"


@dataclass(frozen=True)
class Control:
    """The acting side, for ``--mode advise|act``: the mode and the newest audit entries (newest first)."""

    mode: str
    actions: Sequence[dict[str, Any]] = ()


def _control_table(control: Control, get: Callable[[str], float | None]) -> Table:
    table = Table(title=f"control (mode {control.mode}; /api/actions lists every decision)", box=None)
    for column in ("time", "knob", "from -> to", "result", "policy", "reason"):
        table.add_column(column)
    table.caption = (
        f"gate: limit {_fmt(get('gate.limit'), digits=0)} (reserved for high priority "
        f"{_fmt(get('gate.reserved'), digits=0)}), in flight {_fmt(get('gate.in_flight'), digits=0)}, "
        f"queued {_fmt(get('gate.queue_depth'), digits=0)}"
    )
    for action in control.actions:
        result = str(action.get("result", ""))
        table.add_row(
            time.strftime("%H:%M:%S", time.localtime(float(action.get("time", 0.0)))),
            str(action.get("knob", "")),
            f"{action.get('from')} -> {action.get('to')}",
            Text(result, style="green" if result == "ok" else "yellow"),
            str(action.get("policy", "")),
            str(action.get("reason", ""))[:60],
        )
    if not control.actions:
        table.add_row(
            "—", "", "", "", "", "no decision yet: the limit has not bound, or latency is on target"
        )
    return table


def _gpu_indices(state: AgentState) -> list[int]:
    snap = state.snapshot
    if snap is None:
        return []
    found = {
        int(k.split(".")[1][3:])
        for k in snap.values
        if k.startswith("nvml.gpu") and k.split(".")[1][3:].isdigit()
    }
    return sorted(found)


def render(
    state: AgentState, load: LoadStats, elapsed_s: float, url: str, control: Control | None = None
) -> RenderableType:
    snap = state.snapshot
    get = snap.get if snap is not None else (lambda _name: None)

    header = Text.assemble(
        ("servepilot demo", "bold cyan"),
        f"  {elapsed_s:6.0f} s   agent {url}/metrics   ticks {state.stats.ticks}   ",
        ("Ctrl-C to stop", "dim"),
    )

    sources = Text()
    for name, reading in sorted(snap.readings.items()) if snap else ():
        style = {SourceStatus.OK: "green", SourceStatus.NO_DATA: "yellow", SourceStatus.ERROR: "red"}[
            reading.status
        ]
        sources.append(f"{name}: {reading.status.value}", style=style)
        if reading.error:
            sources.append(f" ({reading.error[:60]})", style="dim")
        sources.append("   ")

    top = Table.grid(padding=(0, 3))
    load_t = Table(title="load (client)", show_header=False, box=None)
    load_t.add_row("sent / ok / shed / failed", f"{load.sent} / {load.ok} / {load.shed} / {load.failed}")
    load_t.add_row("in flight", str(load.in_flight))
    load_t.add_row(
        "TTFT p50 / p99",
        f"{_fmt(load.ttft_quantile(0.5), ' s', digits=3)} / {_fmt(load.ttft_quantile(0.99), ' s', digits=3)}",
    )
    load_t.add_row("tokens streamed", str(load.tokens))
    for name, stats in load.classes.items():  # a priority mix (the gate on): each class apart
        load_t.add_row(
            f"  {name}: TTFT p99 / shed",
            f"{_fmt(stats.ttft_quantile(0.99), ' s', digits=3)} / {stats.shed} of {stats.sent}",
        )

    eng = Table(title="engine (/metrics)", show_header=False, box=None)
    eng.add_row(
        "running / waiting",
        _pair(get, "engine.requests_running", "engine.requests_waiting", digits=0),
    )
    eng.add_row("KV cache used", _fmt(get("engine.kv_cache_usage_ratio"), " %", 100))
    eng.add_row(
        "gen / prompt tok/s",
        _pair(get, "engine.generation_tokens_per_second", "engine.prompt_tokens_per_second", digits=0),
    )
    eng.add_row(
        "TTFT p50 / p99",
        _pair(get, "engine.ttft_seconds.p50", "engine.ttft_seconds.p99", " s", digits=3),
    )
    eng.add_row(
        "ITL p50 / p99",
        _pair(get, "engine.itl_seconds.p50", "engine.itl_seconds.p99", " ms", 1000),
    )
    eng.add_row("preemptions/s", _fmt(get("engine.preemptions_per_second"), digits=2))
    if get("engine.spec_drafts_per_second") is not None:  # the engine drafts (--spec-tokens)
        eng.add_row(
            "drafts accepted / tokens per step",
            _pair(get, "engine.spec_acceptance_ratio", "engine.decode_tokens_per_step", digits=2),
        )

    alloc = Table(title="allocator (probe)", show_header=False, box=None)
    alloc.add_row("reserved", _fmt(get("probe.reserved_bytes"), " GiB", 1 / _GIB, 2))
    alloc.add_row("allocated", _fmt(get("probe.allocated_bytes"), " GiB", 1 / _GIB, 2))
    alloc.add_row("fragmentation", _fmt(get("probe.fragmentation_ratio"), " %", 100))
    top.add_row(load_t, eng, alloc)

    gpus = Table(title="GPU (NVML, 100 ms samples aggregated per tick)", box=None)
    for column in ("gpu", "util mean/max", "mem bw", "SM clock", "temp", "power", "memory", "throttle"):
        gpus.add_column(column)
    for i in _gpu_indices(state):
        p = f"nvml.gpu{i}."
        gpus.add_row(
            str(i),
            _pair(get, p + "utilization_ratio.mean", p + "utilization_ratio.max", "%", 100, 0),
            _fmt(get(p + "memory_bandwidth_utilization_ratio.mean"), "%", 100, 0),
            _fmt(get(p + "sm_clock_hz.mean"), " MHz", 1e-6, 0),
            _fmt(get(p + "temperature_celsius.last"), " °C", digits=0),
            _pair(get, p + "power_watts.mean", p + "power_limit_watts", " W", digits=0),
            _pair(get, p + "memory_used_bytes", p + "memory_total_bytes", "", 1 / _GIB, 1),
            _fmt(get(p + "throttle_reasons"), digits=0),
        )

    findings = Table(title=f"findings: {finding_counts(state.findings)}", box=None)
    for column in ("severity", "detector", "signal", "score", "summary"):
        findings.add_column(column)
    # the worst first: sixteen info findings of an overload, each scored 1, must not hide a warning
    for f in sorted(state.findings, key=lambda f: (-f.severity.rank, -f.score))[:8]:
        colour = {"critical": "red", "warning": "yellow"}.get(f.severity.value, "white")
        findings.add_row(
            Text(f.severity.value, style=colour), f.detector, f.signal, f"{f.score:.2f}", f.summary[:70]
        )
    if not state.findings:
        findings.add_row("—", "", "", "", "nothing unusual")

    if control is None:
        return Group(header, sources, top, gpus, findings)
    return Group(header, sources, top, gpus, _control_table(control, get), findings)
