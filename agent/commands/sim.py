"""``servepilot sim``: serve the calibrated engine simulator (OpenAI API, vLLM /metrics, control API,
simulated NVML and allocator probe) on one port, so the sidecar can be developed without a GPU."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from agent import eventloop
from agent.commands.spec_flags import add_spec_flags, spec_config

if TYPE_CHECKING:
    import asyncio

GPU_CHOICES = ("a100-80g", "h100-sxm", "h200", "4xa100-80g-tp")
MODEL_CHOICES = ("llama-2-7b", "llama-3-8b", "llama-3-70b")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="run the calibrated engine simulator (no GPU needed)",
        description="Serve a simulated vLLM-like engine: /v1/completions, /v1/chat/completions and "
        "/v1/messages (SSE), /metrics with vLLM's names, /v1/control/*, /sim/nvml, /sim/probe/metrics "
        "and /sim/faults.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000, vLLM's)")
    parser.add_argument("--gpu", default="a100-80g", choices=GPU_CHOICES, help="GPU profile")
    parser.add_argument("--model", default="llama-3-8b", choices=MODEL_CHOICES, help="model profile")
    parser.add_argument(
        "--precision", default="fp16", choices=("fp16", "bf16", "fp8"), help="weights/KV dtype"
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory used")
    parser.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="the queue's order, as vLLM's flag: fcfs (default), or priority: by the body's integer "
        "priority (lower first), which also picks whom a KV shortage preempts",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for fault draws and GPU UUIDs")
    parser.add_argument(
        "--node-gpus",
        type=int,
        help="GPUs the simulated node has (default: the engine's tensor-parallel size); the engine runs on "
        "the last ones and the rest idle in /sim/nvml, as on a node shared with other pods",
    )
    parser.add_argument(
        "--control-token-file", help="require this bearer token (file contents) on the control API"
    )
    parser.add_argument("--speed", type=float, default=1.0, help="time scale: 10 runs ten times faster")
    parser.add_argument(
        "--fp8-ppl-delta",
        type=float,
        default=0.003,
        help="relative perplexity rise in fp8 seen through echo + logprobs (default 0.003 = 0.3%%)",
    )
    parser.add_argument(
        "--event-loop",
        choices=eventloop.CHOICES,
        default="auto",
        help="event loop (default auto: uvloop when installed, as vLLM's API server runs)",
    )
    parser.add_argument(
        "--stamp-chunks",
        action="store_true",
        help="bench aid: stamp each request's arrival (header X-Sim-Received-Ns) and each SSE event's "
        "departure (comment line ': sent_ns=N') on the host's monotonic clock (bench/gate.py)",
    )
    add_spec_flags(parser, "speculative decoding (vLLM's spec_decode counters, per position too)")
    faults = parser.add_argument_group("faults (also settable at run time with POST /sim/faults)")
    faults.add_argument(
        "--fault-metrics-delay-s", type=float, default=0.0, help="delay every /metrics answer"
    )
    faults.add_argument("--fault-error-rate", type=float, default=0.0, help="share of API requests that fail")
    faults.add_argument("--fault-error-status", type=int, default=503, choices=(500, 503), help="status used")
    faults.add_argument("--fault-leak-bytes-per-hour", type=float, default=0.0, help="staircase memory leak")
    faults.add_argument(
        "--fault-fragmentation-ratio", type=float, default=0.0, help="allocator fragmentation"
    )
    faults.add_argument("--fault-latency-factor", type=float, default=1.0, help="multiply every step time")
    faults.add_argument(
        "--fault-stalled", action="store_true", help="hang the engine: hold requests, emit no token"
    )
    faults.add_argument(
        "--fault-stalled-gpu",
        choices=("busy", "idle"),
        default="busy",
        help="what NVML reads while stalled: busy (a collective spinning, as NCCL hangs read) or idle",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from agent.cli import UsageError
    from simulator.engine import make_core
    from simulator.faults import FaultError
    from simulator.server import SimServer

    if not 1 <= args.port <= 65535:
        raise UsageError(f"--port must be in [1, 65535], got {args.port}")
    if args.speed <= 0:
        raise UsageError(f"--speed must be > 0, got {args.speed}")
    if not 0 <= args.fp8_ppl_delta < 1:
        raise UsageError(f"--fp8-ppl-delta must be in [0, 1), got {args.fp8_ppl_delta}")
    try:
        spec = spec_config(args)
    except ValueError as error:
        raise UsageError(str(error)) from None
    try:
        core = make_core(
            args.gpu,
            args.model,
            args.precision,
            args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization,
            scheduling_policy=args.scheduling_policy,
            spec=spec,
        )
        faults = core.faults.updated(
            {
                "metrics_delay_s": args.fault_metrics_delay_s,
                "error_rate": args.fault_error_rate,
                "error_status": args.fault_error_status,
                "leak_bytes_per_hour": args.fault_leak_bytes_per_hour,
                "fragmentation_ratio": args.fault_fragmentation_ratio,
                "latency_factor": args.fault_latency_factor,
                "stalled": args.fault_stalled,
                "stalled_gpu": args.fault_stalled_gpu,
            }
        )
    except (ValueError, FaultError) as error:
        raise UsageError(str(error)) from None
    core.set_faults(faults, core.time)
    if args.node_gpus is not None and args.node_gpus < core.gpu.tp:
        raise UsageError(
            f"--node-gpus must be at least the engine's {core.gpu.tp} GPU(s), got {args.node_gpus}"
        )
    token = None
    if args.control_token_file:
        from agent.admin import load_token

        try:
            token = load_token(args.control_token_file)
        except ValueError as error:
            raise UsageError(f"--control-token-file: {error}") from None
    loop = _new_loop(args.event_loop)
    server = SimServer(
        core,
        speed=args.speed,
        seed=args.seed,
        control_token=token,
        fp8_ppl_delta=args.fp8_ppl_delta,
        stamp_chunks=args.stamp_chunks,
        node_gpus=args.node_gpus,
    )
    print(
        f"servepilot sim: {core.model.served_name} ({args.precision}) on {core.gpu.name} x{core.gpu.tp}, "
        f"{core.budget.num_blocks} KV blocks, {args.scheduling_policy} scheduling"
        + (f", {args.spec_tokens} draft tokens" if core.spec else "")
        + f", http://{args.host}:{args.port}",
        flush=True,
    )
    web.run_app(server.app(), host=args.host, port=args.port, print=None, loop=loop)
    return 0


def _new_loop(choice: eventloop.EventLoopChoice) -> asyncio.AbstractEventLoop:
    """The event loop ``--event-loop`` asks for, picked as ``agent.event_loop`` is: the simulator stands
    in for an engine whose API server runs on uvloop (vLLM's does), so a proxy benchmark against it does
    not charge the engine's side the standard loop's extra CPU."""
    import asyncio

    from agent.cli import UsageError

    try:
        name = eventloop.resolve(choice)
    except ValueError:  # uvloop asked for and missing
        raise UsageError("--event-loop is uvloop, but it does not import: pip install uvloop") from None
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()
    return 0
