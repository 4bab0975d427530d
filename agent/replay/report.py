"""A self-contained HTML report of a replay: load, batch, latency against the SLO, clock, breaker level
and actions over time, drawn as inline SVG (no plotting library, opens anywhere, diffable)."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from typing import Any

from agent.replay.driver import ReplayRun

W, H, PAD = 900, 160, 40


def _series_svg(
    title: str, t: Sequence[float], lines: dict[str, Sequence[float]], hline: float | None = None
) -> str:
    """One panel: a few lines over time, optionally a dashed horizontal line (the SLO)."""
    if not t:
        return ""
    t0, t1 = t[0], max(t[-1], t[0] + 1e-9)
    values = [v for series in lines.values() for v in series] + ([hline] if hline is not None else [])
    top = max([*values, 1e-9]) * 1.05

    def xy(x: float, y: float) -> str:
        return f"{PAD + (x - t0) / (t1 - t0) * (W - 2 * PAD):.1f},{H - PAD / 2 - y / top * (H - PAD):.1f}"

    step = max(1, len(t) // 1500)  # at most ~1500 points per line keeps the file small
    colours = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
    parts = [
        f'<svg width="{W}" height="{H}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="{PAD}" y="14" font-size="13">{html.escape(title)} (max {top / 1.05:.3g})</text>',
    ]
    for (name, series), colour in zip(lines.items(), colours, strict=False):
        points = " ".join(xy(t[i], series[i]) for i in range(0, len(t), step))
        parts.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="1" points="{points}">'
            f"<title>{html.escape(name)}</title></polyline>"
        )
    if hline is not None:
        y = xy(t0, hline).split(",")[1]
        parts.append(
            f'<line x1="{PAD}" x2="{W - PAD}" y1="{y}" y2="{y}" stroke="black" stroke-dasharray="4"/>'
        )
    legend = " · ".join(
        f'<tspan fill="{c}">{html.escape(n)}</tspan>' for n, c in zip(lines, colours, strict=False)
    )
    parts.append(f'<text x="{W - PAD}" y="14" font-size="12" text-anchor="end">{legend}</text></svg>')
    return "".join(parts)


def _classes_table(classes: dict[str, dict[str, Any]] | None) -> str:
    """Per priority class (a replay with a mix): targets, attainment, goodput, tails, turned away."""
    if not classes:
        return ""
    head = "".join(
        f"<th>{h}</th>"
        for h in ("class", "requests", "TTFT target", "ITL target", "attainment", "goodput tok/s", "TTFT p99",
                  "ITL p99", "503", "429")
    )  # fmt: skip
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{r['requests']}</td><td>{r['slo']['ttft_s']:g}</td>"
        f"<td>{r['slo']['itl_s']:g}</td><td>{r['slo_attainment']:.2%}</td><td>{r['goodput_tps']:.1f}</td>"
        f"<td>{r['ttft_p99_s']:.3f}</td><td>{r['itl_p99_s']:.3f}</td><td>{r['expired']}</td>"
        f"<td>{r['rejected']}</td></tr>"
        for name, r in classes.items()
    )
    return f"<h2>priority classes</h2><table><tr>{head}</tr>{rows}</table>"


def render(run: ReplayRun, summary: dict[str, Any]) -> str:
    """The HTML page for one replay and its summary."""
    rows = run.timeline
    t = [r.t - rows[0].t for r in rows] if rows else []
    level = {"primary": 0.0, "fp8": 2.0, "small": 3.0}
    panels = [
        _series_svg("load: arrivals per tick", t, {"arrivals": [float(r.arrivals) for r in rows]}),
        _series_svg(
            "batch: limit, running, waiting",
            t,
            {
                "limit": [r.limit for r in rows],
                "running": [r.running for r in rows],
                "waiting": [r.waiting for r in rows],
            },
        ),
        _series_svg("TTFT p99 (s) vs SLO", t, {"ttft p99": [r.ttft_p99 for r in rows]}, run.slo.ttft_s),
        _series_svg("token gap p99 (s) vs ITL SLO", t, {"itl p99": [r.itl_p99 for r in rows]}, run.slo.itl_s),
        _series_svg(
            "SM clock (MHz) and power (W)",
            t,
            {"clock": [r.clock_mhz for r in rows], "power": [r.power_w for r in rows]},
        ),
        _series_svg(
            "upstream (0 primary, 2 fp8, 3 small)",
            t,
            {"upstream": [level.get(r.upstream, 0.0) for r in rows]},
        ),
    ]
    start = rows[0].t if rows else 0.0
    actions = "".join(
        f"<tr><td>{d.at - start:.0f}</td><td>{html.escape(d.knob)}</td>"
        f"<td>{html.escape(str(d.previous))}</td>"
        f"<td>{html.escape(str(d.value))}</td><td>{html.escape(d.reason)}</td></tr>"
        for d in run.actions[:2000]
    )
    brief = {k: v for k, v in summary.items() if k not in ("actions", "sweep", "classes")}
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>servepilot replay</title>"
        "<style>body{font-family:sans-serif;margin:20px}td{padding:2px 8px;font-size:12px}</style>"
        "</head><body>"
        f"<h1>servepilot replay: {html.escape(str(summary.get('policy')))}</h1>"
        f"<pre>{html.escape(json.dumps(brief, indent=1))}</pre>"
        + _classes_table(summary.get("classes"))
        + "".join(f"<div>{p}</div>" for p in panels)
        + f"<h2>actions ({len(run.actions)})</h2><table><tr><th>t (s)</th><th>knob</th><th>from</th>"
        f"<th>to</th><th>reason</th></tr>{actions}</table></body></html>"
    )
