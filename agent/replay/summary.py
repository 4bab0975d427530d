"""The JSON summary of a replay (the contract in DESIGN.md section 4) and the text table it prints."""

from __future__ import annotations

from typing import Any

import numpy as np

from agent.replay.classes import CLASSES
from agent.replay.driver import ReplayRun


def _quantile(values: np.ndarray, q: float) -> float:
    finite = values[np.isfinite(values)]
    return float(np.quantile(finite, q)) if finite.size else 0.0


def summarise(run: ReplayRun, policy: str, *, with_actions: bool = True) -> dict[str, Any]:
    """``policy``, ``goodput_tps``, ``throughput_tps``, ``slo_attainment``, TTFT/ITL quantiles, energy per
    token and the action timeline. Rates divide by the trace's span (the same for every policy), so
    numbers of different policies on one trace compare directly."""
    w = run.workload
    span = max(w.duration_s, 1e-9)
    outputs = w.outputs.astype(np.float64)
    good = run.good
    served = run.done & ~run.error
    tokens = float(outputs[served].sum())
    good_tokens = float(outputs[good].sum())
    n = len(w)
    rejected = int(run.rejected.sum()) if run.rejected is not None else 0
    summary: dict[str, Any] = {
        "policy": policy,
        "requests": n,
        "goodput_tps": good_tokens / span,
        "throughput_tps": tokens / span,
        "slo_attainment": float(good.sum()) / n if n else 0.0,
        "slo": {"ttft_s": run.slo.ttft_s, "itl_s": run.slo.itl_s},
        "ttft_p50_s": _quantile(run.ttft[served], 0.5),
        "ttft_p95_s": _quantile(run.ttft[served], 0.95),
        "ttft_p99_s": _quantile(run.ttft[served], 0.99),
        "itl_p50_s": _quantile(run.tpot[served], 0.5),
        "itl_p95_s": _quantile(run.tpot[served], 0.95),
        "itl_p99_s": _quantile(run.tpot[served], 0.99),
        "token_gap_p99_s": run.itl_p99_s,
        "energy_j": run.energy_j,
        "energy_j_per_token": run.energy_j / tokens if tokens else 0.0,
        "errors": int(run.error.sum()) - run.expired - rejected,
        "expired": run.expired,
        "preemptions": run.preemptions,
        "duration_s": span,
        "clipped_prompts": w.clipped,
    }
    if run.classes is not None:
        summary["rejected"] = rejected
        summary["classes"] = _per_class(run, span)
    if run.spec_decode is not None:
        summary["spec_decode"] = dict(run.spec_decode)
    if with_actions:
        summary["actions"] = [d.to_json() for d in run.actions]
    else:
        summary["actions_count"] = len(run.actions)
    return summary


def _per_class(run: ReplayRun, span: float) -> dict[str, dict[str, Any]]:
    """Per priority class: its requests, its targets, what it got, and what the gate turned away (503
    after its deadline, 429 from a full queue)."""
    assert run.classes is not None
    good, served = run.good, run.done & ~run.error
    outputs = run.workload.outputs.astype(np.float64)
    refused = run.refused if run.refused is not None else np.zeros_like(served)
    rejected = run.rejected if run.rejected is not None else np.zeros_like(served)
    rows: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(CLASSES):
        mine = run.classes == index
        n = int(mine.sum())
        if not n:
            continue
        target = run.targets[index]
        rows[name] = {
            "requests": n,
            "slo": {"ttft_s": target.ttft_s, "itl_s": target.itl_s},
            "goodput_tps": float(outputs[good & mine].sum()) / span,
            "slo_attainment": float((good & mine).sum()) / n,
            "ttft_p99_s": _quantile(run.ttft[served & mine], 0.99),
            "itl_p99_s": _quantile(run.tpot[served & mine], 0.99),
            "expired": int((refused & mine).sum()),
            "rejected": int((rejected & mine).sum()),
        }
    return rows


def class_table(summary: dict[str, Any]) -> str:
    """Per class lines under a summary that has classes (empty otherwise)."""
    classes = summary.get("classes")
    if not classes:
        return ""
    head = f"{'class':<8}{'requests':>9}{'TTFT tgt':>10}{'ITL tgt':>9}{'goodput':>10}{'SLO att':>9}"
    head += f"{'TTFT p99':>10}{'ITL p99':>9}{'expired':>9}{'429':>6}"
    lines = [f"{summary['policy']}, per class:", head]
    for name, r in classes.items():
        lines.append(
            f"{name:<8}{r['requests']:>9}{r['slo']['ttft_s']:>10.3g}{r['slo']['itl_s']:>9.3g}"
            f"{r['goodput_tps']:>10.1f}{r['slo_attainment']:>9.2%}{r['ttft_p99_s']:>10.3f}"
            f"{r['itl_p99_s']:>9.3f}{r['expired']:>9}{r['rejected']:>6}"
        )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table of summaries (one row each), for the terminal."""
    cols: list[tuple[str, str]] = [
        ("policy", "<14"),
        ("goodput", ">10"),
        ("thruput", ">10"),
        ("SLO att", ">9"),
    ]
    cols += [("TTFT p99", ">10"), ("ITL p99", ">9"), ("J/tok", ">8")]
    head = "".join(f"{name:{fmt}}" for name, fmt in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['policy']:<14}{r['goodput_tps']:>10.1f}{r['throughput_tps']:>10.1f}{r['slo_attainment']:>9.2%}"
            f"{r['ttft_p99_s']:>10.3f}{r['itl_p99_s']:>9.3f}{r['energy_j_per_token']:>8.3f}"
        )
    return "\n".join(lines)


def spec_line(summary: dict[str, Any]) -> str:
    """One line on what speculative decoding did in a summary's run (empty without it)."""
    spec = summary.get("spec_decode")
    if not spec:
        return ""
    return (
        f"speculative decoding: {spec['draft_tokens']:g} draft tokens at a cost of {spec['draft_cost']:g} "
        f"of a step each, {spec['acceptance']:.2f} of draft tokens accepted (each with p "
        f"{spec['acceptance_per_token']:g} after the one before), {spec['tokens_per_draft']:.2f} tokens "
        "per draft"
    )
