"""``servepilot demo``: the simulated engine, the sidecar and a real-trace load, in one command.

Needs no GPU: the engine is servepilot's calibrated simulator (simulated NVML and allocator probe
included) and the load replays the arrival pattern and token lengths of the bundled Azure LLM 2023
conversation trace. A live terminal view shows what the sidecar sees; Ctrl-C or ``--duration`` ends it
cleanly (exit code 0).

By default the sidecar only observes. ``--mode advise|act`` puts the admission gate in front of the engine,
sends the load through it and runs the auto policy set: in ``act`` the effective batch and the gate's queue
deadline move, in ``advise`` the same decisions are only recorded; the view lists the newest ones.
"""

from __future__ import annotations

import argparse
from typing import Any

from policies import knobs

DEFAULT_GPU = "h100-sxm"
DEFAULT_MODEL = "llama-3-8b"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="simulated engine + sidecar + real-trace load, with a live view (no GPU needed)",
        description="Start the calibrated engine simulator, the servepilot sidecar and a load generator "
        "replaying the Azure LLM 2023 conversation trace; show what the sidecar sees (and, with --mode "
        "advise|act, what it decides). Ctrl-C stops.",
    )
    parser.add_argument(
        "--duration", type=float, default=0.0, help="stop after S seconds (default: run until Ctrl-C)"
    )
    parser.add_argument("--port", type=int, default=9400, help="agent API and /metrics port (default 9400)")
    parser.add_argument("--engine-port", type=int, default=8000, help="simulated engine port (default 8000)")
    parser.add_argument(
        "--engine",
        choices=["sim", "llamacpp", "vllm"],
        default="sim",
        help="engine beside the sidecar: the simulator (default) or a real CPU engine "
        "(install those first with: bash scripts/engines.sh)",
    )
    parser.add_argument("--gpu", default=DEFAULT_GPU, help=f"simulated GPU profile (default {DEFAULT_GPU})")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"simulated model (default {DEFAULT_MODEL})")
    parser.add_argument(
        "--rate-scale", type=float, default=3.0, help="multiply the trace's request rate (default 3)"
    )
    parser.add_argument("--speed", type=float, default=1.0, help="replay the trace this many times faster")
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="simulator fault switch to set at start, e.g. leak_bytes_per_hour=2e9 (repeatable)",
    )
    parser.add_argument(
        "--mode",
        choices=["observe", "advise", "act"],
        default="observe",
        help="observe (default): watch only; advise or act: the admission gate goes in front of the "
        "engine (on --gate-port, where the load is sent) and the auto policy sets its effective batch "
        "(on the simulator also its token budget and, SLO-gated, its GPU clock, through its control API): "
        "act applies each decision, advise only records it (both listed at /api/actions)",
    )
    parser.add_argument(
        "--gate-port",
        type=int,
        default=8080,
        help="admission gate port with --mode advise|act (default 8080)",
    )
    parser.add_argument(
        "--initial-batch",
        type=int,
        default=None,
        help="the gate's effective batch to start from with --mode advise|act (default: the auto policy's, "
        "64); start low, e.g. 4, to watch act mode raise it",
    )
    parser.add_argument(
        "--priority-mix",
        default=None,
        metavar="CLASS=SHARE,...",
        help="with --mode advise|act, the share of requests sent in each priority class, e.g. "
        f"high=0.1,low=0.5 (default {DEFAULT_PRIORITY_MIX}); the view shows each class's TTFT and "
        "what the gate shed of it",
    )
    parser.add_argument(
        "--spec-tokens",
        type=int,
        default=0,
        metavar="N",
        help="speculative decoding: the engine drafts N tokens per step (simulator: a draft model costing "
        "5%% of a step per token, each token accepted at 0.7; change that with --fault "
        "spec_acceptance=0.05 or POST /sim/faults; vLLM: n-gram lookup); the spec_decode detector "
        "judges the acceptance (default 0: no drafting)",
    )
    parser.add_argument(
        "--no-view", action="store_true", help="print a status line every 5 s instead of the live view"
    )
    parser.set_defaults(func=run)


DEFAULT_PRIORITY_MIX = "high=0.1,normal=0.7,low=0.2"
"""The load's priority classes when the gate is on: a tenth of the traffic urgent, a fifth batch."""
PRIORITY_CLASSES = knobs.CLASSES


def parse_priority_mix(text: str) -> dict[str, float]:
    """``high=0.1,low=0.5`` -> {"high": 0.1, "low": 0.5}; ValueError in one line naming what is wrong."""
    mix: dict[str, float] = {}
    for item in text.split(","):
        name, sep, raw = item.strip().partition("=")
        if not sep or name not in PRIORITY_CLASSES:
            raise ValueError(
                f"--priority-mix must look like high=0.1,normal=0.7,low=0.2, got {item.strip()!r}"
            )
        try:
            share = float(raw)
        except ValueError:
            raise ValueError(f"--priority-mix share of {name} must be a number, got {raw!r}") from None
        if not share >= 0 or share == float("inf"):
            raise ValueError(f"--priority-mix share of {name} must be >= 0, got {raw}")
        mix[name] = share
    if sum(mix.values()) <= 0:
        raise ValueError(f"--priority-mix needs a share above 0, got {text!r}")
    return mix


