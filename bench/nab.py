"""Reproduce the NAB figures of docs/detectors.md in one command.

    .venv/bin/python bench/nab.py [--detector NAME] [--data ../shared/data/nab] [--results DIR]

Runs ``servepilot detect --input DATA/data --output RESULTS`` (the same code path as the CLI), then the
independent scorer ``../shared/tools/nab_score.py`` for the three cost profiles overall and per category,
and prints a Markdown table plus the streaming cost in microseconds per point. One parameter set for all
files: nothing here looks at the labels except the scorer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
PROFILES = ("standard", "reward_low_FP_rate", "reward_low_FN_rate")
CATEGORIES = ("artificialNoAnomaly", "artificialWithAnomaly", "realAWSCloudwatch", "realKnownCause")


def run_detect(data: Path, results: Path, detector: str) -> float:
    """Score the tree with ``servepilot detect``; return CPU microseconds per point."""
    from agent.commands import detect

    parser = argparse.ArgumentParser(prog="servepilot")
    detect.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["detect", "--input", str(data), "--output", str(results), "--detector", detector]
    )
    points = sum(max(0, len(p.read_text().splitlines()) - 1) for p in data.rglob("*.csv"))
    started = time.process_time()
    if args.func(args) != 0:
        raise SystemExit("detect failed")
    return 1e6 * (time.process_time() - started) / points


def nab_score(nab: Path, results: Path, files_glob: str | None = None) -> dict[str, dict[str, float]]:
    cmd = [
        sys.executable,
        str(SHARED / "tools" / "nab_score.py"),
        "--data", str(nab / "data"),
        "--windows", str(nab / "labels" / "windows.json"),
        "--profiles", str(nab / "config" / "profiles.json"),
        "--results", str(results),
        "--json",
    ]  # fmt: skip
    if files_glob:
        cmd += ["--files-glob", files_glob]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["profiles"]  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--detector", default=None, help="scorer name (default: the registry default)")
    ap.add_argument("--data", type=Path, default=SHARED / "data" / "nab")
    ap.add_argument("--results", type=Path, help="where to keep the scored files (default: a temp dir)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from detectors.registry import DEFAULT_SCORER

    args.detector = args.detector or DEFAULT_SCORER
    with tempfile.TemporaryDirectory() as tmp:
        results = args.results or Path(tmp)
        us = run_detect(args.data / "data", results, args.detector)
        rows = [("all 35 files", nab_score(args.data, results))]
        rows += [(c, nab_score(args.data, results, f"{c}/*")) for c in CATEGORIES]
    print(f"\ndetector `{args.detector}`, {us:.0f} us/point (CPU, whole detect run incl. CSV I/O)\n")
    print("| files | " + " | ".join(PROFILES) + " | windows hit (standard) | FP rows (standard) |")
    print("|---|" + "---:|" * (len(PROFILES) + 2))
    for label, prof in rows:
        std = prof["standard"]
        hit = f"{std['windows_detected']}/{std['windows_detected'] + std['windows_missed']}"
        cells = " | ".join(
            f"{prof[p]['score']:.1f}" if prof[p]["score"] is not None else "n/a" for p in PROFILES
        )
        print(f"| {label} | {cells} | {hit} | {std['false_positive_rows']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
