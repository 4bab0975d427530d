"""Write (or check) the committed dashboard JSON: ``python -m dashboards.generate [--check]``.

The JSON under ``dashboards/json/`` is what Grafana provisioning loads (see
``deploy/prometheus/grafana/``); it is generated from :mod:`dashboards.boards` with
grafana-foundation-sdk and committed so operators can import it without Python. ``--check`` fails
when the committed files differ from what the code generates (the test runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from dashboards.boards import ALL

JSON_DIR = Path(__file__).resolve().parent / "json"


def render(name: str) -> str:
    """The dashboard ``name`` as stable, pretty JSON (sorted keys, trailing newline)."""
    board = ALL[name]().build()
    return json.dumps(board, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(render(name))
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate servepilot's Grafana dashboards.")
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed dashboard is stale")
    parser.add_argument("--output", type=Path, default=JSON_DIR)
    args = parser.parse_args(argv)
    stale = []
    for name in ALL:
        path = args.output / f"servepilot-{name}.json"
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    if stale:
        print(f"stale dashboards (run python -m dashboards.generate): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
