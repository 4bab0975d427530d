"""Small helpers over grafana-foundation-sdk builders, so dashboard modules read like a layout.

Every query goes through :func:`q`, which adds the pod/namespace (and, for engine series, model)
selectors, so a panel cannot forget to honour the template variables.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    ValueMap,
    ValueMappingResult,
    VariableHide,
    VariableRefresh,
    VariableSort,
)

DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
#: Selector of the agent's own series (target labels set by Prometheus).
POD = 'namespace=~"$namespace", pod=~"$pod"'
#: Selector of the engine's series: the agent's plus the served model.
MODEL = POD + ', model_name=~"$model"'


def expand(expr: str) -> str:
    """``@POD`` / ``@MODEL`` inside a selector expand to the template-variable matchers."""
    return expr.replace("@MODEL", MODEL).replace("@POD", POD)


def q(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    """A Prometheus range query over ``expand(expr)``."""
    text = expand(expr)
    query = prometheus.Dataquery().expr(text).ref_id(ref).datasource(DS).range()
    return query.legend_format(legend) if legend else query


def ts(
    title: str, unit: str, *queries: prometheus.Dataquery, desc: str = "", w: int = 12
) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).unit(unit).datasource(DS).height(8).span(w)
    if desc:
        panel = panel.description(desc)
    for query in queries:
        panel = panel.with_target(query)
    return panel


def single(title: str, unit: str, query: prometheus.Dataquery, red_above: float | None = None) -> stat.Panel:
    panel = stat.Panel().title(title).unit(unit).datasource(DS).height(4).span(4).with_target(query)
    if red_above is not None:
        panel = panel.thresholds(
            dashboard.ThresholdsConfig()
            .mode(ThresholdsMode.ABSOLUTE)
            .steps([Threshold(value=None, color="green"), Threshold(value=red_above, color="red")])
        )
    return panel


def up(title: str, query: prometheus.Dataquery, absent: str) -> stat.Panel:
    """A source's ``*_up`` gauge as "up" (green) or "down" (red), and ``absent`` where it has no series:
    a source turned off in the config exports none, and "No data" read like a broken panel."""
    mapped = ValueMap(
        {
            "1": ValueMappingResult(text="up", color="green", index=0),
            "0": ValueMappingResult(text="down", color="red", index=1),
        }
    )
    return single(title, "none", query).mappings([mapped]).no_value(absent)


def tab(title: str, query: prometheus.Dataquery, w: int = 24) -> table.Panel:
    return table.Panel().title(title).datasource(DS).height(8).span(w).with_target(query.instant())


def variables(board: dashboard.Dashboard, with_model: bool = True) -> dashboard.Dashboard:
    """Datasource, namespace, pod (and model) variables, chained so each narrows the next."""
    board = board.with_variable(
        dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
    )
    chain = [
        ("namespace", "Namespace", "label_values(servepilot_engine_up, namespace)"),
        ("pod", "Pod", 'label_values(servepilot_engine_up{namespace=~"$namespace"}, pod)'),
    ]
    if with_model:
        chain.append(("model", "Model", "label_values(vllm:num_requests_running{" + POD + "}, model_name)"))
    for name, label, query in chain:
        board = board.with_variable(
            dashboard.QueryVariable(name)
            .label(label)
            .datasource(DS)
            .query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .include_all(True)
            .all_value(".*")
            .multi(True)
            .hide(VariableHide.DONT_HIDE)
        )
    return board


def base(uid: str, title: str, description: str) -> dashboard.Dashboard:
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["servepilot", "llm-serving"])
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .editable()
    )
