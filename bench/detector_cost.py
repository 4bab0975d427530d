"""Cost of the domain detectors per signal per tick (target: under 1 ms per signal per tick).

Builds one realistic snapshot per 1-s tick for ``--gpus`` GPUs (engine, NVML, probe and the admission
gate's four request-length buckets: the full signal set the domain detectors read), with load shaped by
the Azure 2024 code trace, then times every domain detector's ``update`` over ``--ticks`` ticks. Snapshot
construction is excluded. Reports microseconds per tick per detector, the total, and the total divided by
the number of signals in the snapshot. Run ``python -m bench.detector_cost``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from bench.leak import TRACE, load_counts
from detectors.base import Detector
from detectors.fragmentation import FragmentationDetector
from detectors.leak import MemoryLeakDetector
from detectors.multivariate import MultivariateAnomalyDetector
from detectors.scheduler import SchedulerEfficiencyDetector
from detectors.snapshot import Reading, Snapshot, SourceStatus
from detectors.tail_latency import TailLatencyDetector
from detectors.thermal import ThermalDetector

GIB = float(1 << 30)


def detectors() -> list[Detector]:
    """Every domain detector with its defaults."""
    return [
        MemoryLeakDetector(),
        FragmentationDetector(),
        SchedulerEfficiencyDetector(),
        TailLatencyDetector(),
        MultivariateAnomalyDetector(),
        ThermalDetector(),
    ]


def snapshots(ticks: int, gpus: int, seed: int = 0) -> list[Snapshot]:
    """One snapshot per second, load from the trace (10-s counts repeated over their bin)."""
    rng = np.random.default_rng(seed)
    counts = load_counts(TRACE)[: ticks // 10 + 1]
    out = []
    for i in range(ticks):
        running = min(256.0, counts[i // 10] / 10.0 * 4.0)
        util = min(1.0, 0.15 + running / 200.0)
        values: dict[str, float] = {
            "engine.requests_running": running,
            "engine.requests_waiting": float(rng.poisson(1.0)),
            "engine.kv_cache_usage_ratio": running / 256.0,
            "engine.batch_size_mean": running,
            "engine.generation_tokens_per_second": running / (0.02 + 0.0003 * running) * rng.normal(1, 0.03),
            "engine.prompt_tokens_per_second": 2000.0 * running / 40.0,
            "engine.requests_finished_per_second": running / 4.0,
            "engine.preemptions_per_second": 0.0,
            "gate.prompt_tokens_mean": 2048.0 + rng.normal(0, 50),
            "probe.allocated_bytes": 50 * GIB,
            "probe.reserved_bytes": 54 * GIB,
        }
        for kind in ("ttft", "itl", "e2e"):
            for q, mult in (("p50", 1.0), ("p95", 2.0), ("p99", 3.0)):
                values[f"engine.{kind}_seconds.{q}"] = 0.05 * mult * math.exp(util) * rng.lognormal(0, 0.05)
        for bucket in ("le256", "le1k", "le4k", "gt4k"):
            for sig in ("ttft_seconds.p95", "ttft_seconds.p99", "itl_seconds.p99", "e2e_seconds.p99"):
                values[f"gate.{bucket}.{sig}"] = 0.1 * math.exp(util) * rng.lognormal(0, 0.05)
            values[f"gate.{bucket}.requests_per_second"] = running / 16.0
        for g in range(gpus):
            p = f"nvml.gpu{g}"
            values |= {
                f"{p}.memory_used_bytes": 70 * GIB + running * 24e6,
                f"{p}.memory_total_bytes": 80 * GIB,
                f"{p}.process_used_bytes.pid{1000 + g}": 69 * GIB + running * 24e6,
                f"{p}.utilization_ratio.mean": util,
                f"{p}.utilization_ratio.max": min(1.0, util + 0.05),
                f"{p}.utilization_ratio.last": util,
                f"{p}.memory_bandwidth_utilization_ratio.mean": util * 0.7,
                f"{p}.temperature_celsius.mean": 35 + 40 * util + rng.normal(0, 0.5),
                f"{p}.temperature_celsius.max": 36 + 40 * util,
                f"{p}.temperature_celsius.last": 35 + 40 * util,
                f"{p}.sm_clock_hz.mean": 1.98e9,
                f"{p}.power_watts.mean": 100 + 500 * util,
                f"{p}.throttle_reasons": 0.0,
            }
        out.append(
            Snapshot.from_readings(float(i), {"bench": Reading("bench", float(i), SourceStatus.OK, values)})
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=3600)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    snaps = snapshots(args.ticks, args.gpus)
    n_signals = len(snaps[0].values)
    per_detector: dict[str, float] = {}
    for detector in detectors():
        started = time.perf_counter()
        for snap in snaps:
            detector.update(snap)
        per_detector[detector.name] = (time.perf_counter() - started) / len(snaps) * 1e6
    total_us = sum(per_detector.values())
    result = {
        "ticks": len(snaps),
        "signals": n_signals,
        "us_per_tick": per_detector,
        "total_us_per_tick": total_us,
        "us_per_signal_per_tick": total_us / n_signals,
        "passed": total_us / n_signals < 1000.0,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for name, cost in per_detector.items():
            print(f"{name:22s} {cost:9.1f} us/tick")
        print(
            f"{'all domain detectors':22s} {total_us:9.1f} us/tick over {n_signals} signals = "
            f"{total_us / n_signals:.1f} us per signal per tick (target < 1000) "
            f"{'PASS' if result['passed'] else 'FAIL'}"
        )
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
