"""``servepilot replay``: the simulator's engine core and servepilot's brain on a real trace, in virtual time.

Prints goodput (tokens/s of requests within the SLO), SLO attainment, TTFT and ITL quantiles, energy per
token and the action timeline; ``--sweep`` adds every static batch setting and the best one in hindsight;
``--json`` prints the DESIGN.md section 4 object; ``--report`` writes an HTML report.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent.commands.spec_flags import add_spec_flags, spec_config


def _targets(text: str, flag: str, shape: str) -> dict[str, float]:
    """``ttft=2,itl=0.1`` (seconds; ``ms`` suffix allowed) -> {"ttft": 2.0, "itl": 0.1}, either or both."""
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, raw = part.strip().partition("=")
        if not sep or key not in ("ttft", "itl"):
            raise argparse.ArgumentTypeError(f"{flag} must look like {shape}, got {text!r}")
        scale = 1e-3 if raw.endswith("ms") else 1.0
        try:
            value = float(raw.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {key} must be a number, got {raw!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} {key} must be > 0, got {raw!r}")
        values[key] = value
    return values


def parse_slo(text: str) -> tuple[float, float]:
    """``ttft=2,itl=0.1`` (seconds; ``ms`` suffix allowed) -> (ttft_s, itl_s)."""
    values = _targets(text, "--slo", "ttft=2,itl=0.1")
    if set(values) != {"ttft", "itl"}:
        raise argparse.ArgumentTypeError(f"--slo needs both ttft and itl, got {text!r}")
    return values["ttft"], values["itl"]


def parse_class_slo(text: str) -> tuple[str, float | None, float | None]:
    """``high:ttft=2,itl=50ms`` -> ("high", 2.0, 0.05); a target left out is the SLO's."""
    from agent.replay.classes import CLASSES

    shape = "high:ttft=2,itl=50ms"
    name, sep, rest = text.partition(":")
    if not sep or name not in CLASSES:
        raise argparse.ArgumentTypeError(
            f"--class-slo must look like {shape} (class high, normal or low), got {text!r}"
        )
    values = _targets(rest, "--class-slo", shape)
    return name, values.get("ttft"), values.get("itl")


def _priority_mix(text: str) -> tuple[tuple[str, float], ...]:
    from agent.commands.demo import parse_priority_mix

    try:
        return tuple(parse_priority_mix(text).items())
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _draft_lengths(text: str) -> tuple[int, ...]:
    """``0,2,3`` -> (0, 2, 3): draft lengths in [0, 16], each once."""
    try:
        values = tuple(dict.fromkeys(int(part) for part in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--spec-compare must be draft lengths like 0,2,3, got {text!r}"
        ) from None
    if not values or not all(0 <= k <= 16 for k in values):
        raise argparse.ArgumentTypeError(f"--spec-compare lengths must be in [0, 16], got {text!r}")
    return values


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="closed-loop replay of a trace on the engine simulator, in virtual time",
        description="Replay an Azure LLM trace CSV, a Mooncake JSONL or a timestamp,count series on the "
        "simulated engine with servepilot's policies deciding, thousands of times faster than real time.",
    )
    parser.add_argument("--trace", required=True, help="trace file: .csv or .jsonl, gzip-compressed or not")
    parser.add_argument(
        "--policy",
        default="auto",
        help="auto, seed, static:N (max_num_seqs N) or static:N/T (and token budget T); default auto",
    )
    parser.add_argument("--sweep", action="store_true", help="also replay every static setting")
    parser.add_argument("--gpu", default="a100-80g", help="simulated GPU profile (default a100-80g)")
    parser.add_argument("--model", default="llama-2-7b", help="simulated model (default llama-2-7b)")
    parser.add_argument(
        "--slo",
        type=parse_slo,
        help="ttft=S,itl=S (default: the config's policies.ttft_slo_s and itl_slo_s, else ttft=10,itl=0.1)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a sidecar config: replay its SLO, class targets, ITL steering, batch bounds, queue timeout "
        "and energy setting (flags given override it; docs/policies.md)",
    )
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the trace's request rate")
    parser.add_argument("--lengths", help="per-request trace whose token lengths a count series borrows")
    parser.add_argument("--duration", type=float, help="replay only the first S seconds of the trace")
    parser.add_argument("--energy", action="store_true", help="add the SLO-gated clock policy to auto")
    parser.add_argument(
        "--default-batch",
        type=int,
        help="engine default max_num_seqs (vLLM V1's: 256 on A100, 1024 on H100/H200)",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        metavar="S",
        help="the gate's max_queue_wait_s: a request not scheduled within S s is answered 503 "
        "(default: the TTFT SLO, or the config's gate.max_queue_wait_s; inf: no timeout, the engine alone)",
    )
    classes = parser.add_argument_group(
        "priority classes", "replay the gate's classes: each judged by its own targets, with its own deadline"
    )
    classes.add_argument(
        "--priority-mix",
        type=_priority_mix,
        metavar="MIX",
        help="each request's class drawn with these shares, e.g. high=0.1,normal=0.7,low=0.2; the engine "
        "schedules by class (default: no classes)",
    )
    classes.add_argument(
        "--class-slo",
        type=parse_class_slo,
        action="append",
        default=[],
        metavar="CLASS:ttft=S,itl=S",
        help="a class's own targets (policies.slo_by_priority; repeatable), e.g. low:ttft=60; its queue "
        "deadline scales with its TTFT target",
    )
    classes.add_argument(
        "--itl-steering",
        choices=("global", "served_classes"),
        help="policies.itl_steering: steer the batch to the SLO's ITL (global) or to the tightest target "
        "of the classes served in the last 300 s (default: the config's, else served_classes)",
    )
    add_spec_flags(
        parser,
        "speculative decoding (the simulated engine drafts; compare a replay with and without to see "
        "whether it pays at the trace's load)",
    )
    parser.add_argument(
        "--spec-compare",
        type=_draft_lengths,
        metavar="K,K,...",
        help="also replay the policy with each of these draft lengths (0: no drafting) at --spec-acceptance "
        "and --spec-draft-cost, side by side, and name the best (not with --sweep)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="random seed (count series, Mooncake jitter, classes, drafts)"
    )
    parser.add_argument("--json", action="store_true", help="print the JSON summary")
    parser.add_argument("--report", metavar="FILE.html", help="write an HTML report")
    parser.set_defaults(func=run)


