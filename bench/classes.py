"""Priority classes replayed on the traces: what each class gets under the engine default, auto steering
globally, and auto steering to the classes served (docs/policies.md, "Priority classes in replay").

Every run is the simulated A100-80GB with Llama-2-7B, SLO TTFT 10 s and ITL 0.1 s, the gate's queue
timeout at the TTFT SLO, and the mix ``high=0.1,normal=0.7,low=0.2`` with an interactive high class
(TTFT 2 s, ITL 0.05 s) and a patient low one (TTFT 60 s). Prints one markdown table per trace.

    .venv/bin/python bench/classes.py [--traces DIR] [--only conv,code,mooncake] [--duration S]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.replay.runner import ReplaySpec, run_summary  # noqa: E402

TRACES = Path("/work/shared/data/traces")
CASES = {
    "conv": ("Azure 2023 conversation", "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"),
    "code": ("Azure 2023 code", "azure_llm_2023/AzureLLMInferenceTrace_code.csv"),
    "mooncake": ("Mooncake conversation", "mooncake/conversation_trace.jsonl"),
}
MIX = (("high", 0.1), ("normal", 0.7), ("low", 0.2))
CLASS_SLO = (("high", 2.0, 0.05), ("low", 60.0, None))
RUNS = (("static:256", "global"), ("auto", "global"), ("auto", "served_classes"))


def _row(summary: dict, steering: str) -> str:
    classes = summary["classes"]
    cells = [
        summary["policy"],
        steering if summary["policy"] == "auto" else "—",
        f"{summary['slo_attainment']:.2%}",
    ]
    cells += [f"{classes[name]['slo_attainment']:.2%}" for name in ("high", "normal", "low")]
    cells += [f"{classes['high']['itl_p99_s']:.3f}", f"{classes['low']['ttft_p99_s']:.1f}"]
    cells += [str(classes[name]["expired"] + classes[name]["rejected"]) for name in ("normal", "low")]
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--traces", type=Path, default=TRACES, help="the traces folder (../shared/data/traces)"
    )
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated cases: conv, code, mooncake")
    parser.add_argument("--duration", type=float, default=3600.0, help="replay the first S seconds (3600)")
    args = parser.parse_args()
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CASES]
    if unknown:
        parser.error(f"--only: unknown case {unknown[0]!r} (cases: {', '.join(CASES)})")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for key in keys:
        title, relative = CASES[key]
        trace = args.traces / relative
        if not trace.is_file():
            print(f"{trace}: no such file", file=sys.stderr)
            return 2
        print(f"\n{title}, first {args.duration:g} s, mix {MIX}, class targets {CLASS_SLO}:\n")
        print(
            "| policy | steering | attainment | high | normal | low | high ITL p99 (s) | low TTFT p99 (s) "
            "| normal turned away | low turned away |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for policy, steering in RUNS:
            spec = ReplaySpec(
                trace,
                duration_s=args.duration,
                priority_mix=MIX,
                class_slo=CLASS_SLO,
                itl_steering=steering,
            )
            started = time.perf_counter()
            summary = run_summary(spec, policy, with_actions=False)
            print(
                _row(summary, steering),
                f"<!-- {summary['requests']} requests, {time.perf_counter() - started:.1f} s -->",
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