def demo_config(port: int, engine_port: int) -> dict[str, Any]:
    """The sidecar config the demo runs (the same as examples/demo.yaml with the chosen ports)."""
    engine = f"http://127.0.0.1:{engine_port}"
    return {
        "agent": {
            "interval_s": 1.0,
            "listen_host": "127.0.0.1",
            "listen_port": port,
            "admin_listen_port": None,
        },
        "engine": {"kind": "vllm", "url": engine},
        "nvml": {"backend": "simulated", "simulated_url": engine},
        "probe": {"enabled": True, "url": f"{engine}/sim/probe/metrics"},
        "forecast": {"enabled": True, "state_path": None},
    }


def with_gate(
    cfg: dict[str, Any],
    mode: str,
    gate_port: int,
    initial_batch: int | None,
    engine_control: bool = False,
    engine_priority: str | None = None,
) -> dict[str, Any]:
    """``cfg`` with the admission gate in front of the engine and the auto policy in ``mode``.

    Every setting is the sidecar's own default except: the gate's one upstream is the demo's engine, the
    business-line rate is raised so that the trace's bursts (the demo runs it at 3x) are not refused by
    the default 1000 requests/min, and the audit stays in memory (``/api/actions``), not in a file in
    the working directory. With ``engine_control`` (the simulator) the engine's control API is used too:
    the token budget controller joins, and the energy policy drives the simulated GPU's clock through it
    (``sm_clock_mhz``), so the demo shows the clock stepping down while latency has room.
    ``engine_priority`` (a ``gate.engine_priority`` preset) passes the load's classes to an engine
    started with priority scheduling.
    """
    engine = cfg["engine"]["url"]
    gate: dict[str, Any] = {
        "enabled": True,
        "listen_host": "127.0.0.1",
        "listen_port": gate_port,
        "upstreams": {"primary": engine},
        "split": {"primary": 1.0},
        "default_requests_per_min": 60_000.0,
    }
    if engine_priority is not None:
        gate["engine_priority"] = {"primary": engine_priority}
    policies: dict[str, Any] = {"set": "auto"}
    if initial_batch is not None:  # the gate starts there and the policy knows it
        gate["max_in_flight"] = initial_batch
        policies.update(initial_batch=initial_batch, batch_min=min(initial_batch, 8))
    out = {
        **cfg,
        "gate": gate,
        "policies": policies,
        "actuators": {"mode": mode},
        "audit": {"path": None},
    }
    if engine_control:
        out["control"] = {"enabled": True, "url": engine}
        policies["energy"] = True
    return out


def run(args: argparse.Namespace) -> int:
    from agent.cli import UsageError

    for name, value in (
        ("--duration", args.duration),
        ("--rate-scale", args.rate_scale),
        ("--speed", args.speed),
        ("--initial-batch", args.initial_batch if args.initial_batch is not None else 1),
    ):
        if value < 0 or (name != "--duration" and value == 0):
            raise UsageError(f"{name} must be positive, got {value:g}")
    if not 0 <= args.spec_tokens <= 16:
        raise UsageError(f"--spec-tokens must be in [0, 16], got {args.spec_tokens}")
    if args.spec_tokens and args.engine == "llamacpp":
        raise UsageError("--spec-tokens needs --engine sim or vllm (the demo's llama.cpp has no draft model)")
    faults: dict[str, float] = {}
    for item in args.fault:
        key, sep, raw = item.partition("=")
        try:
            faults[key] = float(raw)
        except ValueError:
            raise UsageError(f"--fault must look like NAME=NUMBER, got {item!r}") from None
        if not sep:
            raise UsageError(f"--fault must look like NAME=NUMBER, got {item!r}")

    from agent.demo_runner import run_demo

    if args.engine == "sim":
        cfg = demo_config(args.port, args.engine_port)
        if args.spec_tokens:
            from agent.demo_runner import DEMO_DRAFT_COST

            cfg["detectors"] = {"spec_draft_cost_ratio": DEMO_DRAFT_COST}
    else:
        if faults:
            raise UsageError("--fault switches exist only on the simulator (--engine sim)")
        from agent.engines.demo import demo_config as real_engine_config

        cfg = real_engine_config(args.engine, args.port, args.engine_port)
    mix = None
    if args.mode != "observe":
        from agent.engines.demo import ENGINE_PRIORITY

        try:
            mix = parse_priority_mix(args.priority_mix or DEFAULT_PRIORITY_MIX)
        except ValueError as error:
            raise UsageError(str(error)) from None
        cfg = with_gate(
            cfg,
            args.mode,
            args.gate_port,
            args.initial_batch,
            engine_control=args.engine == "sim",
            engine_priority=ENGINE_PRIORITY.get(args.engine),
        )
    elif args.initial_batch is not None:
        raise UsageError("--initial-batch sets the gate's batch: it needs --mode advise or act")
    elif args.priority_mix is not None:
        raise UsageError("--priority-mix sets classes the gate acts on: it needs --mode advise or act")
    return run_demo(args, faults, cfg, mix)
