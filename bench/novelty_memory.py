"""What the novelty scorer's long memory saves on a daily cycle sampled at the agent's 1 s tick.

The Azure 2024 coding week (requests per 10 s) becomes a per-second arrival count (Poisson around the
trace's rate), smoothed over 10 s and over 60 s as an engine's request rates are. Each series runs
through ``LevelNoveltyScorer`` and the general detector's thresholder (0.9, k = n = 1, one alarm a day),
three ways: the 5000-point window alone (``memory_s=0``, 83 minutes at 1 s), with the default long memory
(7 days at 30-minute steps), and a window of the whole week in points (the reference the memory stands in
for, at 120x its memory). Prints, per series and way, the rising edges per day (alarms raised plus those
the budget suppressed: what an unlimited budget would have sent), the alarms raised, microseconds per
point and the pickled size of the scorer at the end (what ``agent.state_path`` stores per signal).

    .venv/bin/python -m bench.novelty_memory [--trace FILE] [--json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np

from bench.leak import TRACE, load_counts
from detectors.novelty import LevelNoveltyScorer
from detectors.thresholds import Thresholder

WAYS = {
    "window only": {"memory_s": 0.0},
    "window + 7-day memory": {},
    "window of 8 days": {"history": 8 * 86400, "memory_s": 0.0},
}


def series(counts: np.ndarray, seed: int = 0) -> dict[str, np.ndarray]:
    """Per-second request rates from 10-s counts, smoothed over 10 s and 60 s."""
    per_second = np.random.default_rng(seed).poisson(np.repeat(counts / 10.0, 10)).astype(float)
    out = {}
    for window in (10, 60):
        out[f"rate over {window} s"] = np.convolve(per_second, np.ones(window) / window)[: per_second.size]
    return out


def run(x: np.ndarray, params: dict[str, float]) -> dict[str, object]:
    scorer, thresholder = LevelNoveltyScorer(**params), Thresholder(threshold=0.9, k=1, n=1)
    t = np.arange(x.size, dtype=float)
    days = max(1, x.size // 86400)  # a partial last day counts with the day before
    edges, raised = [0] * days, [0] * days
    started = time.process_time()
    for ti, xi in zip(t.tolist(), x.tolist(), strict=True):
        event = thresholder.update(ti, scorer.update(ti, xi))
        day = min(days - 1, int(ti // 86400))
        edges[day] += event.raised or event.suppressed
        raised[day] += event.raised
    cost = 1e6 * (time.process_time() - started) / x.size
    return {
        "edges_per_day": edges,
        "edges": sum(edges),
        "raised": sum(raised),
        "us_per_point": round(cost, 2),
        "state_kib": round(len(pickle.dumps(scorer)) / 1024, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = {
        name: {way: run(x, params) for way, params in WAYS.items()}
        for name, x in series(load_counts(args.trace)).items()
    }
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
        return 0
    print("| series | scorer | rising edges | per day | alarms raised | us/point | state (KiB) |")
    print("|---|---|---:|---|---:|---:|---:|")
    for name, ways in results.items():
        for way, r in ways.items():
            print(
                f"| {name} | {way} | {r['edges']} | {r['edges_per_day']} | {r['raised']} | "
                f"{r['us_per_point']} | {r['state_kib']} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
