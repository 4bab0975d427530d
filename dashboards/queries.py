"""Every PromQL expression in the dashboards and rules, and the metric names each one reads.

Used by the tests (every expression parses, every series exists) and by the end-to-end test (every
dashboard query returns data). Grafana's variables are replaced by values Prometheus accepts
(:func:`substitute`); metric names come from the AST of ``promql_parser`` (the Rust PromQL parser
of GreptimeDB, wrapped for Python), not from regexes. The authoritative parse is still promtool's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import promql_parser

_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.*),\s*(?P<label>\w+)\s*\)\s*$", re.S)
DEFAULT_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "30s",
    "$__range": "1h",
    "$namespace": ".*",
    "$pod": ".*",
    "$model": ".*",
}


@dataclass(frozen=True)
class Query:
    """One expression and where it lives (``where`` is human-readable, for test messages)."""

    where: str
    expr: str


def _panels(board: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for panel in board.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # collapsed rows keep their panels inside


def dashboard_queries(board: Mapping[str, Any]) -> Iterator[Query]:
    """Panel targets, annotation queries and the selectors inside ``label_values`` variables."""
    title = board.get("title", "?")
    for panel in _panels(board):
        for target in panel.get("targets", []) or []:
            if target.get("expr"):
                yield Query(f"{title} / {panel.get('title')} / {target.get('refId')}", target["expr"])
    for annotation in board.get("annotations", {}).get("list", []):
        if annotation.get("expr"):
            yield Query(f"{title} / annotation {annotation.get('name')}", annotation["expr"])
    for variable in board.get("templating", {}).get("list", []):
        query = variable.get("query")
        if variable.get("type") == "query" and isinstance(query, str):
            match = _LABEL_VALUES.match(query)
            yield Query(f"{title} / variable {variable['name']}", match.group("selector") if match else query)


def rule_queries(rules: Mapping[str, Any]) -> Iterator[Query]:
    for group in rules.get("groups", []):
        for rule in group.get("rules", []):
            name = rule.get("record") or rule.get("alert")
            yield Query(f"rule {group['name']} / {name}", rule["expr"])


def recorded_names(rules: Mapping[str, Any]) -> set[str]:
    return {r["record"] for g in rules.get("groups", []) for r in g.get("rules", []) if "record" in r}


def substitute(expr: str, variables: Mapping[str, str] | None = None) -> str:
    """Replace Grafana variables (longest first, so ``$__rate_interval`` beats ``$__r...``)."""
    values = {**DEFAULT_VARIABLES, **(variables or {})}
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name[1:] + "}", values[name]).replace(name, values[name])
    return expr


def metric_names(expr: str) -> set[str]:
    """Names of every vector selector in ``expr`` (raises ValueError when it does not parse)."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            else:
                for matcher in node.matchers.matchers:
                    if matcher.name == "__name__":
                        names.add(matcher.value)

    promql_parser.walk(promql_parser.parse(substitute(expr)), visit)
    return names