def _versus_line(summary: dict[str, Any]) -> str:
    """``auto``'s goodput against the best static setting and the engine default, in one line."""
    parts = []
    for key, what in (("best_static", "the best static"), ("engine_default", "the engine default")):
        other = summary["versus"][key]
        ratio = "-" if other["goodput_ratio"] is None else f"{other['goodput_ratio']:.3f}x"
        parts.append(f"{ratio} {what} ({other['policy']})")
    attained = summary["versus"]["slo_attainment"]
    return f"{summary['policy']} goodput: {', '.join(parts)}, at {attained:.2%} SLO attainment"


def run(args: argparse.Namespace) -> int:
    from agent.cli import UsageError
    from agent.config import load
    from agent.replay.from_config import Flags, describe, spec_fields
    from agent.replay.report import render
    from agent.replay.runner import (
        ReplaySpec,
        engine_default,
        parse_policy,
        run_policy,
        run_summary,
        sweep,
        versus,
    )
    from agent.replay.slo import Slo
    from agent.replay.summary import class_table, spec_line, summarise, table
    from agent.traces import TraceError

    try:
        parse_policy(args.policy)
        if not args.rate_scale > 0:
            raise ValueError(f"--rate-scale must be > 0, got {args.rate_scale:g}")
        if args.queue_timeout is not None and not args.queue_timeout > 0:
            raise ValueError(f"--queue-timeout must be > 0, got {args.queue_timeout:g}")
        if args.duration is not None and not args.duration > 0:
            raise ValueError(f"--duration must be > 0, got {args.duration:g}")
        drafts = spec_config(args)
        if args.spec_compare and args.sweep:
            raise ValueError("--spec-compare and --sweep together would replay every pair: choose one")
        flags = Flags(args.slo, tuple(args.class_slo), args.itl_steering, args.queue_timeout, args.energy)
        fields: dict[str, Any] = {
            "slo": flags.slo or (10.0, 0.1),
            "class_slo": flags.class_slo,
            "itl_steering": flags.itl_steering,
            "queue_timeout_s": flags.queue_timeout_s,
            "energy": flags.energy,
        }
        if args.config:
            cfg = load(args.config)
            fields = spec_fields(cfg, flags, with_classes=bool(args.priority_mix))
            print(describe(cfg, fields, bool(args.priority_mix)), file=sys.stderr)
        fields["slo"] = Slo(*fields["slo"])
        spec = ReplaySpec(
            Path(args.trace),
            gpu=args.gpu,
            model=args.model,
            rate_scale=args.rate_scale,
            lengths=Path(args.lengths) if args.lengths else None,
            seed=args.seed,
            duration_s=args.duration,
            default_batch=args.default_batch,
            priority_mix=args.priority_mix or (),
            spec_decode=drafts if drafts.draft_tokens else None,
            **fields,
        )
        replay_run, name = run_policy(spec, args.policy)
        summary: dict[str, Any] = summarise(replay_run, name)
        if args.sweep:
            rows, best = sweep(spec, workload=replay_run.workload)
            default_name = engine_default(spec)
            default = next((row for row in rows if row["policy"] == default_name), None)
            if default is None:  # a --default-batch the sweep's grid lacks
                default = run_summary(spec, default_name, with_actions=False, workload=replay_run.workload)
                rows.append(default)
            summary["sweep"] = rows
            summary["best_static"] = best
            summary["versus"] = versus(summary, best, default)
        if args.spec_compare:
            rows = []
            for k in args.spec_compare:
                drafting = replace(spec, spec_decode=replace(drafts, draft_tokens=k) if k else None)
                compared, _ = run_policy(drafting, args.policy, workload=replay_run.workload)  # same trace
                rows.append(summarise(compared, f"{name} K={k}", with_actions=False))
            summary["spec_compare"] = rows
            best = max(rows, key=lambda r: (r["goodput_tps"], r["slo_attainment"]))
            summary["best_spec"] = best["policy"]
    except (TraceError, ValueError) as error:
        raise UsageError(str(error)) from None
    if args.report:
        Path(args.report).write_text(render(replay_run, summary), encoding="utf-8")
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        print()
        return 0
    print(table([summary, *summary.get("sweep", []), *summary.get("spec_compare", [])]))
    if args.sweep:
        print(f"best static in hindsight: {summary['best_static']['policy']}")
        print(_versus_line(summary))
    if args.spec_compare:
        best = summary["best_spec"]
        print(f"best draft length for this load: {best} (goodput, then SLO attainment; ties: shorter)")
    if "classes" in summary:
        print(class_table(summary))
    if "spec_decode" in summary:
        print(spec_line(summary))
    for action in summary["actions"][:50]:
        change = f"{action['knob']} {action['previous']} -> {action['value']}"
        print(f"  t={action['at']:9.1f}s {change}: {action['reason']}")
    if len(summary["actions"]) > 50:
        print(f"  ... {len(summary['actions']) - 50} more actions (see --json)")
    return 0
