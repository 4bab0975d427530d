"""How fast ``servepilot replay`` runs: one hour of the Azure 2023 conversation trace, auto policy.

Prints simulated seconds per wall second (the acceptance bar is >= 1000x on the development machine)
and the same figure for a static setting (no brain), so the brain's own cost is visible.

    .venv/bin/python bench/replay.py [--trace FILE] [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from agent.replay.runner import ReplaySpec, run_policy, workload_for

SHARED = Path("/work/shared/data/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=SHARED)
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs (the machine is shared)")
    args = parser.parse_args()
    spec = ReplaySpec(args.trace, duration_s=3600.0)
    workload = workload_for(spec, 4096)
    print(
        f"trace {args.trace.name}: {len(workload)} requests over {workload.duration_s:.0f} s; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    for policy in ("auto", "static:256"):
        best = float("inf")
        for _ in range(args.repeat):
            started = time.perf_counter()
            run, _name = run_policy(spec, policy, workload)
            best = min(best, time.perf_counter() - started)
        speed = run.end_s / best
        print(f"{policy:>11}: {run.end_s:.0f} simulated s in {best:.2f} wall s = {speed:,.0f}x real time")


if __name__ == "__main__":
    main()
