"""``servepilot forecast``: rolling-origin backtest of every forecaster on a traffic file, and the choice.

Reads a ``timestamp,count`` series, an Azure LLM trace CSV, a Mooncake JSONL or the Azure 2024 10-s counts
file (see :mod:`agent.traces`), aggregates it to ``--step``, backtests each model at 5/15/30/60 min and
``--horizon``, and prints per-model MASE and sMAPE plus the model (or ensemble) it would select.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

STANDARD_HORIZONS_S = (300, 900, 1800, 3600)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``30m`` -> 1800.0; bare numbers are seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bad duration {text!r} (use e.g. 90s, 30m, 1h)")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "forecast",
        help="backtest the traffic forecasters on a trace and show which one would be selected",
        description="Rolling-origin backtest (no lookahead) of every forecaster; prints MASE (scaled by the "
        "in-sample one-step naive MAE) and sMAPE per model and horizon, and the selected model.",
    )
    parser.add_argument(
        "--input",
        "--trace",  # the name replay uses for the same files
        dest="input",
        required=True,
        help="timestamp,count CSV, Azure trace CSV or Mooncake JSONL (also --trace)",
    )
    parser.add_argument("--horizon", type=parse_duration, default=1800.0, help="selection horizon (30m)")
    parser.add_argument("--step", type=parse_duration, default=60.0, help="aggregation step (1m)")
    parser.add_argument("--initial", type=parse_duration, help="training span before the first origin")
    parser.add_argument("--stride", type=parse_duration, default=600.0, help="time between origins (10m)")
    parser.add_argument("--refit", type=parse_duration, default=86400.0, help="refit interval (1d)")
    parser.add_argument(
        "--validation",
        type=float,
        default=0.4,
        help="share of the origins (the earliest) used to select the model; the table reports the rest "
        "(default 0.4; 0 selects and reports on all origins)",
    )
    parser.add_argument("--models", help="comma-separated subset of models (default: all)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="plot forecast vs actual of the selected model")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.cli import UsageError
    from agent.traces import TraceError, read_counts

    try:
        series = read_counts(args.input, args.step)
    except TraceError as error:
        raise UsageError(str(error)) from error
    report = backtest_report(series, args)
    if args.plot:
        _plot(args.plot, report.pop("_best"), series.step_s)
    else:
        report.pop("_best")
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def backtest_report(series: Any, args: argparse.Namespace) -> dict[str, Any]:
    from agent.cli import UsageError
    from detectors.forecast.backtest import combine, rolling_origin
    from detectors.forecast.select import BASELINES, default_factories, select

    step = series.step_s
    horizon = max(1, round(args.horizon / step))
    horizons = sorted({horizon} | {round(h / step) for h in STANDARD_HORIZONS_S if h >= step})
    longest = max(horizons)
    initial = round(args.initial / step) if args.initial else min(round(2 * 86400 / step), len(series) // 2)
    if initial < 2 or initial > len(series) - longest:
        raise UsageError(f"series of {len(series)} steps is too short for a {longest}-step backtest")
    factories = default_factories(horizon_steps=longest)
    if args.models:
        wanted = [name.strip() for name in args.models.split(",")]
        unknown = sorted(set(wanted) - set(factories))
        if unknown:
            raise UsageError(f"unknown models {unknown}; choose from {sorted(factories)}")
        factories = {name: factories[name] for name in wanted}
    results = [
        rolling_origin(
            factory,
            series,
            horizon=longest,
            initial=initial,
            stride=max(1, round(args.stride / step)),
            refit_every=max(1, round(args.refit / step)),
            name=name,
        )
        for name, factory in factories.items()
    ]
    if not 0.0 <= args.validation < 1.0:
        raise UsageError(f"--validation must be in [0, 1), got {args.validation:g}")
    split = _split(results, args.validation)
    chosen_on = [r.window(stop=split) if r.ok else r for r in results]
    reported = [r.window(first=split) if r.ok else r for r in results]
    try:
        selection, _ = select(chosen_on, horizon)
    except ValueError as error:
        raise UsageError(str(error)) from error
    by_name = {r.name: r for r in reported}
    shown = list(reported)
    if len(selection.members) > 1:
        shown.append(combine([by_name[m] for m in selection.members], name=selection.name))
    best = next(r for r in shown if r.name == selection.name)
    best_baseline = min((r for r in reported if r.ok and r.name in BASELINES), key=lambda r: r.mase(horizon))
    improvement = 1.0 - best.mase(horizon) / best_baseline.mase(horizon)
    return {
        "horizon_s": horizon * step,
        "step_s": step,
        "selected": selection.name,
        "improvement_vs_best_baseline": round(improvement, 4),
        "best_baseline": best_baseline.name,
        "mase_scale": "in-sample one-step naive MAE of the initial training window",
        "validation_share": args.validation,
        "selection_window": _describe_window(chosen_on, series),
        "report_window": _describe_window(reported, series),
        "validation_mase": {r.name: round(r.mase(horizon), 4) for r in chosen_on if r.ok},
        "origins": int(best.origins.size),
        "models": [_row(r, horizon, horizons, step) for r in shown],
        "_best": best,
    }


def _split(results: list[Any], share: float) -> int | None:
    """Series index that separates the selection origins (before) from the reported ones (after)."""
    ok = next((r for r in results if r.ok), None)
    if ok is None or share <= 0:
        return None
    cut = round(share * ok.origins.size)
    return int(ok.origins[min(max(cut, 1), ok.origins.size - 1)])


def _describe_window(results: list[Any], series: Any) -> dict[str, Any]:
    ok = next((r for r in results if r.ok), None)
    if ok is None or ok.origins.size == 0:
        return {"origins": 0}
    return {
        "origins": int(ok.origins.size),
        "first_origin_s": float(series.start_s + ok.origins[0] * series.step_s),
        "last_origin_s": float(series.start_s + ok.origins[-1] * series.step_s),
    }


def _row(result: Any, horizon: int, horizons: list[int], step: float) -> dict[str, Any]:
    if not result.ok:
        return {"name": result.name, "mase": None, "smape": None, "error": result.error}
    return {
        "name": result.name,
        "mase": round(result.mase(horizon), 4),
        "smape": round(result.smape(horizon), 4),
        "coverage_80": round(result.coverage(horizon), 4) if {0.1, 0.9} <= set(result.quantiles) else None,
        "by_horizon_s": {
            str(int(h * step)): {"mase": round(result.mase(h), 4), "smape": round(result.smape(h), 4)}
            for h in horizons
        },
        "fit_s": round(result.fit_s, 2),
    }


def _table(report: dict[str, Any]) -> str:
    keys = list(next((m["by_horizon_s"] for m in report["models"] if m["mase"] is not None), {}))
    header = f"{'model':<40}" + "".join(
        f"{f'MASE@{int(k) // 60}m':>11}{f'sMAPE@{int(k) // 60}m':>12}" for k in keys
    )
    lines = [header, "-" * len(header)]
    for model in report["models"]:
        if model["mase"] is None:
            lines.append(f"{model['name']:<40}  skipped: {model['error']}")
            continue
        cells = "".join(f"{v['mase']:>11.3f}{v['smape']:>12.3f}" for v in model["by_horizon_s"].values())
        lines.append(f"{model['name']:<40}{cells}")
    chosen, shown = report["selection_window"], report["report_window"]
    where = (
        f"(chosen on the first {chosen['origins']} origins); on the {shown['origins']} later origins above"
        if report["validation_share"] > 0
        else f"(chosen and scored on the same {shown['origins']} origins)"
    )
    lines.append(
        f"selected at {report['horizon_s'] / 60:g} min: {report['selected']} {where}: "
        f"{report['improvement_vs_best_baseline']:.1%} lower MASE than {report['best_baseline']}, "
        "the best baseline there"
    )
    lines.append(f"MASE scale: {report['mase_scale']}")
    return "\n".join(lines)


def _plot(path: str, best: Any, step: float) -> None:
    from agent.cli import UsageError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise UsageError("--plot needs matplotlib (pip install matplotlib)") from error
    last = min(best.origins.size, 144)  # the last day of origins at the default 10-min stride
    times = (best.origins[-last:] * step) / 3600.0
    figure, axis = plt.subplots(figsize=(12, 4))
    axis.plot(times, best.actual[-last:, -1], label="actual", color="black", linewidth=1)
    axis.plot(times, best.mean[-last:, -1], label=f"{best.name} at the longest horizon")
    if {0.1, 0.9} <= set(best.quantiles):
        axis.fill_between(
            times,
            best.quantiles[0.1][-last:, -1],
            best.quantiles[0.9][-last:, -1],
            alpha=0.3,
            label="80% interval",
        )
    axis.set_xlabel("hours since series start (target time minus horizon)")
    axis.set_ylabel("requests per step")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)
