"""``servepilot demo``: the simulated engine, the sidecar and a real-trace load, in one command.

Needs no GPU: the engine is servepilot's calibrated simulator (simulated NVML and allocator probe
included) and the load replays the arrival pattern and token lengths of the bundled Azure LLM 2023
conversation trace. A live terminal view shows what the sidecar sees; Ctrl-C or ``--duration`` ends it
cleanly (exit code 0).
"""

from __future__ import annotations

import argparse
from typing import Any

DEFAULT_GPU = "h100-sxm"
DEFAULT_MODEL = "llama-3-8b"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="simulated engine + sidecar + real-trace load, with a live view (no GPU needed)",
        description="Start the calibrated engine simulator, the servepilot sidecar and a load generator "
        "replaying the Azure LLM 2023 conversation trace; show what the sidecar sees. Ctrl-C stops.",
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
        help="simulator fault switch to set at start, e.g. memory_leak_bytes_per_hour=2e9 (repeatable)",
    )
    parser.add_argument(
        "--no-view", action="store_true", help="print a status line every 5 s instead of the live view"
    )
    parser.set_defaults(func=run)


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


def run(args: argparse.Namespace) -> int:
    from agent.cli import UsageError

    for name, value in (
        ("--duration", args.duration),
        ("--rate-scale", args.rate_scale),
        ("--speed", args.speed),
    ):
        if value < 0 or (name != "--duration" and value == 0):
            raise UsageError(f"{name} must be positive, got {value:g}")
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
    else:
        if faults:
            raise UsageError("--fault switches exist only on the simulator (--engine sim)")
        from agent.engines.demo import demo_config as real_engine_config

        cfg = real_engine_config(args.engine, args.port, args.engine_port)
    return run_demo(args, faults, cfg)
