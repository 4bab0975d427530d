"""Benchmark the forecasters: LSTM training time and peak memory on one week of 1-minute request counts,
and single-forecast latency of the LSTM and of level_shape (the model the backtest selects on the Azure
2024 week). Targets (issue 5, 2-core CI machine): train < 60 s, peak RSS < 1 GiB, forecast < 10 ms.

    .venv/bin/python bench/forecast.py [--input FILE] [--threads 1]

Input defaults to the Azure 2024 coding week (10-s counts summed to 1 minute). Prints one line per figure
and exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

DEFAULT_INPUT = (
    Path(__file__).resolve().parents[2] / "shared/data/traces/azure_llm_2024/azure2024_coding_counts_10s.csv"
)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default=str(DEFAULT_INPUT))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np
    import torch

    from agent.traces import read_counts
    from detectors.forecast.lstm import LSTMForecaster
    from detectors.forecast.profile import LevelShape

    torch.set_num_threads(args.threads)
    series = read_counts(args.input, 60.0)
    base_mib = _rss_mib()
    started = time.perf_counter()
    model = LSTMForecaster(threads=args.threads).fit(series)
    train_s = time.perf_counter() - started
    peak_mib = _rss_mib()
    model.forecast(60)
    latencies = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        model.forecast(60)
        latencies.append(time.perf_counter() - started)
    p50, p99 = np.percentile(latencies, [50, 99]) * 1000
    started = time.perf_counter()
    shape = LevelShape().fit(series)
    shape_fit_s = time.perf_counter() - started
    shape_latencies = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        shape.forecast(60)
        shape_latencies.append(time.perf_counter() - started)
    shape_p50, shape_p99 = np.percentile(shape_latencies, [50, 99]) * 1000
    print(
        f"series: {len(series)} points at {series.step_s:g} s, threads={args.threads}, epochs={model.epochs}"
    )
    print(f"lstm train time: {train_s:.1f} s (target < 60 s)")
    added = peak_mib - base_mib
    print(f"peak RSS: {peak_mib:.0f} MiB, training added {added:.0f} MiB (target < 1024 MiB)")
    print(f"forecast latency (60 steps): p50 {p50:.2f} ms, p99 {p99:.2f} ms (target < 10 ms)")
    print(f"level_shape fit (incl. 1-day calibration replay): {shape_fit_s * 1000:.0f} ms")
    print(f"level_shape forecast latency (60 steps): p50 {shape_p50:.2f} ms, p99 {shape_p99:.2f} ms")
    return 0 if train_s < 60 and peak_mib < 1024 and p99 < 10 and shape_p99 < 10 else 1


if __name__ == "__main__":
    sys.exit(main())
