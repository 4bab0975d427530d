"""The committed dashboard JSON is what the generator produces, and each board honours the variables."""

from __future__ import annotations

from typing import Any

import pytest

from dashboards import generate, queries


@pytest.fixture(params=sorted(generate.ALL))
def board(request: pytest.FixtureRequest) -> dict[str, Any]:
    return generate.load(request.param)


def test_committed_dashboards_are_current() -> None:
    assert generate.main(["--check"]) == 0, "run: python -m dashboards.generate"


def test_a_stale_dashboard_is_detected(tmp_path: Any) -> None:
    assert generate.main(["--output", str(tmp_path)]) == 0
    (tmp_path / "servepilot-gpu.json").write_text("{}", encoding="utf-8")
    assert generate.main(["--check", "--output", str(tmp_path)]) == 1


def test_boards_have_datasource_namespace_and_pod_variables(board: dict[str, Any]) -> None:
    names = [v["name"] for v in board["templating"]["list"]]
    assert names[:3] == ["datasource", "namespace", "pod"]


def test_every_query_filters_by_namespace_and_pod(board: dict[str, Any]) -> None:
    for query in queries.dashboard_queries(board):
        if "variable" in query.where and "namespace" in query.where:
            continue  # the namespace variable lists all namespaces
        assert "$namespace" in query.expr, query.where
        if "variable" not in query.where:
            assert "$pod" in query.expr, query.where


def test_every_panel_uses_the_datasource_variable(board: dict[str, Any]) -> None:
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_uids_are_stable_and_distinct() -> None:
    uids = [generate.load(name)["uid"] for name in generate.ALL]
    assert sorted(uids) == ["servepilot-energy", "servepilot-gpu", "servepilot-overview"]


def test_a_source_turned_off_reads_off_not_no_data() -> None:
    """``nvml.backend: off`` (a CPU engine, or dcgm-exporter instead) exports no servepilot_nvml_up at all:
    the overview's stat says so, and a reading says up or down rather than 1 or 0."""
    panels = {p["title"]: p for p in generate.load("overview")["panels"]}
    gpu = panels["GPU telemetry up"]["fieldConfig"]["defaults"]
    assert gpu["noValue"] == "off (nvml.backend)"
    [mapping] = gpu["mappings"]
    assert mapping["type"] == "value"
    assert {k: v["text"] for k, v in mapping["options"].items()} == {"1": "up", "0": "down"}
    assert panels["Engine up"]["fieldConfig"]["defaults"]["mappings"] == gpu["mappings"]
