"""Every series a dashboard or rule names exists: in the agent's golden /metrics, in a real engine
scrape, or on the explicit planned list; and every expression parses with promtool."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from dashboards import generate, queries, rules, series
from tests.dashboards.golden import FIXTURES, agent_exposition, read_golden, surface, write_golden

ENGINE_FIXTURES = {
    "vllm": sorted((FIXTURES / "expo" / "vllm-0.32-cpu").glob("*.prom")),
    "sglang": sorted((FIXTURES / "expo" / "sglang").glob("*.prom")),
}


def _all_queries() -> list[queries.Query]:
    out = [q for name in generate.ALL for q in queries.dashboard_queries(generate.load(name))]
    return out + list(queries.rule_queries(rules.build()))


def _used_names() -> dict[str, str]:
    used: dict[str, str] = {}
    for query in _all_queries():
        for name in queries.metric_names(query.expr):
            used.setdefault(name, query.where)
    return used


def _engine_sample_names(engine: str) -> set[str]:
    names: set[str] = set()
    for path in ENGINE_FIXTURES[engine]:
        text = "\n".join(line for line in path.read_text(encoding="utf-8").splitlines() if line != "...")
        for family in text_string_to_metric_families(text + "\n"):
            names.update(sample.name for sample in family.samples)
    return names


def _golden_names() -> set[str]:
    return {line.split("{", 1)[0] for line in read_golden()}


def test_agent_metrics_match_the_golden_file(tmp_path: Path) -> None:
    lines = surface(asyncio.run(agent_exposition(tmp_path)))
    if os.environ.get("SERVEPILOT_UPDATE_GOLDEN") == "1":
        write_golden(lines)
    assert lines == read_golden(), "agent /metrics changed: SERVEPILOT_UPDATE_GOLDEN=1 to accept"


def test_the_agent_metrics_are_valid_openmetrics_too(tmp_path: Path) -> None:
    """Prometheus asks for OpenMetrics (the gate's exemplars need it): the same registry must parse under
    OpenMetrics' stricter rules (no gauge named like a counter, an ``# EOF``), or every scrape fails."""
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

    text = asyncio.run(agent_exposition(tmp_path, openmetrics))
    families = list(parse_openmetrics(text))  # raises on anything OpenMetrics does not allow
    (tmp_path / "plain").mkdir()
    plain = asyncio.run(agent_exposition(tmp_path / "plain"))
    # the same families (the text format writes a counter's ``_created`` as a family of its own)
    written = {f.name for f in text_string_to_metric_families(plain) if not f.name.endswith("_created")}
    named = {f.name + ("_info" if f.type == "info" else "") for f in families}  # an info's name, as text
    assert named == written and len(written) > 100


def test_every_queried_series_is_listed_or_recorded() -> None:
    known = set(series.ALL) | queries.recorded_names(rules.build())
    unknown = {name: where for name, where in _used_names().items() if name not in known}
    assert unknown == {}, f"add these to dashboards/series.py: {unknown}"


def test_every_listed_series_is_queried_somewhere() -> None:
    stale = set(series.ALL) - set(_used_names())
    assert stale == set(), f"series.py lists series nothing queries: {sorted(stale)}"


@pytest.mark.parametrize("entry", series.AGENT, ids=lambda s: s.name)
def test_agent_series_is_in_the_golden_metrics(entry: series.Series) -> None:
    assert entry.name in _golden_names()


@pytest.mark.parametrize("entry", series.ENGINE, ids=lambda s: s.name)
def test_engine_series_is_in_a_real_scrape(entry: series.Series) -> None:
    assert entry.name in _engine_sample_names(entry.source)


def test_planned_series_are_not_exported_yet() -> None:
    """Every planned series is documented and absent from the golden /metrics (the list may be empty).

    When this fails, the feature landed: move the series from PLANNED to AGENT.
    """
    landed = [entry.name for entry in series.PLANNED if entry.name in _golden_names()]
    assert landed == []
    assert all(entry.note for entry in series.PLANNED)


def test_every_expression_parses_with_promtool(promtool: str, tmp_path: Path) -> None:
    """promtool parses with Prometheus's own parser; each expression becomes one recording rule."""
    exprs = _all_queries()
    rule_list = [
        {"record": f"check:expr_{i}", "expr": queries.substitute(q.expr)} for i, q in enumerate(exprs)
    ]
    path = tmp_path / "exprs.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "parse", "rules": rule_list}]}), encoding="utf-8")
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    failing = [exprs[int(i)].where for i in re.findall(r"check:expr_(\d+)", done.stdout + done.stderr)]
    assert done.returncode == 0, f"unparsable: {failing or done.stdout + done.stderr}"
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout


def test_a_broken_expression_is_reported_by_the_parse_check() -> None:
    with pytest.raises(ValueError):
        queries.metric_names("sum(rate(servepilot_ticks_total[5m])")
